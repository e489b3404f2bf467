"""Gloo and NCCL through torch.distributed, bootstrapped from MPI.

torch.distributed needs every process to know its rank, the world size, and where
to meet (a TCP "store" run by rank 0). Launchers such as torchrun provide these
through environment variables; here MPI already knows rank and size, so rank 0
chooses the meeting point and broadcasts it over MPI:

- address: ``MASTER_ADDR`` if set; else the address of the interface named by
  ``GLOO_SOCKET_IFNAME`` / ``NCCL_SOCKET_IFNAME``; else 127.0.0.1 when every rank
  runs on this host; else this host's resolvable address.
- port: ``MASTER_PORT`` if set (it must be free); else a free port the operating
  system picks. The source hard-codes 29500, which breaks as soon as two people
  (or two notebooks) share a machine.

Every collective has a deadline: the ``timeout`` given here is the process group's
timeout, after which a stuck collective raises instead of hanging.
"""

from __future__ import annotations

import os
import socket
from datetime import timedelta
from typing import Any

import torch

from pcourse.backends import Backend, BackendUnavailable, Work, check_avg_dtype, check_op

DEFAULT_TIMEOUT = 120.0  # seconds per collective (and for the rendezvous)

# The object that owns torch's default process group. A re-run notebook cell makes a
# new backend; that one replaces the group, and the old object refuses further use.
_owner: _TorchBackend | None = None


class _TorchBackend(Backend):
    dist_backend: str  # "gloo" or "nccl"
    ifname_var: str  # the environment variable naming the socket interface

    def __init__(self, comm: Any = None, timeout: float = DEFAULT_TIMEOUT) -> None:
        global _owner
        import torch.distributed as dist
        from mpi4py import MPI

        self._dist = dist
        self.timeout = timeout
        mpi = (MPI.COMM_WORLD if comm is None else comm).Dup()
        try:
            self.rank, self.size = mpi.Get_rank(), mpi.Get_size()
            self.device = self._pick_device(mpi)
            if _owner is not None:
                _owner._release()
            elif dist.is_initialized():  # someone else's default group, e.g. a manual init
                dist.destroy_process_group()
            addr, port = rendezvous_address(mpi, self.ifname_var)
        finally:
            mpi.Free()
        dist.init_process_group(
            self.dist_backend, init_method=f"tcp://{addr}:{port}", rank=self.rank,
            world_size=self.size, timeout=timedelta(seconds=timeout),
        )
        self.address = f"{addr}:{port}"
        _owner = self

    def _pick_device(self, mpi: Any) -> torch.device:
        return torch.device("cpu")

    def _release(self) -> None:
        """Destroy the default group if this object still owns it."""
        global _owner
        if _owner is self:
            if self._dist.is_initialized():
                self._dist.destroy_process_group()
            _owner = None

    def _live(self) -> Any:
        if _owner is not self:
            raise RuntimeError(
                f"this {self.name} backend was closed or replaced by a newer one "
                "(torch.distributed has one default group per process); use the newest"
            )
        return self._dist

    def allreduce(self, tensor: torch.Tensor, op: str = "sum") -> torch.Tensor:
        self.allreduce_async(tensor, op).wait()
        return tensor

    def allreduce_async(self, tensor: torch.Tensor, op: str = "sum") -> Work:
        check_op(op)
        check_avg_dtype(tensor, op)
        dist = self._live()
        native_avg = op == "avg" and self.dist_backend == "nccl"
        buf = tensor.detach() if tensor.is_contiguous() else tensor.detach().contiguous()
        handle = dist.all_reduce(buf, op=self._reduce_op(op, native_avg), async_op=True)
        divide = op == "avg" and not native_avg
        return _TorchWork(handle, tensor, buf, self.size if divide else 0)

    def broadcast(self, tensor: torch.Tensor, root: int = 0) -> torch.Tensor:
        buf = tensor.detach() if tensor.is_contiguous() else tensor.detach().contiguous()
        self._live().broadcast(buf, src=root)
        if buf.data_ptr() != tensor.data_ptr():
            tensor.detach().copy_(buf)
        return tensor

    def barrier(self) -> None:
        self._live().barrier()

    def close(self) -> None:
        self._release()

    def _reduce_op(self, op: str, native_avg: bool) -> Any:
        R = self._dist.ReduceOp
        # Gloo has no AVG; NCCL has it for floating types: sum then divide elsewhere.
        return {"sum": R.SUM, "avg": R.AVG if native_avg else R.SUM, "max": R.MAX,
                "min": R.MIN, "prod": R.PRODUCT}[op]


class _TorchWork(Work):
    """A pending torch collective; on wait, finish avg and copy back a staged buffer."""

    def __init__(self, handle: Any, tensor: torch.Tensor, buf: torch.Tensor, divisor: int):
        self._handle, self._tensor, self._buf, self._divisor = handle, tensor, buf, divisor

    def wait(self) -> None:
        if self._handle is None:
            return
        self._handle.wait()
        self._handle = None
        if self._divisor:
            self._buf.div_(self._divisor)
        if self._buf.data_ptr() != self._tensor.data_ptr():
            self._tensor.detach().copy_(self._buf)


class GlooBackend(_TorchBackend):
    """torch.distributed with Gloo: CPU tensors, TCP between processes."""

    name = "gloo"
    dist_backend = "gloo"
    ifname_var = "GLOO_SOCKET_IFNAME"


class NCCLBackend(_TorchBackend):
    """torch.distributed with NCCL: one GPU per rank, GPU tensors only."""

    name = "nccl"
    dist_backend = "nccl"
    ifname_var = "NCCL_SOCKET_IFNAME"

    def __init__(self, comm: Any = None, timeout: float = DEFAULT_TIMEOUT) -> None:
        from pcourse.backends import unavailable_reason

        reason = unavailable_reason("nccl")  # before any MPI call: fails fast, alone
        if reason:
            raise BackendUnavailable(f"backend 'nccl' cannot run here: {reason}")
        super().__init__(comm, timeout)

    def _pick_device(self, mpi: Any) -> torch.device:
        return local_gpu(mpi, "nccl")

    def barrier(self) -> None:
        self._live().barrier(device_ids=[self.device.index])


def local_gpu(mpi: Any, name: str) -> torch.device:
    """This rank's own GPU; BackendUnavailable on every rank if a host has too few.

    NCCL refuses two ranks on one GPU ("Duplicate GPU"), so each local rank needs
    its own device. The decision is allreduced so that all ranks raise together.
    """
    from mpi4py import MPI

    node = mpi.Split_type(MPI.COMM_TYPE_SHARED, key=mpi.Get_rank())
    local_rank, local_size = node.Get_rank(), node.Get_size()
    node.Free()
    ngpu = torch.cuda.device_count()
    short = mpi.allreduce(int(ngpu < local_size), op=MPI.MAX)
    if short:
        raise BackendUnavailable(
            f"backend {name!r} needs one GPU per rank: a host runs {local_size} ranks "
            f"here but has {ngpu} GPU(s); start at most one rank per GPU"
        )
    torch.cuda.set_device(local_rank)
    return torch.device("cuda", local_rank)


def rendezvous_address(mpi: Any, ifname_var: str) -> tuple[str, int]:
    """Rank 0's address and a free port, the same on every rank (broadcast over MPI)."""
    hosts = mpi.allgather(socket.gethostname())
    answer: tuple[str, int] | str = ("", 0)
    if mpi.Get_rank() == 0:
        try:
            answer = (_pick_address(len(set(hosts)) == 1, ifname_var), _pick_port())
        except (OSError, ValueError) as exc:
            answer = str(exc)
    answer = mpi.bcast(answer, root=0)
    if isinstance(answer, str):  # rank 0 failed: every rank raises the same error
        raise RuntimeError(f"torch.distributed rendezvous: {answer}")
    return answer


def _pick_address(one_host: bool, ifname_var: str) -> str:
    if os.environ.get("MASTER_ADDR"):
        return os.environ["MASTER_ADDR"]
    ifname = os.environ.get(ifname_var)
    if ifname:
        addr = interface_address(ifname)
        if addr:
            return addr
    if one_host:
        return "127.0.0.1"
    addr = socket.gethostbyname(socket.gethostname())
    if addr.startswith("127."):
        raise ValueError(
            f"this host's name resolves to {addr}, which other hosts cannot reach; "
            f"set MASTER_ADDR to rank 0's address or {ifname_var} to its interface"
        )
    return addr


def _pick_port() -> int:
    wanted = os.environ.get("MASTER_PORT")
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        try:
            s.bind(("", int(wanted) if wanted else 0))
        except OSError as exc:
            raise ValueError(
                f"MASTER_PORT={wanted} is already in use on rank 0's host ({exc.strerror}); "
                "unset MASTER_PORT to let rank 0 pick a free port, or choose another"
            ) from None
        # Closed again before torch's store binds it: a tiny window in which another
        # program could take it; the rendezvous would then fail within `timeout`.
        return s.getsockname()[1]


def interface_address(spec: str) -> str:
    """IPv4 address of the first interface matching an NCCL/Gloo-style name list.

    ``eth0,ib0`` lists names (NCCL treats them as prefixes, ``=eth0`` as exact);
    ``^docker`` excludes, which picks nothing here. Empty when nothing matches.
    """
    import fcntl
    import struct

    names = [n for _, n in socket.if_nameindex()]
    for item in spec.split(","):
        item = item.strip()
        if not item or item.startswith("^"):
            continue
        exact = item.startswith("=")
        item = item.lstrip("=")
        for name in names:
            if name == item or (not exact and name.startswith(item)):
                with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
                    try:
                        packed = fcntl.ioctl(s.fileno(), 0x8915,  # SIOCGIFADDR
                                             struct.pack("256s", name[:15].encode()))
                    except OSError:  # no IPv4 address on this interface
                        continue
                return socket.inet_ntoa(packed[20:24])
    return ""
