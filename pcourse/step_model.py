"""A model of one overlapped training step, and the bucket cap it says is best.

Lesson 07 derives it. A step is compute (forward, backward, optimizer: the
"no averaging" floor) plus the communication backward could not hide. Buckets
go in order, one allreduce each, costing ``a + b·n`` for ``n`` bytes (the
learner's own alpha-beta fit of lesson 04, :func:`pcourse.collectives.fit_alpha_beta`,
on the backend that reduces them). A bucket can start when its last gradient is
ready and the previous bucket is done; gradients are assumed ready in bucket order,
at a time proportional to the bytes computed before them (backward's work on a
dense layer grows with its weights). Communication that ends after backward is
exposed::

    done_k  = max(ready_k, done_{k-1}) + a + b·n_k
    exposed = max(0, done_last - backward)          # without overlap: sum of a + b·n_k

Few large buckets pay ``a`` rarely but start late (the last one holds everything
backward computes first); many small ones start early but pay ``a`` each. The
model does not know that, on CPUs, communication and backward compete for the
same cores, nor that a library may progress a reduction only inside its calls:
where the measured optimum differs, that is what the trace shows.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import nn

from pcourse.buckets import plan_buckets


@dataclass(frozen=True)
class Prediction:
    """What the model says of one cap (seconds)."""

    cap: int  # bytes
    buckets: int
    communication: float  # sum over buckets of a + b·n
    exposed: float  # the part of it after backward's end


def bucket_bytes(params: Sequence[torch.Tensor], cap: int) -> list[int]:
    """Bytes each bucket sends for ``params`` (reverse registration order, as the
    reducer takes them) at ``cap``: its gradients plus one flag per parameter.
    Any tensors of the parameters' shapes do (meta tensors: sizes without memory)."""
    return [sum(p.numel() + 1 for p in group) * group[0].element_size()
            for group in plan_buckets(list(params), cap)]


def exposed_time(sizes: Sequence[int], a: float, b: float, backward: float,
                 overlap: bool = True) -> float:
    """Seconds of communication left after backward ends, buckets of ``sizes`` bytes.

    With ``overlap``, bucket k is ready at ``backward`` times the share of the bytes
    in buckets 0..k; without, every bucket waits for backward's end.
    """
    if a < 0 or b < 0 or backward < 0:
        raise ValueError(f"a, b and backward must be non-negative, got {a}, {b}, {backward}")
    total, filled, done = sum(sizes), 0, 0.0
    for n in sizes:
        filled += n
        ready = backward * filled / total if overlap else backward
        done = max(ready, done) + a + b * n
    return max(0.0, done - backward)


def predict(params: Sequence[nn.Parameter], caps: Sequence[int], a: float, b: float,
            backward: float, overlap: bool = True) -> list[Prediction]:
    """The model at every cap (bytes): buckets, their total cost, what stays exposed."""
    out = []
    for cap in caps:
        sizes = bucket_bytes(params, cap)
        out.append(Prediction(cap, len(sizes), sum(a + b * n for n in sizes),
                              exposed_time(sizes, a, b, backward, overlap)))
    return out


def best_cap(predictions: Sequence[Prediction]) -> Prediction:
    """The cap with the least exposed communication (ties: the larger cap, fewer buckets)."""
    return min(predictions, key=lambda p: (p.exposed, -p.cap))
