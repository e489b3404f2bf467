"""One small allreduce interface, and the four real backends behind it.

Data-parallel training needs very little from a communication library: know your
rank, sum (or average) a tensor across ranks in place, broadcast a tensor from a
root, wait at a barrier. Every backend here offers exactly that, so the training
code, the benchmarks and the notebooks never care which one runs underneath.

=============  =========================================  ===========
name           what it is                                 devices
=============  =========================================  ===========
mpi            mpi4py ``Allreduce`` on the tensor memory   CPU (+GPU*)
mpi-pickle     mpi4py ``allreduce``: the source's way       CPU, GPU
gloo           torch.distributed, Gloo                      CPU
nccl           torch.distributed, NCCL                      GPU
nccl-cupy      CuPy's NCCL bindings                         GPU
=============  =========================================  ===========

(*) the buffer path stages GPU tensors through host memory unless MPI is CUDA-aware.

Every backend is bootstrapped from MPI, whatever it uses to communicate: MPI
gives rank and size, and rank 0 broadcasts what the others need (NCCL's unique id,
or the address and a free port for torch.distributed's rendezvous).
"""

from __future__ import annotations

import importlib
import importlib.util
from abc import ABC, abstractmethod
from dataclasses import dataclass

import torch

BACKENDS = ("mpi", "mpi-pickle", "gloo", "nccl", "nccl-cupy")
OPS = ("sum", "avg", "max", "min", "prod")

# name -> (module, class); imported lazily so `import pcourse.backends` never
# touches CuPy, NCCL or CUDA.
_IMPLEMENTATIONS = {
    "mpi": ("pcourse.mpi_backend", "MPIBackend"),
    "mpi-pickle": ("pcourse.mpi_backend", "MPIPickleBackend"),
    "gloo": ("pcourse.torch_backend", "GlooBackend"),
    "nccl": ("pcourse.torch_backend", "NCCLBackend"),
    "nccl-cupy": ("pcourse.cupy_backend", "CupyNCCLBackend"),
}


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


def make_backend(name: str, **kwargs: object) -> Backend:
    """Create the backend called ``name`` (see BACKENDS) on this MPI rank.

    Raises BackendUnavailable, with the reason, where this machine cannot run it.
    Creating a backend again in the same process (a re-run cell) is fine.
    """
    if name not in _IMPLEMENTATIONS:
        raise ValueError(f"unknown backend {name!r}; choose one of {', '.join(BACKENDS)}")
    reason = unavailable_reason(name)
    if reason:
        raise BackendUnavailable(f"backend {name!r} cannot run here: {reason}")
    module, cls = _IMPLEMENTATIONS[name]
    return getattr(importlib.import_module(module), cls)(**kwargs)


@dataclass(frozen=True)
class BackendStatus:
    name: str
    usable: bool
    reason: str  # why not, or what it will run on


def _cuda_reason() -> str:
    if not torch.cuda.is_available():
        if torch.version.cuda is None:
            return "torch is a CPU-only build (no CUDA)"
        return "no CUDA device"
    return ""


def _cupy_nccl_reason() -> str:
    if importlib.util.find_spec("cupy") is None:
        return "cupy not installed (pip install -e '.[gpu]')"
    try:
        import cupy  # noqa: F401
    except Exception as exc:  # noqa: BLE001 - any import failure makes it unusable
        return f"cupy fails to import: {exc}"
    try:
        from cupy.cuda import nccl
    except Exception:  # noqa: BLE001
        return "NCCL library missing (pip install nvidia-nccl-cu12)"
    if not getattr(nccl, "available", True):  # some CuPy builds import a stub
        return "NCCL library missing (pip install nvidia-nccl-cu12)"
    try:
        import cupy

        if cupy.cuda.runtime.getDeviceCount() < 1:
            return "no CUDA device"
    except Exception:  # noqa: BLE001 - CUDARuntimeError without a driver
        return "no CUDA device"
    return ""


def unavailable_reason(name: str) -> str:
    """Why this machine cannot run backend ``name``; empty when it can.

    Local checks only (libraries, devices); no communication, so it is safe to
    call from a notebook kernel that is not an MPI rank.
    """
    if name in ("mpi", "mpi-pickle"):
        if importlib.util.find_spec("mpi4py") is None:
            return "mpi4py not installed"
        return ""
    if name == "gloo":
        import torch.distributed as dist

        if not dist.is_available() or not dist.is_gloo_available():
            return "this torch build has no Gloo support"
        return ""
    if name == "nccl":
        reason = _cuda_reason()
        if reason:
            return reason
        import torch.distributed as dist

        if not dist.is_available() or not dist.is_nccl_available():
            return "NCCL library missing from this torch build"
        return ""
    if name == "nccl-cupy":
        return _cupy_nccl_reason()
    raise ValueError(f"unknown backend {name!r}; choose one of {', '.join(BACKENDS)}")


def backend_status() -> list[BackendStatus]:
    """Usable / not usable, with the reason, for every backend on this machine."""
    rows = []
    for name in BACKENDS:
        reason = unavailable_reason(name)
        if reason:
            rows.append(BackendStatus(name, False, reason))
        else:
            on = "GPU" if name.startswith("nccl") else "CPU"
            rows.append(BackendStatus(name, True, f"runs on {on}"))
    return rows
