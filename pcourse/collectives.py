"""Allreduce written from point-to-point messages: tree, ring and recursive doubling.

Each algorithm is a few lines of mpi4py ``Send``/``Recv``/``Sendrecv`` on numpy
buffers. Every one works on any number of ranks p >= 1, any length (0 and shorter
than p included), ops sum/max/min/prod, in place or into ``out``; torch CPU tensors
are reduced through a numpy view of their memory. Before sending anything each call
checks, in one tiny MPI allreduce, that all ranks passed the same length (a mismatch
would deadlock or mix up data); ``check=False`` skips that where the caller knows
(the benchmark, which times the algorithm alone).

:func:`cost_terms`, :func:`cost_model` and :func:`fit_alpha_beta` are the alpha-beta
model: an allreduce costs (messages on its critical path)·α + (bytes on it)·β.

Lesson 03 explains the algorithms, the model, and what MPI, NCCL and Gloo really run.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from pcourse.agree import MismatchError, checked_then_agreed

OPS = {"sum": np.add, "max": np.maximum, "min": np.minimum, "prod": np.multiply}
ALGORITHMS = ("tree", "ring", "recursive-doubling")


class LengthMismatchError(MismatchError):
    """Ranks called the same allreduce with buffers of different lengths."""


def _as_array(x: Any, name: str) -> np.ndarray:
    """A flat numpy view of ``x`` (numpy array or CPU torch tensor), never a copy."""
    if hasattr(x, "numpy") and not isinstance(x, np.ndarray):  # a torch tensor
        if x.device.type != "cpu":
            raise ValueError(f"{name} is on {x.device}; these collectives need CPU memory")
        x = x.detach().numpy()  # shares the tensor's memory
    if not isinstance(x, np.ndarray):
        raise TypeError(f"{name} must be a numpy array or a CPU torch tensor, got {type(x)}")
    if not x.flags.c_contiguous:
        raise ValueError(f"{name} must be contiguous (MPI sends raw memory); use .copy()")
    return x.reshape(-1)


def _world(comm: Any) -> Any:
    if comm is None:
        from mpi4py import MPI

        comm = MPI.COMM_WORLD
    return comm


def _max_over(comm: Any) -> Any:
    """The elementwise MAX over ``comm``'s ranks of a small int64 vector (the agreement's)."""
    from mpi4py import MPI

    def max_over_ranks(v: np.ndarray) -> np.ndarray:
        comm.Allreduce(MPI.IN_PLACE, v, op=MPI.MAX)
        return v

    return max_over_ranks


def _agreed(checks: Any, comm: Any, kind: str, check: bool) -> Any:
    """This rank's ``checks()``, then (``check``) one tiny MPI allreduce: every rank passed
    the same length, or one refused its input (:func:`pcourse.agree.checked_then_agreed`:
    a refusing rank still joins, so that every rank raises instead of the others waiting)."""
    return checked_then_agreed(checks, ("length",), _max_over(comm), check=check,
                               subject=f"{kind} needs the same length on every rank",
                               hint="Pass equally sized buffers.", error=LengthMismatchError)


def _prepare(x: Any, op: str, out: Any, comm: Any, check: bool):
    """Shared set-up: the buffer to reduce into, the numpy ufunc, the communicator;
    every rank checked its input and (``check``) that all passed the same length."""
    comm = _world(comm)

    def checks():
        if op not in OPS:
            raise ValueError(f"unknown op {op!r}; use one of {', '.join(OPS)}")
        src = _as_array(x, "input")
        buf = src if out is None else _as_array(out, "out")
        if buf.shape != src.shape or buf.dtype != src.dtype:
            raise ValueError(f"out must match the input: {buf.dtype}{buf.shape} vs "
                             f"{src.dtype}{src.shape}")
        return {"length": src.size}, (src, buf)

    src, buf = _agreed(checks, comm, "allreduce", check)
    if buf is not src:
        buf[...] = src
    return buf, OPS[op], comm, x if out is None else out


def tree_allreduce(x: Any, op: str = "sum", *, out: Any = None, comm: Any = None,
                   check: bool = True) -> Any:
    """Reduce to rank 0 along a binomial tree, then broadcast back down the same tree.

    Step d = 1, 2, 4, ...: a rank whose lowest set bit is d sends everything it has
    summed so far to rank - d and is done; the receiver adds it in. After
    ceil(log2 p) steps rank 0 holds the result, and the broadcast replays the steps
    backwards. Every step moves the whole message, and each waits for the one
    before, so the critical path costs 2·ceil(log2 p)·(α + N·β). The load is uneven:
    rank 0 receives and sends ceil(log2 p) whole messages, a leaf one of each, and
    most ranks sit idle in most steps. Fine for small N, wasteful for large N.
    """
    buf, reduce, comm, result = _prepare(x, op, out, comm, check)
    rank, p = comm.rank, comm.size
    if buf.size == 0 or p == 1:
        return result
    incoming = np.empty_like(buf)
    d = 1
    while d < p:  # reduce towards rank 0
        if rank & d:  # lowest set bit: hand my partial result to my parent
            comm.Send(buf, dest=rank - d, tag=1)
            break
        if rank + d < p:
            comm.Recv(incoming, source=rank + d, tag=1)
            reduce(buf, incoming, out=buf)
        d *= 2
    # broadcast: receive from the parent I sent to, then serve my own children
    d = rank & -rank if rank else 1 << (p - 1).bit_length()
    if rank:
        comm.Recv(buf, source=rank - d, tag=2)
    d //= 2
    while d >= 1:
        if rank + d < p:
            comm.Send(buf, dest=rank + d, tag=2)
        d //= 2
    return result


def ring_allreduce(x: Any, op: str = "sum", *, out: Any = None, comm: Any = None,
                   check: bool = True) -> Any:
    """Reduce-scatter then allgather around a ring, one chunk (N/p bytes) per step.

    The message is cut into p chunks. Reduce-scatter: in each of p-1 steps every rank
    sends one chunk to its right neighbour and adds the chunk arriving from its left;
    afterwards rank r owns the complete result for chunk r+1. Allgather: p-1 more
    steps pass the finished chunks around. Every link is busy in every step and every
    rank sends the same, so the cost is 2(p-1)·α + 2(p-1)/p·N·β: the bandwidth-optimal
    bound, paid for with latency that grows with p. NCCL's ring and Gloo's ring
    allreduce are this algorithm (NCCL also has trees, and picks by size).
    """
    buf, reduce, comm, result = _prepare(x, op, out, comm, check)
    rank, p = comm.rank, comm.size
    if buf.size == 0 or p == 1:
        return result
    chunks = np.array_split(buf, p)  # views into buf; sizes differ by at most one
    incoming = np.empty_like(chunks[0])  # chunk 0 is a largest one
    right, left = (rank + 1) % p, (rank - 1) % p
    for step in range(p - 1):  # reduce-scatter
        send, recv = chunks[(rank - step) % p], chunks[(rank - step - 1) % p]
        got = incoming[: recv.size]
        comm.Sendrecv(send, dest=right, sendtag=3, recvbuf=got, source=left, recvtag=3)
        reduce(recv, got, out=recv)
    for step in range(p - 1):  # allgather: pass the finished chunks on
        send, recv = chunks[(rank - step + 1) % p], chunks[(rank - step) % p]
        comm.Sendrecv(send, dest=right, sendtag=4, recvbuf=recv, source=left, recvtag=4)
    return result


def recursive_doubling_allreduce(x: Any, op: str = "sum", *, out: Any = None,
                                 comm: Any = None, check: bool = True) -> Any:
    """Swap with the partner at distance 1, 2, 4, ... and reduce, until all hold the result.

    After the step with distance d every rank holds the reduction over its group of 2d
    ranks, so log2(p) steps suffice and nobody waits for a root: cost
    log2(p)·(α + N·β), half the tree's. It needs a power of two, so when p is not
    one, the q = p - 2^k extra ranks (2^k = the largest power of two below p) first
    fold their data into a partner among the first q ranks and get the result back
    at the end: floor(log2 p) + 2 steps in all. MPICH uses this for short messages.
    """
    buf, reduce, comm, result = _prepare(x, op, out, comm, check)
    rank, p = comm.rank, comm.size
    if buf.size == 0 or p == 1:
        return result
    p2 = 1 << (p.bit_length() - 1)  # largest power of two <= p
    if rank >= p2:  # an extra rank: fold in, wait for the answer
        comm.Send(buf, dest=rank - p2, tag=5)
        comm.Recv(buf, source=rank - p2, tag=6)
        return result
    incoming = np.empty_like(buf)
    if rank + p2 < p:
        comm.Recv(incoming, source=rank + p2, tag=5)
        reduce(buf, incoming, out=buf)
    d = 1
    while d < p2:
        comm.Sendrecv(buf, dest=rank ^ d, sendtag=7, recvbuf=incoming, source=rank ^ d,
                      recvtag=7)
        reduce(buf, incoming, out=buf)
        d *= 2
    if rank + p2 < p:
        comm.Send(buf, dest=rank + p2, tag=6)
    return result


def cost_terms(method: str, p: int) -> tuple[float, float]:
    """(steps, volume) on the critical path of one allreduce of N bytes on p ranks.

    steps: messages that must follow one another; volume: the bytes they carry, per
    byte of data. The time is then steps·α + volume·N·β; for p = 1 nothing is sent.
    tree: 2·ceil(log2 p) steps of N. ring: 2(p-1) steps of N/p. recursive doubling:
    floor(log2 p) steps of N, plus 2 (fold in, hand back) when p is not a power of 2.
    """
    if method not in ALGORITHMS:
        raise ValueError(f"no cost model for {method!r}; use one of {', '.join(ALGORITHMS)}")
    if p < 1:
        raise ValueError(f"p must be at least 1, got {p}")
    if p == 1:
        return 0.0, 0.0
    if method == "tree":
        steps = 2 * math.ceil(math.log2(p))
        return steps, steps
    if method == "ring":
        return 2 * (p - 1), 2 * (p - 1) / p
    steps = int(math.log2(p)) + (0 if p & (p - 1) == 0 else 2)  # recursive doubling
    return steps, steps


def cost_model(method: str, p: int, nbytes: Any, alpha: float, beta: float) -> Any:
    """Predicted seconds of an allreduce of ``nbytes`` (a number or an array)."""
    steps, volume = cost_terms(method, p)
    return steps * alpha + volume * np.asarray(nbytes, dtype=float) * beta


def fit_alpha_beta(sizes_bytes: Any, times: Any) -> tuple[float, float]:
    """Least-squares a >= 0, b >= 0 of t = a + b·N, weighted so every size counts alike.

    Sizes span seven orders of magnitude; a plain fit would be dominated by the
    largest messages and leave the latency a (microseconds) to chance. Dividing each
    equation by its t minimises the relative error instead. A latency or a time per
    byte cannot be negative, but noise can make the free fit say so; then the best
    fit with that term at zero is taken. For a method with cost_terms (steps,
    volume), the link's α = a/steps and β = b/volume.
    """
    n = np.asarray(sizes_bytes, dtype=float)
    t = np.asarray(times, dtype=float)
    if n.shape != t.shape or n.ndim != 1:
        raise ValueError(f"sizes and times must be 1-D and equally long: {n.shape}, {t.shape}")
    if np.unique(n).size < 2 or np.any(t <= 0):
        raise ValueError("need at least two different sizes and positive times to fit")
    design = np.stack([np.ones_like(n), n], axis=1) / t[:, None]
    target = np.ones_like(t)
    free = np.linalg.lstsq(design, target, rcond=None)[0]
    # the free fit, or one term pinned at zero (each then a one-column least squares)
    candidates = [free] + [
        np.where(np.arange(2) == k, design[:, k] @ target / (design[:, k] @ design[:, k]), 0.0)
        for k in (0, 1)
    ]
    feasible = [c for c in candidates if np.all(c >= 0)]
    a, b = min(feasible, key=lambda c: np.sum((design @ c - target) ** 2))
    return float(a), float(b)


# ------------------------------------------------------------------ the ring's two halves
def chunk_bounds(n: int, p: int) -> list[tuple[int, int]]:
    """[start, stop) of each rank's chunk of n elements: ``np.array_split``'s cut.

    The first n % p chunks are one element longer, so no chunk is empty unless n < p.
    """
    if p < 1 or n < 0:
        raise ValueError(f"need p >= 1 and n >= 0, got p={p}, n={n}")
    q, extra = divmod(n, p)
    starts = [r * q + min(r, extra) for r in range(p + 1)]
    return list(zip(starts[:-1], starts[1:], strict=True))


def ring_reduce_scatter(x: Any, op: str = "sum", *, out: Any = None, comm: Any = None,
                        check: bool = True) -> Any:
    """The ring allreduce's first half: rank r ends with chunk r of the reduction.

    Every rank passes the whole vector (N elements, the same N everywhere); it is cut
    as :func:`chunk_bounds` cuts it, and rank r receives the reduction of chunk r
    over all ranks, in ``out`` (a new array if None). ``x`` is left as it was. In
    each of p-1 steps every rank sends one chunk to its right neighbour and adds the
    chunk arriving from its left into its working copy; the chunks are numbered so
    that the last one a rank completes is its own. Cost: (p-1)·α + (p-1)/p·N·β.
    """
    comm = _world(comm)
    rank, p = comm.rank, comm.size

    def checks():
        if op not in OPS:
            raise ValueError(f"unknown op {op!r}; use one of {', '.join(OPS)}")
        src = _as_array(x, "input")
        lo, hi = chunk_bounds(src.size, p)[rank]
        result = np.empty(hi - lo, dtype=src.dtype) if out is None else out
        mine = _as_array(result, "out")
        if mine.size != hi - lo or mine.dtype != src.dtype:
            raise ValueError(f"out must hold rank {rank}'s chunk: {src.dtype}({hi - lo},) "
                             f"for {src.size} elements on {p} ranks, got {mine.dtype}{mine.shape}")
        return {"length": src.size}, (src, result, mine)

    src, result, mine = _agreed(checks, comm, "reduce-scatter", check)
    buf = src.copy()  # the working copy the partial sums are added into
    chunks = [buf[a:b] for a, b in chunk_bounds(buf.size, p)]
    if p > 1 and buf.size:
        reduce = OPS[op]
        incoming = np.empty_like(chunks[0])
        right, left = (rank + 1) % p, (rank - 1) % p
        for step in range(p - 1):
            send, recv = chunks[(rank - step - 1) % p], chunks[(rank - step - 2) % p]
            got = incoming[: recv.size]
            comm.Sendrecv(send, dest=right, sendtag=8, recvbuf=got, source=left, recvtag=8)
            reduce(recv, got, out=recv)
    mine[...] = chunks[rank]
    return result


def ring_allgather(x: Any, *, out: Any = None, comm: Any = None, check: bool = True) -> Any:
    """The ring allreduce's second half: every rank ends with every rank's chunk, in order.

    Rank r passes its own chunk (any length; lengths may differ between ranks, as in
    MPI's ``Allgatherv``); ``out`` (a new array if None) receives the chunks of ranks
    0, 1, ..., p-1 one after the other. The ranks first check that their dtypes agree
    (``check``) and swap their lengths (one tiny allgather); then in each of p-1 steps
    every rank passes on the chunk it received last. Cost: (p-1)·α + (p-1)/p·N·β for
    N elements in all.
    """
    comm = _world(comm)
    rank, p = comm.rank, comm.size

    def checks():
        src = _as_array(x, "input")
        return {"dtype": src.dtype.str}, src

    src = checked_then_agreed(checks, ("dtype",), _max_over(comm), check=check,
                              subject="allgather needs one dtype on every rank",
                              hint="Pass buffers of one dtype.", error=LengthMismatchError)
    sizes = np.empty(p, dtype=np.int64)
    comm.Allgather(np.array([src.size], dtype=np.int64), sizes)  # lengths may differ
    starts = np.concatenate([[0], np.cumsum(sizes)])
    total = int(starts[-1])
    result = np.empty(total, dtype=src.dtype) if out is None else out
    full = _as_array(result, "out")
    if full.size != total or full.dtype != src.dtype:
        raise ValueError(f"out must hold all {total} elements as {src.dtype}, "
                         f"got {full.dtype}{full.shape}")
    chunks = [full[starts[r]:starts[r + 1]] for r in range(p)]
    chunks[rank][...] = src
    right, left = (rank + 1) % p, (rank - 1) % p
    for step in range(p - 1):  # pass on what arrived last step (at first: my own)
        send, recv = chunks[(rank - step) % p], chunks[(rank - step - 1) % p]
        comm.Sendrecv(send, dest=right, sendtag=9, recvbuf=recv, source=left, recvtag=9)
    return result


def half_cost_terms(p: int) -> tuple[float, float]:
    """(steps, volume) of a ring reduce-scatter or allgather on p ranks: half the allreduce's.

    Each of the two halves takes p-1 steps of N/p bytes: together they are
    :func:`cost_terms` ("ring", p).
    """
    if p < 1:
        raise ValueError(f"p must be at least 1, got {p}")
    return float(p - 1), (p - 1) / p
