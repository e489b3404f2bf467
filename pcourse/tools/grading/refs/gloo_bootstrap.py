"""Exercise 04, bootstrap torch.distributed (Gloo) from MPI: ``init_gloo(comm, timeout_s)``.

Its ranks open sockets to each other, so under the grader its learner processes share one
jail (a network: :data:`NETWORKED`), still apart from the ranks that make and count their
MPI calls. The group is started once per world size and version of the learner's code
(:func:`~pcourse.tools.grading.checks.once`), and its three checks read that one start.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import numpy as np
import torch

from pcourse.runtime import private
from pcourse.tools.grading.checks import (
    Check,
    Contract,
    Learner,
    at_sizes,
    checker,
    once,
    per_rank,
    run,
)
from pcourse.tools.grading.trials import CountingComm, reports_calls, world

INIT = Learner("init_gloo")
NETWORKED = True  # the learner processes of its ranks share a network (Gloo's sockets)
TIMEOUTS = {2: 6.5, 3: 7.5, 4: 8.5}  # seconds: the group's timeout the learner is given


@reports_calls
def gloo_trial(init: Callable, timeout_s: float) -> dict:
    """Start Gloo with the learner's ``init(comm, timeout_s)``; what it did, and the group.

    While ``init`` runs, every port the operating system hands out on request is noted
    (a socket bound to port 0, or ``dist.TCPStore`` asked for port 0): the port the group
    meets at must be one of rank 0's. A socket that got its port so and is then *closed*
    gives the port back, and here another program takes it at once, as one may on a
    shared machine: the bind-close-rebind race, made to happen every time. Afterwards the
    group sums ``arange(4) * (rank + 1)`` once, its store and timeout are read back, and
    it is destroyed, so the check can run again.
    """

    import torch.distributed as dist

    comm = world()
    if dist.is_initialized():
        dist.destroy_process_group()
    chosen: list[int] = []
    counting = CountingComm(comm)
    with _taking_freed_ports(chosen) as taken, _noting_stores(dist, chosen):
        try:
            where = init(counting, timeout_s)
        except Exception as e:
            if taken and ("EADDRINUSE" in str(e) or "address already in use" in str(e).lower()):
                raise OSError(
                    f"port {taken[0]} was taken between choosing it and listening on it: the "
                    "socket that got it from the operating system was closed before torch "
                    "listened on it, and another program (here, the check) took it in between, "
                    f"as one can on a shared machine ({type(e).__name__}: {str(e)[:120]}). Let "
                    "the port be chosen by the socket that will listen on it: "
                    "dist.TCPStore(address, 0, ...) on rank 0 listens on a free port and says "
                    "which (store.port)") from e
            if "EADDRINUSE" in str(e) or "address already in use" in str(e).lower():
                raise OSError(
                    f"{type(e).__name__}: {str(e)[:160]}: the port was in use when torch "
                    "listened on it (a socket that got it is still open, or another program "
                    "holds it). Let the store choose and hold the port: dist.TCPStore(address, "
                    "0, ...) on rank 0, then store.port") from e
            raise
    try:
        t = torch.arange(4, dtype=torch.float64) * (comm.rank + 1)
        dist.all_reduce(t)
        store = private.default_store()
        return {"where": where if isinstance(where, tuple | list) else None,
                "returned": type(where).__name__, "os_ports": chosen,
                "store": (getattr(store, "host", None), getattr(store, "port", None)),
                "rank": dist.get_rank(), "size": dist.get_world_size(),
                "sum": t.numpy(), "calls": counting.calls,
                "timeout": private.default_group_timeout()}
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


@contextmanager
def _taking_freed_ports(chosen: list[int]) -> Iterator[list[int]]:
    """Inside: ports that sockets bind to port 0 get are noted in ``chosen``; when such a
    socket is closed, a listener of ours takes its address at once (the ports so taken are
    yielded). Ours close on the way out."""
    import socket

    bind, close = socket.socket.bind, socket.socket.close
    given: dict[int, tuple] = {}  # id of a socket that got a port from the OS -> its address
    squatters: list[socket.socket] = []
    taken: list[int] = []

    def noting(sock: socket.socket, address: Any) -> None:
        bind(sock, address)
        if isinstance(address, tuple) and len(address) >= 2 and address[1] == 0:
            chosen.append(sock.getsockname()[1])
            given[id(sock)] = (sock.family, sock.getsockname())

    def taking(sock: socket.socket) -> None:
        freed = given.pop(id(sock), None) if sock.fileno() >= 0 else None
        close(sock)
        if freed is None:
            return
        family, address = freed
        squatter = socket.socket(family, socket.SOCK_STREAM)
        try:
            bind(squatter, address)
            squatter.listen()
        except OSError:
            close(squatter)
            return
        squatters.append(squatter)
        taken.append(address[1])

    socket.socket.bind, socket.socket.close = noting, taking  # type: ignore[method-assign,assignment]  # patched for the trial's length, put back below
    try:
        yield taken
    finally:
        socket.socket.bind, socket.socket.close = bind, close  # type: ignore[method-assign]
        for squatter in squatters:
            squatter.close()


@contextmanager
def _noting_stores(dist: Any, chosen: list[int]) -> Iterator[None]:
    """Inside: ``dist.TCPStore`` notes in ``chosen`` the port it listens on when asked for
    port 0 (the operating system's choice, taken by the listener itself)."""
    real = dist.TCPStore

    def noting(host_name: str, port: int, *args: Any, **kwargs: Any) -> Any:
        store = real(host_name, port, *args, **kwargs)
        if port == 0:
            chosen.append(store.port)
        return store

    dist.TCPStore = noting
    try:
        yield
    finally:
        dist.TCPStore = real


def gloo_sum_reference(size: int) -> np.ndarray:
    """What all_reduce of arange(4) * (rank + 1) over ``size`` ranks gives."""
    return np.arange(4, dtype=np.float64) * size * (size + 1) / 2


def _start(mc: Any, p: int) -> list[dict]:
    """The learner's group at p ranks, started once per version of their init_gloo."""
    return once(mc, ("gloo", p, INIT), lambda: run(mc, gloo_trial, INIT, TIMEOUTS[p], ranks=p))


def _meeting_point(mc: Any, p: int) -> str | None:
    got = _start(mc, p)
    where = got[0]["where"]
    if not (where and len(where) == 2 and isinstance(where[0], str)
            and isinstance(where[1], int)):
        return (f"init_gloo returned {where!r} ({got[0]['returned']}); return (address, port): "
                "a str, then an int")
    if where[0] in ("0.0.0.0", "::", ""):
        return (f"init_gloo returned the address {where[0]!r}: that is where a server listens "
                "on every interface, not an address another rank can connect to; return rank "
                "0's address (here 127.0.0.1)")
    if any(o["where"] != where for o in got):
        return "the ranks returned different meeting points: broadcast rank 0's choice over MPI"
    if got[0]["store"][1] != where[1]:
        return f"the group met at port {got[0]['store'][1]}, but init_gloo returned {where[1]}"
    if where[1] not in got[0]["os_ports"]:
        return (f"port {where[1]} was not chosen by the operating system on rank 0: open the "
                "store there on port 0 and read store.port (a fixed port collides on a shared "
                "machine)")
    silent = [r for r, o in enumerate(got)
              if all(c.name in ("Barrier", "barrier") for c in o["calls"])]
    if silent:
        return (f"rank {silent[0]} received nothing over MPI: rank 0's choice must reach the "
                "others through MPI (comm.bcast)")
    return None


def _agrees(mc: Any, p: int) -> str | None:
    want = gloo_sum_reference(p)
    return per_rank(_start(mc, p), lambda r, o: None if (o["rank"], o["size"]) == (r, p)
                    and np.array_equal(o["sum"], want) else
                    f"Gloo says rank {o['rank']} of {o['size']}, MPI says rank {r} of {p}; "
                    f"all_reduce gave {o['sum'].tolist()}, expected {want.tolist()}")


def _keeps_timeout(mc: Any, p: int) -> str | None:
    return per_rank(_start(mc, p), lambda r, o: None if o["timeout"] == TIMEOUTS[p] else
                    f"the group's timeout is {o['timeout']:g} s, expected the {TIMEOUTS[p]} s "
                    "given")


CONTRACT = Contract(
    why_not={"dtypes": "init_gloo makes a process group; the sums it is checked with are "
                       "Gloo's own",
             "shapes": "init_gloo takes a communicator and a timeout, no tensor",
             "aliasing": "init_gloo takes no tensor of the caller's",
             "groups": "torch.distributed holds one default group per process: a second "
                       "init_process_group is an error",
             "orders": "init_gloo takes no order of actions",
             "accumulation": "init_gloo takes no gradients, so none accumulate"},
)

CHECKS = (
    Check("rank 0's OS-chosen port reaches every rank over MPI, returned as (address, port)",
          lambda mc: at_sizes(mc, lambda p: _meeting_point(mc, p))),
    Check("Gloo agrees with MPI on rank, size and sums",
          lambda mc: at_sizes(mc, lambda p: _agrees(mc, p))),
    Check("the process group has the timeout it was given",
          lambda mc: at_sizes(mc, lambda p: _keeps_timeout(mc, p))),
)
check = checker(CHECKS)
