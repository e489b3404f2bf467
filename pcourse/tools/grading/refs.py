"""The graded exercises' trials (run where the learner's code runs) and references
(computed apart).

A *trial* runs on every rank of a check's world: it sets up the situation an
exercise is about (a model, a data shard, a communicator that counts its calls),
calls the learner's function, and returns what happened. A *reference* computes
the right answer without the learner's code and, where it can, without this
course's code either: torch's own ``DistributedSampler``, a sum in one process, a
single process training on the whole batch, a serial simulation of every rank. It
runs in the checking kernel, never in a trial: what a trial holds, the learner's
code on that engine can read (its caller's frames are its own process's).

Trials take the world from :func:`pcourse.tools.grading.trials.world` (the sub-communicator
the check runs at) and make their own MPI calls *before* the learner's code, never
after: a learner's rank that failed must not leave the others waiting in ours.
"""

from __future__ import annotations

import os
import random
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import numpy as np
import torch

from pcourse.runtime import private
from pcourse.tools.grading.trials import (
    COLLECTIVES,
    SENDS,
    Call,
    CountingComm,
    check_left_behind,
    reports_calls,
    world,
)

BATCH = 60  # global batch of the gradient exercises: equal shards at 2, 3, 4, 5 and 6 ranks


# ---------------------------------------------------------------- a model and its data

class PartlyTrained(torch.nn.Module):
    """The gradient exercises' model with a frozen bias and an unused layer.

    Both end a backward pass with ``grad is None``, as fine-tuning (frozen layers) and
    models with optional branches do; gradient averaging must leave them alone.
    """

    def __init__(self, seed: int = 0, general: bool = False) -> None:
        super().__init__()
        self.body = make_model(seed, general=general)
        self.body[0].bias.requires_grad_(False)
        self.unused = torch.nn.Linear(2, 2).to(next(self.body.parameters()).dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.body(x)


def make_model(seed: int = 0, frozen: bool = False, general: bool = False) -> torch.nn.Module:
    """A small MLP whose parameters all differ in shape (wrong offsets show).

    ``general``: the model as the exercises' contracts allow it, not only as a first
    test would build it: float64 (a float32 copy or bucket rounds its numbers, about
    1e-8 apart, which float32's tolerance cannot see), and the last layer's weight stored
    transposed, as a tied or transposed weight is (not contiguous: ``view(-1)`` fails on
    it, ``contiguous()`` is a copy of it).
    """
    if frozen:
        return PartlyTrained(seed, general)
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(3, 8), torch.nn.Tanh(), torch.nn.Linear(8, 2))
    if general:
        model = model.double()
        last = model[2]
        last.weight = torch.nn.Parameter(last.weight.detach().t().contiguous().t())
    return model


def model_dtype(model: torch.nn.Module) -> torch.dtype:
    return next(model.parameters()).dtype


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


def learner_call(fn: Callable, comm: CountingComm, model: torch.nn.Module, *args: Any) -> Any:
    """``fn(model, comm, *args)``, the learner's; its error said in plain words where the
    general model explains it, and what it left behind (requests, communicators) refused."""
    try:
        value = fn(model, comm, *args)
    except NotImplementedError:
        raise
    except Exception as exc:
        odd = [n for n, t in model.named_parameters() if not t.is_contiguous()]
        if odd and ("view" in str(exc) or "contiguous" in str(exc)):
            raise _said(exc, f"{exc} (the parameter {odd[0]} is stored transposed, as a tied "
                    "or transposed weight is: it and its gradient are not contiguous, so "
                    ".view(-1) fails on them; .reshape(-1) copies where it must, and .numpy() "
                    "shares their memory as it is)") from exc
        raise
    check_left_behind(comm, getattr(fn, "__name__", "the function"))
    return value


def _said(exc: Exception, message: str) -> Exception:
    """``exc``'s type with ``message``, where that type can be made from a message."""
    try:
        return type(exc)(message)
    except Exception:  # noqa: BLE001 - an exception type with another constructor
        return RuntimeError(message)


FLOAT64_RTOL, FLOAT64_ATOL = 1e-10, 1e-13  # float64's summation-order differences, not more


def differ(got: list, want: list, names: list[str]) -> str | None:
    """:func:`~pcourse.tools.grading.harness.tensors_differ` at float64's precision, after
    the dtypes: a float64 model's numbers passed through float32 (``.float()``, a bucket
    made with ``torch.empty(n)``, ``np.float32``) are off by about 1e-8, which a float32
    tolerance lets through; said in plain words."""
    from pcourse.tools.grading.harness import tensors_differ

    for g, w, name in zip(got, want, names, strict=False):
        if isinstance(g, torch.Tensor) and isinstance(w, torch.Tensor) and g.dtype != w.dtype:
            return (f"{name} is {str(g.dtype).removeprefix('torch.')}, but the model is "
                    f"{str(w.dtype).removeprefix('torch.')}: keep every tensor in the model's "
                    "own dtype")
    problem = tensors_differ(got, want, names, rtol=FLOAT64_RTOL, atol=FLOAT64_ATOL)
    if problem and tensors_differ(got, want, names) is None:
        return (f"{problem}, about float32's rounding: the model is float64, and its numbers "
                "went through float32 on the way (.float(), a bucket of torch.empty(n) or "
                "torch.zeros(n) without dtype=, np.float32): keep them in the model's dtype")
    return problem


# ---------------------------------------------------------------- 01 partitioner

def partition_trial(shard: Callable, cases: list[tuple[int, int, int]]) -> dict:
    """This rank's indices for every (n, seed, epoch), and whether the global RNGs were spared."""
    comm = world()
    before = (torch.get_rng_state(), np.random.get_state()[1].copy(), random.getstate())
    shares = [_share(shard, n, comm.rank, comm.size, seed, epoch) for n, seed, epoch in cases]
    after = (torch.get_rng_state(), np.random.get_state()[1], random.getstate())
    spared = (torch.equal(before[0], after[0]) and np.array_equal(before[1], after[1])
              and before[2] == after[2])
    return {"shares": shares, "rng_spared": spared}


def _share(shard: Callable, n: int, rank: int, size: int, seed: int, epoch: int) -> list[int]:
    """The learner's share as plain ints; an index type too small for n said so."""
    try:
        return [int(i) for i in shard(n, rank, size, seed=seed, epoch=epoch)]
    except (RuntimeError, OverflowError) as exc:
        if n > 32_767 and ("int16" in str(exc) or "overflow" in str(exc)):
            raise _said(exc, f"n = {n}: {exc}: an index above 32,767 does not fit in int16 "
                        "(nor above 127 in int8); let randperm keep its int64") from exc
        raise


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

@reports_calls
def gradient_trial(average: Callable, steps: int = 1, lr: float = 0.1,
                   frozen: bool = False) -> dict:
    """Backward on this rank's shard, the learner's ``average(model, comm)``, SGD; repeat.

    The model is the general one (float64, a transposed weight: :func:`make_model`).
    Returns each step's gradients, the final parameters, whether every gradient
    stayed the same tensor (in place), and the communicator calls of each step.
    """
    comm = world()
    model = make_model(frozen=frozen, general=True)
    x, y = (t.double() for t in shard_of(make_data(), comm.rank, comm.size))
    out: dict = {"grads": [], "calls": [], "in_place": True}
    for _ in range(steps):
        model.zero_grad(set_to_none=False)
        loss_of(model, x, y).backward()
        before = [p.grad.data_ptr() if p.grad is not None else None for p in model.parameters()]
        counting = CountingComm(comm)
        learner_call(average, counting, model)
        out["in_place"] &= before == [p.grad.data_ptr() if p.grad is not None else None
                                      for p in model.parameters()]
        out["grads"].append(grads(model))
        out["calls"].append(counting.calls)
        sgd_step(model, lr)
    out["params"] = params(model)
    return out


def single_process_sgd(steps: int = 1, lr: float = 0.1, frozen: bool = False) -> dict:
    """The same steps in one process on the whole batch: what averaging must reproduce."""
    model = make_model(frozen=frozen, general=True)
    x, y = (t.double() for t in make_data())
    out: dict = {"grads": []}
    for _ in range(steps):
        model.zero_grad()
        loss_of(model, x, y).backward()
        out["grads"].append(grads(model))
        sgd_step(model, lr)
    out["params"] = params(model)
    return out


# ---------------------------------------------------------------- 03 ring allreduce

def ring_data(n: int, seed: int, rank: int) -> np.ndarray:
    """Rank ``rank``'s numbers to sum: the trial's input, and the reference's."""
    return np.random.default_rng(seed + rank).standard_normal(n)


@reports_calls
def ring_trial(ring: Callable, n: int, seed: int = 0) -> dict:
    """The learner's ring sum of rank-dependent data, and the calls it made.

    No reference is on the engines: the sum is computed in the checking kernel
    (:func:`ring_reference`), where the learner's code cannot read it from a frame.
    """
    comm = world()
    x = ring_data(n, seed, comm.rank)
    counting = CountingComm(comm)
    ring(x, counting)
    check_left_behind(counting, getattr(ring, "__name__", "the ring"))
    return {"got": x, "calls": counting.calls}


def sends(calls: list[Call]) -> list[Call]:
    """The calls that send data to one other rank."""
    return [c for c in calls if c.name in SENDS]


def collectives(calls: list[Call]) -> list[Call]:
    return [c for c in calls if c.name in COLLECTIVES]


def ring_reference(n: int, size: int, seed: int = 0) -> np.ndarray:
    """The sum over ``size`` ranks of :func:`ring_data`, in one process."""
    return sum(ring_data(n, seed, rank) for rank in range(size))


# ---------------------------------------------------------------- 04 Gloo from MPI

@reports_calls
def gloo_trial(init: Callable, timeout_s: float) -> dict:
    """Start Gloo with the learner's ``init(comm, timeout_s)``; what it did, and the group.

    While ``init`` runs, every port the operating system hands out on request is noted
    (a socket bound to port 0, or ``dist.TCPStore`` asked for port 0): the port the group
    meets at must be one of rank 0's. A socket that got its port so and is then *closed*
    gives the port back, and here another program takes it at once, as one may on a
    shared machine: the bind-close-rebind race, made to happen every time. Afterwards the
    group sums ``arange(4) * (rank + 1)`` once, its store and timeout are read back, and
    it is destroyed, so the check can run again.
    """

    import torch.distributed as dist

    comm = world()
    if dist.is_initialized():
        dist.destroy_process_group()
    chosen: list[int] = []
    counting = CountingComm(comm)
    with _taking_freed_ports(chosen) as taken, _noting_stores(dist, chosen):
        try:
            where = init(counting, timeout_s)
        except Exception as e:
            if taken and ("EADDRINUSE" in str(e) or "address already in use" in str(e).lower()):
                raise OSError(
                    f"port {taken[0]} was taken between choosing it and listening on it: the "
                    "socket that got it from the operating system was closed before torch "
                    "listened on it, and another program (here, the check) took it in between, "
                    f"as one can on a shared machine ({type(e).__name__}: {str(e)[:120]}). Let "
                    "the port be chosen by the socket that will listen on it: "
                    "dist.TCPStore(address, 0, ...) on rank 0 listens on a free port and says "
                    "which (store.port)") from e
            if "EADDRINUSE" in str(e) or "address already in use" in str(e).lower():
                raise OSError(
                    f"{type(e).__name__}: {str(e)[:160]}: the port was in use when torch "
                    "listened on it (a socket that got it is still open, or another program "
                    "holds it). Let the store choose and hold the port: dist.TCPStore(address, "
                    "0, ...) on rank 0, then store.port") from e
            raise
    try:
        t = torch.arange(4, dtype=torch.float64) * (comm.rank + 1)
        dist.all_reduce(t)
        store = private.default_store()
        return {"where": where if isinstance(where, tuple | list) else None,
                "returned": type(where).__name__, "os_ports": chosen,
                "store": (getattr(store, "host", None), getattr(store, "port", None)),
                "rank": dist.get_rank(), "size": dist.get_world_size(),
                "sum": t.numpy(), "calls": counting.calls,
                "timeout": private.default_group_timeout()}
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


@contextmanager
def _taking_freed_ports(chosen: list[int]) -> Iterator[list[int]]:
    """Inside: ports that sockets bind to port 0 get are noted in ``chosen``; when such a
    socket is closed, a listener of ours takes its address at once (the ports so taken are
    yielded). Ours close on the way out."""
    import socket

    bind, close = socket.socket.bind, socket.socket.close
    given: dict[int, tuple] = {}  # id of a socket that got a port from the OS -> its address
    squatters: list[socket.socket] = []
    taken: list[int] = []

    def noting(sock: socket.socket, address: Any) -> None:
        bind(sock, address)
        if isinstance(address, tuple) and len(address) >= 2 and address[1] == 0:
            chosen.append(sock.getsockname()[1])
            given[id(sock)] = (sock.family, sock.getsockname())

    def taking(sock: socket.socket) -> None:
        freed = given.pop(id(sock), None) if sock.fileno() >= 0 else None
        close(sock)
        if freed is None:
            return
        family, address = freed
        squatter = socket.socket(family, socket.SOCK_STREAM)
        try:
            bind(squatter, address)
            squatter.listen()
        except OSError:
            close(squatter)
            return
        squatters.append(squatter)
        taken.append(address[1])

    socket.socket.bind, socket.socket.close = noting, taking
    try:
        yield taken
    finally:
        socket.socket.bind, socket.socket.close = bind, close
        for squatter in squatters:
            squatter.close()


@contextmanager
def _noting_stores(dist: Any, chosen: list[int]) -> Iterator[None]:
    """Inside: ``dist.TCPStore`` notes in ``chosen`` the port it listens on when asked for
    port 0 (the operating system's choice, taken by the listener itself)."""
    real = dist.TCPStore

    def noting(host_name: str, port: int, *args: Any, **kwargs: Any) -> Any:
        store = real(host_name, port, *args, **kwargs)
        if port == 0:
            chosen.append(store.port)
        return store

    dist.TCPStore = noting
    try:
        yield
    finally:
        dist.TCPStore = real


def gloo_sum_reference(size: int) -> np.ndarray:
    """What all_reduce of arange(4) * (rank + 1) over ``size`` ranks gives."""
    return np.arange(4, dtype=np.float64) * size * (size + 1) / 2


# ---------------------------------------------------------------- 05 broadcast, consistency

def _bn_model(seed: int, shift: float = 0.0, forwards: int = 1) -> torch.nn.Module:
    """Linear + BatchNorm; ``forwards`` train-mode passes on data shifted by ``shift``."""
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.BatchNorm1d(4)).double()
    # the contract's whole range: float64, a weight stored transposed (a copy of it is no
    # longer the model's memory), a frozen parameter (a broadcast covers it too)
    model[0].weight = torch.nn.Parameter(model[0].weight.detach().t().contiguous().t())
    model[0].bias.requires_grad_(False)
    gen = torch.Generator().manual_seed(seed)
    for _ in range(forwards):
        model(torch.randn(16, 3, generator=gen, dtype=torch.float64) + shift)
    return model


def diverged_model(rank: int) -> torch.nn.Module:
    """Weights, running statistics and batch counts that all differ from rank to rank."""
    return _bn_model(100 + rank, shift=rank, forwards=rank + 1)


def broadcast_source(root: int) -> list[torch.Tensor]:
    """What the root holds before (and after) a broadcast from ``root``, built here.

    Up to rounding: BatchNorm's statistics sum in another order on another number of
    threads; the ranks' tensors are compared bit for bit with the root's own."""
    return params(diverged_model(root))


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


@reports_calls
def broadcast_trial(broadcast: Callable, roots: list[int]) -> list[dict]:
    """For each root: the state after ``broadcast(model, comm, root)``, in place or not (the
    kernel knows the state before: :func:`broadcast_source`)."""
    comm = world()
    out = []
    for root in roots:
        model = diverged_model(comm.rank)
        where = addresses(model)
        counting = CountingComm(comm)
        broadcast(model, counting, root)
        check_left_behind(counting, getattr(broadcast, "__name__", "the broadcast"))
        out.append({"root": root, "after": params(model),
                    "in_place": where == addresses(model), "calls": counting.calls})
    return out


def counts_only_model(rank: int) -> torch.nn.Module:
    """The same floats on every rank; only the (integer) count of batches seen differs."""
    model = _bn_model(0)
    model[1].num_batches_tracked += rank
    return model


def nearly_identical_model(rank: int) -> torch.nn.Module:
    """The same everywhere but one weight, 3e-9 apart between ranks 0 and 1: a spread that
    a rounded answer (to 6 decimals, or through float32) says is 0."""
    model = _bn_model(0)
    with torch.no_grad():
        model[0].weight[1, 2] += 3e-9 * (rank == 1)
    return model


SPREAD_MODELS: dict[str, Callable[[int], torch.nn.Module]] = {
    "diverged": diverged_model, "buffers only": buffers_only_model,
    "batch counts only": counts_only_model, "nearly identical": nearly_identical_model,
    "identical": lambda rank: _bn_model(0)}
SPREAD_CASES = tuple(SPREAD_MODELS)


def spread_trial(spread: Callable) -> dict:
    """The learner's ``spread(model, comm)`` of four models, and whether it left them alone."""
    comm = world()
    out = {}
    for case, make in SPREAD_MODELS.items():
        model = make(comm.rank)
        before, where = params(model), addresses(model)
        counting = CountingComm(comm)
        value = spread(model, counting)
        check_left_behind(counting, getattr(spread, "__name__", "max_spread"))
        after = params(model)
        untouched = where == addresses(model) and all(
            torch.equal(a, b) for a, b in zip(before, after, strict=True))
        out[case] = {"value": float(value), "untouched": untouched}
    return out


def spread_reference(case: str, size: int) -> float:
    """Largest max-over-ranks minus min-over-ranks of any element of the ``case`` models,
    built here for every rank (never read from the engines)."""
    states = [params(SPREAD_MODELS[case](rank)) for rank in range(size)]
    spread = 0.0
    for tensors in zip(*states, strict=True):
        stacked = torch.stack([t.double() for t in tensors])
        spread = max(spread, (stacked.max(0).values - stacked.min(0).values).max().item())
    return spread


# ---------------------------------------------------------------- 07 periodic averaging

def average_params_trial(average: Callable) -> dict:
    """Rank-dependent weights after the learner's ``average(model, comm)``.

    The general model (:func:`make_model`), with an integer buffer that differs between
    ranks (a count of steps, as BatchNorm's ``num_batches_tracked``): parameters are
    averaged, buffers are not (torch's own parameter averaging takes ``parameters()``;
    an integer has no average). ``after``: the parameters only; the kernel builds the
    weights before itself (:func:`mean_parameters`).
    """
    comm = world()
    model = _averaged_model(comm.rank)
    where, buffers = addresses(model), [b.clone() for b in model.buffers()]
    learner_call(average, CountingComm(comm), model)
    return {"after": [t.detach().clone() for t in model.parameters()],
            "in_place": where == addresses(model),
            "buffers_kept": all(torch.equal(a, b) for a, b in zip(buffers, model.buffers(),
                                                                  strict=True))}


def _averaged_model(rank: int) -> torch.nn.Module:
    model = make_model(seed=10 + rank, general=True)
    model.register_buffer("steps_seen", torch.tensor(7 + rank))
    return model


def mean_parameters(size: int) -> list[torch.Tensor]:
    """The mean over ``size`` ranks of :func:`average_params_trial`'s weights, built here."""
    models = [_averaged_model(rank) for rank in range(size)]
    weights = [[t.detach() for t in m.parameters()] for m in models]
    return [sum(ts) / size for ts in zip(*weights, strict=True)]


def local_sgd_trial(local_sgd: Callable, steps: int, period: int, lr: float = 0.1) -> list:
    """Final parameters after the learner's ``local_sgd`` on this rank's shard."""
    comm = world()
    model = make_model(general=True)
    x, y = (t.double() for t in shard_of(make_data(), comm.rank, comm.size))
    counting = CountingComm(comm)
    local_sgd(model, x, y, counting, steps=steps, period=period, lr=lr)
    check_left_behind(counting, getattr(local_sgd, "__name__", "local_sgd"))
    return params(model)


def local_sgd_reference(size: int, steps: int, period: int, lr: float = 0.1) -> list:
    """Every rank's final parameters, simulated serially in one process.

    Each simulated rank takes plain SGD steps on its shard; after step k·period the
    parameters of all of them are replaced by their mean.
    """
    models = [make_model(general=True) for _ in range(size)]
    shards = [tuple(t.double() for t in shard_of(make_data(), r, size)) for r in range(size)]
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


@reports_calls
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
    sync = CountingComm(comm, timeout=120.0)
    sync.Barrier()
    model = zero_model()
    x, y = (t.double() for t in shard_of(make_data(), comm.rank, comm.size))
    n = sum(p.numel() for p in model.parameters())
    start, stop, padded = my_slice(n, comm.rank, comm.size)
    flat = torch.zeros(padded, dtype=torch.float64)
    flat[:n] = torch.nn.utils.parameters_to_vector(model.parameters()).detach()
    shard = flat[start:stop].clone()
    opt = torch.optim.AdamW([shard], lr=ZERO_LR, weight_decay=ZERO_DECAY)
    out: dict = {"sync": sync.calls, "flat": [], "calls": [], "state": []}
    for _ in range(steps):
        with torch.no_grad():
            torch.nn.utils.vector_to_parameters(flat[:n].clone(), model.parameters())
        model.zero_grad()
        loss_of(model, x, y).backward()
        grad = torch.zeros(padded, dtype=torch.float64)
        grad[:n] = torch.cat([p.grad.reshape(-1) for p in model.parameters()])
        counting = CountingComm(comm)
        sharded_step(flat, grad, shard, opt, counting)
        check_left_behind(counting, getattr(sharded_step, "__name__", "sharded_step"))
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


# ---------------------------------------------------------------- 09 tensor parallelism

TP_D, TP_HIDDEN = 5, 12  # the MLP's width and hidden size: 12 divides by 2, 3 and 4, and 5
#                          differs from it, so a block cut along the wrong axis has the wrong shape
TP_SHAPE = (4, 2, TP_D)  # an input [T, B, d], sequence-first as in lesson 11
TP_FG_SHAPE = (2, 3)  # what f and g are tried on alone


def tp_ranks(tp: int, engines: int) -> int:
    """The ranks a check at tensor-parallel size ``tp`` runs on: as many groups of ``tp``
    as the engines hold (at tp = 2 on 4 engines, two groups: a 2x2 mesh)."""
    return tp * (engines // tp)


def at_tp(check: Callable[[int], str | None]) -> str | None:
    """:func:`~pcourse.tools.grading.harness.at_sizes` over tensor-parallel sizes: the problem
    says at which tp it showed (a check at tp = 2 runs on more than 2 ranks)."""
    from pcourse.tools.grading import harness

    sizes = harness.GRADER_SIZES if os.environ.get(harness.CLUSTER_ENV) else harness.SIZES
    for tp in sizes:
        try:
            problem = check(tp)
        except harness.ExerciseError as exc:
            return f"at tp={tp}: {exc}"
        if problem:
            return f"at tp={tp}, {problem}"
    return None


def tp_mlp() -> torch.nn.Module:
    """The one-process MLP the exercise splits, in float64 (lesson 11's, smaller)."""
    from pcourse.workloads.transformer import MLP

    torch.manual_seed(11)
    return MLP(TP_D, TP_HIDDEN).double()


def tp_batch(group_index: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Group ``group_index``'s input and the weights its output is summed with.

    Each group its own batch, as data parallelism across groups gives it; the weights
    depend on the position, since a plain sum of the output would hide a transposed block.
    """
    gen = torch.Generator().manual_seed(100 + group_index)
    return (torch.randn(TP_SHAPE, generator=gen, dtype=torch.float64),
            torch.randn(TP_SHAPE, generator=gen, dtype=torch.float64))


def fg_data(rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A rank's own input to f and g, and its own cotangent: every rank's differs."""
    gen = torch.Generator().manual_seed(300 + rank)
    return (torch.randn(TP_FG_SHAPE, generator=gen, dtype=torch.float64),
            torch.randn(TP_FG_SHAPE, generator=gen, dtype=torch.float64))


def tp_layout(rank: int, size: int, tp: int, strided: bool = False) -> tuple[int, int]:
    """(group, rank in the group) of ``rank`` of ``size``: groups of ``tp`` consecutive
    ranks, or, ``strided``, ranks ``size // tp`` apart (the other axis of a mesh)."""
    if strided:
        return rank % (size // tp), rank // (size // tp)
    return rank // tp, rank % tp


class _TPGroup:
    """This rank's tensor-parallel group of the trial's world, as a course Backend."""

    def __init__(self, tp: int, strided: bool = False) -> None:
        from pcourse.backends import make_backend
        from pcourse.tools.grading.trials import OP_TIMEOUT

        comm = world()
        self.index, key = tp_layout(comm.rank, comm.size, tp, strided)
        sub = comm.Split(self.index, key)
        self.backend = make_backend("mpi", comm=sub, timeout=OP_TIMEOUT)
        sub.Free()

    def __enter__(self) -> _TPGroup:
        return self

    def __exit__(self, *exc: object) -> None:
        self.backend.close()


def _pair(value: Any, who: str) -> tuple[torch.Tensor, torch.Tensor]:
    if not (isinstance(value, tuple | list) and len(value) == 2
            and all(isinstance(t, torch.Tensor) for t in value)):
        raise TypeError(f"{who} returned {type(value).__name__}, not a pair of tensors "
                        "(weight, bias)")
    return value[0], value[1]


def tp_blocks(column_block: Callable, row_block: Callable, group: Any) -> list[torch.Tensor]:
    """This rank's blocks of the MLP, by the learner's ``column_block`` and ``row_block``."""
    mlp = tp_mlp()
    w1, b1 = _pair(column_block(mlp.fc1.weight.detach().clone(), mlp.fc1.bias.detach().clone(),
                                group), "column_block")
    w2, b2 = _pair(row_block(mlp.fc2.weight.detach().clone(), mlp.fc2.bias.detach().clone(),
                             group), "row_block")
    return [t.detach().clone() for t in (w1, b1, w2, b2)]


def tp_blocks_trial(column_block: Callable, row_block: Callable, tp: int) -> list[torch.Tensor]:
    """This rank's four blocks (fc1's weight and bias, fc2's weight and bias)."""
    with _TPGroup(tp) as group:
        return tp_blocks(column_block, row_block, group.backend)


def fg_trial(f: Callable, g: Callable, tp: int) -> dict:
    """f and g alone on this rank's own input: their outputs, and the input's gradient
    when this rank's own cotangent flows back (None where none reached it)."""
    with _TPGroup(tp) as group:
        out = {}
        for name, op in (("f", f), ("g", g)):
            x, cotangent = fg_data(world().rank)
            x.requires_grad_()
            y = op(x, group.backend)
            if not isinstance(y, torch.Tensor) or y.shape != x.shape:
                raise TypeError(f"{name} returned {type(y).__name__} "
                                f"{tuple(getattr(y, 'shape', ()))}, not a tensor shaped like "
                                f"its input {tuple(x.shape)}")
            if y.requires_grad:
                y.backward(cotangent)
            out[name] = {"forward": y.detach().clone(), "linked": y.requires_grad,
                         "backward": None if x.grad is None else x.grad.clone()}
        return out


def fg_reference(tp: int, size: int) -> list[dict]:
    """Every rank's f and g, from the closed forms: f is the identity forward and sums
    over the group backward; g sums over the group forward and is the identity backward.
    ``world_*``: the sums over all ``size`` ranks instead, what using the world gives."""
    data = [fg_data(r) for r in range(size)]
    xs, cots = [d[0] for d in data], [d[1] for d in data]
    out = []
    for r in range(size):
        members = [m for m in range(size) if tp_layout(m, size, tp)[0] == tp_layout(r, size,
                                                                                     tp)[0]]
        out.append({"f": {"forward": xs[r], "backward": sum(cots[m] for m in members)},
                    "g": {"forward": sum(xs[m] for m in members), "backward": cots[r]},
                    "world_forward": sum(xs), "world_backward": sum(cots)})
    return out


FG_WHAT = {("f", "forward"): "f's forward (the identity)",
           ("f", "backward"): "f's backward (the sum of the gradients over the group)",
           ("g", "forward"): "g's forward (the sum over the group)",
           ("g", "backward"): "g's backward (the identity)"}


def fg_problem(got: dict, want: dict, tp: int, size: int) -> str | None:
    """What is wrong with one rank's f and g, in plain words; None if nothing."""
    from pcourse.tools.grading.harness import tensors_differ

    for name in ("f", "g"):
        if not got[name]["linked"]:
            return (f"{name}'s output does not require grad: it is cut off from its input, "
                    "so no gradient flows back through it")
        for way in ("forward", "backward"):
            mine, right = got[name][way], want[name][way]
            what = FG_WHAT[name, way]
            if mine is None:
                return f"{what}: no gradient reached the input (did backward return None?)"
            problem = tensors_differ([mine], [right], [what], rtol=1e-12, atol=1e-12)
            if problem and size > tp and tensors_differ([mine], [want[f"world_{way}"]],
                                                        rtol=1e-12, atol=1e-12) is None:
                return (f"{what} is the sum over all {size} ranks, not over this rank's group "
                        f"of {tp}: reduce over the group you are given, never the world")
            if problem:
                other, why = _fg_mixups(want)[name, way]
                if tensors_differ([mine], [other], rtol=1e-12, atol=1e-12) is None:
                    return f"{problem}: {why}"
                return problem
    return None


def _fg_mixups(want: dict) -> dict:
    """What each of f's and g's directions gives when it does the other's job, and why not."""
    return {("f", "forward"): (want["g"]["forward"], "it is the sum over the group; going "
                               "forward f is the identity (the sum is g's)"),
            ("f", "backward"): (want["g"]["backward"], "it is this rank's own gradient only; "
                                "going backward f sums the gradients over the group"),
            ("g", "forward"): (want["f"]["forward"], "it is this rank's own input only; going "
                               "forward g sums over the group"),
            ("g", "backward"): (want["f"]["backward"], "it is the sum over the group; going "
                                "backward g is the identity (the sum is f's)")}


def tp_mlp_trial(column_block: Callable, row_block: Callable, column_linear: Callable,
                 row_linear: Callable, tp: int, strided: bool = False) -> dict:
    """The MLP split over this rank's group by the learner's four functions, on the
    group's batch: its output, and the gradients of the input and of this rank's blocks."""
    with _TPGroup(tp, strided) as group:
        params = [t.requires_grad_() for t in tp_blocks(column_block, row_block,
                                                        group.backend)]
        w1, b1, w2, b2 = params
        x, weights = tp_batch(group.index)
        x.requires_grad_()
        hidden = column_linear(x, w1, b1, group.backend)
        out = row_linear(torch.nn.functional.gelu(hidden), w2, b2, group.backend)
        if not isinstance(out, torch.Tensor) or out.shape != weights.shape:
            raise TypeError(f"the MLP's output is {type(out).__name__} "
                            f"{tuple(getattr(out, 'shape', ()))}, expected a tensor "
                            f"{tuple(weights.shape)}")
        if out.requires_grad:
            (out * weights).sum().backward()
        return {"out": out.detach().clone(),
                "grads": [None if t.grad is None else t.grad.clone() for t in [x, *params]]}


TP_NAMES = ["the input x", "fc1's weight block", "fc1's bias block", "fc2's weight block",
            "fc2's bias"]


def one_process_mlp(group_index: int) -> dict:
    """One process, the whole MLP, on group ``group_index``'s batch: output and gradients.

    ``hidden``: the gradient of fc1's output, from which each rank's own part of the
    input's gradient follows (what a rank holds before f sums them).
    """
    mlp = tp_mlp()
    x, weights = tp_batch(group_index)
    x.requires_grad_()
    hidden = mlp.fc1(x)
    hidden.retain_grad()
    out = mlp.fc2(torch.nn.functional.gelu(hidden))
    (out * weights).sum().backward()
    return {"out": out.detach(), "bias": mlp.fc2.bias.detach(), "hidden": hidden.grad,
            "fc1": mlp.fc1.weight.detach(),
            "grads": [x.grad, mlp.fc1.weight.grad, mlp.fc1.bias.grad, mlp.fc2.weight.grad,
                      mlp.fc2.bias.grad]}


def tp_block_reference(full: list[torch.Tensor], tp: int, rank: int) -> list[torch.Tensor]:
    """Rank ``rank``'s blocks of [fc1 weight, fc1 bias, fc2 weight, fc2 bias] (or of their
    gradients): fc1 split by its output features (rows), fc2 by its input features
    (columns), fc2's bias whole."""
    n = full[0].shape[0] // tp
    rows = slice(rank * n, (rank + 1) * n)
    return [full[0][rows], full[1][rows], full[2][:, rows], full[3]]


def tp_blocks_problem(got: list[torch.Tensor], tp: int, rank: int) -> str | None:
    """What is wrong with one rank's four blocks of the MLP, in plain words; None if nothing."""
    from pcourse.tools.grading.harness import tensors_differ

    mlp = tp_mlp()
    whole = [t.detach() for t in (mlp.fc1.weight, mlp.fc1.bias, mlp.fc2.weight, mlp.fc2.bias)]
    want = tp_block_reference(whole, tp, rank)
    n = TP_HIDDEN // tp
    first, last = rank * n, (rank + 1) * n
    names = ["column_block's weight", "column_block's bias", "row_block's weight",
             "row_block's bias"]
    should = [f"rows {first} to {last} (this rank's output features) of the whole "
              f"{tuple(whole[0].shape)} weight: torch stores a weight as [out_features, "
              "in_features]",
              f"elements {first} to {last} of the whole bias",
              f"columns {first} to {last} (this rank's input features) of the whole "
              f"{tuple(whole[2].shape)} weight",
              "the whole bias (added once, after the sum)"]
    for mine, right, name, block in zip(got, want, names, should, strict=True):
        problem = tensors_differ([mine], [right], [name], rtol=0, atol=0)
        if problem:
            return f"{problem}: it should be {block}"
    return None


def tp_forward_problem(got: dict, want: dict, tp: int) -> str | None:
    """What is wrong with one rank's MLP output; None if nothing."""
    from pcourse.tools.grading.harness import tensors_differ

    problem = tensors_differ([got["out"]], [want["out"]], ["the MLP's output"],
                             rtol=1e-12, atol=1e-12)
    if problem and tensors_differ([got["out"]], [want["out"] + (tp - 1) * want["bias"]],
                                  rtol=1e-12, atol=1e-12) is None:
        return (f"{problem}: fc2's bias was added {tp} times, once on every rank; add it "
                "once, after the sum")
    return problem


def tp_backward_problem(got: dict, want: dict, tp: int, rank: int) -> str | None:
    """What is wrong with one rank's gradients (the input's, its blocks'); None if nothing."""
    from pcourse.tools.grading.harness import tensors_differ

    right = [want["grads"][0], *tp_block_reference(want["grads"][1:], tp, rank)]
    for mine, expected, name in zip(got["grads"], right, TP_NAMES, strict=True):
        if mine is None:
            return (f"no gradient reached {name}: the backward pass never got there (was "
                    "something computed outside autograd, or detached?)")
        problem = tensors_differ([mine], [expected], [f"the gradient of {name}"],
                                 rtol=1e-12, atol=1e-12)
        if problem and name == TP_NAMES[0]:
            n = TP_HIDDEN // tp
            rows = slice(rank * n, (rank + 1) * n)
            own = want["hidden"][..., rows] @ want["fc1"][rows]
            if tensors_differ([mine], [own], rtol=1e-12, atol=1e-12) is None:
                return (f"{problem}: it is this rank's own part only; the parts of the group's "
                        "ranks must be summed (x enters the column-parallel layer through f)")
        if problem:
            return problem
    return None


# ---------------------------------------------------------------- 10 pipeline, 1F1B

PIPE_WIDTH, PIPE_MICRO = 4, 2  # the model's width; rows of one micro-batch
PIPE_LAYERS = 2  # Linear + tanh blocks per stage: the stages of p = 2, 3, 4 cut one chain
PIPE_MS = (1, 3, 4, 8)  # micro-batch counts of the loop's checks: m < p, m not a multiple of p
PIPE_ORDER_SIZES = (2, 3, 4)  # the order is plain Python: checked at every size, grader or not


def one_f_one_b_reference(p: int, rank: int, m: int) -> list[tuple[str, int]]:
    """Stage ``rank`` of ``p``'s 1F1B order over ``m`` micro-batches, from the closed form.

    A warm-up of min(p - rank - 1, m) forwards (the later stages have not yet sent a
    gradient back), then one forward and one backward in turn, then the backwards left.
    """
    warm = min(p - rank - 1, m)
    order = [("F", i) for i in range(warm)]
    for k in range(m - warm):
        order += [("F", warm + k), ("B", k)]
    return order + [("B", i) for i in range(m - warm, m)]


def gpipe_order(m: int) -> list[tuple[str, int]]:
    """GPipe's order: every forward, then every backward (the same on every stage)."""
    return [("F", i) for i in range(m)] + [("B", i) for i in range(m)]


def in_flight(order: list[tuple[str, int]]) -> int:
    """The most micro-batches forwarded and not yet backwarded at once: the activations
    a stage must keep."""
    now = peak = 0
    for action, _ in order:
        now += 1 if action == "F" else -1
        peak = max(peak, now)
    return peak


def pipe_order_cases() -> list[tuple[int, int, int]]:
    """(p, rank, m) of every order :func:`pipe_order_trial` asks for, in its order."""
    return [(p, rank, m) for p in PIPE_ORDER_SIZES for m in range(1, 9) for rank in range(p)]


def pipe_order_trial(one_f_one_b: Callable) -> list[dict]:
    """The learner's order of every stage at p = 2, 3, 4 and m = 1..8 (plain Python), in
    the order of :func:`pipe_order_cases`: the kernel knows which case each answers."""
    return [{"order": _plain_order(one_f_one_b(p, rank, m))}
            for p, rank, m in pipe_order_cases()]


def _plain_order(order: Any) -> list[tuple[str, int]]:
    """``order`` as a list of (str, int), or a TypeError that says what it was instead."""
    if not isinstance(order, list | tuple):
        raise TypeError(f"one_f_one_b returned {type(order).__name__}, not a list of "
                        "(action, micro-batch) pairs such as [('F', 0), ('B', 0)]")
    plain = []
    for k, step in enumerate(order):
        if not (isinstance(step, tuple | list) and len(step) == 2):
            raise TypeError(f"one_f_one_b's step {k} is {step!r}, not a pair such as ('F', 0)")
        plain.append((str(step[0]), int(step[1])))
    return plain


def pipe_order_problem(got: dict) -> str | None:
    """What is wrong with one stage's order, in plain words; None if nothing."""
    p, rank, m, order = got["p"], got["rank"], got["m"], [tuple(s) for s in got["order"]]
    where = f"at p={p}, m={m}, stage {rank}: "
    seen: dict[tuple[str, int], int] = {}
    for k, (action, i) in enumerate(order):
        if action not in ("F", "B") or not 0 <= i < m:
            return (where + f"step {k} is {(action, i)}: an action is 'F' or 'B' and a "
                    f"micro-batch 0 to {m - 1}")
        if (action, i) in seen:
            return where + f"micro-batch {i} goes {_way(action)} twice (steps {seen[action, i]} " \
                f"and {k})"
        if action == "B" and ("F", i) not in seen:
            return where + f"micro-batch {i} goes backward (step {k}) before it went forward"
        seen[action, i] = k
    missing = [(a, i) for i in range(m) for a in ("F", "B") if (a, i) not in seen]
    if missing:
        return where + f"micro-batch {missing[0][1]} never goes {_way(missing[0][0])}"
    want = one_f_one_b_reference(p, rank, m)
    if order == want:
        return None
    most, limit = in_flight(order), min(p - rank, m)
    kept = (f"it keeps up to {most} micro-batches' activations in flight where 1F1B keeps at "
            f"most min(p - rank, m) = {limit}")
    ahead, right = _ahead(order), _ahead(want)
    if ahead != right:
        extra = f"; {kept}" if most > limit else ""
        return (where + f"it runs {_forwards(ahead)} before its first backward, 1F1B "
                f"{right}: a warm-up of min(p - rank - 1, m) = {_forwards(min(p - rank - 1, m))}, "
                f"then one forward before each backward{extra}")
    k = next(k for k, (a, b) in enumerate(zip(order, want, strict=True)) if a != b)
    return (where + f"step {k} is {order[k]}, 1F1B's is {want[k]}: after the warm-up, one "
            "forward and one backward in turn, then the remaining backwards, each in "
            "micro-batch order")


def pipe_orders_problem(results: list[dict]) -> str | None:
    """The first stage, size and m whose order is wrong, in plain words; None if none.

    An order that is GPipe's everywhere is said to be, at the first place it differs from
    1F1B's: its gradients are right, only the count in flight shows it. Each order is
    taken as the case asked for in its place (:func:`pipe_order_cases`), whatever the
    engine labelled it.
    """
    cases = pipe_order_cases()
    if len(results) != len(cases):
        return (f"the engine sent back {len(results)} orders where {len(cases)} were asked "
                "for: did the code replace the checks' functions?")
    results = [{"p": p, "rank": rank, "m": m, "order": r["order"]}
               for (p, rank, m), r in zip(cases, results, strict=True)]
    if all([tuple(s) for s in r["order"]] == gpipe_order(r["m"]) for r in results):
        for r in results:
            want = one_f_one_b_reference(r["p"], r["rank"], r["m"])
            if want != gpipe_order(r["m"]):
                return (f"at p={r['p']}, m={r['m']}, stage {r['rank']}: this is GPipe's order "
                        "(every forward, then every backward): the gradients come out right, "
                        f"but it keeps {r['m']} micro-batches' activations in flight where 1F1B "
                        f"keeps at most min(p - rank, m) = {in_flight(want)}")
    return next(filter(None, map(pipe_order_problem, results)), None)


def _way(action: str) -> str:
    return "forward" if action == "F" else "backward"


def _forwards(n: int) -> str:
    return f"{n} forward" + ("" if n == 1 else "s")


def _ahead(order: list[tuple[str, int]]) -> int:
    """How many forwards an order runs before its first backward."""
    return next((k for k, (a, _) in enumerate(order) if a == "B"), len(order))


def pipe_block(k: int) -> torch.nn.Module:
    """Block ``k`` of the chain (Linear + tanh, float64), seeded by its place in it."""
    torch.manual_seed(1000 + k)
    return torch.nn.Sequential(torch.nn.Linear(PIPE_WIDTH, PIPE_WIDTH), torch.nn.Tanh()).double()


def pipe_stage(p: int, rank: int) -> torch.nn.Module:
    """Stage ``rank`` of ``p``: blocks PIPE_LAYERS·rank onwards of the chain."""
    return torch.nn.Sequential(*(pipe_block(rank * PIPE_LAYERS + j) for j in range(PIPE_LAYERS)))


def pipe_batch(m: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The whole batch of m micro-batches, and the weights the loss sums the output with.

    The weights differ at every position, so a micro-batch's output paired with another
    one's weights, or transposed, changes the gradients.
    """
    gen = torch.Generator().manual_seed(500 + m)
    shape = (m * PIPE_MICRO, PIPE_WIDTH)
    return (torch.randn(shape, generator=gen, dtype=torch.float64),
            torch.randn(shape, generator=gen, dtype=torch.float64))


def _micro(t: torch.Tensor, m: int) -> list[torch.Tensor]:
    return [c.clone() for c in t.split(PIPE_MICRO)][:m]


class NotHere:
    """What a stage gets in place of the inputs or targets another stage holds: reading it
    says which stage has them (where None would only say it is not subscriptable)."""

    def __init__(self, what: str, holder: int, rank: int) -> None:
        self.what, self.holder, self.rank = what, holder, rank

    def __getitem__(self, i: Any) -> Any:
        raise LookupError(f"stage {self.rank} read {self.what}[{i!r}], but only stage "
                          f"{self.holder} has the {self.what}: the first stage (rank 0) the "
                          "inputs, the last (rank p - 1) the targets")

    def __bool__(self) -> bool:
        return False

    def __repr__(self) -> str:
        return f"<no {self.what} on stage {self.rank}>"


def pipe_data(m: int, p: int, rank: int) -> tuple[Any, Any]:
    """Stage ``rank``'s inputs (the first stage's) and targets (the last's), m micro-batches."""
    x, weights = pipe_batch(m)
    return (_micro(x, m) if rank == 0 else NotHere("inputs", 0, rank),
            _micro(weights, m) if rank == p - 1 else NotHere("targets", p - 1, rank))


PIPE_TAG_BASE = 3000  # above the small tags other exercises' messages carry


class PipeGroup:
    """The point-to-point messages between stages, as the exercise's ``group`` gives them.

    ``send`` posts MPI's Isend of a float64 copy and returns at once (the trial waits for
    every send after the learner's loop, with a deadline); ``recv`` waits for a message
    polling MPI's Irecv, and past the deadline raises DeadlockError saying who waited for
    what. The micro-batch number, after ``base``, is the message's tag: a message cannot be
    taken for another micro-batch's, nor for one of another m run on the same communicator.
    """

    def __init__(self, comm: Any, timeout: float, m: int, base: int = 0) -> None:
        self.comm, self.timeout, self.m, self.base = comm, timeout, m, base
        self.rank, self.size = comm.rank, comm.size
        self.pending: list[tuple[Any, np.ndarray, str]] = []  # requests, buffers they keep

    def _tag(self, i: Any) -> int:
        if not isinstance(i, int | np.integer) or not 0 <= i < self.m:
            raise ValueError(f"stage {self.rank} sent or received micro-batch {i!r}: there are "
                             f"m = {self.m}, numbered 0 to {self.m - 1}")
        return self.base + int(i)

    def _peer(self, peer: Any, what: str) -> int:
        if not isinstance(peer, int | np.integer) or not 0 <= peer < self.size \
                or peer == self.rank:
            raise ValueError(
                f"stage {self.rank} {what} rank {peer!r}: a pipeline of {self.size} stages has "
                f"ranks 0 to {self.size - 1}. Activations go forward to rank + 1 and gradients "
                "back to rank - 1; the first stage receives no activation and the last sends "
                "none forward")
        return int(peer)

    def send(self, tensor: torch.Tensor, dest: int, i: int) -> None:
        """Post the send of micro-batch ``i``'s tensor to rank ``dest``; return at once."""
        dest = self._peer(dest, "sent to")
        if not isinstance(tensor, torch.Tensor):
            raise TypeError(f"group.send needs a tensor, got {type(tensor).__name__} (a "
                            "received activation needs requires_grad_() before the forward, "
                            "or its .grad stays None)")
        if tuple(tensor.shape) != (PIPE_MICRO, PIPE_WIDTH):
            raise ValueError(f"group.send got a tensor of shape {tuple(tensor.shape)}; every "
                             f"message here is one micro-batch, {(PIPE_MICRO, PIPE_WIDTH)}")
        tag = self._tag(i)
        buf = np.ascontiguousarray(tensor.detach().double().numpy()).copy()
        what = f"micro-batch {int(i)}'s tensor from stage {self.rank} to stage {dest}"
        self.pending.append((self.comm.Isend(buf, dest, tag), buf, what))

    def recv(self, source: int, i: int) -> torch.Tensor:
        """Wait for micro-batch ``i``'s tensor from rank ``source``; a new float64 tensor."""
        from pcourse.runtime.waits import CollectiveTimeout, wait_request
        from pcourse.tools.grading.trials import DeadlockError

        source = self._peer(source, "received from")
        buf = np.empty((PIPE_MICRO, PIPE_WIDTH))
        request = self.comm.Irecv(buf, source, self._tag(i))
        try:
            wait_request(request, self.timeout)
        except CollectiveTimeout:
            request.Cancel()  # withdrawn: no late message lands in it
            raise DeadlockError(
                f"stage {self.rank} waited {self.timeout:g} s for micro-batch {int(i)}'s tensor "
                f"from stage {source} (group.recv({source}, {int(i)})) and it never came: a "
                f"deadlock. Stage {source} sends it only after something it waits for itself; "
                "with sends that return at once, only receives wait, so follow the order: a "
                "forward receives from rank - 1 (the first stage takes its input), a backward "
                "from rank + 1 (the last stage starts from its loss)") from None
        return torch.from_numpy(buf)

    def finish(self) -> None:
        """Wait for every send posted: each must have been received, within the deadline."""
        from pcourse.runtime.waits import CollectiveTimeout, wait_request
        from pcourse.tools.grading.trials import DeadlockError

        for request, _, what in self.pending:
            try:
                wait_request(request, self.timeout)
            except CollectiveTimeout:
                raise DeadlockError(f"{what} was never received within {self.timeout:g} s: "
                                    "does that stage receive it, from this rank, with this "
                                    "micro-batch number?") from None
        self.pending.clear()


def pipe_stage_trial(run_stage: Callable, one_f_one_b: Callable | None,
                     ms: tuple[int, ...] = PIPE_MS) -> list[dict]:
    """This stage's gradients after the learner's ``run_stage`` for each m: with the
    reference 1F1B order, or, given ``one_f_one_b``, with the learner's own."""
    from pcourse.tools.grading.trials import OP_TIMEOUT

    # A communicator of its own, never freed: a run that fails leaves sends unreceived, and a
    # freed communicator's context is reused, so they would meet a later learner's receives
    # (seen grading a class: another learner's wrong loop's tensors). Each m its own tags.
    comm = world().Dup()
    p, rank = comm.size, comm.rank
    out = []
    for k, m in enumerate(ms):
        group = PipeGroup(comm, OP_TIMEOUT, m, base=PIPE_TAG_BASE + k * max(ms))
        stage = pipe_stage(p, rank)
        order = (one_f_one_b_reference(p, rank, m) if one_f_one_b is None
                 else _plain_order(one_f_one_b(p, rank, m)))
        run_stage(stage, order, group, *pipe_data(m, p, rank), m)
        group.finish()
        out.append({"grads": [None if t.grad is None else t.grad.detach().clone()
                              for t in stage.parameters()]})  # its m: its place in ms
    return out


def pipe_deadlock_orders(p: int, rank: int) -> list[tuple[str, int]]:
    """Orders of m = 2 that wait on each other: every stage takes micro-batch 0 through
    and back before micro-batch 1, but the last takes micro-batch 1 first. Its first
    receive (micro-batch 1's activation) is sent only after stage p - 2's backward of
    micro-batch 0, which waits for the last stage: every stage ends up in a receive."""
    if rank == p - 1:
        return [("F", 1), ("B", 1), ("F", 0), ("B", 0)]
    return [("F", 0), ("B", 0), ("F", 1), ("B", 1)]


PIPE_DEADLOCK_TIMEOUT = 2.0  # seconds: the check expects a deadlock, so it waits less


def pipe_deadlock_trial(run_stage: Callable) -> dict:
    """The learner's loop on :func:`pipe_deadlock_orders`: the DeadlockError's words if it
    reported one, else that it finished (it cannot have followed the order)."""
    from pcourse.tools.grading.trials import DeadlockError

    comm = world()
    p, rank, m = comm.size, comm.rank, 2
    # A communicator of its own, never freed: the deadlock leaves a message unreceived,
    # which must not meet a later communicator that reuses the world's context.
    group = PipeGroup(comm.Dup(), PIPE_DEADLOCK_TIMEOUT, m, base=PIPE_TAG_BASE)
    try:
        run_stage(pipe_stage(p, rank), pipe_deadlock_orders(p, rank), group,
                  *pipe_data(m, p, rank), m)
        group.finish()
    except DeadlockError as exc:
        return {"deadlock": str(exc)}
    return {"deadlock": None}


def pipe_deadlock_problem(got: dict) -> str | None:
    if got["deadlock"] is None:
        return ("it finished an order that cannot finish (the last stage takes micro-batch 1 "
                "first, the others micro-batch 0): run_stage must follow the order it is given, "
                "and let group.recv's DeadlockError through")
    if "deadlock" not in got["deadlock"]:
        return f"the deadlock was reported as {got['deadlock']!r}, without saying so"
    return None


def one_process_pipe(p: int, m: int) -> dict:
    """One process, the whole chain of p stages, on the whole batch of m micro-batches.

    The loss is the mean over micro-batches of each one's weighted sum. Also returned:
    the gradients of micro-batch m - 1 alone (what a loop that does not accumulate
    keeps), and those of the loss divided by p instead of m.
    """
    x, weights = pipe_batch(m)
    stages = [pipe_stage(p, r) for r in range(p)]
    model = torch.nn.Sequential(*stages)
    (model(x) * weights).sum().div(m).backward()
    whole = [[t.grad.clone() for t in s.parameters()] for s in stages]
    model.zero_grad()
    (model(x[-PIPE_MICRO:]) * weights[-PIPE_MICRO:]).sum().div(m).backward()
    last = [[t.grad.clone() for t in s.parameters()] for s in stages]
    return {"grads": whole, "last": last,
            "by_p": [[g * m / p for g in stage] for stage in whole]}


PIPE_NAMES = [f"block {j}'s {what}" for j in range(PIPE_LAYERS) for what in ("weight", "bias")]


def pipe_stage_problem(got: list[dict], want: dict[int, dict], rank: int) -> str | None:
    """The first m (:data:`PIPE_MS`, in order, as asked) whose gradients are wrong on this
    stage; ``want``: one process's run for each m (:func:`one_process_pipe`)."""
    if len(got) != len(PIPE_MS):
        return (f"{len(got)} results where {len(PIPE_MS)} were asked for (m = "
                f"{', '.join(map(str, PIPE_MS))}): did the code replace the checks' functions?")
    return next(filter(None, (pipe_grads_problem({**one, "m": m}, want[m], rank)
                              for m, one in zip(PIPE_MS, got, strict=True))), None)


def pipe_grads_problem(got: dict, want: dict, rank: int) -> str | None:
    """What is wrong with one stage's gradients for one m, in plain words; None if nothing."""
    from pcourse.tools.grading.harness import tensors_differ

    m, names = got["m"], [f"the gradient of {n}" for n in PIPE_NAMES]
    mine = got["grads"]
    if any(g is None for g in mine):
        return (f"m={m}: no gradient reached this stage's parameters: did the backward run "
                "(torch.autograd.backward(output, gradient)) on the stage's own output?")
    problem = tensors_differ(mine, want["grads"][rank], names, rtol=1e-12, atol=1e-12)
    if problem is None:
        return None

    def same(other: list) -> bool:
        return tensors_differ(mine, other, rtol=1e-12, atol=1e-12) is None

    if m > 1 and same(want["last"][rank]):
        return (f"m={m}: {problem}: it is the last micro-batch's gradient alone; the "
                "micro-batches' gradients must add up (backward adds into .grad: do not zero "
                "or replace it between micro-batches)")
    if same(want["by_p"][rank]):
        return (f"m={m}: {problem}: the loss was divided by the number of stages p; the mean "
                f"is over the m = {m} micro-batches")
    if m > 1 and same([g * m for g in want["grads"][rank]]):
        return (f"m={m}: {problem}: it is the sum of the micro-batches' losses, not their mean: "
                "divide each one's loss by m")
    return f"m={m}: {problem}"
