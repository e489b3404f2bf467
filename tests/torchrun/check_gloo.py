"""The gloo backend and BucketedAllreduce without MPI: under torchrun, or spawned.

- ``torchrun --nproc-per-node N check_gloo.py``: ``make_backend("gloo")`` meets
  through torchrun's environment (``env://``).
- ``python check_gloo.py N``: spawns N processes with torch.multiprocessing; each
  sets torch.distributed up itself, and the backends are built on its group (given
  as ``comm``, and found as the default group).

Either way, on every rank: allreduce and broadcast against closed forms, ranks that
disagree refused on every rank, and BucketedAllreduce with ``no_sync()`` (gradient
accumulation) against a single-process run; MPI is never imported. Rank 0 prints
"gloo without MPI OK (<how>, N ranks)"; a failure exits non-zero.
"""

from __future__ import annotations

import contextlib
import os
import sys
import tempfile

import torch
import torch.distributed as dist
from torch import nn
from torch.nn import functional as F

from pcourse.backends import Backend, MismatchError, make_backend
from pcourse.buckets import BucketedAllreduce

STEPS, MICRO, SHARD = 3, 2, 4
TINY_CAP = 200 * 8  # bytes, 200 float64s: several buckets


def model_and_optimizer() -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(3)
    model = nn.Sequential(nn.Linear(3, 12), nn.Tanh(), nn.Linear(12, 12), nn.Tanh(),
                          nn.Linear(12, 2)).double()
    return model, torch.optim.Adam(model.parameters(), lr=1e-2, weight_decay=1e-2)


def shard_loss(model: nn.Module, step: int, micro: int, rank: int, size: int) -> torch.Tensor:
    """Mean loss of ``rank``'s shard of the global micro-batch (step, micro)."""
    gen = torch.Generator().manual_seed(100 * step + micro)
    x = torch.randn(size * SHARD, 3, generator=gen, dtype=torch.float64)
    mine = slice(rank * SHARD, (rank + 1) * SHARD)
    return F.mse_loss(model(x[mine]), torch.sin(x[mine, :2]))


def one_process(size: int, micros: range) -> nn.Module:
    """The reference: one model, each micro-batch's loss averaged over the ranks' shards."""
    model, opt = model_and_optimizer()
    for step in range(STEPS):
        for micro in micros:
            torch.stack([shard_loss(model, step, micro, r, size) for r in range(size)]
                        ).mean().backward()
        opt.step()
        opt.zero_grad()
    return model


def accumulated(backend: Backend) -> nn.Module:
    """MICRO backwards per step, all but the last inside no_sync(), then one finish()."""
    model, opt = model_and_optimizer()
    reducer = BucketedAllreduce(model, backend, bucket_cap_bytes=TINY_CAP)
    for step in range(STEPS):
        for micro in range(MICRO):
            quiet = reducer.no_sync() if micro < MICRO - 1 else contextlib.nullcontext()
            with quiet:
                shard_loss(model, step, micro, backend.rank, backend.size).backward()
        reducer.finish()
        opt.step()
        opt.zero_grad()
    reducer.remove()
    return model


def same(a: nn.Module, b: nn.Module) -> bool:
    return all(torch.allclose(p, q, rtol=1e-10, atol=1e-12)
               for p, q in zip(a.parameters(), b.parameters(), strict=True))


def check(backend: Backend) -> list[str]:
    rank, size = backend.rank, backend.size
    problems = []
    x = torch.full((5,), float(rank + 1))
    backend.allreduce(x)
    if not torch.equal(x, torch.full((5,), size * (size + 1) / 2)):
        problems.append(f"allreduce gave {x.tolist()}")
    y = torch.full((3,), float(rank))
    backend.broadcast(y, size - 1)
    if not torch.equal(y, torch.full((3,), float(size - 1))):
        problems.append(f"broadcast gave {y.tolist()}")
    try:
        backend.allreduce(torch.ones(2 + rank))
        problems.append("ranks with different lengths were not refused")
    except MismatchError:
        pass
    got = accumulated(backend)
    if not same(got, one_process(size, range(MICRO))):
        problems.append("no_sync() accumulation differs from the single-process run")
    if same(got, one_process(size, range(MICRO - 1, MICRO))):
        problems.append("the comparison cannot tell accumulation from the last micro-batch alone")
    return [f"rank {rank} ({backend.name} {backend.size} ranks): {p}" for p in problems]


def report(problems: list[str], how: str) -> None:
    if "mpi4py.MPI" in sys.modules:
        problems.append("MPI was imported")
    if problems:
        raise SystemExit("\n".join(problems))
    if dist.get_rank() == 0:
        print(f"gloo without MPI OK ({how}, {dist.get_world_size()} ranks)", flush=True)


def spawned(rank: int, size: int, rendezvous: str) -> None:
    dist.init_process_group("gloo", init_method=rendezvous, rank=rank, world_size=size)
    problems = []
    for how, kwargs in (("given group", {"comm": dist.group.WORLD}), ("default group", {})):
        with make_backend("gloo", timeout=60, **kwargs) as backend:
            problems += check(backend)
            if how == "given group" and backend.group is not dist.group.WORLD:
                problems.append("the backend did not run on the group it was given")
    report(problems, "torch.multiprocessing")
    dist.destroy_process_group()


def main() -> None:
    if "TORCHELASTIC_RUN_ID" in os.environ:  # started by torchrun
        with make_backend("gloo", timeout=60) as backend:
            report(check(backend), "torchrun")
        return
    size = int(sys.argv[1])
    with tempfile.TemporaryDirectory() as tmp:
        torch.multiprocessing.spawn(spawned, args=(size, f"file://{tmp}/rendezvous"),
                                    nprocs=size)


if __name__ == "__main__":
    main()
