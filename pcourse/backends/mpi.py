"""Allreduce over MPI with mpi4py, two ways (lesson 04): the source's (pickle) and in place.

mpi4py has two APIs. Lowercase methods (``comm.allreduce(obj)``) take any Python
object: they pickle it, send the bytes, unpickle, and reduce with Python operators.
That is the source's approach, and it is simple, but every call copies the tensor
to the CPU, serialises it and allocates a new one. Uppercase methods
(``comm.Allreduce(MPI.IN_PLACE, buf)``) hand MPI the tensor's own memory through
the buffer protocol: no pickling, no new tensor, which is why the buffer backend is
the fast one on CPU.

Both take tensors on any device: what MPI cannot read in place is staged through
host memory. MPI has no timeouts of its own: a rank that never joins a collective
blocks the others forever. The buffer backend's allreduce waits through
``pcourse.cluster.interrupts.wait_request``: an interrupt stops it, and ``timeout``
seconds without the other ranks raise CollectiveTimeout. Elsewhere the deadline
comes from the launch (``pcourse.cluster.launch.mpirun``, the engine cluster).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from pcourse.backends.base import AsyncBackend, Backend, Work, private_comm
from pcourse.cluster.interrupts import wait_request


def _default_device() -> torch.device:
    # init_rank() has pinned this process to its GPU, if any; asking CUDA is local,
    # unlike init_rank itself, which is collective on COMM_WORLD.
    if torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


class _MPICommBackend(Backend):
    """What both MPI modes share: a private communicator and barrier."""

    any_device = True

    def __init__(self, comm: Any = None, *, device: str | torch.device | None = None,
                 timeout: float | None = None) -> None:
        from mpi4py import MPI

        self._MPI = MPI
        self.comm = private_comm(comm, self.name)
        self.rank, self.size = self.comm.Get_rank(), self.comm.Get_size()
        self.device = torch.device(device) if device is not None else _default_device()
        self.timeout = timeout  # see the module docstring: the launch enforces it

    def _check_tensor(self, tensor: torch.Tensor, op: str | None) -> None:
        if op is not None and tensor.dtype == torch.bool:
            raise TypeError("cannot reduce bool tensors across ranks; convert to uint8")

    def barrier(self) -> None:
        self._live().Barrier()

    def _live(self) -> Any:
        if self.comm is None:
            raise RuntimeError(f"{self.name} backend was closed; create a new one")
        return self.comm

    def close(self) -> None:
        if self.comm is not None and not self._MPI.Is_finalized():
            self.comm.Free()
        self.comm = None


class MPIBackend(_MPICommBackend, AsyncBackend):
    """Uppercase ``Allreduce``/``Bcast`` directly on the tensor's memory.

    A contiguous CPU tensor is reduced where it lies (numpy shares its memory).
    Everything else is staged through a contiguous host copy and copied back: GPU
    tensors (this MPI is not assumed CUDA-aware), non-contiguous views, and
    bfloat16, which numpy (and so MPI) has no type for: reductions run in float32
    and round back; broadcasts move its raw 16-bit patterns unchanged.
    """

    name = "mpi"

    def allreduce_async(self, tensor: torch.Tensor, op: str = "sum", *,
                        check: bool = True) -> Work:
        self._agree(tensor, check, op=op)
        host, staged = self._host_buffer(tensor, reduce=True)
        request = self._live().Iallreduce(self._MPI.IN_PLACE, host.numpy(), self._op(op))

        def finish() -> None:
            if op == "avg":
                host.div_(self.size)
            if staged:
                tensor.detach().copy_(host)

        return _RequestWork(request, finish, keep=(tensor, host), timeout=self.timeout)

    def broadcast(self, tensor: torch.Tensor, root: int = 0, *,
                  check: bool = True) -> torch.Tensor:
        self._agree(tensor, check, root=root)
        host, staged = self._host_buffer(tensor, reduce=False)
        raw = host
        if raw.dtype == torch.bfloat16:
            raw = raw.view(torch.int16)  # same bits; a type numpy and MPI know
        elif raw.dtype == torch.bool:
            raw = raw.view(torch.uint8)
        self._live().Bcast(raw.numpy(), root=root)
        if staged:
            tensor.detach().copy_(host)
        return tensor

    def _host_buffer(self, tensor: torch.Tensor, reduce: bool) -> tuple[torch.Tensor, bool]:
        """A contiguous CPU tensor MPI can use, and whether it is a copy."""
        t = tensor.detach()
        wide = reduce and (t.dtype == torch.bfloat16 or
                           (t.dtype == torch.float16 and not _mpi_has_float16()))
        if wide:
            return t.to("cpu", torch.float32).contiguous(), True
        if t.device.type == "cpu" and t.is_contiguous():
            return t, False
        return t.to("cpu").contiguous(), True

    def _op(self, op: str) -> Any:
        MPI = self._MPI
        return {"sum": MPI.SUM, "avg": MPI.SUM, "max": MPI.MAX, "min": MPI.MIN,
                "prod": MPI.PROD}[op]


def _mpi_has_float16() -> bool:
    from mpi4py import MPI

    # MPICH maps numpy's float16 to MPIX_C_FLOAT16; an MPI without it gets float32.
    return getattr(MPI, "_typedict", {}).get("e") not in (None, MPI.DATATYPE_NULL)


class _RequestWork(Work):
    """A pending ``Iallreduce``: wait for it, then copy back what was staged."""

    def __init__(self, request: Any, finish: Callable[[], None], keep: tuple,
                 timeout: float | None = None) -> None:
        self._request, self._finish, self._timeout = request, finish, timeout
        self._keep = keep  # the buffers MPI writes into must outlive the request

    def wait(self) -> None:
        if self._request is None:
            return
        wait_request(self._request, self._timeout, "allreduce")  # interruptible, with a deadline
        self._request = None
        self._finish()
        self._keep = ()


class MPIPickleBackend(_MPICommBackend):
    """The source's way: lowercase ``comm.allreduce`` of the tensor, copied to the CPU.

    mpi4py pickles the tensor, reduces with Python operators (``+``, ``*``) and
    returns a new tensor, which is copied back into the caller's. Python's ``max``
    cannot compare tensors elementwise, so MAX and MIN use user-defined MPI ops
    built on ``torch.maximum`` / ``torch.minimum``.
    """

    name = "mpi-pickle"

    def __init__(self, comm: Any = None, *, device: str | torch.device | None = None,
                 timeout: float | None = None) -> None:
        super().__init__(comm, device=device, timeout=timeout)
        MPI = self._MPI
        self._max = MPI.Op.Create(lambda a, b, _t=None: torch.maximum(a, b), commute=True)
        self._min = MPI.Op.Create(lambda a, b, _t=None: torch.minimum(a, b), commute=True)
        self._ops = {"sum": MPI.SUM, "avg": MPI.SUM, "max": self._max, "min": self._min,
                     "prod": MPI.PROD}

    def allreduce(self, tensor: torch.Tensor, op: str = "sum", *,
                  check: bool = True) -> torch.Tensor:
        self._agree(tensor, check, op=op)
        result = self._live().allreduce(tensor.detach().cpu(), op=self._ops[op])
        if op == "avg":
            result = result / self.size
        tensor.detach().copy_(result)
        return tensor

    def broadcast(self, tensor: torch.Tensor, root: int = 0, *,
                  check: bool = True) -> torch.Tensor:
        self._agree(tensor, check, root=root)
        mine = tensor.detach().cpu() if self.rank == root else None
        tensor.detach().copy_(self._live().bcast(mine, root=root))
        return tensor

    def close(self) -> None:
        if self.comm is not None and not self._MPI.Is_finalized():
            self._max.Free()
            self._min.Free()
        super().close()
