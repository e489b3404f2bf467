"""A backend that counts the bytes each rank sends: lesson 10's wire, measured.

:class:`CountingBackend` wraps any backend and passes every collective on
unchanged; on the way it adds what a ring implementation of that collective sends
from this rank, by collective. The ring's figures are lesson 03's, read from
:func:`pcourse.collectives.cost_terms` (an allreduce: 2(p-1)/p of its bytes) and
:func:`pcourse.collectives.half_cost_terms` (a reduce-scatter or an all-gather, one
half each: (p-1)/p), never derived again here. Lesson 10 counts ZeRO's and FSDP's
messages with it. :func:`calls_seen` counts instead what torch.distributed's process
groups record in torch's profiler: a library's calls and ours alike (lessons 11, 12).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from pcourse.backends.base import Backend, Work
from pcourse.collectives import cost_terms, half_cost_terms

if TYPE_CHECKING:
    import numpy as np
    import torch

__all__ = ["CountingBackend", "calls_seen"]


class CountingBackend(Backend):
    """A backend that counts the bytes each rank sends through the backend it wraps.

    Every collective is passed on unchanged; what a ring implementation of it sends
    from this rank is added to ``sent`` (bytes, by collective) and ``calls``: an
    allreduce of N bytes 2(p-1)/p·N, a reduce-scatter of an N-byte input (p-1)/p·N,
    an all-gather into an N-byte output (p-1)/p·N, a broadcast N (the most any rank
    sends down a chain), a point-to-point send N (lesson 12). The agreement checks
    run inside the wrapped backend and
    are not counted. ``close()`` leaves the wrapped backend open: it is the caller's.
    """

    def __init__(self, inner: Backend) -> None:
        self.inner = inner
        self.name, self.rank, self.size = inner.name, inner.rank, inner.size
        self.device, self.any_device, self.timeout = inner.device, inner.any_device, inner.timeout
        self.needs_gpu = inner.needs_gpu
        self.sent: dict[str, float] = {}
        self.calls: dict[str, int] = {}

    def _count(self, kind: str, nbytes: float) -> None:
        self.sent[kind] = self.sent.get(kind, 0.0) + nbytes
        self.calls[kind] = self.calls.get(kind, 0) + 1

    def total(self) -> float:
        """Bytes this rank sent since the last :meth:`reset`, every collective together."""
        return float(sum(self.sent.values()))

    def reset(self) -> None:
        self.sent, self.calls = {}, {}

    def allreduce(self, tensor: torch.Tensor, op: str = "sum", *,
                  check: bool = True) -> torch.Tensor:
        _, volume = cost_terms("ring", self.size)
        self._count("allreduce", volume * _nbytes(tensor))
        return self.inner.allreduce(tensor, op, check=check)

    def broadcast(self, tensor: torch.Tensor, root: int = 0, *,
                  check: bool = True) -> torch.Tensor:
        self._count("broadcast", (self.size > 1) * _nbytes(tensor))
        return self.inner.broadcast(tensor, root, check=check)

    def reduce_scatter(self, output: torch.Tensor, input: torch.Tensor, op: str = "sum", *,
                       check: bool = True) -> torch.Tensor:
        _, volume = half_cost_terms(self.size)
        self._count("reduce_scatter", volume * _nbytes(input))
        return self.inner.reduce_scatter(output, input, op, check=check)

    def all_gather(self, output: torch.Tensor, input: torch.Tensor, *,
                   check: bool = True) -> torch.Tensor:
        _, volume = half_cost_terms(self.size)
        self._count("all_gather", volume * _nbytes(output))
        return self.inner.all_gather(output, input, check=check)

    def reduce_scatter_async(self, output: torch.Tensor, input: torch.Tensor, op: str = "sum",
                             *, check: bool = True) -> Work:
        _, volume = half_cost_terms(self.size)
        self._count("reduce_scatter", volume * _nbytes(input))
        return self.inner.reduce_scatter_async(output, input, op, check=check)

    def all_gather_async(self, output: torch.Tensor, input: torch.Tensor, *,
                         check: bool = True) -> Work:
        _, volume = half_cost_terms(self.size)
        self._count("all_gather", volume * _nbytes(output))
        return self.inner.all_gather_async(output, input, check=check)

    def send(self, tensor: torch.Tensor, dst: int) -> Work:
        self._count("send", _nbytes(tensor))  # a message: its bytes, once
        return self.inner.send(tensor, dst)

    def recv(self, tensor: torch.Tensor, src: int) -> torch.Tensor:
        return self.inner.recv(tensor, src)  # counted where it was sent

    def max_over_ranks(self, v: np.ndarray) -> np.ndarray:
        return self.inner.max_over_ranks(v)  # an agreement check: not the workload's bytes

    def barrier(self) -> None:
        self.inner.barrier()

    def close(self) -> None:
        return None  # the wrapped backend belongs to the caller


def _nbytes(tensor: torch.Tensor) -> int:
    return tensor.numel() * tensor.element_size()


# The profiler's names of the floating dtypes: a collective of data, not an agreement check
# (those are integers, and only the course's backends make them).
_FLOATING = {"float", "double", "c10::Half", "c10::BFloat16"}


def calls_seen(fn: Callable[[], Any]) -> tuple[Any, dict[str, int]]:
    """Run ``fn()`` under torch's profiler; return its result and how many collectives
    and point-to-point messages of floating data torch.distributed's process groups ran
    meanwhile, by kind (``all_reduce``, ``allgather``, ``send``, ...), on every thread.

    The process group's own record (``gloo:all_reduce``, ``nccl:send``, ...): the same
    instrument for a library's code and for the course's (whose backends on Gloo and
    NCCL are torch.distributed's), so a comparison between the two counts alike.
    Integer ones are left out: the course's agreement checks, which a library has not.
    """
    from torch.profiler import ProfilerActivity, profile

    from pcourse.runtime.private import profile_all_threads

    with profile(activities=[ProfilerActivity.CPU], record_shapes=True,
                 experimental_config=profile_all_threads()) as prof:
        out = fn()
    seen: dict[str, int] = {}
    for e in prof.events():
        lib, _, kind = e.name.partition(":")
        if lib in ("gloo", "nccl") and kind and set(e.input_dtypes[:1]) <= _FLOATING:
            seen[kind] = seen.get(kind, 0) + 1
    return out, dict(sorted(seen.items()))
