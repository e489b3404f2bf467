"""Where torch.distributed's ranks meet: the default group, bootstrapped from MPI.

torch.distributed needs every process to know its rank, the world size, and where to
meet (a TCP "store" run by rank 0). Under ``mpiexec``, MPI gives rank and size, and
rank 0 opens the store and broadcasts where it is (:func:`rendezvous`):

- address: ``MASTER_ADDR`` if set; else the address of the interface named by
  ``GLOO_SOCKET_IFNAME`` / ``NCCL_SOCKET_IFNAME``; else 127.0.0.1 when every rank
  runs on this host; else this host's resolvable address.
- port: ``MASTER_PORT`` if set (it must be free); else a free port the operating
  system picks. The source hard-codes 29500, which breaks as soon as two people
  (or two notebooks) share a machine.

Rank 0 listens on that address only, and every rank learns whether the store
opened, so a bad ``MASTER_PORT`` is the same error on every rank, not a hang. Under
torchrun (or with torch.distributed set up already) torch's own ``env://`` meeting is
used instead (:func:`from_env`).

Nothing listens beyond this machine unless a run asks for it: when the meeting
address is a loopback address, Gloo and NCCL bind to the loopback interface too,
unless ``GLOO_SOCKET_IFNAME`` / ``NCCL_SOCKET_IFNAME`` name another (lesson 09). The
default group on a CUDA machine is ``cpu:gloo,cuda:nccl``, half of each, so its
rendezvous sets both. NCCL's groups are made with ``TORCH_NCCL_ASYNC_ERROR_HANDLING=2``
unless it is set: torch's default (3) ends the whole process when a collective times
out, which would kill a notebook's engine instead of raising in it (:func:`binding`).

torch.distributed has one default process group per process. The first backend that
needs it creates it (here), over the ranks of its communicator (the whole job unless
it was given a part of it); every backend object then gets its *own* group on top of
it with ``new_group``, so a re-run notebook cell simply makes another group. The
default group goes when the last backend that needed it lets go (:func:`release`), if
it was made here.

**The rule for groups** (:func:`groups_for`). A backend may run on any part of the
default group's ranks, and backends of different membership may live at once (a
tensor-parallel and a data-parallel group). torch names a group by counting the
groups made in its process, so every rank of the default group makes *every* group,
in the same order, members or not. Making a torch backend is therefore collective
over every rank of the default group: each rank passes its own communicator (its
part: ``comm.Split``; a rank in no part passes ``MPI.COMM_SELF``), the ranks swap
who is in which part, and each makes all the parts' groups, in one order, keeping
its own. Make the first torch backend of a process over the whole job (the default)
when parts of it will follow: :class:`pcourse.mesh.Mesh` does. A rank that does not
come within the timeout is an error on the others, not a hang. (torch's other mode,
``use_local_synchronization``, involves only the members, but names a group by its
ranks and the count of live groups in each process: a re-made or re-run group can
clash with a live one, and processes with different histories disagree on names.)
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

from pcourse.agree import everyone

IFNAME_VARS = ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME")
# torch reads it when it makes an NCCL group: 2 aborts the communicator on an error or
# a timeout and raises in the waiting thread; torch's default (3) ends the process.
NCCL_ERROR_HANDLING = ("TORCH_NCCL_ASYNC_ERROR_HANDLING", "2")

_users = 0  # backends standing on the default group
_own_default = False  # whether the default group was made here
_address = ""  # host:port of the default group's store, where the ranks met
_default_comm: Any = None  # a duplicate of the MPI communicator the default group was made on
_out_of_step = ""  # why the default group's ranks no longer make groups in one order


def address() -> str:
    """``host:port`` where this process's ranks met ("" before they did)."""
    return _address


@contextmanager
def binding(ifname_var: str | tuple[str, ...] = IFNAME_VARS,
            where: str | None = None) -> Iterator[None]:
    """Inside: groups made bind like the meeting point ``where`` (``host:port``; default:
    where the ranks met), so loopback stays loopback, and an NCCL group raises on a
    timeout rather than ending the process."""
    host = (_address if where is None else where).rpartition(":")[0]
    with socket_ifname(ifname_var, _is_loopback(host)), _nccl_error_handling():
        yield


def joined() -> None:
    """A backend now stands on the default group."""
    global _users
    _users += 1


def release() -> None:
    """A backend let go of the default group; the last one destroys it, if made here."""
    global _users, _own_default, _default_comm, _out_of_step
    import torch.distributed as dist

    _users -= 1
    if _users == 0 and _own_default and dist.is_initialized():
        dist.destroy_process_group()  # a later backend meets afresh
        _own_default, _out_of_step = False, ""
        if _default_comm is not None:
            _default_comm.Free()
            _default_comm = None


def from_env(timeout: float) -> None:
    """torch's own default group: as it is, or from torchrun's ``env://`` variables."""
    global _own_default, _address
    import torch.distributed as dist

    if dist.is_initialized():
        return
    where = f"{os.environ.get('MASTER_ADDR', '')}:{os.environ.get('MASTER_PORT', '')}"
    with binding(where=where):
        dist.init_process_group(_default_kind(), init_method="env://",
                                timeout=timedelta(seconds=timeout))
    _own_default, _address = True, where


def _default_kind() -> str:
    # CPU tensors on the default group go through Gloo, CUDA tensors through NCCL
    # (created lazily, on first use), so code such as DDP that uses the default
    # group works on either device; our backends use their own groups.
    import torch.distributed as dist

    return "cpu:gloo,cuda:nccl" if torch.cuda.is_available() and dist.is_nccl_available() \
        else "gloo"


def groups_for(mpi: Any, ifname_var: str, timeout: float) -> tuple[list[list[int]], int]:
    """The groups every rank of torch's default group makes now, and which is this rank's.

    ``mpi``: the communicator of this rank's backend. Makes the default group over
    ``mpi`` first if there is none. Each group is the default-group ranks of one
    communicator's members, in that communicator's rank order; every rank makes all of
    them, in the order returned (the module docstring's rule). Collective over every
    rank of the default group, each passing its own communicator.
    """
    import torch.distributed as dist

    here = dist.is_initialized()
    mine = (here, _address, dist.get_rank() if here else -1,
            dist.get_world_size() if here else 0)
    states = mpi.allgather(mine)
    if not any(h for h, *_ in states):
        ensure_default_group(mpi, ifname_var, timeout)
        states = [(True, _address, r, mpi.Get_size()) for r in range(mpi.Get_size())]
    elif not all(h for h, *_ in states) or len({(a, n) for _, a, _, n in states}) > 1:
        raise RuntimeError(
            "torch.distributed's default group differs between the ranks of this "
            "communicator (made on some only, or by other ranks): call "
            "torch.distributed.destroy_process_group() on every rank, then create the backend "
            "again, first over the whole job if parts of it will follow (the module "
            "pcourse.backends.bootstrap says why)")
    members = [r for _, _, r, _ in states]  # default-group ranks, in mpi's rank order
    everyone = _default_comm
    if everyone is None:  # not made here: usable only where it is exactly these ranks
        if members != list(range(mpi.Get_size())) or states[0][3] != mpi.Get_size():
            raise RuntimeError(
                "torch.distributed was initialised outside the course with other ranks than "
                "this communicator's; call torch.distributed.destroy_process_group() on every "
                "rank, then create the backend again")
        everyone = mpi
    return _swap_parts(everyone, members, timeout)


def _swap_parts(everyone: Any, members: list[int], timeout: float) -> tuple[list[list[int]], int]:
    """Every rank of ``everyone`` (the default group's communicator) says who is in its
    part; the distinct parts in one order, and the index of this rank's. Each rank's row
    holds, for default-group rank j, 1 + j's rank in the part (0: not in it)."""
    import numpy as np

    from pcourse.runtime.waits import wait_request

    global _out_of_step
    if _out_of_step:
        raise RuntimeError(f"no torch backend can be made on part of the job here: {_out_of_step}"
                           "; the ranks are out of step: close every torch backend on every rank "
                           "(or restart the engines)")
    size = everyone.Get_size()
    row = np.zeros(size, dtype=np.int64)
    row[members] = np.arange(1, len(members) + 1)
    rows = np.empty((size, size), dtype=np.int64)
    try:
        wait_request(everyone.Iallgather(row, rows), timeout,
                     f"making a torch.distributed group (collective over all {size} ranks of "
                     "the default group, each passing its own communicator)")
    except BaseException as exc:
        _out_of_step = f"a rank did not come to make a group ({exc})"
        raise
    parts = sorted({tuple(int(j) for j in np.argsort(r)[np.sort(r) > 0]) for r in rows})
    if sum(len(p) for p in parts) != len({j for p in parts for j in p}):
        raise RuntimeError(f"the ranks passed overlapping communicators {parts} (default-group "
                           "ranks) to one torch backend: each rank passes its own part (Split)")
    return [list(p) for p in parts], parts.index(tuple(members))


def ensure_default_group(mpi: Any, ifname_var: str, timeout: float) -> None:
    """Initialise torch's default group over ``mpi``'s ranks from the MPI rendezvous.

    Collective over ``mpi``; every rank of it has none (:func:`groups_for` checks).
    """
    global _own_default, _address, _default_comm
    import torch.distributed as dist

    store, where = rendezvous(mpi, ifname_var, timeout)
    with binding(where=where):  # the default group may be cpu:gloo,cuda:nccl: both bind
        _everyone(mpi, lambda: dist.init_process_group(
            _default_kind(), store=store, rank=mpi.Get_rank(), world_size=mpi.Get_size(),
            timeout=timedelta(seconds=timeout)))
    _own_default, _address, _default_comm = True, where, mpi.Dup()


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
    return everyone(mpi, step, "torch.distributed rendezvous")


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
