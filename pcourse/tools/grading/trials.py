"""What a learner's function meets during a check (on their engines, or under the grader
on its ranks): a communicator of a chosen size that records every call and never hangs.

Three things make a check honest about MPI code, and they live here:

- **Any world size from one cluster.** :func:`on_ranks` runs a trial on a
  sub-communicator of ``ranks`` ranks, numbered in *reverse* world order, so a
  check at 2 ranks and one at 3 share one job of 3 ranks, and code that
  quietly uses ``MPI.COMM_WORLD`` instead of the ``comm`` it was given gets the
  wrong ranks and shows it.
- **Blocking sends that really block.** MPI lets ``Send`` return before the
  matching ``Recv`` is posted when the message is small (the eager limit), so a
  ring where every rank sends first works in a test with 1000 numbers and
  deadlocks in training. :class:`CountingComm` sends with ``Issend``, which
  completes only once the receive has started: the standard's guarantee, at any
  message size, so such a ring fails every time.
- **A deadline on every wait.** Each blocking call is made as its nonblocking twin
  and polled until :data:`OP_TIMEOUT`; a rank that waits longer raises
  :class:`DeadlockError` saying what it waited for, instead of leaving the ranks
  stuck for the next check.
"""

from __future__ import annotations

import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

from pcourse.runtime.waits import CollectiveTimeout
from pcourse.tools.grading import wire
from pcourse.tools.grading.wire import Call  # noqa: F401 - the checks' record of a call

OP_TIMEOUT = 5.0  # seconds one MPI call may wait for its partners: more than a correct one needs

_HERE = str(Path(__file__).resolve().parent)


class DeadlockError(CollectiveTimeout):
    """An MPI call of the learner's waited longer than any correct program would.

    A :class:`~pcourse.runtime.waits.CollectiveTimeout`, the one exception of a wait
    past its deadline, whose message says what the learner's code did wrong."""


SENDS = ("Send", "Ssend", "Isend", "Issend", "Sendrecv", "Sendrecv_replace",
         "send", "ssend", "isend", "issend", "sendrecv")
RECEIVES = ("Recv", "Irecv", "recv", "irecv")
BUFFER_COLLECTIVES = ("Allreduce", "Bcast", "Reduce", "Allgather", "Allgatherv", "Gather",
                      "Gatherv", "Scatter", "Scatterv", "Alltoall", "Alltoallv", "Reduce_scatter",
                      "Reduce_scatter_block", "Scan", "Exscan", "Barrier")
OBJECT_COLLECTIVES = ("allreduce", "bcast", "reduce", "allgather", "gather", "scatter",
                      "alltoall", "barrier")
NONBLOCKING_COLLECTIVES = tuple("I" + n[0].lower() + n[1:] for n in BUFFER_COLLECTIVES)
COLLECTIVES = BUFFER_COLLECTIVES + OBJECT_COLLECTIVES + NONBLOCKING_COLLECTIVES


def _mpi() -> Any:
    from mpi4py import MPI

    return MPI


class CountingComm:
    """An mpi4py communicator that records every call and gives up on a deadlock.

    Everything else (``rank``, ``size``, ``Get_rank``, ...) passes through to the
    real communicator. ``log``, where given, records every call too, with those of other
    CountingComms (a trial's calls in order, whichever communicator made them).

    Made of a learner process's communicator under the grader (a
    :mod:`~pcourse.tools.grading.relay` one), it is made and kept by the rank, where
    the calls are made: what the learner's process holds only asks it.
    """

    def __new__(cls, comm: Any, timeout: float = OP_TIMEOUT, log: list | None = None) -> Any:
        relayed = getattr(comm, "relay_counting", None)
        if relayed is not None:
            return relayed(timeout)
        return super().__new__(cls)

    def __init__(self, comm: Any, timeout: float = OP_TIMEOUT, log: list | None = None) -> None:
        self._comm = comm
        self._timeout = timeout
        self._log = log
        self.calls: list[Call] = []
        self.requests: list[Any] = []  # the nonblocking calls' requests handed to the learner
        self.made: list[tuple[str, Any]] = []  # communicators made from this one, by which call

    def __getattr__(self, name: str) -> Any:
        target = getattr(self._comm, name)
        handler = _HANDLERS.get(name)
        if handler is not None:
            return lambda *args, **kwargs: handler(self, name, *args, **kwargs)
        if name in SENDS + RECEIVES + COLLECTIVES:  # nonblocking: record, then call as is
            def recorded(*args: Any, **kwargs: Any) -> Any:
                self._record(name, args, kwargs)
                result = target(*args, **kwargs)
                if isinstance(result, _mpi().Request):
                    self.requests.append(result)
                return result
            return recorded
        if name in MAKERS:
            def making(*args: Any, **kwargs: Any) -> Any:
                if name in COLLECTIVE_MAKERS:  # blocking, and no deadline of its own
                    _agree(self, COLLECTIVE_MAKERS, name)
                made = target(*args, **kwargs)
                self.made.append((name, made))
                return made
            return making
        return target

    def collectives(self) -> list[Call]:
        return [c for c in self.calls if c.name in COLLECTIVES]

    def left_behind(self, who: str) -> str | None:
        """What ``who`` (the learner's function, just returned) left behind, in plain words.

        A request never completed (an ``Isend`` nobody waited for: its buffer may still be
        read, and MPI keeps the request) or a communicator never freed (a ``Dup`` on every
        call: MPI has a few thousand, so a training loop runs out). None if nothing.
        """
        MPI = _mpi()
        pending = [r for r in self.requests if r != MPI.REQUEST_NULL]
        if pending:
            return (f"{who} returned with {len(pending)} nonblocking request(s) never completed "
                    "(an Isend or Irecv nobody waited for): MPI may still be reading or writing "
                    "their buffers, and keeps each request until it is waited for; call .Wait() "
                    "on each (or MPI.Request.Waitall) before returning")
        alive = [name for name, c in self.made if c != MPI.COMM_NULL]
        if alive:
            return (f"{who} returned with {len(alive)} communicator(s) it made (comm.{alive[0]}) "
                    "still alive: one more on every call, and MPI has only a few thousand, so a "
                    "training loop runs out; Free() it before returning, or use the comm given")
        return None

    def sends(self) -> list[Call]:
        """Calls that send data to one other rank (receives excluded)."""
        return [c for c in self.calls if c.name in SENDS]

    # ------------------------------------------------------------ recording and waiting

    def _record(self, name: str, args: tuple, kwargs: dict) -> None:
        buf = args[0] if args else next(iter(kwargs.values()), None)
        if buf is _mpi().IN_PLACE and len(args) > 1:
            buf = args[1]  # Allreduce(MPI.IN_PLACE, buf): the data is the receive buffer
        if name in SENDS:
            peer = _arg(args, kwargs, 1, "dest")
        elif name in RECEIVES:
            peer = _arg(args, kwargs, 1, "source")
        else:
            peer = kwargs.get("root")
        self.calls.append(Call(name, _elements(buf), peer))
        if self._log is not None:
            self._log.append(self.calls[-1])

    def _wait(self, request: Any, what: str, hint: str, status: Any = None) -> None:
        _poll(request, status, self._timeout, f"comm.{what} on rank {self._comm.rank}", hint)

    def _wait_until(self, ready: Callable[[], bool], what: str, hint: str) -> None:
        deadline = time.monotonic() + self._timeout
        while not ready():
            if time.monotonic() > deadline:
                raise DeadlockError(f"comm.{what} on rank {self._comm.rank} waited "
                                    f"{self._timeout:g} s and never completed. {hint}")
            time.sleep(0.0005)


def _arg(args: tuple, kwargs: dict, i: int, name: str, default: Any = None) -> Any:
    return args[i] if len(args) > i else kwargs.get(name, default)


def _poll(request: Any, status: Any, timeout: float, what: str, hint: str) -> None:
    """Test ``request`` until it completes; past ``timeout`` s, raise DeadlockError."""
    deadline = time.monotonic() + timeout
    polls = 0
    while not (request.Test(status) if status is not None else request.Test()):
        if time.monotonic() > deadline:
            try:
                request.Cancel()  # a receive is withdrawn; a send may stay pending
            except Exception:  # noqa: BLE001 - the error below is what matters
                pass
            raise DeadlockError(f"{what} waited {timeout:g} s and never completed. {hint}")
        polls += 1
        if polls > 200:  # spin briefly (fast partners), then let the other ranks run
            time.sleep(0.0005)


_guarded_request: type | None = None


def _guarded(request: Any, timeout: float, what: str) -> Any:
    """``request`` (of a nonblocking send) whose Wait gives up after ``timeout`` s.

    A subclass of MPI.Request, so MPI.Request.Waitall and friends still take it.
    """
    global _guarded_request
    if _guarded_request is None:
        base: Any = _mpi().Request  # mypy takes no base class from a call; mpi4py's, as Any

        class GuardedRequest(base):
            def Wait(self, status: Any = None) -> bool:
                _poll(self, status, self.timeout, self.what, SEND_HINT)
                return True

            def wait(self, status: Any = None) -> None:
                self.Wait(status)

        _guarded_request = GuardedRequest
    guarded = _guarded_request(request)
    guarded.timeout, guarded.what, guarded.original = timeout, what, request  # keeps its buffer
    return guarded


SEND_HINT = ("A send may wait until the matching receive has been posted (MPI guarantees "
             "no more, and large messages always wait), so ranks that all send before they "
             "receive wait for each other forever: a deadlock. Use comm.Sendrecv, which sends "
             "and receives at once.")
RECV_HINT = ("No matching message arrived: does that rank send it, with this tag, and does "
             "it not wait for this rank first?")
COLLECTIVE_HINT = ("The other ranks never joined it: every rank must call the same "
                   "collectives, in the same order, with the same root.")


MAKERS = ("Dup", "Split", "Clone", "Create", "Create_group", "Split_type", "Dup_with_info")
COLLECTIVE_MAKERS = tuple(m for m in MAKERS if m != "Create_group")  # every rank calls these


def reports_calls(trial: Callable) -> Callable:
    """Mark a trial whose result holds the calls it made (CountingComm.calls), in order.

    Under the grader the result is then taken only if those calls are the rank's own
    record of the trial's (:func:`pcourse.tools.grading.checks.run`).
    """
    trial.reports_calls = True  # type: ignore[attr-defined]
    return trial


class LeftBehind(RuntimeError):
    """The learner's function returned leaving MPI resources behind (see ``left_behind``)."""


def check_left_behind(comm: CountingComm, who: str) -> None:
    """Raise :class:`LeftBehind` if ``who`` left a request or a communicator behind."""
    problem = comm.left_behind(who)
    if problem:
        raise LeftBehind(problem)


def _any(source: int | None, tag: int | None) -> tuple[int, int]:
    """mpi4py's defaults for an omitted source and tag (None here: -1 is PROC_NULL in MPICH)."""
    MPI = _mpi()
    return (MPI.ANY_SOURCE if source is None else source,
            MPI.ANY_TAG if tag is None else tag)


def _send(self: CountingComm, name: str, buf: Any, dest: int, tag: int = 0) -> None:
    self._record(name, (buf, dest), {})
    self._wait(self._comm.Issend(buf, dest, tag), f"{name} to rank {dest}", SEND_HINT)


def _isend(self: CountingComm, name: str, buf: Any, dest: int, tag: int = 0) -> Any:
    self._record(name, (buf, dest), {})
    request = _guarded(self._comm.Issend(buf, dest, tag), self._timeout,
                       f"the Wait for comm.{name} to rank {dest} on rank {self._comm.rank}")
    self.requests.append(request)
    return request


def _recv(self: CountingComm, name: str, buf: Any, source: int | None = None,
          tag: int | None = None, status: Any = None) -> None:
    source, tag = _any(source, tag)
    self._record(name, (buf, source), {})
    self._wait(self._comm.Irecv(buf, source, tag), f"{name} from rank {source}", RECV_HINT,
               status)


def _sendrecv(self: CountingComm, name: str, sendbuf: Any, dest: int, sendtag: int = 0,
              recvbuf: Any = None, source: int | None = None, recvtag: int | None = None,
              status: Any = None) -> None:
    source, recvtag = _any(source, recvtag)
    self._record(name, (sendbuf, dest), {})
    request = self._comm.Isendrecv(sendbuf, dest, sendtag, recvbuf, source, recvtag)
    self._wait(request, f"{name} to rank {dest} from rank {source}", RECV_HINT, status)


def _sendrecv_replace(self: CountingComm, name: str, buf: Any, dest: int, sendtag: int = 0,
                      source: int | None = None, recvtag: int | None = None,
                      status: Any = None) -> None:
    source, recvtag = _any(source, recvtag)
    self._record(name, (buf, dest), {})
    request = self._comm.Isendrecv_replace(buf, dest, sendtag, source, recvtag)
    self._wait(request, f"{name} to rank {dest} from rank {source}", RECV_HINT, status)


def _send_object(self: CountingComm, name: str, obj: Any, dest: int, tag: int = 0) -> None:
    self._record(name, (obj, dest), {})
    self._wait(self._comm.issend(obj, dest, tag), f"{name} to rank {dest}", SEND_HINT)


def _isend_object(self: CountingComm, name: str, obj: Any, dest: int, tag: int = 0) -> Any:
    self._record(name, (obj, dest), {})
    request = _guarded(self._comm.issend(obj, dest, tag), self._timeout,
                       f"the wait for comm.{name} to rank {dest} on rank {self._comm.rank}")
    self.requests.append(request)
    return request


def _recv_object(self: CountingComm, name: str, buf: Any = None, source: int | None = None,
                 tag: int | None = None, status: Any = None) -> Any:
    source, tag = _any(source, tag)
    self._record(name, (buf, source), {})
    self._wait_until(lambda: self._comm.iprobe(source, tag), f"{name} from rank {source}",
                     RECV_HINT)
    return self._comm.recv(buf, source, tag, status)


def _sendrecv_object(self: CountingComm, name: str, sendobj: Any, dest: int, sendtag: int = 0,
                     recvbuf: Any = None, source: int | None = None, recvtag: int | None = None,
                     status: Any = None) -> Any:
    source, recvtag = _any(source, recvtag)
    self._record(name, (sendobj, dest), {})
    request = self._comm.isend(sendobj, dest, sendtag)
    self._wait_until(lambda: self._comm.iprobe(source, recvtag),
                     f"{name} to rank {dest} from rank {source}", RECV_HINT)
    received = self._comm.recv(recvbuf, source, recvtag, status)
    self._wait(request, f"{name} to rank {dest}", SEND_HINT)
    return received


def _buffer_collective(self: CountingComm, name: str, *args: Any, **kwargs: Any) -> None:
    self._record(name, args, kwargs)
    nonblocking = getattr(self._comm, "I" + name[0].lower() + name[1:])
    self._wait(nonblocking(*args, **kwargs), name, COLLECTIVE_HINT)


_ROOT_AT = {"bcast": 1, "gather": 1, "scatter": 1, "reduce": 2}  # root's position in the call


def _object_collective(self: CountingComm, name: str, *args: Any, **kwargs: Any) -> Any:
    """Agree (with the deadline) on the call and its root across ranks, then make it.

    mpi4py's lowercase collectives have no nonblocking twin, so the deadline cannot
    cover the call itself (:func:`_agree`): a rank calling ``bcast`` while another calls
    ``allreduce`` (or with another root) is an error naming both.
    """
    self._record(name, args, kwargs)
    at = _ROOT_AT.get(name)
    _agree(self, OBJECT_COLLECTIVES, name, -1 if at is None else int(_arg(args, kwargs, at,
                                                                         "root", 0)))
    return getattr(self._comm, name)(*args, **kwargs)


def _agree(self: CountingComm, names: tuple[str, ...], name: str, root: int = -1) -> None:
    """Share, with the deadline, which of ``names`` (and root) every rank is about to call.

    For the calls that cannot wait with a deadline themselves: a rank that calls another
    one (or another root) is an error naming what each called, one that never comes a
    DeadlockError, where the calls would hang.
    """
    import numpy as np

    mine = np.array([names.index(name), root], dtype=np.int64)
    everyone = np.empty((self._comm.size, 2), dtype=np.int64)
    self._wait(self._comm.Iallgather(mine, everyone), name, COLLECTIVE_HINT)
    calls = [(names[k], r) for k, r in everyone.tolist()]
    if len(set(calls)) > 1:
        said = ", ".join(f"rank {i}: comm.{c}" + (f"(root={r})" if r >= 0 else "")
                         for i, (c, r) in enumerate(calls))
        raise DeadlockError(f"the ranks called different collectives at the same point "
                            f"({said}). {COLLECTIVE_HINT}")


_HANDLERS: dict[str, Callable[..., Any]] = {
    "Send": _send, "Ssend": _send, "Isend": _isend, "Issend": _isend, "Recv": _recv,
    "Sendrecv": _sendrecv, "Sendrecv_replace": _sendrecv_replace,
    "send": _send_object, "ssend": _send_object, "isend": _isend_object,
    "issend": _isend_object, "recv": _recv_object, "sendrecv": _sendrecv_object,
    **{name: _buffer_collective for name in BUFFER_COLLECTIVES},
    **{name: _object_collective for name in OBJECT_COLLECTIVES},
}


def _elements(buf: Any) -> int:
    """How many numbers a buffer argument holds (1 for a scalar or a Python object)."""
    if isinstance(buf, list | tuple) and buf and hasattr(buf[0], "size"):
        buf = buf[0]  # mpi4py's [array, MPI type] form
    size = getattr(buf, "size", None)
    if callable(size):  # a torch tensor
        return int(buf.numel())
    if isinstance(size, int):  # a numpy array
        return size
    return 1


# ---------------------------------------------------------------- trials on a sub-world

_subs: dict[int, Any] = {}  # ranks -> this rank's sub-communicator (COMM_NULL if outside)
_current: Any = None  # the communicator of the trial running now


def world() -> Any:
    """The communicator of the running trial (MPI.COMM_WORLD outside a trial)."""
    return _current if _current is not None else _mpi().COMM_WORLD


def subworld(ranks: int) -> Any:
    """The last ``ranks`` world ranks, numbered in reverse (collective; cached).

    Reversed, so that a sub-rank is never the world rank of the same process.
    """
    if ranks not in _subs:
        MPI = _mpi()
        w = MPI.COMM_WORLD
        if not 1 <= ranks <= w.size:
            raise ValueError(f"cannot check at {ranks} ranks in a world of {w.size}")
        inside = w.rank >= w.size - ranks
        _subs[ranks] = w.Split(0 if inside else MPI.UNDEFINED, key=w.size - w.rank)
    return _subs[ranks]


def on_ranks(ranks: int, fn: Callable, args: tuple, kwargs: dict) -> dict | None:
    """Run ``fn(*args, **kwargs)`` as one rank of a ``ranks``-rank world (on every engine of
    a notebook's cluster).

    Returns None on engines outside that world, else ``{"rank", "value"}`` (the result in
    the format of :mod:`pcourse.tools.grading.wire`, as the grader's ranks send theirs) or,
    when ``fn`` raised, ``{"rank", "error": (name, message, traceback)}``: the kernel then
    knows which rank failed without unpicking ipyparallel's errors.
    """
    global _current
    sub = subworld(ranks)
    if sub == _mpi().COMM_NULL:
        return None
    comm = sub.Dup()  # a fresh context: messages a failed trial left behind cannot match
    rank, _current = comm.rank, comm
    try:
        value = fn(*args, **kwargs)
    except BaseException as exc:  # noqa: BLE001 - SystemExit too: it is the learner's error
        return {"rank": rank, "error": (type(exc).__name__, str(exc), _learner_tb(exc))}
    finally:
        _current = None
    # Never freed: a trial that returned with a message unreceived (a broadcast skipped on
    # one rank) leaves it on this context, and a freed context is handed to the next Dup,
    # where the next trial would receive it.
    return sent_back(rank, value)


def sent_back(rank: int, value: Any) -> dict:
    """A trial's result as it travels: wire bytes, or the error of a result that is no data."""
    try:
        return {"rank": rank, "value": wire.dumps(value)}
    except TypeError as exc:
        return {"rank": rank, "error": ("TypeError", f"the result could not be sent back: {exc}",
                                        "")}


def _learner_tb(exc: BaseException, frames: int = 6) -> str:
    """The traceback's last frames outside this package: where the learner's code failed."""
    stack = [f for f in traceback.extract_tb(exc.__traceback__)
             if not f.filename.startswith(_HERE)]
    lines = [f"  in {f.name}, line {f.lineno}" + (f": {f.line.strip()}" if f.line else "")
             for f in stack[-frames:]]
    return "\n".join(lines)
