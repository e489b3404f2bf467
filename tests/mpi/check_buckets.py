"""Run under mpiexec: BucketedAllreduce trains exactly like DDP and like one process.

For every model (plain MLP, frozen first layer, tied weights, a branch that some
ranks skip in some steps) this trains k steps three ways from the same seed:

- the single-process reference: one model, loss = mean over the ranks' shards of
  each shard's mean loss (equal shards, so this is the mean over the union batch),
  one backward, one optimizer step;
- torch DDP on the Gloo process group;
- BucketedAllreduce for backends mpi and gloo, overlap on and off, default and tiny
  bucket caps (several buckets).

Then gradient accumulation: two micro-batches per step, the first inside
``no_sync()``, for BucketedAllreduce and DDP, against the single-process run that
backpropagates both micro-batches' losses before its step.

Adam with weight decay makes the test sensitive to "no gradient" versus "a zero
gradient": the first skips the parameter, the second still moves it.
Prints "buckets ok on N ranks" on rank 0 when every comparison holds.
"""

from __future__ import annotations

import contextlib
import gc
import sys
import traceback

import torch
from mpi4py import MPI
from torch import nn
from torch.nn import functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

from pcourse.backends import Backend, make_backend
from pcourse.buckets import BucketedAllreduce
from pcourse.runtime.ranks import init_rank

STEPS, SHARD = 4, 6
TINY_CAP = 300 * 8  # bytes, 300 float64s: several buckets for every model here
DDP_CAP = 25 * 2**20  # bytes, DDP's default
world = MPI.COMM_WORLD


def mlp(frozen: bool = False) -> nn.Module:
    net = nn.Sequential(nn.Linear(3, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh(),
                        nn.Linear(16, 3))
    if frozen:
        net[0].requires_grad_(False)
    return net


class Tied(nn.Module):
    """A tied auto-encoder: ``mid`` runs twice, the decoder reuses the encoder's weight."""

    def __init__(self) -> None:
        super().__init__()
        self.enc, self.mid, self.dec_bias = nn.Linear(3, 16), nn.Linear(16, 16), nn.Parameter(
            torch.zeros(3))
        self.mid_again = self.mid  # the same module (same Parameters) registered twice

    def forward(self, x: torch.Tensor, use_extra: bool = True) -> torch.Tensor:
        h = torch.tanh(self.mid_again(torch.tanh(self.mid(torch.tanh(self.enc(x))))))
        return F.linear(h, self.enc.weight.t(), self.dec_bias)


class Branchy(nn.Module):
    """``extra`` (registered in the middle, so it sits in a middle bucket) is optional."""

    def __init__(self) -> None:
        super().__init__()
        self.first, self.extra, self.last = nn.Linear(3, 16), nn.Linear(16, 16), nn.Linear(16, 3)

    def forward(self, x: torch.Tensor, use_extra: bool = True) -> torch.Tensor:
        h = torch.tanh(self.first(x))
        if use_extra:
            h = h + torch.tanh(self.extra(h))
        return self.last(h)


def uses_extra(step: int, rank: int, size: int) -> bool:
    """Everyone, no one, rank 0 only, the last rank only: locally and globally unused."""
    return [True, False, rank == 0, rank == size - 1][step % 4]


MODELS = {"mlp": mlp, "frozen": lambda: mlp(frozen=True), "tied": Tied, "branchy": Branchy,
          "mlp/zeroed": mlp}  # zero_grad(set_to_none=False): autograd adds into the views


def build(name: str) -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(7)
    model = MODELS[name]().double()
    params = [p for p in model.parameters() if p.requires_grad]
    return model, torch.optim.Adam(params, lr=1e-2, weight_decay=1e-2)


def batch(step: int, micro: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """The global (micro-)batch of this step, the same on every rank."""
    gen = torch.Generator().manual_seed(1000 + 10 * step + micro)
    x = torch.randn(world.size * SHARD, 3, generator=gen, dtype=torch.float64)
    return x, torch.sin(x)


def forward(model: nn.Module, name: str, x: torch.Tensor, step: int, rank: int) -> torch.Tensor:
    flag = uses_extra(step, rank, world.size)
    return model(x, flag) if name in ("tied", "branchy") else model(x)


def reference(name: str, micros: int = 1) -> nn.Module:
    model, opt = build(name)
    for step in range(STEPS):
        for micro in range(micros):
            x, y = batch(step, micro)
            losses = [F.mse_loss(forward(model, name, x[r::world.size], step, r),
                                 y[r::world.size]) for r in range(world.size)]
            torch.stack(losses).mean().backward()
        opt.step()
        opt.zero_grad(set_to_none=not name.endswith("zeroed"))
    return model


def parallel(name: str, wrap, micros: int = 1) -> nn.Module:
    """Train on this rank's shard; ``wrap(model)`` returns (module to call, after-backward,
    no-sync context); all micro-batches but the last run in the no-sync context."""
    model, opt = build(name)
    net, after_backward, no_sync = wrap(model)
    for step in range(STEPS):
        for micro in range(micros):
            x, y = batch(step, micro)
            shard = slice(world.rank, None, world.size)
            with no_sync() if micro < micros - 1 else contextlib.nullcontext():
                F.mse_loss(forward(net, name, x[shard], step, world.rank), y[shard]).backward()
        after_backward()
        opt.step()
        opt.zero_grad(set_to_none=not name.endswith("zeroed"))
    return model


def ddp(model: nn.Module):
    # Only the branchy model has parameters without a gradient; DDP must look for them.
    net = DDP(model, find_unused_parameters=isinstance(model, Branchy))
    return net, lambda: None, net.no_sync


def bucketed(backend: Backend, overlap: bool, cap: int, seen: list[int], drive: bool = False):
    def wrap(model: nn.Module):
        reducer = BucketedAllreduce(model, backend, bucket_cap_bytes=cap, overlap=overlap,
                                    drive_progress=drive)
        seen.append(len(reducer.buckets))
        return model, reducer.finish, reducer.no_sync
    return wrap


def compare(a: nn.Module, b: nn.Module, what: str, failures: list[str]) -> None:
    for (n, p), q in zip(a.named_parameters(), b.parameters(), strict=True):
        if not torch.allclose(p, q, rtol=1e-9, atol=1e-11):
            err = (p - q).abs().max().item()
            failures.append(f"rank {world.rank}: {what}: {n} differs by {err:.2e}")


def check(backends: dict[str, Backend]) -> list[str]:
    failures: list[str] = []
    for name in MODELS:
        ref = reference(name)
        compare(parallel(name, ddp), ref, f"{name} DDP vs reference", failures)
        for bname, backend in backends.items():
            for overlap in (True, False):
                for cap in (DDP_CAP, TINY_CAP):
                    seen: list[int] = []
                    got = parallel(name, bucketed(backend, overlap, cap, seen))
                    what = f"{name} {bname} overlap={overlap} cap={cap} bytes"
                    compare(got, ref, what + " vs reference", failures)
                    if cap == TINY_CAP and seen[0] < 2:
                        failures.append(f"{what}: expected several buckets, got {seen[0]}")
            got = parallel(name, bucketed(backend, True, TINY_CAP, [], drive=True))
            compare(got, ref, f"{name} {bname} requests tested in the hooks", failures)
    for name in ("mlp", "branchy"):  # gradient accumulation
        ref = reference(name, micros=2)
        one = reference(name)
        if all(torch.allclose(p, q) for p, q in zip(ref.parameters(), one.parameters(),
                                                    strict=True)):
            failures.append(f"{name}: accumulation cannot be told from one micro-batch")
        compare(parallel(name, ddp, micros=2), ref, f"{name} DDP no_sync", failures)
        for bname, backend in backends.items():
            for overlap in (True, False):
                got = parallel(name, bucketed(backend, overlap, TINY_CAP, []), micros=2)
                compare(got, ref, f"{name} {bname} overlap={overlap} no_sync", failures)
    return failures


def close_all(backends: dict[str, Backend]) -> None:
    """Close together: a rank that exits while a peer still tears down its Gloo
    connections can make that peer abort ("terminate called without an active
    exception") after every check has passed."""
    gc.collect()  # the DDP wrappers still hold the process group
    world.Barrier()
    for backend in backends.values():
        backend.close()
    world.Barrier()


def main() -> int:
    init_rank()
    backends = {"mpi": make_backend("mpi"), "gloo": make_backend("gloo")}
    try:
        failures = check(backends)
    except Exception:  # noqa: BLE001 - report, then take every rank down, never hang
        traceback.print_exc()
        sys.stdout.flush()
        world.Abort(1)
    everyone = world.gather(failures, root=0)
    close_all(backends)
    if world.rank == 0:
        flat = [f for fs in everyone for f in fs]
        print("\n".join(flat) if flat else f"buckets ok on {world.size} ranks", flush=True)
        return 1 if flat else 0
    return 0


if __name__ == "__main__":
    sys.exit(main())
