"""NCCL through CuPy's bindings: the source's GPU backend, bootstrapped from MPI.

NCCL needs every rank to start from the same 128-byte "unique id". Rank 0 makes it
with ``nccl.get_unique_id()``, MPI broadcasts it, and each process builds one
``NcclCommunicator(size, uid, rank)`` for its own GPU. After that, MPI is no longer
involved: ``allReduce`` runs on raw device pointers, enqueued on torch's current
CUDA stream so that it is ordered after the kernels that produced the gradients
and before those that use them, without any synchronisation of our own.

CuPy is imported only inside the constructor: ``import pcourse`` must work on a
laptop without CUDA, where CuPy may be missing or fail at its first CUDA call.
"""

from __future__ import annotations

from typing import Any

import torch

from pcourse.backends.base import Backend, BackendUnavailable, check_avg_dtype, check_op

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

# One NCCL communicator per process: a re-created backend destroys the old one.
_current: CupyNCCLBackend | None = None


class CupyNCCLBackend(Backend):
    """NCCL via ``cupy.cuda.nccl``: GPU tensors, one GPU per rank."""

    name = "nccl-cupy"

    def __init__(self, comm: Any = None, timeout: float | None = None) -> None:
        global _current
        from pcourse.backends import unavailable_reason

        reason = unavailable_reason("nccl-cupy")  # local checks: fails fast, alone
        if reason:
            raise BackendUnavailable(f"backend 'nccl-cupy' cannot run here: {reason}")
        from cupy.cuda import nccl
        from mpi4py import MPI

        from pcourse.backends.torch_dist import local_gpu

        self._nccl = nccl
        self.timeout = timeout  # NCCL via CuPy has none; the launch deadline applies
        mpi = (MPI.COMM_WORLD if comm is None else comm).Dup()
        try:
            self.rank, self.size = mpi.Get_rank(), mpi.Get_size()
            self.device = local_gpu(mpi, self.name)
            import cupy

            cupy.cuda.Device(self.device.index).use()
            if _current is not None:
                _current.close()
            uid = nccl.get_unique_id() if self.rank == 0 else None
            uid = mpi.bcast(uid, root=0)
            self._comm = nccl.NcclCommunicator(self.size, uid, self.rank)
        finally:
            mpi.Free()
        _current = self

    def _live(self) -> Any:
        if self._comm is None:
            raise RuntimeError("this nccl-cupy backend was closed or replaced; use the newest")
        return self._comm

    def _dtype(self, tensor: torch.Tensor) -> int:
        const = DTYPES.get(tensor.dtype)
        if const is None or not hasattr(self._nccl, const):
            supported = ", ".join(str(d).removeprefix("torch.") for d in DTYPES
                                  if hasattr(self._nccl, DTYPES[d]))
            raise TypeError(f"nccl-cupy cannot reduce {tensor.dtype}; supported: {supported}")
        return getattr(self._nccl, const)

    def _buffer(self, tensor: torch.Tensor) -> torch.Tensor:
        if tensor.device != self.device:
            raise ValueError(
                f"nccl-cupy works on tensors on {self.device}, got one on {tensor.device}; "
                f"move it with .to({str(self.device)!r})"
            )
        t = tensor.detach()
        return t if t.is_contiguous() else t.contiguous()

    def allreduce(self, tensor: torch.Tensor, op: str = "sum") -> torch.Tensor:
        check_op(op)
        check_avg_dtype(tensor, op)
        dtype = self._dtype(tensor)
        buf = self._buffer(tensor)
        stream = torch.cuda.current_stream(self.device).cuda_stream
        self._live().allReduce(buf.data_ptr(), buf.data_ptr(), buf.numel(), dtype,
                               getattr(self._nccl, _OPS[op]), stream)
        if op == "avg":
            buf.div_(self.size)  # same stream: runs after the reduction
        if buf.data_ptr() != tensor.data_ptr():
            tensor.detach().copy_(buf)
        return tensor

    def broadcast(self, tensor: torch.Tensor, root: int = 0) -> torch.Tensor:
        buf = self._buffer(tensor)
        # A broadcast moves bytes: types NCCL does not know travel as uint8.
        const = DTYPES.get(buf.dtype)
        raw = buf if const and hasattr(self._nccl, const) else buf.view(torch.uint8)
        stream = torch.cuda.current_stream(self.device).cuda_stream
        self._live().bcast(raw.data_ptr(), raw.numel(), self._dtype(raw), root, stream)
        if buf.data_ptr() != tensor.data_ptr():
            tensor.detach().copy_(buf)
        return tensor

    def barrier(self) -> None:
        # An allreduce of one element: returns only once every rank has joined it.
        flag = torch.ones(1, device=self.device)
        self.allreduce(flag)
        torch.cuda.current_stream(self.device).synchronize()

    def close(self) -> None:
        global _current
        if getattr(self, "_comm", None) is not None:
            torch.cuda.synchronize(self.device)
            self._comm.destroy()
        self._comm = None
        if _current is self:
            _current = None
