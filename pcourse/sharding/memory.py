"""What sharding saves: the training state a rank holds, measured and in theory (lesson 10).

:func:`state_bytes` counts the live tensors at one moment (at rest, between steps);
:func:`theory_bytes` is the ZeRO paper's table for fp32 Adam (16Ψ bytes replicated,
down to 16Ψ/p fully sharded). A step holds more than that for a while: what it
allocates and frees again (a gradient buffer being reduced, a unit gathered and its
gradient). :func:`held_in_step` measures the most a step held, from the allocator's
own count (:class:`AllocatorLog`, opened before the model is built, so nothing is
counted by hand), and :func:`peak_theory_bytes` says what the code holds at that
peak, moment by moment; what it leaves out (the batch's activations) is small, and
the lesson checks the two against each other both ways.
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from pcourse.buckets import DEFAULT_CAP_BYTES, plan_buckets
from pcourse.sharding.fsdp import FullyShardedDataParallel
from pcourse.sharding.zero import IN_FLIGHT, ShardedOptimizer
from pcourse.utils.profiler import chrome_events

__all__ = ["AllocatorLog", "held_in_step", "peak_bytes", "peak_theory_bytes", "state_bytes",
           "theory_bytes"]


def state_bytes(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, int]:
    """Bytes of parameters, gradients and optimizer state this rank holds, from the
    live tensors: each storage counted once, at its allocated size (views and padding
    included, freed storages as zero)."""
    seen: set[int] = set()

    def size(t: torch.Tensor | None) -> int:
        if t is None or not isinstance(t, torch.Tensor):
            return 0
        s = t.untyped_storage()
        if s.data_ptr() in seen or s.nbytes() == 0:
            return 0
        seen.add(s.data_ptr())
        return s.nbytes()

    params: list[torch.Tensor] = list(model.parameters())
    if isinstance(model, FullyShardedDataParallel):  # gathered ones alive now, if any
        params += [t for u in model.units
                   for t in (u.full, *u.again.values(), *(f for _, f in u.coming.values()))
                   if t is not None]
    opt = optimizer.local if isinstance(optimizer, ShardedOptimizer) else optimizer
    grads_of = params + [p for g in opt.param_groups for p in g["params"]]
    counts = {"parameters": sum(size(p) for p in params)}
    counts["gradients"] = sum(size(p.grad) for p in grads_of)
    counts["optimizer"] = sum(size(v) for st in opt.state.values() for v in st.values()
                              if isinstance(v, torch.Tensor) and v.dim() > 0)
    counts["total"] = sum(counts.values())
    return counts


def theory_bytes(strategy: str, psi: int, p: int, *, bytes_per: int = 4,
                 unit: int = 0) -> float:
    """Per-rank bytes of fp32 Adam training state for Ψ = ``psi`` parameters on p ranks.

    ddp 16Ψ; zero1 8Ψ + 8Ψ/p; zero2 4Ψ + 12Ψ/p; fsdp 16Ψ/p + the largest gathered
    unit (``unit`` parameters, while it is computed).
    """
    b = bytes_per
    table = {"ddp": 4 * b * psi, "zero1": 2 * b * psi + 2 * b * psi / p,
             "zero2": b * psi + 3 * b * psi / p, "fsdp": 4 * b * psi / p + b * unit}
    if strategy not in table:
        raise ValueError(f"unknown strategy {strategy!r}; use one of {', '.join(table)}")
    return float(table[strategy])


def peak_theory_bytes(strategy: str, model: nn.Module, p: int, *, shard: Any = None,
                      bucket_cap_bytes: int = DEFAULT_CAP_BYTES, overlap: bool = False,
                      prefetch: int = 0, compute_dtype: torch.dtype | None = None) -> float:
    """The most a rank holds at any moment of a step, as the course's code holds it:
    ``model``'s training state with torch's AdamW, and the transients of each moment.

    ``model`` gives the trainable parameters in forward order; ``shard`` FSDP's units
    (as :class:`FullyShardedDataParallel` takes it), ``bucket_cap_bytes`` ZeRO's
    buckets (as :class:`ShardedOptimizer` plans them), ``overlap``, ``prefetch`` and
    ``compute_dtype`` as those classes take them. The peak is the largest of these moments, each the
    state held at rest plus what exists only then:

    - in backward, the gradient autograd computes for a parameter before it goes where
      it is kept (added into DDP's or ZeRO-1's buffer, moved into ZeRO-2's bucket);
      ZeRO-2 also holds the buckets being filled and reduced: every one when the
      reduce-scatters wait for the step, else one being filled and ``IN_FLIGHT`` in
      flight. FSDP, in a unit's backward: the unit gathered again and its parameters'
      gradients, then (the gathered copy freed) those gradients and the flat one they
      are joined into; the slices' gradients of the units already done; ``prefetch``
      units gathered ahead, and with ``overlap`` ``IN_FLIGHT`` units' flat gradients
      still being reduced. Under ``compute_dtype`` a unit is gathered, and its gradient
      computed, in that dtype, and the joined gradient is cast to the slices' for the
      reduce-scatter (both exist at once);
    - ZeRO's reduce-scatters and all-gathers in ``step()``: every bucket's averaged
      slice arriving (ZeRO-1), every slice copied to be sent (both);
    - the optimizer's step: torch's AdamW on CPU (its for-loop, not foreach) makes two
      temporaries the size of the tensor it is stepping, the largest one counted.

    Left out, and so measured above it: the batch's activations and autograd's small
    temporaries, the padding of the flat vectors, DDP's flags (one value a parameter).
    """
    sizes = [q.numel() for q in model.parameters() if q.requires_grad]
    b = next(model.parameters()).element_size()
    psi, largest = sum(sizes), max(sizes)
    if strategy == "ddp":  # lesson 07's buckets hold the gradients for good
        return float(b * (4 * psi + max(largest, 2 * largest)))
    if strategy in ("zero1", "zero2"):
        buckets = [sum(q.numel() for q in bucket) for bucket in plan_buckets(
            [q for q in model.parameters() if q.requires_grad][::-1], bucket_cap_bytes)]
        slices = [math.ceil(n / p) for n in buckets]
        if strategy == "zero1":  # the whole gradient buffer, for good
            rest = 2 * psi + 2 * psi / p
            return float(b * (rest + max(largest, sum(slices), 2 * max(slices))))
        rest = psi + 3 * psi / p  # each bucket's averaged slice is kept too
        window = 1 + IN_FLIGHT if overlap else len(buckets)
        waiting = max(sum(buckets[i:i + window]) for i in range(len(buckets)))
        return float(b * (rest + max(waiting + largest, sum(slices), 2 * max(slices))))
    if strategy == "fsdp":
        low = (compute_dtype or next(model.parameters()).dtype).itemsize / b
        return float(b * _fsdp_peak(model, shard, p, overlap, prefetch, low))
    raise ValueError(f"unknown strategy {strategy!r}; use one of ddp, zero1, zero2, fsdp")


def _fsdp_peak(model: nn.Module, shard: Any, p: int, overlap: bool, prefetch: int,
               low: float) -> float:
    """:func:`peak_theory_bytes` for FSDP, in the slices' elements (``low``: a gathered
    element's size in them): the largest moment of a unit's backward (the units in
    forward order, their backwards in reverse), or of the step."""
    from pcourse.sharding.fsdp import _unit_roots

    units = [sum(q.numel() for q in root.parameters() if q.requires_grad)
             for root in _unit_roots(model, shard)]
    units = [u for u in units if u]
    sharded = sum(units)
    whole = sum(q.numel() for q in model.parameters() if q.requires_grad) - sharded
    rest = 4 * whole + 3 * sum(math.ceil(u / p) for u in units)  # before the gradients
    moments = [rest + sharded / p + 2 * max([math.ceil(u / p) for u in units] + [whole])]
    for i, u in reversed(list(enumerate(units))):
        done = sum(math.ceil(v / p) for v in units[i + 1:])  # slices' gradients, already
        ahead = low * sum(units[max(0, i - prefetch):i])  # the next backwards' units, gathered
        flying = sum(units[i + 1:i + 1 + IN_FLIGHT]) * overlap  # joined, being reduced
        # gathered + its gradients; then those + the joined one; then joined + its cast
        moments.append(rest + done + ahead + flying + max(2 * low * u, low * u + u))
    return max(moments)


class AllocatorLog:
    """What torch's allocator held over a stretch of code: ``torch.profiler``'s memory
    events (recorded on CPU too), every allocation and free with the running total.

    Open it before building what you measure, so that every byte held was allocated
    under it (memory allocated before and freed under it is not seen to go); mark the
    moments to read; after it closes, :meth:`peak` is the most held during the last
    marked moment of that name, counted from the log's start::

        with AllocatorLog() as log:
            model, opt = build()
            for _ in range(3):
                with log.mark("step"):
                    step()
        held = log.peak("step")
    """

    def __init__(self) -> None:
        from torch.profiler import ProfilerActivity, profile

        os.environ.setdefault("KINETO_LOG_LEVEL", "9")  # no start/stop lines on stderr
        self._prof = profile(activities=[ProfilerActivity.CPU], profile_memory=True)
        self._totals: list[tuple[float, int]] = []  # (time, bytes held since the start)
        self._marks: dict[str, tuple[float, float]] = {}

    def __enter__(self) -> AllocatorLog:
        self._prof.__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._prof.__exit__(*exc)
        events = chrome_events(self._prof)
        memory = sorted((e for e in events if e.get("name") == "[memory]"), key=lambda e: e["ts"])
        if memory:  # the allocator's count runs on from one log to the next: start from the first
            start = memory[0]["args"]["Total Allocated"] - memory[0]["args"]["Bytes"]
            self._totals = [(e["ts"], e["args"]["Total Allocated"] - start) for e in memory]
        for e in events:
            if e.get("ph") == "X" and str(e.get("name", "")).startswith(_MARK):
                self._marks[e["name"][len(_MARK):]] = (e["ts"], e["ts"] + e["dur"])

    def mark(self, name: str) -> Any:
        """A context in which what is held is read as ``name`` (the last one counts)."""
        from torch.profiler import record_function

        return record_function(_MARK + name)

    def peak(self, name: str) -> int:
        """The most held during the last moment marked ``name``, counted from the start."""
        if name not in self._marks:
            raise KeyError(f"no moment marked {name!r} (marked: {sorted(self._marks)})")
        lo, hi = self._marks[name]
        before = [t for ts, t in self._totals if ts < lo]
        during = [t for ts, t in self._totals if lo <= ts <= hi]
        return max([before[-1] if before else 0, *during])


_MARK = "pcourse.held:"


def peak_bytes(step: Callable[[], Any]) -> int:
    """The most bytes torch held at any moment of ``step()`` above what it held when
    ``step()`` began (an :class:`AllocatorLog` opened for the step alone). Memory
    allocated before and freed during the step is not seen to go (the profiler never
    learnt its size), so free what the step would free before calling (``zero_grad()``).
    """
    with AllocatorLog() as log, log.mark("step"):
        step()
    return max(0, log.peak("step"))


def held_in_step(strategy: str, build: Callable[[], nn.Module], backend: Any,
                 loss: Callable[[nn.Module], torch.Tensor], *, steps: int = 3,
                 shard: Any = None, bucket_cap_bytes: int = DEFAULT_CAP_BYTES,
                 overlap: bool = False, prefetch: int = 0,
                 compute_dtype: torch.dtype | None = None) -> tuple[int, dict[str, int]]:
    """The most torch's allocator held at any moment of the last of ``steps`` training
    steps (AdamW) under ``strategy``, counted from before ``build()`` made the model:
    everything the strategy holds, its state and its transients, with nothing counted
    by hand; and, beside it, the state held at rest after the steps (:func:`state_bytes`).
    The options are :func:`peak_theory_bytes`'s (``shard`` as
    :class:`FullyShardedDataParallel` takes it); ``ddp`` is lesson 07's
    :class:`~pcourse.buckets.BucketedAllreduce`. Every rank of ``backend`` calls it.
    """
    from pcourse.buckets import BucketedAllreduce

    with AllocatorLog() as log:
        model, finish = build(), None
        if strategy == "ddp":
            finish = BucketedAllreduce(model, backend).finish  # the average, in place
        elif strategy == "fsdp":
            model = FullyShardedDataParallel(model, backend, shard=shard, prefetch=prefetch,
                                             overlap=overlap, compute_dtype=compute_dtype)
            finish = model.finish
        opt: torch.optim.Optimizer
        if strategy in ("ddp", "fsdp"):
            opt = torch.optim.AdamW(model.parameters())
        elif strategy in ("zero1", "zero2"):
            opt = ShardedOptimizer(model.parameters(), torch.optim.AdamW, backend,
                                   stage=int(strategy[-1]), overlap=overlap, module=model,
                                   bucket_cap_bytes=bucket_cap_bytes)
        else:
            raise ValueError(f"unknown strategy {strategy!r}; use one of ddp, zero1, zero2, fsdp")
        for _ in range(steps):  # the last is read: no first-step checks in it
            opt.zero_grad(set_to_none=strategy != "ddp")  # DDP's buckets hold them for good
            with log.mark("step"):
                loss(model).backward()
                if finish is not None:
                    finish()
                opt.step()
        if isinstance(opt, ShardedOptimizer):
            opt.synchronize()
        rest = state_bytes(model, opt)
        del model, opt, finish  # freed under the log: seen to go
    return log.peak("step"), rest
