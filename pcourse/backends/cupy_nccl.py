"""NCCL through CuPy's bindings (lesson 04): the source's GPU backend, bootstrapped from MPI.

NCCL needs every rank to start from the same 128-byte "unique id". Rank 0 makes it
with ``nccl.get_unique_id()``, MPI broadcasts it, and each process builds one
``NcclCommunicator(size, uid, rank)`` for its own GPU. On a part of the job (``comm``
a sub-communicator, one group of a :class:`pcourse.mesh.Mesh`) the same happens within
the part: its rank 0 makes the id, and the part's communicator broadcasts it; each
part has its own communicator. After that, MPI is no longer involved: ``allReduce``
runs on raw device pointers, enqueued on torch's current CUDA stream so that it is
ordered after the kernels that produced the gradients and before those that use
them, without any synchronisation of our own.

NCCL's kernels run on the stream while the CPU goes on, so the backend itself waits
only for the agreement check's result, in ``barrier`` and in ``close``: interruptibly,
and at most ``timeout`` seconds (a hang elsewhere shows where torch next synchronises
with the GPU). A ``close`` whose wait ends early aborts the communicator, which ends
the kernels that wait for a peer that is gone.

At one rank it runs too (one GPU is the common machine): that checks the plumbing
(device, stream, dtypes, the communicator), not a reduction across GPUs.

CuPy is imported only inside the constructor: ``import pcourse`` must work on a
laptop without CUDA, where CuPy may be missing or fail at its first CUDA call.
"""

from __future__ import annotations

import socket
import warnings
from typing import Any

import numpy as np
import torch

from pcourse.backends.base import (
    Backend,
    BackendUnavailable,
    collective_timeout,
    private_comm,
)
from pcourse.backends.bootstrap import socket_ifname
from pcourse.runtime.ranks import pick_gpu
from pcourse.runtime.waits import CollectiveTimeout, wait_until

# torch dtype -> name of the constant in cupy.cuda.nccl (looked up lazily).
DTYPES = {
    torch.float16: "NCCL_FLOAT16",
    torch.bfloat16: "NCCL_BFLOAT16",
    torch.float32: "NCCL_FLOAT32",
    torch.float64: "NCCL_FLOAT64",
    torch.int32: "NCCL_INT32",
    torch.int64: "NCCL_INT64",
    torch.uint8: "NCCL_UINT8",
}
_OPS = {"sum": "NCCL_SUM", "avg": "NCCL_SUM", "max": "NCCL_MAX", "min": "NCCL_MIN",
        "prod": "NCCL_PROD"}

# One NCCL communicator per process over the whole job: a re-created one (a re-run cell)
# destroys the old one. Those on a communicator given (parts, a Mesh's groups, which
# may hold the same ranks) live beside it until closed.
_current: CupyNCCLBackend | None = None


class CupyNCCLBackend(Backend):
    """NCCL via ``cupy.cuda.nccl``: GPU tensors, one GPU per rank."""

    name = "nccl-cupy"
    needs_gpu = True

    def __init__(self, comm: Any = None, *, device: str | torch.device | None = None,
                 timeout: float | None = None) -> None:
        global _current
        from mpi4py import MPI

        from pcourse.backends import unavailable_reason

        reason = unavailable_reason("nccl-cupy")  # local checks: fails fast, alone
        if reason:
            raise BackendUnavailable(f"backend 'nccl-cupy' cannot run here: {reason}")
        import cupy
        from cupy.cuda import nccl

        self._nccl = nccl
        self.timeout = collective_timeout(timeout)
        mpi = private_comm(comm, self.name)
        try:
            self.rank, self.size = mpi.Get_rank(), mpi.Get_size()
            self.device = pick_gpu(self.name, device, mpi)
            cupy.cuda.Device(self.device.index).use()
            whole_job = comm is None or comm == MPI.COMM_WORLD
            if whole_job and _current is not None:
                _current.close()
            one_host = len(set(mpi.allgather(socket.gethostname()))) == 1
            with socket_ifname("NCCL_SOCKET_IFNAME", one_host):  # NCCL's bootstrap listener
                uid = nccl.get_unique_id() if self.rank == 0 else None
                uid = mpi.bcast(uid, root=0)
                self._comm = nccl.NcclCommunicator(self.size, uid, self.rank)
        finally:
            mpi.Free()
        if whole_job:
            _current = self

    def _live(self) -> Any:
        if self._comm is None:
            raise RuntimeError("this nccl-cupy backend was closed or replaced; use the newest")
        self._check_in_step()
        return self._comm

    def _dtype(self, dtype: torch.dtype) -> int:
        const = DTYPES.get(dtype)
        if const is None or not hasattr(self._nccl, const):
            supported = ", ".join(str(d).removeprefix("torch.") for d in DTYPES
                                  if hasattr(self._nccl, DTYPES[d]))
            raise TypeError(f"nccl-cupy cannot reduce {dtype}; supported: {supported}")
        return getattr(self._nccl, const)

    def _check_tensor(self, tensor: torch.Tensor, op: str | None) -> None:
        if tensor.device != self.device:
            raise ValueError(
                f"nccl-cupy works on tensors on {self.device}, got one on {tensor.device}; "
                f"move it with .to({str(self.device)!r})"
            )
        if op is not None:
            self._dtype(tensor.dtype)

    def allreduce(self, tensor: torch.Tensor, op: str = "sum", *,
                  check: bool = True) -> torch.Tensor:
        self._agree(tensor, check, op=op)
        t = tensor.detach()
        buf = t if t.is_contiguous() else t.contiguous()
        stream = torch.cuda.current_stream(self.device).cuda_stream
        before, after = self.avg_divisors(buf.dtype, op)  # avg: 16 bits divide first
        if before > 1:
            buf.div_(before)  # same stream: runs before the reduction
        self._live().allReduce(buf.data_ptr(), buf.data_ptr(), buf.numel(),
                               self._dtype(buf.dtype), getattr(self._nccl, _OPS[op]), stream)
        if after > 1:
            buf.div_(after)  # same stream: runs after the reduction
        if buf.data_ptr() != tensor.data_ptr():
            tensor.detach().copy_(buf)
        return tensor

    def broadcast(self, tensor: torch.Tensor, root: int = 0, *,
                  check: bool = True) -> torch.Tensor:
        self._agree(tensor, check, root=root)
        t = tensor.detach()
        buf = t if t.is_contiguous() else t.contiguous()
        raw = as_nccl_bytes(buf, self._nccl)
        stream = torch.cuda.current_stream(self.device).cuda_stream
        self._live().bcast(raw.data_ptr(), raw.numel(), self._dtype(raw.dtype), root, stream)
        if buf.data_ptr() != tensor.data_ptr():
            tensor.detach().copy_(buf)
        return tensor

    def barrier(self) -> None:
        # An allreduce of one element: returns only once every rank has joined it.
        self.allreduce(torch.ones(1, device=self.device), check=False)
        self._sync("barrier")

    def max_over_ranks(self, v: np.ndarray) -> np.ndarray:
        t = self.allreduce(torch.from_numpy(v).to(self.device), "max", check=False)
        self._sync("agreement check")
        return t.cpu().numpy()

    def _sync(self, what: str) -> None:
        """Wait until the stream's work so far is done: interruptibly, with the deadline."""
        done = torch.cuda.Event()
        done.record(torch.cuda.current_stream(self.device))
        self._wait_for(lambda: wait_until(done.query, self.timeout, what), what)

    def close(self) -> None:
        """Wait (at most ``timeout`` s) for the stream's work, then free the communicator.

        A rank whose wait ends early (a peer died, an interrupt) aborts the communicator
        instead: its kernels would wait forever for the peer, and destroy with them.
        """
        global _current
        comm, interrupted = getattr(self, "_comm", None), None
        if comm is not None and not self._gave_up:
            try:
                self._sync("close")
            except CollectiveTimeout as exc:
                warnings.warn(f"nccl-cupy close: {exc}; the communicator is aborted",
                              RuntimeWarning, stacklevel=2)
            except BaseException as exc:  # noqa: BLE001 - an interrupt: abort, then go on
                interrupted = exc
        if comm is not None and self._gave_up:
            comm.abort()  # its kernels wait for peers that never come: end them
        elif comm is not None:
            comm.destroy()
        self._comm = None
        if _current is self:
            _current = None
        if interrupted is not None:
            raise interrupted

    # ---------------------------------------------------- sharding (lesson 10)
    def reduce_scatter(self, output: torch.Tensor, input: torch.Tensor, op: str = "sum", *,
                       check: bool = True) -> torch.Tensor:
        """NCCL's ``reduceScatter`` on device pointers, on torch's current stream."""
        self._agree_blocks("reduce_scatter", output, input, check, op)
        out, inp = output.detach(), input.detach()
        before, after = self.avg_divisors(inp.dtype, op)
        if before > 1:
            inp = inp / before  # a copy (the input stays), on the same stream: before it
        stream = torch.cuda.current_stream(self.device).cuda_stream
        self._live().reduceScatter(inp.data_ptr(), out.data_ptr(), out.numel(),
                                   self._dtype(inp.dtype), getattr(self._nccl, _OPS[op]),
                                   stream)
        if after > 1:
            out.div_(after)  # same stream: after the reduction
        return output

    def all_gather(self, output: torch.Tensor, input: torch.Tensor, *,
                   check: bool = True) -> torch.Tensor:
        """NCCL's ``allGather``; types NCCL does not know travel as bytes."""
        self._agree_blocks("all_gather", output, input, check, None)
        out, inp = output.detach(), input.detach()
        out, inp = as_nccl_bytes(out, self._nccl), as_nccl_bytes(inp, self._nccl)
        stream = torch.cuda.current_stream(self.device).cuda_stream
        self._live().allGather(inp.data_ptr(), out.data_ptr(), inp.numel(),
                               self._dtype(inp.dtype), stream)
        return output


def as_nccl_bytes(buf: torch.Tensor, nccl: Any) -> torch.Tensor:
    """``buf`` itself if NCCL has its dtype, else the same memory as a flat uint8 tensor.

    A broadcast only moves bytes, so a dtype NCCL lacks (bool, int16, complex) travels
    as uint8. ``buf`` must be contiguous; a 0-dim tensor is flattened first, since a
    view as another element size needs at least one dimension.
    """
    const = DTYPES.get(buf.dtype)
    if const and hasattr(nccl, const):
        return buf
    return buf.reshape(-1).view(torch.uint8)
