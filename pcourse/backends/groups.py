"""A pcourse backend for whatever a caller holds: a backend, a process group, or nothing.

Code written for this course takes a :class:`~pcourse.backends.base.Backend`; code
written for torch.distributed holds a process group (``dist.group.WORLD`` under
torchrun, a ``new_group``). :func:`as_backend` lets lesson 10's classes take either.
A group becomes the torch backend on that very group: case 1 of
:mod:`pcourse.backends.torch_dist` (``make_backend("gloo", comm=group)``), nothing
else. This module adds only which class (Gloo or NCCL) a group calls for, and that
no argument means torch's default group.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from pcourse.backends import make_backend
from pcourse.backends.base import Backend

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup

__all__ = ["as_backend"]


def as_backend(backend: Backend | ProcessGroup | None = None) -> Backend:
    """A pcourse backend for ``backend``: a Backend as it is; a torch.distributed
    process group as the Gloo or NCCL backend on that group (by the group's kind);
    None: torch's default group, which must be initialised (as under torchrun)."""
    if isinstance(backend, Backend):
        return backend
    import torch.distributed as dist  # here: naming the backends loads no torch

    if backend is None:
        if not dist.is_available() or not dist.is_initialized():
            raise ValueError("no backend given and torch.distributed is not initialised: pass "
                             "backend=make_backend(...) or a process group, or run under "
                             "torchrun after init_process_group")
        backend = dist.group.WORLD
    if not isinstance(backend, dist.ProcessGroup):
        raise TypeError(f"backend must be a pcourse Backend, a torch.distributed ProcessGroup "
                        f"or None, got {type(backend).__name__}")
    return make_backend(_kind(backend, dist), comm=backend)


def _kind(group: ProcessGroup, dist: Any) -> str:
    """"nccl" for a group that runs NCCL where CUDA is there, else "gloo".

    A default group made without naming a backend runs both ("cpu:gloo,cuda:nccl").
    """
    import torch

    return "nccl" if "nccl" in str(dist.get_backend(group)) and torch.cuda.is_available() \
        else "gloo"
