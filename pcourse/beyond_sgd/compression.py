"""Fewer bytes on the wire: gradients averaged in 16 bits, or as low-rank factors.

Exact averaging sends every gradient as float32. Two ways to send less (lesson 08):

- **16 bits** (:func:`low_precision_average`): every rank divides its gradient by p,
  casts it to bfloat16 — or to float16, after a power-of-two scale the ranks agree on,
  so that small gradients do not flush to zero and the sum cannot overflow — and the
  ranks exchange it as a reduce-scatter and an all-gather. The reduce-scatter is an
  all-to-all: each rank receives everyone's piece of its own slice and adds them up
  in *float32*, so each value is rounded once on the way in and once on the way out,
  not at every hop of a ring. The bytes are a 16-bit ring allreduce's: half float32's.
- **PowerSGD** (:class:`PowerSGD`; Vogels, Karimireddy and Jaggi, NeurIPS 2019): a
  gradient matrix M (n × m) is averaged as two thin factors, P = M Q (n × r) and then
  Q = Mᵀ P̂ (m × r) with P̂ the orthonormalised average of P: (n + m)·r numbers
  instead of n·m. What the rank-r approximation P̂ Qᵀ misses of M stays on the rank
  (error feedback) and is added to its next gradient, so it is delayed, not lost.
  Q is kept from step to step (warm start), which makes one power iteration a step
  enough. Tensors that would not shrink at least twofold (biases, thin matrices) are
  averaged exactly.

Both work on a ``torch.distributed`` group — a pcourse torch backend's ``group`` — as
DDP's communication hooks do, so :func:`compare` runs them beside DDP's own
``fp16_compress_hook`` and ``powerSGD_hook`` on the same Gloo group. DDP's
``bf16_compress_hook`` is left out: it casts and calls ``all_reduce``, and Gloo cannot
allreduce bfloat16 (ours can run on Gloo because all-to-all and all-gather only move
bytes; the sums are taken in float32). DDP's bytes are read from DDP: the allreduces
its hook really ran, as torch's profiler records them (:func:`allreduce_bytes_seen`),
never computed with our formula.
"""

from __future__ import annotations

import math
import time
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from pcourse.collectives import cost_terms


def ring_bytes(numel: int, itemsize: int, p: int) -> float:
    """Bytes one rank sends in a ring allreduce of ``numel`` items (lesson 03's 2(p−1)/p·N,
    :func:`pcourse.collectives.cost_terms`)."""
    return cost_terms("ring", p)[1] * numel * itemsize


def _shared_scale(x: torch.Tensor, group: Any) -> float:
    """A power of two s with p · max|x| · s ≤ 2¹⁵ on every rank (float16 tops out at 65504)."""
    peak = x.abs().max().reshape(1)
    dist.all_reduce(peak, op=dist.ReduceOp.MAX, group=group)
    p, top = dist.get_world_size(group), peak.item()
    return 2.0 ** math.floor(math.log2(2**15 / (p * top))) if top > 0 else 1.0


def low_precision_average(grads: Sequence[torch.Tensor], group: Any,
                          dtype: torch.dtype = torch.bfloat16) -> float:
    """Average ``grads`` in place over ``group``, sent as ``dtype`` and summed in float32.

    Collective. Returns the bytes this rank sent (the 16-bit ring's).
    """
    p = dist.get_world_size(group)
    flat = torch.cat([g.reshape(-1) for g in grads]).float()
    per = -(-flat.numel() // p)  # the slice each rank sums; padded with zeros
    mine = torch.zeros(per * p)
    mine[:flat.numel()] = flat / p  # divide first: p of these add up to an average
    scale = _shared_scale(mine, group) if dtype == torch.float16 else 1.0
    pieces = (mine * scale).to(dtype)
    received = torch.empty_like(pieces)
    dist.all_to_all_single(received, pieces, group=group)  # everyone's piece of my slice
    summed = received.view(p, per).float().sum(0).to(dtype)  # added in float32
    gathered = torch.empty_like(pieces)
    dist.all_gather(list(gathered.chunk(p)), summed, group=group)
    average = gathered.float()[:flat.numel()] / scale
    for g, part in zip(grads, average.split([g.numel() for g in grads]), strict=True):
        g.copy_(part.view_as(g))
    return ring_bytes(per * p, pieces.element_size(), p)


def allreduce_mean(tensors: list[torch.Tensor], group: Any) -> list[torch.Tensor]:
    """The average over ``group`` of each tensor, in one float allreduce of them all."""
    flat = torch.cat([t.reshape(-1) for t in tensors])
    dist.all_reduce(flat, group=group)
    flat /= dist.get_world_size(group)
    return [part.view_as(t) for t, part in zip(tensors, flat.split(
        [t.numel() for t in tensors]), strict=True)]


def _grad(p: torch.Tensor) -> torch.Tensor:
    """``p.grad``, which backward has filled: every parameter averaged here has one."""
    assert p.grad is not None, "no gradient: call backward first"
    return p.grad


def _shape(p: torch.Tensor) -> tuple[int, int]:
    return p.shape[0], p.numel() // p.shape[0]


class PowerSGD:
    """Average the gradients of ``params`` over ``group``, matrices as rank-``rank``
    factors with error feedback, the rest exactly. Call :meth:`average` after backward.

    Every rank draws the same initial Q (``seed``); a matrix is compressed only where
    that shrinks it at least ``min_compression`` times, as DDP's ``powerSGD_hook`` does.
    """

    def __init__(self, params: Sequence[nn.Parameter], group: Any, rank: int = 1,
                 seed: int = 0, min_compression: float = 2.0) -> None:
        if rank < 1:
            raise ValueError(f"rank must be at least 1, got {rank}")
        self.params = [q for q in params if q.requires_grad]
        self.group, self.rank = group, rank
        gen = torch.Generator().manual_seed(seed)
        self.q: dict[nn.Parameter, torch.Tensor] = {}
        self.error: dict[nn.Parameter, torch.Tensor] = {}
        for q in self.params:
            if q.dim() >= 2:
                n, m = _shape(q)
                if (n + m) * rank * min_compression <= n * m:
                    self.q[q] = torch.randn(m, rank, generator=gen, dtype=q.dtype)
                    self.error[q] = torch.zeros(n, m, dtype=q.dtype)

    def numbers_sent(self) -> int:
        """Numbers handed to allreduce per step: exact tensors whole, matrices as factors."""
        return sum((sum(_shape(q)) * self.rank) if q in self.q else q.numel()
                   for q in self.params)

    def average(self) -> float:
        """Replace every ``p.grad`` by the (approximate) average; bytes this rank sent."""
        exact = [q for q in self.params if q not in self.q]
        mats = [q for q in self.params if q in self.q]
        if exact:
            for q, avg in zip(exact, allreduce_mean([_grad(q) for q in exact], self.group),
                              strict=True):
                _grad(q).copy_(avg)
        if mats:
            ms = [_grad(q).reshape(_shape(q)) + self.error[q] for q in mats]  # error feedback
            ps = allreduce_mean([m @ self.q[q] for m, q in zip(ms, mats, strict=True)],
                                self.group)
            ps = [torch.linalg.qr(pm).Q for pm in ps]  # orthonormal columns
            qs = allreduce_mean([m.T @ pm for m, pm in zip(ms, ps, strict=True)], self.group)
            for q, m, pm, qm in zip(mats, ms, ps, qs, strict=True):
                approx = pm @ qm.T
                self.error[q] = m - approx  # what this rank's gradient lost this step
                self.q[q] = qm  # warm start
                _grad(q).copy_(approx.view_as(q))  # q.grad has q's shape
        itemsize = self.params[0].element_size() if self.params else 4
        return ring_bytes(self.numbers_sent(), itemsize, dist.get_world_size(self.group))


# ---------------------------------------------------------------- lesson 08's comparison

RANKS = (1, 2, 4)
METHODS = ("float32", "bf16", "fp16 scaled", *(f"PowerSGD r={r}" for r in RANKS))


def _ours(method: str, model: nn.Module, group: Any) -> Any:
    """(model to call, average(): bytes) for one of our methods on ``group``."""
    params = [q for q in model.parameters() if q.requires_grad]
    if method.startswith("PowerSGD"):
        return model, PowerSGD(params, group, rank=int(method.split("=")[1])).average
    if method == "float32":
        dtype = None
    else:
        dtype = torch.bfloat16 if method == "bf16" else torch.float16

    def average() -> float:
        grads = [_grad(q) for q in params]
        if dtype is not None:
            return low_precision_average(grads, group, dtype)
        for g, avg in zip(grads, allreduce_mean(grads, group), strict=True):
            g.copy_(avg)
        return ring_bytes(sum(g.numel() for g in grads), 4, dist.get_world_size(group))

    return model, average


def _ddp(method: str, model: nn.Module, group: Any) -> Any:
    """(DDP model, None) with DDP's own hook for ``method``: DDP averages in backward,
    and :func:`compare` reads the bytes it sent from the profiler.

    DDP's PowerSGD runs plain allreduces for its first ``start_powerSGD_iter`` = 2
    steps (DDP requires more than 1 with error feedback or warm start), where ours
    compresses from the first step: lesson 08 says so beside the comparison."""
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
    from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as psgd
    from torch.nn.parallel import DistributedDataParallel as DDP

    ddp = DDP(model, process_group=group)
    if method == "fp16":  # divides by p, casts, allreduces in float16; no scale
        ddp.register_comm_hook(group, default_hooks.fp16_compress_hook)
    if method.startswith("PowerSGD"):
        r = int(method.split("=")[1])
        state = psgd.PowerSGDState(process_group=group, matrix_approximation_rank=r,
                                   start_powerSGD_iter=2, min_compression_rate=2.0,
                                   use_error_feedback=True, warm_start=True, random_seed=0)
        ddp.register_comm_hook(state, psgd.powerSGD_hook)
    return ddp, None


DDP_METHODS = ("float32", "fp16", *(f"PowerSGD r={r}" for r in RANKS))
_ITEMSIZE = {"float": 4, "double": 8, "c10::Half": 2, "c10::BFloat16": 2}  # the profiler's names


def allreduce_bytes_seen(fn: Any, p: int) -> tuple[Any, float]:
    """Run ``fn()`` under torch's profiler; return its result and the bytes one rank
    sends in the allreduces that ran meanwhile, each counted as a ring's (lesson 03).

    The messages are the process group's own record (``gloo:all_reduce``, with the
    tensor's shape and dtype), so what a library's hook sends is read from the
    library, not from a formula of ours.
    """
    from torch.profiler import ProfilerActivity, profile

    from pcourse.runtime.private import profile_all_threads

    # Every thread: DDP's PowerSGD launches its P and Q allreduces from callbacks.
    with profile(activities=[ProfilerActivity.CPU], record_shapes=True,
                 experimental_config=profile_all_threads()) as prof:
        out = fn()
    by_size: dict[int, int] = {}
    for e in prof.events():
        if e.name.endswith(":all_reduce"):
            (shape, *_), (dtype, *_) = e.input_shapes, e.input_dtypes
            if dtype not in _ITEMSIZE:
                raise ValueError(f"an allreduce of {dtype}, which this count does not know; "
                                 f"add its bytes per item to _ITEMSIZE")
            size = _ITEMSIZE[dtype]
            by_size[size] = by_size.get(size, 0) + math.prod(shape)
    return out, sum(ring_bytes(n, size, p) for size, n in sorted(by_size.items()))


def compare(steps: int = 200, config: Any = None, lr: float = 1e-2, seed: int = 0
            ) -> list[dict]:
    """On every rank of a Gloo group: Franke's network trained ``steps`` steps by every
    method, ours and DDP's hooks, from the same weights on the same batches (drawn
    with ``seed``: another seed, another order of batches, for a spread).

    Collective. One row per (who, method): bytes one rank sent in the last step (ours:
    as each method counts them; DDP: its hook's allreduces, read by the profiler), the median
    step (the slowest rank's), the loss on the whole training set at the end, and the
    global batch's loss at every step.
    """
    from pcourse.backends import make_backend
    from pcourse.backends.torch_dist import GlooBackend
    from pcourse.workloads import make_workload
    from pcourse.workloads.config import FrankeConfig

    config = config or FrankeConfig.quick()
    rows = []
    with make_backend("gloo") as backend:
        assert isinstance(backend, GlooBackend)  # make_backend's class for "gloo"
        group, p, me = backend.group, backend.size, backend.rank
        runs = [("ours", m) for m in METHODS] + [("DDP", m) for m in DDP_METHODS]
        for who, method in runs:
            wl = make_workload("franke", config, torch.device("cpu"))  # same seeded weights
            model, average = (_ours if who == "ours" else _ddp)(method, wl.model, group)
            opt = torch.optim.Adam(wl.model.parameters(), lr=lr)
            losses, times, sent = torch.zeros(steps), torch.zeros(steps), 0.0
            for k in range(steps):
                batch = torch.randint(0, wl.n_train, (config.batch_size,),
                                      generator=torch.Generator().manual_seed(
                                          10_000 * (seed + 1) + k))
                start = time.perf_counter()
                opt.zero_grad()
                loss = wl.loss_sum(model, batch[me::p], 0) / len(batch[me::p])
                if average is not None:
                    loss.backward()
                    sent = average()  # ours: averages now, says what it sent
                elif k == steps - 1:  # DDP averages in backward: its last step's messages
                    _, sent = allreduce_bytes_seen(loss.backward, p)
                else:
                    loss.backward()
                opt.step()
                times[k] = time.perf_counter() - start
                losses[k] = loss.detach()
            dist.all_reduce(losses, group=group)
            dist.all_reduce(times, op=dist.ReduceOp.MAX, group=group)
            with torch.no_grad():
                every = torch.arange(wl.n_train)
                final = (wl.loss_sum(wl.model, every, 0) / wl.n_train).item()
            rows.append({"who": who, "method": method, "ranks": p, "seed": seed, "bytes": sent,
                         "step_ms": times[5:].median().item() * 1e3, "loss": final,
                         "curve": (losses / p).tolist()})
            del model
    return rows
