"""What sharding saves: the training state a rank holds, measured and in theory (lesson 10).

:func:`state_bytes` counts the live tensors at one moment (at rest, between steps);
:func:`theory_bytes` is the ZeRO paper's table for fp32 Adam (16Ψ bytes replicated,
down to 16Ψ/p fully sharded). A step holds more than that for a while: what it
allocates and frees again (a gradient buffer being reduced, a unit gathered and its
gradient). :func:`peak_bytes` measures the most a step held above its start, from
the allocator's own count, and :func:`peak_theory_bytes` says what the training
state reaches at its peak.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn

from pcourse.sharding.fsdp import FullyShardedDataParallel
from pcourse.sharding.zero import IN_FLIGHT, ShardedOptimizer
from pcourse.utils.profiler import chrome_events

__all__ = ["peak_bytes", "peak_theory_bytes", "state_bytes", "theory_bytes"]


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

    params = list(model.parameters())
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


def peak_theory_bytes(strategy: str, psi: int, p: int, *, bytes_per: int = 4,
                      units: Sequence[int] = (), buckets: Sequence[int] = (),
                      overlap: bool = False, prefetch: int = 0) -> float:
    """The per-rank training state at its peak during a step (fp32 Adam), as the course's
    code holds it; ``units``, ``buckets``: FSDP's units' and ZeRO's buckets' parameter
    counts (padding included).

    The peak comes in one of two moments. While the gradients are reduced: ddp 16Ψ
    (lesson 07's buckets hold the gradients for good); zero1 8Ψ + 12Ψ/p (the gradient
    buffer stays, and my slice's average arrives beside it before it is copied in);
    zero2 4Ψ + 12Ψ/p plus the gradients not yet reduced: all of them (4Ψ) when the
    reduce-scatters wait for the step, with ``overlap`` a bucket being filled and
    ``IN_FLIGHT`` in flight (at most: the largest buckets counted); fsdp 16Ψ/p plus,
    in a unit's backward, the unit gathered and its whole gradient (8 bytes per
    parameter of the unit), ``prefetch`` units gathered ahead and, with ``overlap``,
    ``IN_FLIGHT`` gradients being reduced (at most: the largest units counted). And
    while the optimizer steps: the state at rest with the gradients, plus one
    temporary the size of what it steps (torch's foreach AdamW), 4Ψ or 4Ψ/p.
    """
    stepping = {"ddp": 20 * psi, "zero1": 8 * psi + 12 * psi / p,
                "zero2": 4 * psi + 16 * psi / p, "fsdp": 20 * psi / p}
    if strategy not in stepping:
        raise ValueError(f"unknown strategy {strategy!r}; use one of {', '.join(stepping)}")
    waiting = _largest(buckets, 1 + IN_FLIGHT) if overlap else psi  # zero2's gradients
    gathered = _largest(units, 1 + prefetch + IN_FLIGHT * overlap) + max(units, default=0)
    reducing = {"ddp": 16 * psi, "zero1": 8 * psi + 12 * psi / p,
                "zero2": 4 * psi + 12 * psi / p + 4 * waiting,
                "fsdp": 16 * psi / p + 4 * gathered}
    return float(max(stepping[strategy], reducing[strategy]) * bytes_per / 4)


def _largest(sizes: Sequence[int], k: int) -> int:
    return sum(sorted(sizes, reverse=True)[:k])


def peak_bytes(step: Callable[[], Any]) -> int:
    """The most bytes torch held at any moment of ``step()`` above what it held when
    ``step()`` began: the allocator's running total, from ``torch.profiler``'s memory
    events (recorded on CPU too). Everything counts: gradients, copies, gathered
    units, activations, the optimizer's temporaries. Memory allocated before and freed
    during the step is not seen to go (the profiler never learnt its size), so free
    what the step would free before calling (``zero_grad()``).
    """
    from torch.profiler import ProfilerActivity, profile

    os.environ.setdefault("KINETO_LOG_LEVEL", "9")  # no start/stop lines on stderr
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        step()
    events = chrome_events(prof)
    totals = [(e["args"]["Total Allocated"], e["args"]["Bytes"]) for e in
              sorted((e for e in events if e.get("name") == "[memory]"), key=lambda e: e["ts"])]
    if not totals:
        return 0
    # the allocator's count runs on from one profile to the next: start from the first event's
    start = totals[0][0] - totals[0][1]
    return max(0, max(total for total, _ in totals) - start)
