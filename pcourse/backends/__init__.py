"""One small allreduce interface, and the four real backends behind it (lesson 04).

=============  =========================================  ===========
name           what it is                                 devices
=============  =========================================  ===========
mpi            mpi4py ``Allreduce`` on the tensor memory   any (staged)
mpi-pickle     mpi4py ``comm.allreduce``, the source's   any (staged)
gloo           torch.distributed, Gloo                      CPU
nccl           torch.distributed, NCCL                      GPU
nccl-cupy      CuPy's NCCL bindings                         GPU
=============  =========================================  ===========

:func:`make_backend` builds one by name, with the keywords every backend takes
(``comm``, ``device``, ``timeout``: see :mod:`pcourse.backends.base`). ``comm`` may
be any part of the job (an MPI sub-communicator), and backends of different parts
live at once: :class:`pcourse.mesh.Mesh` lays the ranks out on named dimensions and
makes one per dimension. The MPI and CuPy backends run on an MPI job; the torch
ones too, meeting where :mod:`pcourse.backends.bootstrap` says, or on a
torch.distributed process group, under torchrun or torch.multiprocessing
(:mod:`pcourse.backends.torch_dist`). :func:`unavailable_reason` says, without
communicating, why this machine cannot run one, and given a rank count, why not
with that many ranks (the NCCL backends need one GPU per rank; at one rank they
run, and check the plumbing, not a reduction across GPUs).
"""

from __future__ import annotations

import importlib
import importlib.util
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from pcourse.backends.base import (  # noqa: F401 - the interface, re-exported
    OPS,
    Backend,
    BackendUnavailable,
    MismatchError,
    Work,
    check_avg_dtype,
    check_op,
)

BACKENDS = ("mpi", "mpi-pickle", "gloo", "nccl", "nccl-cupy")

# name -> (module, class); imported lazily so `import pcourse.backends` never
# touches CuPy, NCCL or CUDA.
_IMPLEMENTATIONS = {
    "mpi": ("pcourse.backends.mpi", "MPIBackend"),
    "mpi-pickle": ("pcourse.backends.mpi", "MPIPickleBackend"),
    # not in BACKENDS: mpi-pickle's pickles on nonblocking MPI, with the deadline (tests)
    "mpi-pickle-deadline": ("pcourse.backends.mpi", "MPIPickleDeadlineBackend"),
    "gloo": ("pcourse.backends.torch_dist", "GlooBackend"),
    "nccl": ("pcourse.backends.torch_dist", "NCCLBackend"),
    "nccl-cupy": ("pcourse.backends.cupy_nccl", "CupyNCCLBackend"),
}


def make_backend(name: str, *, comm: Any = None, device: Any = None,
                 timeout: float | None = None) -> Backend:
    """Create the backend called ``name`` (see BACKENDS) on this rank.

    ``comm``: the MPI communicator whose ranks take part (default: every rank; a part
    of the job from ``Split`` works for every backend; for torch's, every rank of the
    job makes its own part's backend at the same time: :mod:`pcourse.backends.bootstrap`);
    ``device``: where its tensors live (default: the rank's GPU for NCCL, else the CPU);
    ``timeout``: seconds a collective may wait for a peer (default: the course's).
    Raises BackendUnavailable, with the reason, where this machine cannot run it.
    Creating a backend again in the same process (a re-run cell) is fine.
    """
    # every backend's constructor takes these keywords (the base class declares none)
    cls: Callable[..., Backend] = backend_class(name)
    reason = unavailable_reason(name)
    if reason:
        raise BackendUnavailable(f"backend {name!r} cannot run here: {reason}")
    return cls(comm=comm, device=device, timeout=timeout)


def backend_class(name: str) -> type[Backend]:
    """The class of backend ``name``; importing it touches neither CuPy nor CUDA."""
    if name not in _IMPLEMENTATIONS:
        raise ValueError(f"unknown backend {name!r}; choose one of {', '.join(BACKENDS)}")
    module, cls = _IMPLEMENTATIONS[name]
    return getattr(importlib.import_module(module), cls)


@dataclass(frozen=True)
class BackendStatus:
    name: str
    usable: bool
    reason: str  # why not, or what it will run on


def _cuda_reason() -> str:
    import torch  # here, not at the top: a launcher lists the backends without loading torch

    if not torch.cuda.is_available():
        if torch.version.cuda is None:
            return "torch is a CPU-only build (no CUDA)"
        return "no CUDA device"
    return ""


def _cupy_nccl_reason() -> str:
    if importlib.util.find_spec("cupy") is None:
        return f"cupy not installed ({extra_hint()})"
    try:
        import cupy  # noqa: F401
    except Exception as exc:  # noqa: BLE001 - any import failure makes it unusable
        return f"cupy fails to import: {exc}"
    try:
        from cupy.cuda import nccl
    except Exception:  # noqa: BLE001
        return f"NCCL library missing ({extra_hint()})"
    if not getattr(nccl, "available", True):  # some CuPy builds import a stub
        return f"NCCL library missing ({extra_hint()})"
    try:
        import cupy

        if cupy.cuda.runtime.getDeviceCount() < 1:
            return "no CUDA device"
    except Exception:  # noqa: BLE001 - CUDARuntimeError without a driver
        return "no CUDA device"
    return ""


def unavailable_reason(name: str, ranks: int | None = None) -> str:
    """Why this machine cannot run backend ``name``; empty when it can.

    ``ranks``: the number of ranks that would run it on this machine (a notebook's
    engines): a GPU backend with fewer GPUs than ranks cannot, since NCCL refuses two
    ranks on one GPU. Local checks only (libraries, devices); no communication, so it
    is safe to call from a notebook kernel that is not an MPI rank.
    """
    reason = _library_reason(name)
    if reason or ranks is None:
        return reason
    return too_few_gpus(name, ranks)


def too_few_gpus(name: str, ranks: int) -> str:
    """Why backend ``name`` cannot run ``ranks`` ranks on this machine's GPUs; "" if it can
    (or needs no GPU). NCCL refuses two ranks on one GPU; one rank on one GPU runs."""
    if not backend_class(name).needs_gpu:
        return ""
    from pcourse.runtime.ranks import gpu_count

    if ranks > gpu_count():
        return (f"needs one GPU per rank: {ranks} ranks, {gpu_count()} GPU(s) here "
                f"(start at most {gpu_count()}; one rank checks the plumbing, not the "
                "reduction)")
    return ""


def _library_reason(name: str) -> str:
    if name in ("mpi", "mpi-pickle", "mpi-pickle-deadline"):
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


def backend_status(ranks: int | None = None) -> list[BackendStatus]:
    """Usable / not usable, with the reason, for every backend on this machine
    (at ``ranks`` ranks, if given: see :func:`unavailable_reason`)."""
    rows = []
    for name in BACKENDS:
        reason = unavailable_reason(name, ranks)
        if reason:
            rows.append(BackendStatus(name, False, reason))
        else:
            on = "GPU" if backend_class(name).needs_gpu else "CPU"
            rows.append(BackendStatus(name, True, f"runs on {on}"))
    return rows


# CUDA major version of the torch build -> the extra (pyproject.toml) with the CuPy and
# NCCL built for it. torch's CUDA wheels depend on NCCL's wheel of their own CUDA, so
# the extra of the same CUDA names the very same distribution: one libnccl.so.2 in the
# venv, never two (a second would overwrite torch's, and removing either removes it).
GPU_EXTRAS = {"12": "gpu-cu12", "13": "gpu-cu13"}


def extra_for(cuda_version: str | None) -> str:
    """The extra for a torch built for ``cuda_version`` (``torch.version.cuda``).

    ValueError, naming the version, for a CPU-only torch or a CUDA without an extra.
    """
    if not cuda_version:
        raise ValueError("torch is a CPU-only build (torch.version.cuda is None): install a "
                         "CUDA build of torch first; the GPU extras match its CUDA version")
    major = str(cuda_version).split(".")[0]
    if major not in GPU_EXTRAS:
        raise ValueError(f"torch is built for CUDA {cuda_version}, and the course has GPU "
                         f"extras only for CUDA {', '.join(GPU_EXTRAS)}: install a torch "
                         "built for one of those")
    return GPU_EXTRAS[major]


def extra_hint() -> str:
    """How to install the GPU libraries for this torch, as a short instruction."""
    import torch

    if not torch.version.cuda:
        return "it needs a CUDA build of torch; with one, make gpu-check installs it"
    try:
        extra = extra_for(torch.version.cuda)
    except ValueError:
        return f"the course has no GPU extra for torch's CUDA {torch.version.cuda}"
    return f"pip install -e '.[{extra}]', or make gpu-check"
