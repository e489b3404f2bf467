"""What sharding saves: the training state a rank holds, measured and in theory (lesson 10).

:func:`state_bytes` counts the live tensors; :func:`theory_bytes` is the ZeRO paper's
table for fp32 Adam (16Ψ bytes replicated, down to 16Ψ/p fully sharded).
"""

from __future__ import annotations

import torch
from torch import nn

from pcourse.sharding.fsdp import FullyShardedDataParallel
from pcourse.sharding.zero import ShardedOptimizer

__all__ = ["state_bytes", "theory_bytes"]


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
