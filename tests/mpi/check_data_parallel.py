"""Run under mpiexec (2 or 3 ranks): the training helpers on every CPU backend.

- broadcast_parameters makes all ranks identical (checked against rank 0's state
  sent over plain MPI, and with check_consistency);
- check_consistency names the one parameter a rank perturbed;
- k steps of data-parallel training equal k steps of serial training on the union
  of the ranks' batches, computed independently inside each rank from the same seed;
- ranks with different models get a ValueError on every rank, not a hang.
"""

from __future__ import annotations

import sys

import torch
from mpi4py import MPI
from torch import nn

from pcourse.backends import Backend, make_backend
from pcourse.data_parallel import average_gradients, broadcast_parameters, check_consistency
from pcourse.partition import ParallelDataset, partition_indices

WORLD = MPI.COMM_WORLD
RANK, SIZE = WORLD.Get_rank(), WORLD.Get_size()
N, BATCH, STEPS, SEED = 97, 4, 3, 2024
failures: list[str] = []


def expect(cond: bool, what: str) -> None:
    if not cond:
        failures.append(f"rank {RANK}: {what}")


class Tied(nn.Module):
    """Encoder and decoder share one weight matrix (the same Parameter object)."""

    def __init__(self) -> None:
        super().__init__()
        self.enc, self.dec = nn.Linear(3, 3), nn.Linear(3, 3)
        self.dec.weight = self.enc.weight
        self.head = nn.Linear(3, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.dec(torch.tanh(self.enc(x))))


def build(kind: str, seed: int) -> nn.Module:
    torch.manual_seed(seed)
    if kind == "tied":
        return Tied()
    if kind == "bn":  # buffers to broadcast; not trained here (its statistics are local)
        return nn.Sequential(nn.Linear(3, 8), nn.BatchNorm1d(8), nn.Tanh(), nn.Linear(8, 1))
    model = nn.Sequential(nn.Linear(3, 8), nn.Tanh(), nn.Linear(8, 8), nn.Tanh(),
                          nn.Linear(8, 1))
    if kind == "frozen":
        model[0].weight.requires_grad_(False)
    return model


def data() -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(SEED)
    x = torch.randn(N, 3, generator=gen)
    return x, (x ** 2).sum(1, keepdim=True) + 0.1 * torch.randn(N, 1, generator=gen)


def step(model: nn.Module, opt: torch.optim.Optimizer, x, y, backend: Backend | None) -> None:
    opt.zero_grad()
    nn.functional.mse_loss(model(x), y).backward()  # a mean loss: averaging is exact
    if backend is not None:
        average_gradients(model, backend)
    opt.step()


def train_parallel(kind: str, backend: Backend) -> nn.Module:
    model = build(kind, seed=100 + RANK)  # a different init on every rank ...
    broadcast_parameters(model, backend)  # ... until rank 0's is broadcast
    opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.1,
                          momentum=0.9)
    x, y = ParallelDataset(data(), RANK, SIZE, seed=SEED).local()
    for s in range(STEPS):
        step(model, opt, x[s * BATCH:(s + 1) * BATCH], y[s * BATCH:(s + 1) * BATCH], backend)
    return model


def train_serial(kind: str, shards: list[int]) -> nn.Module:
    """One process, batch = the union of the given ranks' batches at each step."""
    model = build(kind, seed=100)  # rank 0's init, which the broadcast spread
    opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.1,
                          momentum=0.9)
    x, y = data()
    parts = [partition_indices(N, r, SIZE, seed=SEED) for r in shards]
    for s in range(STEPS):
        idx = torch.cat([p[s * BATCH:(s + 1) * BATCH] for p in parts])
        step(model, opt, x[idx], y[idx], None)
    return model


def same(a: nn.Module, b: nn.Module, **tol: float) -> bool:
    sa, sb = a.state_dict(), b.state_dict()
    return all(torch.allclose(sa[k].double(), sb[k].double(), **tol) for k in sa)


def check_training(backend: Backend) -> None:
    for kind in ("mlp", "frozen", "tied"):
        parallel = train_parallel(kind, backend)
        serial = train_serial(kind, list(range(SIZE)))
        expect(same(parallel, serial, rtol=1e-4, atol=1e-6),
               f"{backend.name}/{kind}: data-parallel differs from serial on the union")
        alone = train_serial(kind, [RANK])  # what a rank without averaging would learn
        expect(not same(parallel, alone, rtol=1e-4, atol=1e-6),
               f"{backend.name}/{kind}: the test cannot tell averaging from none")
        if kind == "frozen":
            expect(torch.equal(parallel[0].weight, build(kind, 100)[0].weight),
                   f"{backend.name}/frozen: a frozen weight moved")
        report = check_consistency(parallel, backend)
        expect(report.consistent, f"{backend.name}/{kind}: ranks diverged: {report}")


def check_broadcast_and_consistency(backend: Backend) -> None:
    model = build("bn", seed=100 + RANK)
    model(torch.randn(5, 3))  # training-mode forward: BatchNorm buffers now differ too
    before = check_consistency(model, backend)
    expect(not before.consistent and "1.running_mean" in before.diverging,
           f"{backend.name}: differently seeded ranks reported consistent")
    broadcast_parameters(model, backend)
    root_state = WORLD.bcast(model.state_dict() if RANK == 0 else None)
    expect(all(torch.equal(v, root_state[k]) for k, v in model.state_dict().items()),
           f"{backend.name}: after broadcast a rank differs from rank 0")
    after = check_consistency(model, backend)
    expect(after.consistent and after.max_deviation == 0.0, f"{backend.name}: {after}")
    if RANK == SIZE - 1:
        with torch.no_grad():
            model[3].bias += 1e-3
    perturbed = check_consistency(model, backend)
    expect(perturbed.diverging == ["3.bias"], f"{backend.name}: named {perturbed.diverging}")
    expect(abs(perturbed.max_deviation - 1e-3) < 1e-6, f"{backend.name}: {perturbed}")


def check_mismatch(backend: Backend) -> None:
    """Different models on different ranks: every rank gets the ValueError."""
    model = nn.Linear(4, 3 if RANK == 0 else 5)
    for fn in (broadcast_parameters, check_consistency):
        try:
            fn(model, backend)
            expect(False, f"{backend.name}: {fn.__name__} accepted different models")
        except ValueError as exc:
            expect("different models" in str(exc), f"{backend.name}: message {exc}")
    same_model = build("mlp", 100)
    if RANK == 1:  # a gradient missing on one rank only
        same_model[4].bias.requires_grad_(False)
    nn.functional.mse_loss(same_model(torch.randn(4, 3)), torch.zeros(4, 1)).backward()
    try:
        average_gradients(same_model, backend)
        expect(False, f"{backend.name}: average_gradients accepted mismatched gradients")
    except ValueError as exc:
        expect("gradients" in str(exc), f"{backend.name}: message {exc}")
    backend.barrier()  # everyone is still here: nothing hung


def main() -> int:
    for name in ("mpi", "mpi-pickle", "gloo"):
        with make_backend(name) as backend:
            check_broadcast_and_consistency(backend)
            check_training(backend)
            check_mismatch(backend)
    problems = [f for fs in WORLD.allgather(failures) for f in fs]
    if RANK == 0:
        print("\n".join(problems))
        print(f"training checks on {SIZE} ranks: "
              + ("ALL OK" if not problems else f"{len(problems)} FAILURES"))
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
