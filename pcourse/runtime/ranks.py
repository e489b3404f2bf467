"""Who am I in the job, and which device do I own?

A process is a rank when a launcher started it: ``mpiexec`` (MPICH, Open MPI, Intel
MPI, Slurm's PMI) or ``torchrun``. :func:`launcher` says which, from the variables
those launchers set: it is how every command knows it runs as a rank.
:func:`init_rank` answers rank, size and local rank (from MPI itself, or from
torchrun's variables), pins the process to the GPU of its local rank (chosen by
:func:`gpu_for`, the one place that choice is made) and gives each rank its share of
the CPU cores, so that N ranks on one machine do not each start a thread per core.
The GPU backends take their GPU with :func:`pick_gpu`, which refuses two ranks on one.
"""

from __future__ import annotations

import importlib.util
import os
import socket
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

# Set for each rank by: MPICH/Hydra, Intel MPI and srun (PMI); Open MPI; PMIx launchers.
MPI_RANK_VARS = ("PMI_RANK", "OMPI_COMM_WORLD_RANK", "PMIX_RANK")
TORCHRUN_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK")  # torchrun (torch.distributed.run)


class BackendUnavailable(RuntimeError):
    """This machine cannot run the requested backend; the message says why."""


@dataclass(frozen=True)
class RankInfo:
    rank: int
    size: int
    local_rank: int  # rank among the processes on this host
    local_size: int
    host: str
    device: str  # "cpu" or "cuda:<local GPU index>"
    threads: int  # torch intra-op threads this rank uses


_info: RankInfo | None = None


def launcher() -> str:
    """``"mpi"`` if mpiexec started this process, ``"torchrun"`` under torchrun, else ``""``.

    Any size counts, one rank included: ``mpiexec -n 1 cmd`` runs ``cmd`` as a rank.
    """
    if any(var in os.environ for var in MPI_RANK_VARS):
        return "mpi"
    if all(var in os.environ for var in TORCHRUN_VARS):
        return "torchrun"
    return ""


def gpu_count() -> int:
    """Number of CUDA devices torch can see (0 without a GPU or a CUDA build)."""
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def gpu_for(local_rank: int) -> int | None:
    """The GPU a rank owns: local rank i takes GPU i mod (visible GPUs); None without one.

    With more ranks than GPUs on a host, ranks share GPUs (fine for MPI and Gloo);
    the NCCL backends refuse that case with a clear error.
    """
    ngpu = gpu_count()
    return local_rank % ngpu if ngpu else None


def use_gpu(index: int) -> None:
    """Make GPU ``index`` this process's current device, for torch and (if present) CuPy."""
    import torch

    torch.cuda.set_device(index)
    if importlib.util.find_spec("cupy") is not None:
        try:
            import cupy

            cupy.cuda.Device(index).use()
        except Exception:  # noqa: BLE001 - a broken CuPy must not stop a CPU-capable rank
            pass


def pick_gpu(name: str, device: str | torch.device | None, mpi: Any) -> torch.device:
    """The GPU backend ``name`` uses on this rank, made the current device.

    ``device`` if given; else, bootstrapped from MPI, the GPU of the local rank with
    every rank checking that no two share one (:func:`local_gpu`); else torchrun's
    ``LOCAL_RANK``, or the device the caller made current.
    """
    import torch

    if device is not None:
        dev = torch.device(device)
        if dev.type != "cuda":
            raise ValueError(f"{name} runs on GPUs; got device={device!r}")
        index = torch.cuda.current_device() if dev.index is None else dev.index
    elif mpi is not None:
        return local_gpu(mpi.allgather, mpi_local_rank(mpi)[0], name)
    elif "LOCAL_RANK" in os.environ:
        local = gpu_for(int(os.environ["LOCAL_RANK"]))
        assert local is not None, f"{name}: no GPU here (its constructor checks for one)"
        index = local
    else:
        index = torch.cuda.current_device()
    use_gpu(index)
    return torch.device("cuda", index)


def local_gpu(allgather: Callable[[Any], list], local_rank: int, name: str) -> torch.device:
    """This rank's own GPU; BackendUnavailable on every rank if two ranks share one.

    NCCL refuses two ranks on one GPU ("Duplicate GPU"). Local rank i takes GPU
    :func:`gpu_for` (i); the GPUs' UUIDs are then compared
    across ranks (``allgather``), which also works when a launcher gives each rank
    its own CUDA_VISIBLE_DEVICES. The decision is collective, so all ranks raise together.
    """
    import torch

    index = gpu_for(local_rank)
    uuid = "" if index is None else str(getattr(torch.cuda.get_device_properties(index),
                                                "uuid", index))
    everyone = allgather((socket.gethostname(), uuid))
    # Every rank sees the same list, so every rank takes the same decision.
    crowded = sorted({h for h, u in everyone if u == "" or everyone.count((h, u)) > 1})
    if crowded:
        here = sum(h == socket.gethostname() for h, _ in everyone)
        raise BackendUnavailable(
            f"backend {name!r} needs one GPU per rank, but ranks on {', '.join(crowded)} "
            f"would share a GPU or have none (this host: {here} ranks, "
            f"{torch.cuda.device_count()} GPUs); start at most one rank per GPU"
        )
    assert index is not None  # a rank without a GPU has uuid "" and is crowded: raised above
    use_gpu(index)
    return torch.device("cuda", index)


def mpi_local_rank(comm: Any) -> tuple[int, int]:
    """(rank, size) among the ranks of ``comm`` on this host. Collective on ``comm``."""
    from mpi4py import MPI

    node = comm.Split_type(MPI.COMM_TYPE_SHARED, key=comm.Get_rank())
    try:
        return node.Get_rank(), node.Get_size()
    finally:
        node.Free()


def _place() -> tuple[int, int, int, int]:
    """(rank, size, local rank, local size), from torchrun's variables or from MPI."""
    if launcher() == "torchrun":
        env = os.environ
        local_size = int(env.get("LOCAL_WORLD_SIZE", env["WORLD_SIZE"]))
        return int(env["RANK"]), int(env["WORLD_SIZE"]), int(env["LOCAL_RANK"]), local_size
    from mpi4py import MPI

    world = MPI.COMM_WORLD
    return (world.Get_rank(), world.Get_size(), *mpi_local_rank(world))


def init_rank() -> RankInfo:
    """Find this process's place in the job and pin it to its device and cores.

    Idempotent: later calls return the first answer, so a re-run notebook cell
    never moves a rank to another device under live tensors.
    """
    global _info
    if _info is not None:
        return _info
    import torch

    rank, size, local_rank, local_size = _place()
    index = gpu_for(local_rank)
    if index is not None:
        use_gpu(index)
    threads = max(1, (os.cpu_count() or 1) // local_size)
    torch.set_num_threads(threads)
    _info = RankInfo(rank=rank, size=size, local_rank=local_rank, local_size=local_size,
                     host=socket.gethostname(), device="cpu" if index is None else f"cuda:{index}",
                     threads=threads)
    return _info


@contextmanager
def threads(n: int | None) -> Iterator[None]:
    """Use ``n`` torch threads inside the block (None: leave them), then restore.

    A tiny model gains nothing from splitting its matrices over threads, and on a
    busy machine every op waits for a descheduled thread; Franke's config asks
    for one. Restored afterwards, so a notebook engine keeps its own setting.
    """
    import torch

    before = torch.get_num_threads()
    if n is not None:
        torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)
