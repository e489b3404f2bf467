"""Allreduce over MPI with mpi4py, two ways (lesson 04): the source's (pickle) and in place.

mpi4py has two APIs. Lowercase methods (``comm.allreduce(obj)``) take any Python
object: they pickle it, send the bytes, unpickle, and reduce with Python operators.
That is the source's approach, and it is simple, but every call copies the tensor
to the CPU, serialises it and allocates a new one. Uppercase methods
(``comm.Allreduce(MPI.IN_PLACE, buf)``) hand MPI the tensor's own memory through
the buffer protocol: no pickling, no new tensor, which is why the buffer backend is
the fast one on CPU.

Both take tensors on any device: what MPI cannot read in place is staged through
host memory. MPI has no timeouts of its own, and a blocking MPI call cannot be
interrupted: a rank that never joins a collective would block the others forever,
deaf to the stop button. So every collective of the buffer backend (and of
``mpi-pickle-deadline``) is MPI's nonblocking one (``Iallreduce``, ``Ibcast``,
``Ibarrier``), waited for by ``pcourse.runtime.waits.wait_request``: an
interrupt stops the wait, and ``timeout`` seconds without the other ranks raise
CollectiveTimeout. ``mpi-pickle`` is the source's blocking ``comm.allreduce``, and
has no deadline.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from pcourse.backends.base import (
    OPS,
    AsyncBackend,
    Backend,
    Pending,
    Work,
    collective_timeout,
    private_comm,
)
from pcourse.runtime import private
from pcourse.runtime.waits import wait_request


def _default_device() -> torch.device:
    # init_rank() has pinned this process to its GPU, if any; asking CUDA is local,
    # unlike init_rank itself, which is collective on COMM_WORLD.
    if torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")



def mpi_op(op: str) -> Any:
    """MPI's reduction for ``op``; ``avg`` is a sum, divided by the caller."""
    from mpi4py import MPI

    return {"sum": MPI.SUM, "avg": MPI.SUM, "max": MPI.MAX, "min": MPI.MIN,
            "prod": MPI.PROD}[op]

class _MPICommBackend(Backend):
    """What both MPI modes share: a private communicator, waits, and barrier."""

    any_device = True

    def __init__(self, comm: Any = None, *, device: str | torch.device | None = None,
                 timeout: float | None = None) -> None:
        from mpi4py import MPI

        self._MPI = MPI
        self.timeout = collective_timeout(timeout)  # a bad value fails before any communication
        self.comm = private_comm(comm, self.name)
        self.rank, self.size = self.comm.Get_rank(), self.comm.Get_size()
        self.device = torch.device(device) if device is not None else _default_device()

    def _check_tensor(self, tensor: torch.Tensor, op: str | None) -> None:
        if op is not None and tensor.dtype == torch.bool:
            raise TypeError("cannot reduce bool tensors across ranks; convert to uint8")

    def barrier(self) -> None:
        self._wait(self._live().Ibarrier(), "barrier")

    def _wait(self, request: Any, what: str) -> None:
        """Wait for a nonblocking MPI operation: interruptibly, with the deadline."""
        self._wait_for(lambda: wait_request(request, self.timeout, what), what)

    def send(self, tensor: torch.Tensor, dst: int) -> Work:
        """``Isend`` of the tensor's own memory; waited for with the deadline."""
        self._check_peer(tensor, dst, "send")
        request = self._live().Isend(_raw(tensor).numpy(), dest=dst)
        return Pending(lambda: self._wait(request, f"send to rank {dst}"), keep=(tensor,),
                       test=request.Test)

    def recv(self, tensor: torch.Tensor, src: int) -> torch.Tensor:
        """``Irecv`` into the tensor's own memory, waited for with the deadline."""
        self._check_peer(tensor, src, "recv")
        self._wait(self._live().Irecv(_raw(tensor).numpy(), source=src), f"recv from rank {src}")
        return tensor

    def _live(self) -> Any:
        if self.comm is None:
            raise RuntimeError(f"{self.name} backend was closed; create a new one")
        self._check_in_step()
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
        before, after = self.avg_divisors(host.dtype, op)  # avg: 16 bits divide first
        if before > 1:
            host.div_(before)
        request = self._live().Iallreduce(self._MPI.IN_PLACE, host.numpy(), self._op(op))

        def finish() -> None:
            if after > 1:
                host.div_(after)
            if staged:
                tensor.detach().copy_(host)

        return Pending(lambda: self._wait(request, "allreduce"), finish, keep=(tensor, host),
                       test=request.Test)

    def broadcast(self, tensor: torch.Tensor, root: int = 0, *,
                  check: bool = True) -> torch.Tensor:
        self._agree(tensor, check, root=root)
        host, staged = self._host_buffer(tensor, reduce=False)
        raw = host
        if raw.dtype == torch.bfloat16:
            raw = raw.view(torch.int16)  # same bits; a type numpy and MPI know
        elif raw.dtype == torch.bool:
            raw = raw.view(torch.uint8)
        self._wait(self._live().Ibcast(raw.numpy(), root=root), "broadcast")
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
        return mpi_op(op)

    # ---------------------------------------------------- sharding (lesson 10)
    def reduce_scatter(self, output: torch.Tensor, input: torch.Tensor, op: str = "sum", *,
                       check: bool = True) -> torch.Tensor:
        """MPI's ``Ireduce_scatter_block`` on host buffers (staged as allreduce stages)."""
        self.reduce_scatter_async(output, input, op, check=check).wait()
        return output

    def reduce_scatter_async(self, output: torch.Tensor, input: torch.Tensor, op: str = "sum",
                             *, check: bool = True) -> Work:
        self._agree_blocks("reduce_scatter", output, input, check, op)
        send, _ = self._host_buffer(input, reduce=True)
        recv, staged = self._host_buffer(output, reduce=True)
        if recv.dtype != send.dtype:  # output was not widened like input: a fresh one
            recv, staged = torch.empty(output.numel(), dtype=send.dtype), True
        before, after = self.avg_divisors(send.dtype, op)
        if before > 1:
            send = send / before  # a copy: the input stays as it was
        request = self._live().Ireduce_scatter_block(send.numpy(), recv.numpy(), self._op(op))

        def finish() -> None:
            if after > 1:
                recv.div_(after)
            if staged:
                output.detach().copy_(recv.view_as(output))

        return Pending(lambda: self._wait(request, "reduce_scatter"), finish,
                       keep=(output, input, send, recv), test=request.Test)

    def all_gather(self, output: torch.Tensor, input: torch.Tensor, *,
                   check: bool = True) -> torch.Tensor:
        """MPI's ``Iallgather``: raw bits, so bfloat16 and bool travel unchanged."""
        self.all_gather_async(output, input, check=check).wait()
        return output

    def all_gather_async(self, output: torch.Tensor, input: torch.Tensor, *,
                         check: bool = True) -> Work:
        self._agree_blocks("all_gather", output, input, check, None)
        send, _ = self._host_buffer(input, reduce=False)
        recv, staged = self._host_buffer(output, reduce=False)
        raw = {torch.bfloat16: torch.int16, torch.bool: torch.uint8}.get(send.dtype)
        s, r = (send, recv) if raw is None else (send.view(raw), recv.view(raw))
        request = self._live().Iallgather(s.numpy(), r.numpy())

        def finish() -> None:
            if staged:
                output.detach().copy_(recv.view_as(output))

        return Pending(lambda: self._wait(request, "all_gather"), finish,
                       keep=(output, input, send, recv), test=request.Test)


def _raw(tensor: torch.Tensor) -> torch.Tensor:
    """The tensor's bits as a dtype numpy (and so MPI) knows: bfloat16 and bool as ints."""
    t = tensor.detach()
    raw = {torch.bfloat16: torch.int16, torch.bool: torch.uint8}.get(t.dtype)
    return t if raw is None else t.view(raw)


def _mpi_has_float16() -> bool:
    # MPICH maps numpy's float16 to MPIX_C_FLOAT16; an MPI without it gets float32.
    return private.mpi_datatype("e") is not None


class MPIPickleBackend(_MPICommBackend):
    """The source's way: mpi4py's own lowercase ``comm.allreduce`` of each tensor, on the CPU.

    Exactly what the source's code calls, one tensor at a time: the tensor is copied
    to the CPU, and ``comm.allreduce(tensor, op)`` pickles it, moves the bytes, and
    reduces with Python operators (``+``, ``*``), returning a new tensor, which is
    copied back into the caller's. Python's ``max`` cannot compare tensors
    elementwise, so MAX and MIN are user-defined MPI ops on ``torch.maximum`` /
    ``torch.minimum`` (mpi4py applies a user op to the objects themselves).

    No deadline: mpi4py's lowercase collectives block inside MPI, where neither an
    interrupt nor ``timeout`` reaches them, so a rank that never joins hangs the
    others, as in the source. ``mpi-pickle-deadline`` (:class:`MPIPickleDeadlineBackend`)
    moves the same pickles on nonblocking MPI and keeps the deadline; it is not what
    the source runs, and no lesson times it.
    """

    name = "mpi-pickle"

    def __init__(self, comm: Any = None, *, device: str | torch.device | None = None,
                 timeout: float | None = None) -> None:
        super().__init__(comm, device=device, timeout=timeout)
        MPI = self._MPI
        self._max = MPI.Op.Create(lambda a, b, _t=None: torch.maximum(a, b), commute=True)
        self._min = MPI.Op.Create(lambda a, b, _t=None: torch.minimum(a, b), commute=True)
        self._ops = {**{op: mpi_op(op) for op in OPS}, "max": self._max, "min": self._min}

    def allreduce(self, tensor: torch.Tensor, op: str = "sum", *,
                  check: bool = True) -> torch.Tensor:
        self._agree(tensor, check, op=op)
        host = tensor.detach().cpu()
        before, after = self.avg_divisors(host.dtype, op)  # avg: 16 bits divide first
        if before > 1:
            host = host / before
        result = self._live().allreduce(host, op=self._ops[op])  # the source's call
        if after > 1:
            result = result / after
        tensor.detach().copy_(result)
        return tensor

    def broadcast(self, tensor: torch.Tensor, root: int = 0, *,
                  check: bool = True) -> torch.Tensor:
        self._agree(tensor, check, root=root)
        mine = tensor.detach().cpu() if self.rank == root else None
        theirs = self._live().bcast(mine, root=root)  # mpi4py's comm.bcast
        if self.rank != root:
            tensor.detach().copy_(theirs)
        return tensor

    def close(self) -> None:
        if self.comm is not None and not self._MPI.Is_finalized():
            self._max.Free()
            self._min.Free()
        super().close()


class MPIPickleDeadlineBackend(MPIPickleBackend):
    """``mpi-pickle-deadline``: mpi-pickle's pickles, moved by nonblocking MPI, so every
    wait keeps the deadline and hears an interrupt (what the fault tests need).

    Its communicator's lowercase ``allreduce`` and ``bcast`` are
    :class:`_PicklesWithDeadline`'s: the same pickles, tree and Python reduction as
    mpi4py's, sent hop by hop (a length message, then the payload, polled from
    Python). Slower than mpi4py's own call, and not what the source runs; no lesson or
    benchmark times it.
    """

    name = "mpi-pickle-deadline"

    def _live(self) -> Any:
        return _PicklesWithDeadline(self, super()._live())


class _PicklesWithDeadline:
    """An MPI communicator whose ``allreduce`` and ``bcast`` of objects keep ``backend``'s
    deadline; everything else is the communicator's own."""

    def __init__(self, backend: _MPICommBackend, comm: Any) -> None:
        self._backend, self._comm = backend, comm
        self._pickle = backend._MPI.pickle

    def __getattr__(self, name: str) -> Any:
        return getattr(self._comm, name)

    def allreduce(self, obj: Any, op: Any) -> Any:
        """What ``comm.allreduce(obj, op)`` does, on nonblocking MPI: a tree, then a broadcast.

        Each rank reduces what the ranks above it send (pickled) into its own with
        ``op`` and sends the result down, until rank 0 holds the reduction of all,
        in rank order; rank 0's result is then broadcast to every rank, pickled.
        """
        rank, size = self._comm.Get_rank(), self._comm.Get_size()
        mask = 1
        while mask < size:
            if rank & mask:  # my part is in: hand it to the rank that collects it
                self._send(obj, rank - mask)
                break
            if rank + mask < size:
                obj = op(obj, self._recv(rank + mask))
            mask <<= 1
        return self.bcast(obj if rank == 0 else None, 0, what="allreduce")

    def bcast(self, obj: Any, root: int = 0, *, what: str = "broadcast") -> Any:
        """What ``comm.bcast(obj, root)`` does, on nonblocking MPI: the length, then the pickle.

        The root keeps its own object (mpi4py's gets an unpickled copy). ``what``
        names the collective in a timeout's message."""
        mine = self._comm.Get_rank() == root
        data = self._pickle.dumps(obj) if mine else b""
        count = np.array([len(data)], dtype=np.int64)
        self._wait(self._comm.Ibcast(count, root=root), what)
        buf = data if mine else bytearray(int(count[0]))
        self._wait(self._comm.Ibcast(buf, root=root), what)
        return obj if mine else self._pickle.loads(buf)

    def _send(self, obj: Any, dest: int) -> None:
        """mpi4py's ``comm.send`` in a collective: the pickle's length, then the pickle."""
        data = self._pickle.dumps(obj)
        self._wait(self._comm.Isend(np.array([len(data)], dtype=np.int64), dest), "allreduce")
        self._wait(self._comm.Isend(data, dest), "allreduce")

    def _recv(self, source: int) -> Any:
        count = np.empty(1, dtype=np.int64)
        self._wait(self._comm.Irecv(count, source), "allreduce")
        data = bytearray(int(count[0]))
        self._wait(self._comm.Irecv(data, source), "allreduce")
        return self._pickle.loads(data)

    def _wait(self, request: Any, what: str) -> None:
        self._backend._wait(request, what)
