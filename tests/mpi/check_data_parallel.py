"""Run under mpiexec (2 or 3 ranks): pcourse.data_parallel on every CPU backend.

- broadcast_parameters makes all ranks identical (checked against rank 0's state
  sent over plain MPI, and with check_consistency);
- check_consistency names the one parameter a rank perturbed;
- k steps of data-parallel training equal k steps of serial training on the union
  of the ranks' batches, computed independently inside each rank from the same seed;
- ranks with different models, gradients or roots, and models without gradients,
  get a ValueError on every rank, not a hang (BucketedAllreduce too).
"""

from __future__ import annotations

import sys

import torch
from harness import RANK, SIZE, WORLD, expect, raises, verdict
from torch import nn

from pcourse.backends import Backend, make_backend
from pcourse.buckets import BucketedAllreduce
from pcourse.data_parallel import (
    average_gradients,
    average_gradients_flat,
    broadcast_parameters,
    check_consistency,
)
from pcourse.partition import ParallelDataset, partition_indices

N, BATCH, STEPS, SEED = 97, 4, 3, 2024


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
    """Different models, gradients or roots on different ranks: every rank gets the error."""
    n = backend.name
    model = nn.Linear(4, 3 if RANK == 0 else 5)
    for fn in (broadcast_parameters, check_consistency, BucketedAllreduce):
        expect(raises(ValueError, fn, model, backend, match="every rank must hold the same model"),
               f"{n}: {fn.__name__} accepted different models")
    expect(raises(ValueError, broadcast_parameters, nn.Linear(4, 3), backend, root=RANK,
                   match="root ranges"), f"{n}: broadcast_parameters with different roots")
    expect(raises(ValueError, broadcast_parameters, nn.Linear(4, 3), backend, root=SIZE,
                   match="root must be a rank"), f"{n}: broadcast_parameters beyond the last rank")
    same_model = build("mlp", 100)
    if RANK == 1:  # a gradient missing on one rank only
        same_model[4].bias.requires_grad_(False)
    nn.functional.mse_loss(same_model(torch.randn(4, 3)), torch.zeros(4, 1)).backward()
    for fn in (average_gradients, average_gradients_flat):
        expect(raises(ValueError, fn, same_model, backend, match="same gradients"),
               f"{n}: {fn.__name__} accepted mismatched gradients")
        expect(raises(ValueError, fn, build("mlp", 100), backend, match="no gradients to average"),
               f"{n}: {fn.__name__} of a model without gradients")
    reducer = BucketedAllreduce(build("mlp", 100), backend)
    expect(raises(ValueError, reducer.finish, match="no rank had a gradient"),
           f"{n}: BucketedAllreduce.finish() without a backward")
    backend.barrier()  # everyone is still here: nothing hung


def main() -> int:
    for name in ("mpi", "mpi-pickle", "gloo"):
        with make_backend(name) as backend:
            check_broadcast_and_consistency(backend)
            check_training(backend)
            check_mismatch(backend)
    return verdict(f"data-parallel checks on {SIZE} ranks")


if __name__ == "__main__":
    sys.exit(main())
