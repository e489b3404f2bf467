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

from pcourse.backends.base import Backend, BackendUnavailable, Work, check_avg_dtype, check_op

DEFAULT_TIMEOUT = 120.0  # seconds per collective (and for the rendezvous)

# torch.distributed has one default process group per process. The first backend
# creates it from the MPI rendezvous; every backend object then gets its *own* group
# on top of it with ``new_group``. So a re-run notebook cell simply makes another
# group, and gloo, nccl and an older gloo object can all live at once. The default
# group goes when the last backend that needed it is closed. Pass ``backend.group``
# to code that takes a process group (DDP's ``process_group=``).
_users = 0
_own_default = False
_address = ""


class _TorchBackend(Backend):
    dist_backend: str  # "gloo" or "nccl"
    ifname_var: str  # the environment variable naming the socket interface

    def __init__(self, comm: Any = None, timeout: float = DEFAULT_TIMEOUT) -> None:
        global _users
        import torch.distributed as dist
        from mpi4py import MPI

        self._dist = dist
        self.timeout = timeout
        self.group = None
        mpi = (MPI.COMM_WORLD if comm is None else comm).Dup()
        try:
            self.rank, self.size = mpi.Get_rank(), mpi.Get_size()
            self.device = self._pick_device(mpi)
            _ensure_default_group(mpi, self.ifname_var, timeout)
        finally:
            mpi.Free()
        self.group = dist.new_group(backend=self.dist_backend,
                                    timeout=timedelta(seconds=timeout))
        _users += 1
        self.address = _address  # where the ranks met (host:port of rank 0's store)

    def _pick_device(self, mpi: Any) -> torch.device:
        return torch.device("cpu")

    def _live(self) -> Any:
        if self.group is None:
            raise RuntimeError(f"this {self.name} backend was closed; create a new one")
        return self.group

    def allreduce(self, tensor: torch.Tensor, op: str = "sum") -> torch.Tensor:
        self.allreduce_async(tensor, op).wait()
        return tensor

    def allreduce_async(self, tensor: torch.Tensor, op: str = "sum") -> Work:
        check_op(op)
        check_avg_dtype(tensor, op)
        group = self._live()
        native_avg = op == "avg" and self.dist_backend == "nccl"
        buf = tensor.detach() if tensor.is_contiguous() else tensor.detach().contiguous()
        handle = self._dist.all_reduce(buf, op=self._reduce_op(op, native_avg), group=group,
                                       async_op=True)
        divide = op == "avg" and not native_avg
        return _TorchWork(handle, tensor, buf, self.size if divide else 0)

    def broadcast(self, tensor: torch.Tensor, root: int = 0) -> torch.Tensor:
        buf = tensor.detach() if tensor.is_contiguous() else tensor.detach().contiguous()
        self._dist.broadcast(buf, src=root, group=self._live())
        if buf.data_ptr() != tensor.data_ptr():
            tensor.detach().copy_(buf)
        return tensor

    def barrier(self) -> None:
        self._dist.barrier(group=self._live())

    def close(self) -> None:
        global _users, _own_default
        if self.group is None:
            return
        # Ranks that tear Gloo down while a peer is still finishing its last
        # collective can abort ("terminate called without an active exception"):
        # meet first, so every rank leaves together (bounded by the group timeout).
        try:
            self._dist.barrier(group=self.group)
        except Exception:  # noqa: BLE001 - a dead peer must not stop us releasing ours
            pass
        self._dist.destroy_process_group(self.group)
        self.group = None
        _users -= 1
        if _users == 0 and _own_default and self._dist.is_initialized():
            self._dist.destroy_process_group()  # a later backend meets afresh
            _own_default = False

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
        self._dist.barrier(group=self._live(), device_ids=[self.device.index])


def local_gpu(mpi: Any, name: str) -> torch.device:
    """This rank's own GPU; BackendUnavailable on every rank if two ranks share one.

    NCCL refuses two ranks on one GPU ("Duplicate GPU"). Local rank i takes GPU
    i mod (visible GPUs), as ``init_rank`` does; the GPUs' UUIDs are then compared
    across ranks, which also works when a launcher gives each rank its own
    CUDA_VISIBLE_DEVICES. The decision is collective, so all ranks raise together.
    """
    from mpi4py import MPI

    node = mpi.Split_type(MPI.COMM_TYPE_SHARED, key=mpi.Get_rank())
    local_rank, local_size = node.Get_rank(), node.Get_size()
    node.Free()
    ngpu = torch.cuda.device_count()
    index = local_rank % max(ngpu, 1)
    uuid = str(getattr(torch.cuda.get_device_properties(index), "uuid", index)) if ngpu else ""
    everyone = mpi.allgather((socket.gethostname(), uuid))
    # Every rank sees the same list, so every rank takes the same decision.
    crowded = sorted({h for h, u in everyone if u == "" or everyone.count((h, u)) > 1})
    if crowded:
        raise BackendUnavailable(
            f"backend {name!r} needs one GPU per rank, but ranks on {', '.join(crowded)} "
            f"would share a GPU or have none (this host: {local_size} ranks, {ngpu} GPUs); "
            "start at most one rank per GPU"
        )
    torch.cuda.set_device(index)
    return torch.device("cuda", index)


def _ensure_default_group(mpi: Any, ifname_var: str, timeout: float) -> None:
    """Initialise torch's default group from the MPI rendezvous, unless it exists.

    Collective: every rank reports its state first, so that a mix (initialised on
    some ranks only, or with other ranks) is an error on all ranks, not a hang.
    """
    global _own_default, _address
    import torch.distributed as dist

    here = dist.is_initialized()
    fits = not here or (dist.get_rank(), dist.get_world_size()) == (mpi.Get_rank(),
                                                                    mpi.Get_size())
    states = mpi.allgather((here, fits))
    if all(h for h, _ in states) and all(f for _, f in states):
        return
    if any(h for h, _ in states):
        raise RuntimeError(
            "torch.distributed is already initialised on some ranks, or with other ranks "
            "than this MPI job; call torch.distributed.destroy_process_group() on every "
            "rank, then create the backend again"
        )
    addr, port = rendezvous_address(mpi, ifname_var)
    # CPU tensors on the default group go through Gloo, CUDA tensors through NCCL
    # (created lazily, on first use), so code such as DDP that uses the default
    # group works on either device; our backends use their own groups.
    kind = "cpu:gloo,cuda:nccl" if torch.cuda.is_available() and dist.is_nccl_available() \
        else "gloo"
    dist.init_process_group(kind, init_method=f"tcp://{addr}:{port}", rank=mpi.Get_rank(),
                            world_size=mpi.Get_size(), timeout=timedelta(seconds=timeout))
    _own_default, _address = True, f"{addr}:{port}"


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
        # As torch's store does: a port whose old connections linger in TIME_WAIT
        # (a re-created backend on the same MASTER_PORT) is free; a listener is not.
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
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
