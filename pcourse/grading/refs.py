"""The graded exercises' trials (run on the engines) and references (computed apart).

A *trial* runs on every rank of a check's world: it sets up the situation an
exercise is about (a model, a data shard, a communicator that counts its calls),
calls the learner's function, and returns what happened. A *reference* computes
the right answer without the learner's code and, where it can, without this
course's code either: torch's own ``DistributedSampler``, MPI's own ``Allreduce``,
a single process training on the whole batch, a serial simulation of every rank.

Trials take the world from :func:`pcourse.grading.trials.world` (the sub-communicator
the check runs at) and make their own MPI calls *before* the learner's code, never
after: a learner's rank that failed must not leave the others waiting in ours.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from pcourse.grading.trials import CountingComm, world
from pcourse.runtime import private

BATCH = 60  # global batch of the gradient exercises: equal shards at 2, 3, 4, 5 and 6 ranks


# ---------------------------------------------------------------- a model and its data

class PartlyTrained(torch.nn.Module):
    """The gradient exercises' model with a frozen bias and an unused layer.

    Both end a backward pass with ``grad is None``, as fine-tuning (frozen layers) and
    models with optional branches do; gradient averaging must leave them alone.
    """

    def __init__(self, seed: int = 0) -> None:
        super().__init__()
        self.body = make_model(seed)
        self.body[0].bias.requires_grad_(False)
        self.unused = torch.nn.Linear(2, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.body(x)


def make_model(seed: int = 0, frozen: bool = False) -> torch.nn.Module:
    """A small MLP whose parameters all differ in shape (wrong offsets show)."""
    if frozen:
        return PartlyTrained(seed)
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


def grads(model: torch.nn.Module) -> list[torch.Tensor | None]:
    return [None if p.grad is None else p.grad.detach().clone() for p in model.parameters()]


def params(model: torch.nn.Module) -> list[torch.Tensor]:
    return [t.detach().clone() for t in model.state_dict().values()]


def addresses(model: torch.nn.Module) -> list[int]:
    """Where every parameter and buffer lives: unchanged by anything done in place."""
    return [t.data_ptr() for t in model.state_dict().values()]


def names(frozen: bool = False) -> list[str]:
    return [n for n, _ in make_model(frozen=frozen).named_parameters()]


def sgd_step(model: torch.nn.Module, lr: float) -> None:
    with torch.no_grad():
        for p in model.parameters():
            if p.grad is not None:
                p -= lr * p.grad


# ---------------------------------------------------------------- 01 partitioner

def partition_trial(shard: Callable, cases: list[tuple[int, int, int]]) -> dict:
    """This rank's indices for every (n, seed, epoch), and whether the global RNGs were spared."""
    comm = world()
    before = (torch.get_rng_state(), np.random.get_state()[1].copy(), random.getstate())
    shares = [[int(i) for i in shard(n, comm.rank, comm.size, seed=seed, epoch=epoch)]
              for n, seed, epoch in cases]
    after = (torch.get_rng_state(), np.random.get_state()[1], random.getstate())
    spared = (torch.equal(before[0], after[0]) and np.array_equal(before[1], after[1])
              and before[2] == after[2])
    return {"shares": shares, "rng_spared": spared}


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

def gradient_trial(average: Callable, steps: int = 1, lr: float = 0.1,
                   frozen: bool = False) -> dict:
    """Backward on this rank's shard, the learner's ``average(model, comm)``, SGD; repeat.

    Returns each step's gradients, the final parameters, whether every gradient
    stayed the same tensor (in place), and the communicator calls of each step.
    """
    comm = world()
    model = make_model(frozen=frozen)
    x, y = shard_of(make_data(), comm.rank, comm.size)
    out: dict = {"grads": [], "calls": [], "in_place": True}
    for _ in range(steps):
        model.zero_grad(set_to_none=False)
        loss_of(model, x, y).backward()
        before = [p.grad.data_ptr() if p.grad is not None else None for p in model.parameters()]
        counting = CountingComm(comm)
        average(model, counting)
        out["in_place"] &= before == [p.grad.data_ptr() if p.grad is not None else None
                                      for p in model.parameters()]
        out["grads"].append(grads(model))
        out["calls"].append(counting.calls)
        sgd_step(model, lr)
    out["params"] = params(model)
    return out


def single_process_sgd(steps: int = 1, lr: float = 0.1, frozen: bool = False) -> dict:
    """The same steps in one process on the whole batch: what averaging must reproduce."""
    model = make_model(frozen=frozen)
    x, y = make_data()
    out: dict = {"grads": []}
    for _ in range(steps):
        model.zero_grad()
        loss_of(model, x, y).backward()
        out["grads"].append(grads(model))
        sgd_step(model, lr)
    out["params"] = params(model)
    return out


# ---------------------------------------------------------------- 03 ring allreduce

def ring_trial(ring: Callable, n: int, seed: int = 0) -> dict:
    """The learner's ring sum of rank-dependent data, and MPI's own Allreduce of it."""
    from mpi4py import MPI

    comm = world()
    x = np.random.default_rng(seed + comm.rank).standard_normal(n)
    want = x.copy()
    comm.Allreduce(MPI.IN_PLACE, want, op=MPI.SUM)
    counting = CountingComm(comm)
    ring(x, counting)
    return {"got": x, "want": want, "sends": counting.sends(),
            "collectives": counting.collectives(), "left": (comm.rank - 1) % comm.size,
            "right": (comm.rank + 1) % comm.size}


# ---------------------------------------------------------------- 04 Gloo from MPI

def gloo_trial(init: Callable, timeout_s: float) -> dict:
    """Start Gloo with the learner's ``init(comm, timeout_s)``; what it did, and the group.

    While ``init`` runs, every port the operating system hands to a socket bound to
    port 0 is noted: the port the group meets at must be one of rank 0's. Afterwards
    the group sums ``arange(4) * (rank + 1)`` once, its store and timeout are read
    back, and it is destroyed, so the check can run again. A port already in use
    (a collision: the one thing an OS-chosen port prevents) is said to be one.
    """
    import socket

    import torch.distributed as dist

    comm = world()
    if dist.is_initialized():
        dist.destroy_process_group()
    chosen: list[int] = []
    bind = socket.socket.bind

    def noting(sock: socket.socket, address: Any) -> None:
        bind(sock, address)
        if isinstance(address, tuple) and len(address) >= 2 and address[1] == 0:
            chosen.append(sock.getsockname()[1])

    counting = CountingComm(comm)
    socket.socket.bind = noting
    try:
        where = init(counting, timeout_s)
    except Exception as e:
        if "EADDRINUSE" in str(e) or "address already in use" in str(e).lower():
            raise OSError(f"{type(e).__name__}: {e}. The port was taken when torch bound it: "
                          "let the operating system choose it (bind a socket to port 0 on rank "
                          "0 and read the port it got), then close that socket before "
                          "init_process_group") from e
        raise
    finally:
        socket.socket.bind = bind
    try:
        t = torch.arange(4, dtype=torch.float64) * (comm.rank + 1)
        dist.all_reduce(t)
        store = private.default_store()
        return {"where": where if isinstance(where, tuple | list) else None,
                "returned": type(where).__name__, "os_ports": chosen,
                "store": (getattr(store, "host", None), getattr(store, "port", None)),
                "rank": dist.get_rank(), "size": dist.get_world_size(),
                "mpi": (comm.rank, comm.size), "sum": t.numpy(), "calls": counting.calls,
                "timeout": private.default_group_timeout()}
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def gloo_sum_reference(size: int) -> np.ndarray:
    """What all_reduce of arange(4) * (rank + 1) over ``size`` ranks gives."""
    return np.arange(4, dtype=np.float64) * size * (size + 1) / 2


# ---------------------------------------------------------------- 05 broadcast, consistency

def _bn_model(seed: int, shift: float = 0.0, forwards: int = 1) -> torch.nn.Module:
    """Linear + BatchNorm; ``forwards`` train-mode passes on data shifted by ``shift``."""
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.BatchNorm1d(4))
    gen = torch.Generator().manual_seed(seed)
    for _ in range(forwards):
        model(torch.randn(16, 3, generator=gen) + shift)
    return model


def diverged_model(rank: int) -> torch.nn.Module:
    """Weights, running statistics and batch counts that all differ from rank to rank."""
    return _bn_model(100 + rank, shift=rank, forwards=rank + 1)


# running_mean offsets per rank: rank 0 in the middle, so the spread (max - min over
# ranks) is larger than any rank's distance from rank 0; and at 4 ranks the extremes are
# ranks 1 and 3, which are no ring neighbours: comparing neighbours only misses them
BUFFER_SHIFTS = (0.0, 0.75, -0.5, -0.75)


def buffers_only_model(rank: int) -> torch.nn.Module:
    """The same weights on every rank; only the running mean differs."""
    model = _bn_model(0)
    with torch.no_grad():
        model[1].running_mean += BUFFER_SHIFTS[rank % len(BUFFER_SHIFTS)]
    return model


def state_names() -> list[str]:
    return list(_bn_model(0).state_dict())


def broadcast_trial(broadcast: Callable, roots: list[int]) -> list[dict]:
    """For each root: states before and after ``broadcast(model, comm, root)``, in place or not."""
    comm = world()
    out = []
    for root in roots:
        model = diverged_model(comm.rank)
        before, where = params(model), addresses(model)
        counting = CountingComm(comm)
        broadcast(model, counting, root)
        out.append({"root": root, "before": before, "after": params(model),
                    "in_place": where == addresses(model), "calls": counting.calls})
    return out


def counts_only_model(rank: int) -> torch.nn.Module:
    """The same floats on every rank; only the (integer) count of batches seen differs."""
    model = _bn_model(0)
    model[1].num_batches_tracked += rank
    return model


SPREAD_CASES = ("diverged", "buffers only", "batch counts only", "identical")


def spread_trial(spread: Callable) -> dict:
    """The learner's ``spread(model, comm)`` of four models, and whether it left them alone."""
    comm = world()
    models = {"diverged": diverged_model(comm.rank),
              "buffers only": buffers_only_model(comm.rank),
              "batch counts only": counts_only_model(comm.rank),
              "identical": _bn_model(0)}
    out = {}
    for case, model in models.items():
        before, where = params(model), addresses(model)
        value = spread(model, CountingComm(comm))
        after = params(model)
        untouched = where == addresses(model) and all(
            torch.equal(a, b) for a, b in zip(before, after, strict=True))
        out[case] = {"before": before, "value": float(value), "untouched": untouched}
    return out


def spread_reference(states: list[list[torch.Tensor]]) -> float:
    """Largest max-over-ranks minus min-over-ranks of any element, from gathered states."""
    spread = 0.0
    for tensors in zip(*states, strict=True):
        stacked = torch.stack([t.double() for t in tensors])
        spread = max(spread, (stacked.max(0).values - stacked.min(0).values).max().item())
    return spread


# ---------------------------------------------------------------- 07 periodic averaging

def average_params_trial(average: Callable) -> dict:
    """Rank-dependent weights before, and after the learner's ``average(model, comm)``."""
    comm = world()
    model = make_model(seed=10 + comm.rank)
    before, where = params(model), addresses(model)
    average(model, CountingComm(comm))
    return {"before": before, "after": params(model), "in_place": where == addresses(model)}


def local_sgd_trial(local_sgd: Callable, steps: int, period: int, lr: float = 0.1) -> list:
    """Final parameters after the learner's ``local_sgd`` on this rank's shard."""
    comm = world()
    model = make_model()
    x, y = shard_of(make_data(), comm.rank, comm.size)
    local_sgd(model, x, y, CountingComm(comm), steps=steps, period=period, lr=lr)
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
            sgd_step(model, lr)
        if step % period == 0:
            with torch.no_grad():
                for ps in zip(*(m.parameters() for m in models), strict=True):
                    mean = torch.stack([p.detach() for p in ps]).mean(0)
                    for p in ps:
                        p.copy_(mean)
    return [params(m) for m in models]


# ---------------------------------------------------------------- 08 sharded optimizer

ZERO_LR, ZERO_DECAY = 0.05, 0.1  # AdamW; weight decay on, so a wrong slice of it shows


def zero_model() -> torch.nn.Module:
    """The gradient exercises' MLP in float64: 50 parameters, which 3 ranks do not divide."""
    return make_model().double()


def slice_trial(my_slice: Callable, ns: list[int]) -> list[tuple[int, ...]]:
    """This rank's ``my_slice(n, rank, size)`` for every n, as plain integers."""
    comm = world()
    return [tuple(int(v) for v in my_slice(n, comm.rank, comm.size)) for n in ns]


def zero_trial(my_slice: Callable, sharded_step: Callable, steps: int) -> dict:
    """ZeRO on this rank: its slice (the learner's ``my_slice``), AdamW on it, ``steps``
    steps of the learner's ``sharded_step``; the flat parameters after each step.

    The flat parameters and gradient are padded with zeros to the length ``my_slice``
    says; this rank's AdamW steps only its slice, a copy of it (its master weights).
    """
    comm = world()
    # A process's first optimizer step imports torch's compiler, seconds on a busy
    # machine: paid here, then met at a barrier with room for it, so that no rank
    # waits for a slow peer inside the learner's first collective (5 s deadline).
    warm = torch.zeros(1, requires_grad=True)
    warm.grad = torch.zeros(1)
    torch.optim.AdamW([warm]).step()
    CountingComm(comm, timeout=120.0).Barrier()
    model = zero_model()
    x, y = (t.double() for t in shard_of(make_data(), comm.rank, comm.size))
    n = sum(p.numel() for p in model.parameters())
    start, stop, padded = my_slice(n, comm.rank, comm.size)
    flat = torch.zeros(padded, dtype=torch.float64)
    flat[:n] = torch.nn.utils.parameters_to_vector(model.parameters()).detach()
    shard = flat[start:stop].clone()
    opt = torch.optim.AdamW([shard], lr=ZERO_LR, weight_decay=ZERO_DECAY)
    out: dict = {"flat": [], "calls": [], "state": []}
    for _ in range(steps):
        with torch.no_grad():
            torch.nn.utils.vector_to_parameters(flat[:n].clone(), model.parameters())
        model.zero_grad()
        loss_of(model, x, y).backward()
        grad = torch.zeros(padded, dtype=torch.float64)
        grad[:n] = torch.cat([p.grad.reshape(-1) for p in model.parameters()])
        counting = CountingComm(comm)
        sharded_step(flat, grad, shard, opt, counting)
        out["flat"].append(flat[:n].clone())
        out["calls"].append(counting.calls)
        out["state"].append(sum(v.numel() for st in opt.state.values() for v in st.values()
                                if isinstance(v, torch.Tensor) and v.dim() > 0))
    return out


def single_process_adamw(steps: int) -> list[torch.Tensor]:
    """One process, the whole batch, torch's AdamW: the flat parameters after each step."""
    model = zero_model()
    x, y = (t.double() for t in make_data())
    opt = torch.optim.AdamW(model.parameters(), lr=ZERO_LR, weight_decay=ZERO_DECAY)
    out = []
    for _ in range(steps):
        opt.zero_grad()
        loss_of(model, x, y).backward()
        opt.step()
        out.append(torch.nn.utils.parameters_to_vector(model.parameters()).detach().clone())
    return out


def slice_reference(n: int, size: int) -> list[tuple[int, int, int]]:
    """Every rank's (start, stop, padded): equal slices of n padded to a multiple of size."""
    per = -(-n // size)
    return [(r * per, (r + 1) * per, per * size) for r in range(size)]
