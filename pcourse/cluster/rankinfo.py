"""Who am I in the MPI job, and which device do I own?

Every engine (and every process under ``mpiexec``) calls :func:`init_rank` once. It
answers from MPI itself rather than launcher-specific variables (MPICH and Open MPI
name them differently), pins the process to the GPU of its local rank where there
are GPUs, and gives each rank its share of the CPU cores so that N ranks on one
machine do not each start a thread per core and fight over them.
"""

from __future__ import annotations

import importlib.util
import os
import socket
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass


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


def gpu_count() -> int:
    """Number of CUDA devices torch can see (0 without a GPU or a CUDA build)."""
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def init_rank() -> RankInfo:
    """Find this process's place in the MPI job and pin it to its device and cores.

    Idempotent: later calls return the first answer, so a re-run notebook cell
    never moves a rank to another device under live tensors.
    """
    global _info
    if _info is not None:
        return _info
    import torch
    from mpi4py import MPI

    world = MPI.COMM_WORLD
    node = world.Split_type(MPI.COMM_TYPE_SHARED, key=world.rank)
    local_rank, local_size = node.rank, node.size
    node.Free()

    ngpu = gpu_count()
    if ngpu:
        # With more ranks than GPUs on a host, ranks share GPUs (fine for MPI and
        # Gloo); the NCCL backends refuse that case with a clear error.
        index = local_rank % ngpu
        torch.cuda.set_device(index)
        if importlib.util.find_spec("cupy") is not None:
            try:
                import cupy

                cupy.cuda.Device(index).use()
            except Exception:  # noqa: BLE001 - a broken CuPy must not stop a CPU-capable rank
                pass
        device = f"cuda:{index}"
    else:
        device = "cpu"

    threads = max(1, (os.cpu_count() or 1) // local_size)
    torch.set_num_threads(threads)
    _info = RankInfo(
        rank=world.rank,
        size=world.size,
        local_rank=local_rank,
        local_size=local_size,
        host=socket.gethostname(),
        device=device,
        threads=threads,
    )
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
