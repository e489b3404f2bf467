"""The interface every backend implements (lesson 04): allreduce, broadcast, barrier.

Data-parallel training needs very little from a communication library: know your
rank, sum (or average) a tensor across ranks in place, broadcast a tensor from a
root, wait at a barrier. :class:`Backend` is exactly that, so the training code,
the benchmarks and the notebooks never care which library runs underneath.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # annotations only: listing the backends loads no torch
    import torch

OPS = ("sum", "avg", "max", "min", "prod")


class BackendUnavailable(RuntimeError):
    """This machine cannot run the requested backend; the message says why."""


class Work:
    """Handle of an asynchronous collective; ``wait()`` blocks until it is done."""

    def wait(self) -> None:  # a completed operation: nothing to wait for
        return None


def check_op(op: str) -> str:
    if op not in OPS:
        raise ValueError(f"unknown reduction op {op!r}; use one of {', '.join(OPS)}")
    return op


def check_avg_dtype(tensor: torch.Tensor, op: str) -> None:
    """Refuse ``avg`` of an integer tensor: sum / size does not fit in place.

    Every backend computes avg as sum then divide; an integer tensor would need a
    silent rounding choice, so the caller decides (reduce with sum, then divide).
    """
    if op == "avg" and not (tensor.is_floating_point() or tensor.is_complex()):
        raise TypeError(
            f"op 'avg' needs a floating-point tensor, got {tensor.dtype}; "
            "use op='sum' and divide by size yourself"
        )


class Backend(ABC):
    """What data-parallel training needs from a communication library."""

    name: str
    rank: int
    size: int
    device: torch.device  # where this backend wants the tensors it reduces

    @abstractmethod
    def allreduce(self, tensor: torch.Tensor, op: str = "sum") -> torch.Tensor:
        """Reduce ``tensor`` across all ranks, in place; return it.

        ``op`` is one of sum, avg, max, min, prod. ``avg`` is sum divided by size.
        """

    def allreduce_async(self, tensor: torch.Tensor, op: str = "sum") -> Work:
        """Start an in-place allreduce; the result is valid after ``wait()``.

        Backends with non-blocking collectives override this; the default is
        blocking, which is always correct.
        """
        self.allreduce(tensor, op)
        return Work()

    @abstractmethod
    def broadcast(self, tensor: torch.Tensor, root: int = 0) -> torch.Tensor:
        """Overwrite ``tensor`` on every rank with root's, in place; return it."""

    @abstractmethod
    def barrier(self) -> None:
        """Return only when every rank has called barrier."""

    def close(self) -> None:
        """Release communicators; the backend must not be used afterwards."""
        return None

    def __enter__(self) -> Backend:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"<{self.name} backend rank {self.rank}/{self.size} on {self.device}>"
