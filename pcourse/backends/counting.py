"""A backend that counts the bytes each rank sends: lesson 10's wire, measured.

:class:`CountingBackend` wraps any backend and passes every collective on
unchanged; on the way it adds what a ring implementation of that collective sends
from this rank, by collective. The ring's figures are lesson 03's, read from
:func:`pcourse.collectives.cost_terms` (an allreduce: 2(p-1)/p of its bytes) and
:func:`pcourse.collectives.half_cost_terms` (a reduce-scatter or an all-gather, one
half each: (p-1)/p), never derived again here. Lesson 10 counts ZeRO's and FSDP's
messages with it.

:func:`handed_to_torch` counts the other side: what a library's own code (DDP's
communication hooks) hands to ``torch.distributed.all_reduce``, so that a lesson that
sets ours beside a library's reads the library's messages from the library, never
from a formula of ours (lesson 08's PowerSGD).
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

from pcourse.backends.base import Backend, Work
from pcourse.collectives import cost_terms, half_cost_terms

if TYPE_CHECKING:
    import numpy as np
    import torch

__all__ = ["CountingBackend", "HandedToTorch", "handed_to_torch"]


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


class HandedToTorch:
    """The tensors handed to ``torch.distributed.all_reduce`` on one group while
    :func:`handed_to_torch` watched: one (numbers, bytes) per call, in call order."""

    def __init__(self) -> None:
        self.calls: list[tuple[int, int]] = []
        self._lock = threading.Lock()  # a hook's callbacks may run on torch's threads

    def add(self, tensor: torch.Tensor) -> None:
        with self._lock:
            self.calls.append((tensor.numel(), _nbytes(tensor)))

    @property
    def numbers(self) -> int:
        return sum(n for n, _ in self.calls)

    @property
    def nbytes(self) -> int:
        return sum(b for _, b in self.calls)

    def reset(self) -> None:
        with self._lock:
            self.calls = []


@contextmanager
def handed_to_torch(group: Any = None) -> Iterator[HandedToTorch]:
    """Within the block, record every tensor any code hands to
    ``torch.distributed.all_reduce`` on ``group`` (None: on any group), then pass it on
    unchanged.

    DDP's communication hooks (``fp16_compress_hook``, ``powerSGD_hook``) send through
    that function, from backward and from the futures' callbacks, which may run after
    the hook returned: keep the block open until the step's gradients are synchronised
    (``optimizer.step()`` after ``backward()`` is enough). Not re-entrant.
    """
    import torch.distributed as dist

    real = dist.all_reduce
    handed = HandedToTorch()

    def all_reduce(tensor: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        on = kwargs.get("group", args[1] if len(args) > 1 else None)
        if group is None or on is group:
            handed.add(tensor)
        return real(tensor, *args, **kwargs)

    dist.all_reduce = all_reduce
    try:
        yield handed
    finally:
        dist.all_reduce = real
