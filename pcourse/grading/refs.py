"""The graded exercises' trials (run on the engines) and references (computed apart).

A *trial* runs on every engine: it sets up the situation an exercise is about (a
model, a data shard, a communicator that counts its calls), calls the learner's
function, and returns what happened. A *reference* computes the right answer
without the learner's code and, where it can, without this course's code either:
torch's own ``DistributedSampler``, MPI's own ``Allreduce``, a single process
training on the whole batch, a serial simulation of every rank.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from pcourse.grading.checks import CountingComm

BATCH = 64  # global batch of the gradient exercises, split evenly over the ranks


def _world() -> Any:
    from mpi4py import MPI

    return MPI.COMM_WORLD


# ---------------------------------------------------------------- a model and its data

def make_model(seed: int = 0) -> torch.nn.Module:
    """A small MLP whose parameters all differ in shape (wrong offsets show)."""
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(3, 8), torch.nn.Tanh(), torch.nn.Linear(8, 2))


def make_data(n: int = BATCH, seed: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 3, generator=gen)
    return x, torch.stack([x.sin().sum(1), x.prod(1)], 1)


def shard_of(data: tuple[torch.Tensor, ...], rank: int, size: int) -> tuple[torch.Tensor, ...]:
    per = len(data[0]) // size
    return tuple(t[rank * per:(rank + 1) * per] for t in data)


def loss_of(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.mse_loss(model(x), y)


def grads(model: torch.nn.Module) -> list[torch.Tensor]:
    return [p.grad.detach().clone() for p in model.parameters()]


def params(model: torch.nn.Module) -> list[torch.Tensor]:
    return [t.detach().clone() for t in model.state_dict().values()]


def names(model: torch.nn.Module | None = None) -> list[str]:
    return list((model or make_model()).state_dict())


# ---------------------------------------------------------------- 01 partitioner

def partition_trial(shard: Callable, n: int, seed: int, epoch: int) -> list[int]:
    """This rank's indices, as the learner's ``shard`` computes them."""
    comm = _world()
    return [int(i) for i in shard(n, comm.rank, comm.size, seed=seed, epoch=epoch)]


def sampler_reference(n: int, size: int, seed: int, epoch: int) -> list[list[int]]:
    """Every rank's segment, from torch's DistributedSampler with drop_last=True.

    The sampler draws the same permutation (``randperm`` seeded with seed + epoch)
    and drops the same tail, but deals it out strided (rank r gets every size-th
    index). Interleaving its shares gives back the permutation, which the
    segment layout cuts into contiguous blocks.
    """
    from torch.utils.data.distributed import DistributedSampler

    shares = []
    for r in range(size):
        sampler = DistributedSampler(range(n), num_replicas=size, rank=r, shuffle=True,
                                     seed=seed, drop_last=True)
        sampler.set_epoch(epoch)
        shares.append(list(sampler))
    order = [shares[i % size][i // size] for i in range(len(shares[0]) * size)]
    per = len(shares[0])
    return [order[r * per:(r + 1) * per] for r in range(size)]


# ---------------------------------------------------------------- 02, 06 gradients

def gradient_trial(average: Callable, steps: int = 1, lr: float = 0.1) -> dict:
    """Backward on this rank's shard, the learner's ``average(model, comm)``, SGD; repeat.

    Returns each step's gradients, the final parameters, whether every gradient
    stayed the same tensor (in place), and the communicator calls of each step.
    """
    comm = _world()
    model = make_model()
    x, y = shard_of(make_data(), comm.rank, comm.size)
    out: dict = {"grads": [], "calls": [], "in_place": True}
    for _ in range(steps):
        model.zero_grad(set_to_none=False)
        loss_of(model, x, y).backward()
        before = [p.grad.data_ptr() for p in model.parameters()]
        counting = CountingComm(comm)
        average(model, counting)
        out["in_place"] &= before == [p.grad.data_ptr() for p in model.parameters()]
        out["grads"].append(grads(model))
        out["calls"].append(counting.calls)
        with torch.no_grad():
            for p in model.parameters():
                p -= lr * p.grad
    out["params"] = params(model)
    return out


def single_process_sgd(steps: int = 1, lr: float = 0.1) -> dict:
    """The same steps in one process on the whole batch: what averaging must reproduce."""
    model = make_model()
    x, y = make_data()
    out: dict = {"grads": []}
    for _ in range(steps):
        model.zero_grad()
        loss_of(model, x, y).backward()
        out["grads"].append(grads(model))
        with torch.no_grad():
            for p in model.parameters():
                p -= lr * p.grad
    out["params"] = params(model)
    return out


# ---------------------------------------------------------------- 03 ring allreduce

def ring_trial(ring: Callable, n: int, seed: int = 0) -> dict:
    """The learner's ring sum of rank-dependent data, and MPI's own Allreduce of it."""
    from mpi4py import MPI

    comm = _world()
    x = np.random.default_rng(seed + comm.rank).standard_normal(n)
    want = x.copy()
    comm.Allreduce(MPI.IN_PLACE, want, op=MPI.SUM)
    counting = CountingComm(comm)
    ring(x, counting)
    return {"got": x, "want": want, "sends": counting.sends(),
            "collectives": counting.collectives()}


# ---------------------------------------------------------------- 04 Gloo from MPI

def gloo_trial(init: Callable, timeout_s: float, blocked_port: int = 29500) -> dict:
    """Start Gloo with the learner's ``init(comm, timeout_s)`` while ``blocked_port`` is taken.

    Rank 0 holds the port the source hard-codes, as another user of a shared machine
    would. Afterwards the group is used once (all_reduce against MPI's Allreduce),
    its timeout read back, and the group destroyed, so the check can run again.
    """
    import socket

    import torch.distributed as dist
    from mpi4py import MPI

    comm = _world()
    if dist.is_initialized():
        dist.destroy_process_group()
    blocker = socket.socket()
    try:
        if comm.rank == 0:
            try:
                blocker.bind(("", blocked_port))
                blocker.listen()
            except OSError:
                pass  # someone else holds it already: just as good
        comm.Barrier()
        where = init(comm, timeout_s)
        t = torch.arange(4, dtype=torch.float64) * (comm.rank + 1)
        want = t.numpy().copy()
        comm.Allreduce(MPI.IN_PLACE, want, op=MPI.SUM)
        dist.all_reduce(t)
        backend = dist.distributed_c10d._get_default_group()._get_backend(torch.device("cpu"))
        return {"where": tuple(where) if where is not None else None,
                "rank": dist.get_rank(), "size": dist.get_world_size(),
                "mpi": (comm.rank, comm.size), "same_sum": bool(np.array_equal(t, want)),
                "timeout": backend.options._timeout.total_seconds()}
    finally:
        blocker.close()
        if dist.is_initialized():
            dist.destroy_process_group()


# ---------------------------------------------------------------- 05 broadcast, consistency

def _diverged_model() -> torch.nn.Module:
    """A model with BatchNorm whose weights *and* running statistics differ per rank."""
    rank = _world().rank
    torch.manual_seed(100 + rank)
    model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.BatchNorm1d(4))
    model(torch.randn(16, 3) + rank)  # train-mode forward: rank-dependent running stats
    return model


def broadcast_trial(broadcast: Callable | None, spread: Callable | None, root: int) -> dict:
    """States before and after ``broadcast(model, comm, root)``, and ``spread`` of both.

    Without a learner's broadcast, MPI's own Bcast of every tensor stands in.
    """
    comm = _world()
    model = _diverged_model()
    out: dict = {"before": params(model)}
    out["spread_before"] = spread(model, comm) if spread else None
    if broadcast is not None:
        broadcast(model, comm, root)
    else:
        for t in model.state_dict().values():
            comm.Bcast(t.numpy(), root=root)
    out["after"] = params(model)
    out["spread_after"] = spread(model, comm) if spread else None
    return out


def spread_reference(states: list[list[torch.Tensor]]) -> float:
    """Largest max-over-ranks minus min-over-ranks of any element, from gathered states."""
    spread = 0.0
    for tensors in zip(*states, strict=True):
        stacked = torch.stack([t.double() for t in tensors])
        spread = max(spread, (stacked.max(0).values - stacked.min(0).values).max().item())
    return spread


def broadcast_names() -> list[str]:
    torch.manual_seed(0)
    return list(torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.BatchNorm1d(4)).state_dict())


# ---------------------------------------------------------------- 07 periodic averaging

def average_params_trial(average: Callable) -> dict:
    """Rank-dependent weights before, and after the learner's ``average(model, comm)``."""
    comm = _world()
    model = make_model(seed=10 + comm.rank)
    before = params(model)
    average(model, comm)
    return {"before": before, "after": params(model)}


def local_sgd_trial(local_sgd: Callable, steps: int, period: int, lr: float = 0.1) -> list:
    """Final parameters after the learner's ``local_sgd`` on this rank's shard."""
    comm = _world()
    model = make_model()
    x, y = shard_of(make_data(), comm.rank, comm.size)
    local_sgd(model, x, y, comm, steps=steps, period=period, lr=lr)
    return params(model)


def local_sgd_reference(size: int, steps: int, period: int, lr: float = 0.1) -> list:
    """Every rank's final parameters, simulated serially in one process.

    Each simulated rank takes plain SGD steps on its shard; after step k·period the
    parameters of all of them are replaced by their mean.
    """
    models = [make_model() for _ in range(size)]
    shards = [shard_of(make_data(), r, size) for r in range(size)]
    for step in range(1, steps + 1):
        for model, (x, y) in zip(models, shards, strict=True):
            model.zero_grad()
            loss_of(model, x, y).backward()
            with torch.no_grad():
                for p in model.parameters():
                    p -= lr * p.grad
        if step % period == 0:
            with torch.no_grad():
                for ps in zip(*(m.parameters() for m in models), strict=True):
                    mean = torch.stack([p.detach() for p in ps]).mean(0)
                    for p in ps:
                        p.copy_(mean)
    return [params(m) for m in models]
