"""Gloo and NCCL through torch.distributed (lesson 04).

torch.distributed needs every process to know its rank, the world size, and where to
meet (a TCP "store" run by rank 0). A backend finds them in the first of these that
applies:

1. ``comm`` is a torch.distributed process group: the backend runs on that group.
2. No ``comm``, not launched by mpiexec, and torch.distributed is set up already or
   torchrun's variables are set: torch's own default group (``env://`` under torchrun).
   So the backends work under ``torchrun`` and ``torch.multiprocessing`` without MPI.
3. Otherwise MPI (``comm``, default COMM_WORLD) gives rank and size, and rank 0 opens
   the store and broadcasts where it is (:func:`rendezvous`):

   - address: ``MASTER_ADDR`` if set; else the address of the interface named by
     ``GLOO_SOCKET_IFNAME`` / ``NCCL_SOCKET_IFNAME``; else 127.0.0.1 when every rank
     runs on this host; else this host's resolvable address.
   - port: ``MASTER_PORT`` if set (it must be free); else a free port the operating
     system picks. The source hard-codes 29500, which breaks as soon as two people
     (or two notebooks) share a machine.

   Rank 0 listens on that address only, and every rank learns whether the store
   opened, so a bad ``MASTER_PORT`` is the same error on every rank, not a hang.

Nothing listens beyond this machine unless a run asks for it: when the meeting
address is a loopback address, Gloo and NCCL bind to the loopback interface too,
unless ``GLOO_SOCKET_IFNAME`` / ``NCCL_SOCKET_IFNAME`` name another (lesson 09). The
default group on a CUDA machine is ``cpu:gloo,cuda:nccl``, half of each, so its
rendezvous sets both.

Every collective has a deadline: ``timeout`` (default:
:func:`pcourse.backends.base.collective_timeout`) is the process group's timeout,
after which a stuck collective raises instead of hanging. Gloo's collectives are
waited for in short slices, so that an interrupt stops the wait between two; the
NCCL barrier, the one NCCL wait that blocks the CPU, is polled likewise. NCCL's
groups are made with ``TORCH_NCCL_ASYNC_ERROR_HANDLING=2`` unless it is set: torch's
default (3) ends the whole process when a collective times out, which would kill a
notebook's engine instead of raising in it.

At one rank the NCCL backend runs too (one GPU is the common machine): it then
checks the plumbing (device, stream, dtypes, the group), not a reduction across GPUs.
"""

from __future__ import annotations

import ipaddress
import os
import socket
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from datetime import timedelta
from typing import Any

import torch

from pcourse.backends.base import (
    AsyncBackend,
    BackendUnavailable,
    Pending,
    Work,
    collective_timeout,
    divides_first,
    private_comm,
)
from pcourse.cluster.rankinfo import gpu_for, launcher, mpi_local_rank, use_gpu

# How long one blocking wait for a Gloo collective lasts: Python runs the handler of an
# interrupt only between two, so this is how late the stop button can be.
_SLICE = timedelta(milliseconds=50)
IFNAME_VARS = ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME")
# torch reads it when it makes an NCCL group: 2 aborts the communicator on an error or
# a timeout and raises in the waiting thread; torch's default (3) ends the process.
NCCL_ERROR_HANDLING = ("TORCH_NCCL_ASYNC_ERROR_HANDLING", "2")

# torch.distributed has one default process group per process. The first backend that
# needs it creates it; every backend object then gets its *own* group on top of it with
# ``new_group``. So a re-run notebook cell simply makes another group, and gloo, nccl
# and an older gloo object can all live at once. The default group goes when the last
# backend that needed it is closed, if a backend created it. Pass ``backend.group`` to
# code that takes a process group (DDP's ``process_group=``).
_users = 0
_own_default = False
_address = ""  # host:port of the default group's store, where the ranks met
_kept: list[Any] = []  # groups with a collective given up on mid-way (see close)


class _TorchBackend(AsyncBackend):
    dist_backend: str  # "gloo" or "nccl"
    ifname_var: str  # the environment variable naming the socket interface

    def __init__(self, comm: Any = None, *, device: str | torch.device | None = None,
                 timeout: float | None = None) -> None:
        global _users
        import torch.distributed as dist

        self._dist = dist
        self.timeout = collective_timeout(timeout)  # also the rendezvous's
        self.group = None
        self._given_up: Any = None  # the collective's handle a wait gave up on
        self._owns_group = not isinstance(comm, dist.ProcessGroup)
        if not self._owns_group:  # 1. the caller's group, used as it is
            self.rank, self.size = dist.get_rank(comm), dist.get_world_size(comm)
            self.device = self._pick_device(device, None)
            self.group, self.address = comm, _address
            return
        if comm is None and launcher() != "mpi" and (dist.is_initialized()
                                                     or launcher() == "torchrun"):
            self._from_torch(device)  # 2. torchrun, torch.multiprocessing
        else:
            self._from_mpi(comm, device)  # 3. the MPI bootstrap
        self.address = _address
        with socket_ifname(self.ifname_var, _is_loopback(_address.rpartition(":")[0])), \
                _nccl_error_handling():
            self.group = dist.new_group(backend=self.dist_backend,
                                        timeout=timedelta(seconds=self.timeout))
            _users += 1
            self._connect()

    def _from_torch(self, device: str | torch.device | None) -> None:
        global _own_default, _address
        dist = self._dist
        if not dist.is_initialized():
            master = os.environ.get("MASTER_ADDR", "")
            with socket_ifname(IFNAME_VARS, _is_loopback(master)), _nccl_error_handling():
                dist.init_process_group(_default_kind(), init_method="env://",
                                        timeout=timedelta(seconds=self.timeout))
            _own_default = True
            _address = f"{master}:{os.environ.get('MASTER_PORT', '')}"
        self.rank, self.size = dist.get_rank(), dist.get_world_size()
        self.device = self._pick_device(device, None)

    def _from_mpi(self, comm: Any, device: str | torch.device | None) -> None:
        mpi = private_comm(comm, self.name)
        try:
            self.rank, self.size = mpi.Get_rank(), mpi.Get_size()
            self.device = self._pick_device(device, mpi)
            _ensure_default_group(mpi, self.ifname_var, self.timeout)
        finally:
            mpi.Free()

    def _pick_device(self, device: str | torch.device | None, mpi: Any) -> torch.device:
        if device is not None and torch.device(device).type != "cpu":
            raise ValueError(f"{self.name} reduces CPU tensors; got device={device!r}")
        return torch.device("cpu")

    def _connect(self) -> None:
        """Open the group's connections now, while the socket interface is chosen."""
        return None  # Gloo connects when the group is made

    def _live(self) -> Any:
        if self.group is None:
            raise RuntimeError(f"this {self.name} backend was closed; create a new one")
        self._check_in_step()
        return self.group

    def _wait(self, handle: Any, what: str, poll: bool = False) -> None:
        """Wait for a collective torch started; an interrupt stops a Gloo wait.

        ``poll``: for a wait that blocks the CPU (NCCL's barrier), ask until it is done,
        so an interrupt stops it too, and CollectiveTimeout after the backend's timeout.
        """

        def wait() -> None:
            if poll:
                _poll_work(handle, self.timeout, what)
            else:
                _wait_work(handle, self.dist_backend == "gloo")

        try:
            self._wait_for(wait, what)
        except BaseException:
            self._given_up = handle  # close() must know whether it still runs
            raise

    def allreduce_async(self, tensor: torch.Tensor, op: str = "sum", *,
                        check: bool = True) -> Work:
        self._agree(tensor, check, op=op)
        group = self._live()
        native_avg = op == "avg" and self.dist_backend == "nccl"
        buf = tensor.detach() if tensor.is_contiguous() else tensor.detach().contiguous()
        first = not native_avg and divides_first(buf, op)
        if first:
            buf.div_(self.size)
        handle = self._dist.all_reduce(buf, op=self._reduce_op(op, native_avg), group=group,
                                       async_op=True)
        divide = self.size if op == "avg" and not native_avg and not first else 0

        def finish() -> None:
            if divide:
                buf.div_(divide)
            _copy_back(tensor, buf)

        return Pending(lambda: self._wait(handle, "allreduce"), finish, keep=(tensor, buf),
                       test=handle.is_completed)

    def broadcast(self, tensor: torch.Tensor, root: int = 0, *,
                  check: bool = True) -> torch.Tensor:
        self._agree(tensor, check, root=root)
        buf = tensor.detach() if tensor.is_contiguous() else tensor.detach().contiguous()
        # torch names the root by its rank in the default group; ours may be a subgroup.
        src = self._dist.get_global_rank(self._live(), root)
        self._wait(self._dist.broadcast(buf, src=src, group=self._live(), async_op=True),
                   "broadcast")
        _copy_back(tensor, buf)
        return tensor

    def barrier(self) -> None:
        self._wait(self._dist.barrier(group=self._live(), async_op=True), "barrier")

    def close(self) -> None:
        global _users, _own_default
        if self.group is None:
            return
        if not self._owns_group:  # the caller's group: the caller closes it
            self.group = None
            return
        if self._given_up is not None and not self._given_up.is_completed():
            # A collective this rank stopped waiting for still runs, and whatever frees
            # its group waits for it to fail (up to the timeout), so the group is kept
            # for the process's life, and the default group with it.
            _kept.append(self.group)
            self.group = None
            return
        if not self._gave_up:
            # Ranks that tear Gloo down while a peer is still finishing its last
            # collective can abort ("terminate called without an active exception"):
            # meet first, so every rank leaves together (bounded by the group timeout).
            try:
                self.barrier()
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

    # ---------------------------------------------------- sharding (lesson 10)
    def reduce_scatter(self, output: torch.Tensor, input: torch.Tensor, op: str = "sum", *,
                       check: bool = True) -> torch.Tensor:
        """torch.distributed's ``reduce_scatter_tensor``, waited for like allreduce."""
        self._agree_blocks("reduce_scatter", output, input, check, op)
        group = self._live()
        native_avg = op == "avg" and self.dist_backend == "nccl"
        # torch 2.13 renamed reduce_scatter_tensor to reduce_scatter_single
        reduce_scatter = getattr(self._dist, "reduce_scatter_single", None) \
            or self._dist.reduce_scatter_tensor
        handle = reduce_scatter(
            output.detach(), input.detach(), op=self._reduce_op(op, native_avg), group=group,
            async_op=True)
        self._wait(handle, "reduce_scatter")
        if op == "avg" and not native_avg:
            output.detach().div_(self.size)
        return output

    def all_gather(self, output: torch.Tensor, input: torch.Tensor, *,
                   check: bool = True) -> torch.Tensor:
        """torch.distributed's ``all_gather_into_tensor``, waited for like allreduce."""
        self._agree_blocks("all_gather", output, input, check, None)
        all_gather = getattr(self._dist, "all_gather_single", None) \
            or self._dist.all_gather_into_tensor  # the name before torch 2.13
        handle = all_gather(output.detach(), input.detach(), group=self._live(), async_op=True)
        self._wait(handle, "all_gather")
        return output


def _wait_work(handle: Any, in_slices: bool) -> None:
    """``handle.wait()``; in slices, so that Python can run an interrupt's handler between.

    Only for Gloo: NCCL's wait does not block the CPU, it only orders the CUDA stream.
    """
    if not in_slices:
        handle.wait()
        return
    while True:
        try:
            handle.wait(timeout=_SLICE)  # returns as soon as the collective is done
            return
        except RuntimeError:
            if handle.is_completed():
                # The slice ended, and the collective is done: it may have completed
                # just as the slice timed out, so this error may be the slice's. A
                # wait on a completed collective returns, or raises its own error.
                handle.wait()
                return


def _poll_work(handle: Any, timeout: float, what: str) -> None:
    """Wait for ``handle`` by asking whether it is done, interruptibly, at most ``timeout`` s.

    For a torch collective whose ``wait()`` blocks the CPU without a way to interrupt
    it (the NCCL barrier); ``is_completed()`` only asks, and is also true once the
    collective failed (timed out, aborted). The final wait returns at once, or raises
    the collective's error: with a timeout, since NCCL's ``wait()`` without one and
    without TORCH_NCCL_BLOCKING_WAIT does not look for an error at all.
    """
    from pcourse.cluster.interrupts import wait_until

    wait_until(handle.is_completed, timeout, what)
    handle.wait(timeout=_SLICE)


def _copy_back(tensor: torch.Tensor, buf: torch.Tensor) -> None:
    """Where a contiguous copy was reduced in place of ``tensor``, copy the result back."""
    if buf.data_ptr() != tensor.data_ptr():
        tensor.detach().copy_(buf)


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
    needs_gpu = True

    def __init__(self, comm: Any = None, *, device: str | torch.device | None = None,
                 timeout: float | None = None) -> None:
        from pcourse.backends import unavailable_reason

        reason = unavailable_reason("nccl")  # before any communication: fails fast, alone
        if reason:
            raise BackendUnavailable(f"backend 'nccl' cannot run here: {reason}")
        super().__init__(comm, device=device, timeout=timeout)

    def _pick_device(self, device: str | torch.device | None, mpi: Any) -> torch.device:
        return pick_gpu(self.name, device, mpi)

    def _check_tensor(self, tensor: torch.Tensor, op: str | None) -> None:
        if tensor.device != self.device:
            raise ValueError(f"nccl works on tensors on {self.device}, got one on "
                             f"{tensor.device}; move it with .to({str(self.device)!r})")

    def _connect(self) -> None:
        # NCCL opens its sockets at the first collective: make that happen here.
        self.barrier()

    def barrier(self) -> None:
        # Its wait blocks the CPU until the GPU has done it: polled, so an interrupt or
        # the deadline ends it.
        self._wait(self._dist.barrier(group=self._live(), async_op=True,
                                      device_ids=[self.device.index]), "barrier", poll=True)


def pick_gpu(name: str, device: str | torch.device | None, mpi: Any) -> torch.device:
    """The GPU backend ``name`` uses on this rank, made the current device.

    ``device`` if given; else, bootstrapped from MPI, the GPU of the local rank with
    every rank checking that no two share one (:func:`local_gpu`); else torchrun's
    ``LOCAL_RANK``, or the device the caller made current.
    """
    if device is not None:
        dev = torch.device(device)
        if dev.type != "cuda":
            raise ValueError(f"{name} runs on GPUs; got device={device!r}")
        index = torch.cuda.current_device() if dev.index is None else dev.index
    elif mpi is not None:
        return local_gpu(mpi.allgather, mpi_local_rank(mpi)[0], name)
    elif "LOCAL_RANK" in os.environ:
        index = gpu_for(int(os.environ["LOCAL_RANK"]))
    else:
        index = torch.cuda.current_device()
    use_gpu(index)
    return torch.device("cuda", index)


def local_gpu(allgather: Callable[[Any], list], local_rank: int, name: str) -> torch.device:
    """This rank's own GPU; BackendUnavailable on every rank if two ranks share one.

    NCCL refuses two ranks on one GPU ("Duplicate GPU"). Local rank i takes GPU
    :func:`~pcourse.cluster.rankinfo.gpu_for` (i); the GPUs' UUIDs are then compared
    across ranks (``allgather``), which also works when a launcher gives each rank
    its own CUDA_VISIBLE_DEVICES. The decision is collective, so all ranks raise together.
    """
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
    use_gpu(index)
    return torch.device("cuda", index)


def _default_kind() -> str:
    # CPU tensors on the default group go through Gloo, CUDA tensors through NCCL
    # (created lazily, on first use), so code such as DDP that uses the default
    # group works on either device; our backends use their own groups.
    import torch.distributed as dist

    return "cpu:gloo,cuda:nccl" if torch.cuda.is_available() and dist.is_nccl_available() \
        else "gloo"


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
    store, address = rendezvous(mpi, ifname_var, timeout)
    # The default group may be cpu:gloo,cuda:nccl: both libraries bind sockets.
    with socket_ifname(IFNAME_VARS, _is_loopback(address.rpartition(":")[0])), \
            _nccl_error_handling():
        _everyone(mpi, lambda: dist.init_process_group(
            _default_kind(), store=store, rank=mpi.Get_rank(), world_size=mpi.Get_size(),
            timeout=timedelta(seconds=timeout)))
    _own_default, _address = True, address


def rendezvous(mpi: Any, ifname_var: str, timeout: float) -> tuple[Any, str]:
    """Rank 0 opens the store; every rank gets a client of it and its ``host:port``.

    Rank 0's failure (a busy or invalid MASTER_PORT, an address it cannot listen on)
    is broadcast, and a rank that cannot reach the store says so to all the others:
    every rank raises the same error.
    """
    from torch.distributed import TCPStore

    _everyone(mpi, lambda: _check_interface(ifname_var))
    hosts = mpi.allgather(socket.gethostname())
    answer: tuple[str, int] | str = ("", 0)
    store = None
    if mpi.Get_rank() == 0:
        try:
            addr = _pick_address(len(set(hosts)) == 1, ifname_var)
            listener = _pick_port(addr)
            port = listener.getsockname()[1]
            try:
                store = TCPStore(addr, port, mpi.Get_size(), True, timedelta(seconds=timeout),
                                 wait_for_workers=False, master_listen_fd=listener.fileno())
            except BaseException:
                listener.close()
                raise
            listener.detach()  # the store owns the socket now, and closes it
            answer = (addr, port)
        except Exception as exc:  # noqa: BLE001 - whatever it is, every rank must hear it
            answer = str(exc)
    answer = mpi.bcast(answer, root=0)
    if isinstance(answer, str):
        raise RuntimeError(f"torch.distributed rendezvous: {answer}")
    addr, port = answer
    if store is None:
        store = _everyone(mpi, lambda: TCPStore(addr, port, mpi.Get_size(), False,
                                                 timedelta(seconds=timeout)))
    else:
        _everyone(mpi, lambda: None)
    return store, f"{addr}:{port}"


def _everyone(mpi: Any, step: Callable[[], Any]) -> Any:
    """Run ``step`` on every rank; if it fails on any, raise on all, naming the ranks."""
    try:
        result, error = step(), ""
    except Exception as exc:  # noqa: BLE001 - reported to every rank below
        result, error = None, f"{type(exc).__name__}: {exc}"
    errors = mpi.allgather(error)
    failed = [f"rank {r}: {e}" for r, e in enumerate(errors) if e]
    if failed:
        raise RuntimeError("torch.distributed rendezvous failed on " + "; ".join(failed))
    return result


def _check_interface(ifname_var: str) -> None:
    """A named interface that does not exist here fails now, on every rank, not mid-connect."""
    spec = os.environ.get(ifname_var, "")
    if sys.platform != "linux" or not spec or spec.startswith("^"):
        return  # the address lookup below is Linux's; exclusions name no interface
    if not interface_address(spec):
        raise ValueError(f"{ifname_var}={spec} names no interface with an IPv4 address on "
                         f"{socket.gethostname()}; see `ip -o -4 addr` for the names there")


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


def _pick_port(addr: str) -> socket.socket:
    """A socket listening on ``addr``: on MASTER_PORT if set, else on a free port.

    The store takes this very socket over, so no other program can take the port
    between choosing and listening.
    """
    wanted = os.environ.get("MASTER_PORT", "")
    port = int(wanted) if wanted.isdigit() else -1 if wanted else 0
    if not 0 <= port <= 65535 or (wanted and port == 0):
        raise ValueError(f"MASTER_PORT={wanted} is not a port number (1 to 65535); unset it "
                         "to let rank 0 pick a free port, or choose another")
    family = socket.AF_INET6 if ":" in addr else socket.AF_INET
    s = socket.socket(family, socket.SOCK_STREAM)
    # As torch's store does: a port whose old connections linger in TIME_WAIT
    # (a re-created backend on the same MASTER_PORT) is free; a listener is not.
    s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        s.bind((addr, port))
        s.listen()
    except OSError as exc:
        s.close()
        if wanted:
            raise ValueError(
                f"MASTER_PORT={wanted} is already in use on rank 0's host ({exc.strerror}); "
                "unset MASTER_PORT to let rank 0 pick a free port, or choose another"
            ) from None
        raise ValueError(f"rank 0 cannot listen on {addr} ({exc.strerror}); MASTER_ADDR "
                         "must be an address of rank 0's host") from None
    return s


def _is_loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(socket.gethostbyname(host)).is_loopback
    except (OSError, ValueError):
        return False


@contextmanager
def socket_ifname(var: str | tuple[str, ...], loopback: bool) -> Iterator[None]:
    """With ``loopback``, Gloo/NCCL bind to the loopback interface unless ``var`` names one.

    ``var`` is one variable or several (the default group ``cpu:gloo,cuda:nccl`` needs
    both, each left alone where it is set). The libraries read them when they open
    their sockets, so they are set only for that moment and the process's environment
    is left as it was.
    """
    names = (var,) if isinstance(var, str) else var
    unset = [v for v in names if not os.environ.get(v)] if loopback else []
    with _env(dict.fromkeys(unset, "lo0" if sys.platform == "darwin" else "lo")):
        yield


@contextmanager
def _nccl_error_handling() -> Iterator[None]:
    """:data:`NCCL_ERROR_HANDLING` while a group is made, unless the user set the variable."""
    var, value = NCCL_ERROR_HANDLING
    with _env({} if os.environ.get(var) else {var: value}):
        yield


@contextmanager
def _env(values: dict[str, str]) -> Iterator[None]:
    """Environment variables ``values`` (unset before) inside the block, unset after."""
    os.environ.update(values)
    try:
        yield
    finally:
        for var in values:
            os.environ.pop(var, None)


def interface_address(spec: str) -> str:
    """IPv4 address of the first interface matching an NCCL/Gloo-style name list.

    ``eth0,ib0`` lists names (NCCL treats them as prefixes, ``=eth0`` as exact);
    ``^docker`` excludes, which picks nothing here. Empty when nothing matches.
    """
    import psutil

    ipv4 = {name: [a.address for a in addrs if a.family == socket.AF_INET]
            for name, addrs in psutil.net_if_addrs().items()}
    for item in spec.split(","):
        item = item.strip()
        if not item or item.startswith("^"):
            continue
        exact = item.startswith("=")
        item = item.lstrip("=")
        for name, addresses in ipv4.items():
            if addresses and (name == item or (not exact and name.startswith(item))):
                return addresses[0]
    return ""
