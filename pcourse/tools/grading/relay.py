"""The relay, a rank's end: a learner's ranks reach MPI only through the grader's ranks.

A check's evidence is often what the code sent (a ring's 2(p - 1) chunks, ZeRO's
reduce-scatter and all-gather where DDP makes an allreduce). It must be taken where the
learner's code cannot rewrite it, and the learner's ranks must have no way to talk but
the one that is counted. So, under the grader:

- a rank (:mod:`pcourse.tools.grading.rank`, an MPI process) runs only the course's code.
  Its learner process (:mod:`pcourse.tools.grading.learner`) runs the learner's cells and
  the check's trial, in a jail of its own (:func:`pcourse.tools.grading.sandbox.start_workers`)
  where there is bubblewrap. The two share one unix socket, and the learner process
  nothing with any other rank;
- the trial's communicator in the learner process is a ``RelayComm``. Each call goes over
  the socket to the rank, which makes it on the real communicator through a
  :class:`~pcourse.tools.grading.trials.CountingComm` (deadlines, sends that block) and
  records it (:func:`serve`). Buffers travel both ways, so ``Recv`` fills the learner's
  array as MPI would;
- every message is :mod:`~pcourse.tools.grading.wire` data, which cannot carry code: the rank
  makes only the calls of an allowed list and checks every buffer's counts against its
  size. It hands the grader its own record of every call of the trial, and the grader
  takes the trial's account of its calls only where it is that record
  (:func:`pcourse.tools.grading.checks.run`).
"""

from __future__ import annotations

import socket
import struct
import time
from pathlib import Path
from typing import Any

import numpy as np

from pcourse.tools.grading import wire
from pcourse.tools.grading.wire import Call, Learner, Made, Mpi, Obj, Ref

MAX_FRAME = 1 << 28  # bytes of one message
CONNECT_TIMEOUT = 120.0  # seconds a rank waits for its learner process (which imports torch)
GRACE = 10.0  # seconds a rank waits past the grader's deadline before it gives up a trial
ENGINE_DIED = ("a rank (an MPI process) died: did the code call os._exit or MPI's Abort, "
               "or crash?")  # said of a learner process that died too: it was that rank


# ---------------------------------------------------------------- one socket, two ends

def send(sock: socket.socket, value: Any) -> None:
    """``value`` as one frame of wire data."""
    data = wire.dumps(value)
    sock.sendall(struct.pack("!Q", len(data)) + data)


def receive(sock: socket.socket, deadline: float | None = None) -> Any:
    """One frame's value; WireError if it is not wire data, EOFError if the other end left."""
    return wire.loads(receive_frame(sock, deadline))


def receive_frame(sock: socket.socket, deadline: float | None = None) -> bytes:
    (n,) = struct.unpack("!Q", _read(sock, 8, deadline))
    if n > MAX_FRAME:
        raise ConnectionError(f"a message of {n} bytes, over the relay's {MAX_FRAME}")
    return _read(sock, n, deadline)


def _read(sock: socket.socket, n: int, deadline: float | None) -> bytes:
    chunks, got = [], 0
    while got < n:
        left = None if deadline is None else deadline - time.monotonic()
        if left is not None and left <= 0:
            raise TimeoutError("no answer before the deadline")
        sock.settimeout(left)
        chunk = sock.recv(min(n - got, 1 << 22))
        if not chunk:
            raise EOFError("the other end closed the relay")
        chunks.append(chunk)
        got += len(chunk)
    return b"".join(chunks)


def connect(path: Path, timeout: float = CONNECT_TIMEOUT) -> socket.socket:
    """A connection to the unix socket at ``path``, retried until it listens or ``timeout``."""
    deadline = time.monotonic() + timeout
    while True:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            sock.connect(str(path))
            return sock
        except OSError:
            sock.close()
            if time.monotonic() > deadline:
                raise RuntimeError(f"nothing listened at {path} within {timeout:g} s") from None
            time.sleep(0.05)


def die_with_parent() -> None:
    """In a child, before it runs its program: be killed when the parent dies (Linux), so
    nothing of a job outlives a grader that was killed. Here, not in :mod:`~pcourse.tools.
    grading.job`, so that a rank can say hello before it imports torch (the job imports the
    checks, and they torch)."""
    import ctypes
    import signal

    try:
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL, 0, 0, 0)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


def _mpi() -> Any:
    from mpi4py import MPI

    return MPI


def constants() -> dict[str, Any]:
    """MPI's ops and datatypes by name, and ``IN_PLACE``: what a call may name."""
    MPI = _mpi()
    named = {n: getattr(MPI, n) for n in dir(MPI) if n.isupper()
             and isinstance(getattr(MPI, n), MPI.Op | MPI.Datatype)}
    return {**named, "IN_PLACE": MPI.IN_PLACE}


# ---------------------------------------------------------------- the rank's end

COMM_METHODS = frozenset(("Free", "relay_counting", "calls", "left_behind"))
REQUEST_METHODS = frozenset(("Test", "Wait", "Cancel", "test", "wait"))


def _comm_methods() -> frozenset[str]:
    from pcourse.tools.grading import trials

    return COMM_METHODS | frozenset(trials.SENDS + trials.RECEIVES + trials.COLLECTIVES
                                    + trials.MAKERS)


class _Tamper(Exception):
    """The learner process sent what no honest trial sends."""


class Link:
    """This rank's connection to its learner process, and what that may refer to."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.objects: dict[int, Any] = {}  # Ref id -> CountingComm, or (request, buffers)
        self.kept: list[Any] = []  # requests left pending, communicators made: kept alive
        self.broken = ""  # why this learner process can take no more work, once it cannot
        self.next = 2  # the next Ref id (0: the trial's communicator, 1: its COMM_WORLD)

    def hold(self, obj: Any) -> int:
        self.next += 1
        self.objects[self.next] = obj
        return self.next

    def ask(self, message: tuple, deadline: float) -> tuple:
        send(self.sock, message)
        return self.read(deadline)

    def read(self, deadline: float) -> tuple:
        answer = receive(self.sock, deadline)
        if not isinstance(answer, tuple) or not answer or not isinstance(answer[0], str):
            raise _Tamper(f"the learner process answered {type(answer).__name__}")
        return answer


_link: Link | None = None
_world: Any = None  # a duplicate of COMM_WORLD: the learner's MPI.COMM_WORLD in a trial


def link() -> Link:
    if _link is None:
        raise RuntimeError("no learner process: the grader opens one for each exercise")
    if _link.broken:
        raise RuntimeError(_link.broken)
    return _link


def open_link(path: Path) -> None:
    """Connect to the learner process listening at ``path`` (a fresh one for each exercise),
    and give the learner's ``MPI.COMM_WORLD`` a fresh world: a collective an earlier
    exercise left unfinished on the old one would be matched by this one's."""
    global _link, _world
    if _link is not None:
        _link.sock.close()
        _link = None
    _world = _mpi().COMM_WORLD.Dup()  # every rank opens, together
    _link = Link(connect(path))


def _failed(rank: int | None, name: str, message: str) -> dict:
    return {"rank": rank, "error": (name, message, "")}


def exchange(message: tuple, timeout: float) -> tuple:
    """Send the learner process ``message`` and wait for its answer (define, ping).

    ``("died",)`` when it is gone, ``("timeout",)`` when it did not answer in time (it is
    then given up: still busy with learner code).
    """
    try:
        ln = link()
    except RuntimeError:
        return ("died",)
    try:
        return ln.ask(message, time.monotonic() + timeout)
    except TimeoutError:
        ln.broken = "the learner's process is still busy with an earlier cell or check"
        return ("timeout",)
    except Exception:  # noqa: BLE001 - gone, or garbled: either way of no more use
        ln.broken = "the learner's process died"
        return ("died",)


def serve(comm: Any, trial: tuple, timeout: float) -> dict:
    """Run ``trial`` in the learner process, as rank ``comm.rank`` of ``comm``, making its MPI
    calls.

    ``trial``: ``(module, name, args, kwargs)``, the check's trial function by name and its
    arguments (wire data; :class:`~pcourse.tools.grading.wire.Learner` records name the
    learner's functions). Returns ``{"rank", "value": the learner process's wire bytes of
    the result (read by the grader), "calls": every call made, in order}`` or ``{"rank",
    "error": (name, message, where)}``.
    """
    from pcourse.tools.grading.trials import CountingComm

    rank = comm.rank
    try:
        ln = link()
    except RuntimeError as exc:
        return _failed(rank, "EngineError" if "died" in str(exc) else "RuntimeError", str(exc))
    log: list = []
    ln.objects = {0: CountingComm(comm, log=log), 1: CountingComm(_world, log=log)}
    deadline = time.monotonic() + timeout + GRACE
    try:
        answer = ln.ask(("trial", *trial, rank, comm.size, _world.rank, _world.size), deadline)
        while answer[0] == "call":
            send(ln.sock, _perform(ln, answer))
            answer = ln.read(deadline)
    except TimeoutError:
        ln.broken = "the learner's process is still busy with an earlier check"
        return _failed(rank, "TimeoutError", f"the code did not finish within {timeout:g} s")
    except (EOFError, ConnectionError, OSError):
        ln.broken = "the learner's process died"
        return _failed(rank, "EngineError", ENGINE_DIED)
    except Exception as exc:  # noqa: BLE001 - a garbled message: the process is not ours now
        ln.broken = "the learner's process sent what no check sends"
        return _failed(rank, "TamperError", f"the learner's process sent what no check sends "
                       f"({type(exc).__name__}): did the code replace the checks' functions?")
    finally:
        ln.kept += [o for o in ln.objects.values() if isinstance(o, tuple)]
        ln.objects = {}
    if answer[0] == "done" and len(answer) == 2 and isinstance(answer[1], bytes):
        return {"rank": rank, "value": answer[1], "calls": log}
    if answer[0] == "error" and len(answer) == 4 and all(isinstance(a, str) for a in answer[1:]):
        return {"rank": rank, "error": tuple(answer[1:])}
    ln.broken = "the learner's process sent what no check sends"
    return _failed(rank, "TamperError", "the learner's process answered the trial with "
                   "something else than a result: did the code replace the checks' functions?")


def _perform(ln: Link, message: tuple) -> tuple:
    """Make one call the learner process asked for: ``("ok", result, buffers)`` or
    ``("raise", name, message)``."""
    try:
        _, ref, method, args, kwargs = message
        target = ln.objects.get(ref) if isinstance(ref, int) else None
        if target is None or not isinstance(method, str) or not isinstance(args, tuple) \
                or not isinstance(kwargs, dict) or not all(isinstance(k, str) for k in kwargs):
            raise _Tamper("a call of nothing the rank holds")
        buffers: list[np.ndarray] = []
        args = tuple(_decode(ln, a, buffers) for a in args)
        kwargs = {k: _decode(ln, v, buffers) for k, v in kwargs.items()}
        if isinstance(target, tuple):
            result = _request_call(target, method)
            return ("ok", result, list(target[1]) if completed(result) else [])
        return _comm_call(ln, target, method, args, kwargs, buffers)
    except _Tamper:
        raise
    except Exception as exc:  # noqa: BLE001 - the learner's error, raised where they called
        return ("raise", type(exc).__name__, str(exc))


def completed(result: Any) -> bool:
    return result is True or result is None or (isinstance(result, tuple) and result[0])


def _comm_call(ln: Link, comm: Any, method: str, args: tuple, kwargs: dict,
               buffers: list[np.ndarray]) -> tuple:
    from pcourse.tools.grading.trials import CountingComm

    if method not in _comm_methods():
        raise AttributeError(f"comm.{method} is not among the MPI calls the grader makes for "
                             "a check: use point-to-point sends and receives, collectives, "
                             "Dup, Split and Free")
    if method == "relay_counting":
        timeout = min(max(float(args[0]), 0.1), 120.0)
        counter = CountingComm(comm._comm, timeout=timeout, log=comm._log)
        return ("ok", _hold(ln, counter), [])
    if method == "calls":
        return ("ok", [Call(*c) for c in comm.calls], [])
    if method == "left_behind":
        return ("ok", comm.left_behind(str(args[0]) if args else "the function"), [])
    if method == "Free" and comm in (ln.objects[0], ln.objects[1]):
        raise ValueError("this communicator is the check's: free only those your code made")
    if method[0].isupper():
        for a in (*args, *kwargs.values()):
            _check_message(a)
    result = getattr(comm, method)(*args, **kwargs)
    MPI = _mpi()
    if isinstance(result, MPI.Request):
        return ("ok", Ref(ln.hold((result, buffers))), [])
    if isinstance(result, MPI.Comm):
        if result == MPI.COMM_NULL:
            return ("ok", Mpi("COMM_NULL"), buffers)
        ln.kept.append(result)
        return ("ok", _hold(ln, CountingComm(result, log=comm._log)), buffers)
    if method[0].islower() and method != "Free":
        return ("ok", Obj(result), buffers)
    return ("ok", None, buffers)


def _hold(ln: Link, counter: Any) -> Made:
    return Made(ln.hold(counter), counter._comm.Get_rank(), counter._comm.Get_size())


def _request_call(held: tuple, method: str) -> Any:
    from pcourse.tools.grading import trials

    request, _ = held
    if method not in REQUEST_METHODS:
        raise AttributeError(f"request.{method} is not among the grader's: use Wait, Test "
                             "or Cancel")
    if method == "Test":
        return bool(request.Test())
    if method == "Cancel":
        request.Cancel()
        return None
    what = getattr(request, "what", "the Wait of a nonblocking call")
    hint = trials.SEND_HINT if hasattr(request, "what") else trials.RECV_HINT
    if method == "Wait":
        trials._poll(request, None, trials.OP_TIMEOUT, what, hint)
        return None
    deadline = time.monotonic() + trials.OP_TIMEOUT
    while True:
        flag, obj = request.test()
        if flag or method == "test":
            return (bool(flag), Obj(obj) if flag else None)
        if time.monotonic() > deadline:
            raise trials.DeadlockError(f"{what} waited {trials.OP_TIMEOUT:g} s and never "
                                       f"completed. {hint}")
        time.sleep(0.0005)


def _decode(ln: Link, value: Any, buffers: list[np.ndarray], depth: int = 0) -> Any:
    """A learner process's argument: constants by name, communicators by Ref, arrays as
    buffers (handed back after the call), the objects of pickle-based calls as they are
    (wire data is plain data)."""
    if depth > 4:
        raise _Tamper("arguments nested too deep")
    if isinstance(value, Mpi):
        found = constants().get(value.name)
        if found is None:
            raise ValueError(f"MPI.{value.name} is not a constant the grader passes on")
        return found
    if isinstance(value, Ref):
        held = ln.objects.get(value.id)
        if held is None or isinstance(held, tuple):
            raise ValueError("a communicator this rank does not hold (freed, or another's)")
        return held
    if isinstance(value, Obj):
        return value.value
    if isinstance(value, np.ndarray):
        buffers.append(value)
        return value
    if isinstance(value, Learner | Call | Made):
        raise _Tamper(f"a {type(value).__name__} is no argument of an MPI call")
    if isinstance(value, list | tuple):
        return type(value)(_decode(ln, v, buffers, depth + 1) for v in value)
    if value is None or isinstance(value, bool | int | float | str):
        return value
    raise TypeError(f"{type(value).__name__} is not an argument the grader passes to MPI")


def _check_message(spec: Any) -> None:
    """Refuse a message whose counts or displacements reach past its buffer.

    mpi4py trusts explicit counts; MPI would then read or write past the array, in the
    rank. Counts are in the datatype's units, which must be the array's item size.
    """
    MPI = _mpi()
    if not isinstance(spec, list | tuple) or not spec or not isinstance(spec[0], np.ndarray):
        return
    buf, rest = spec[0], list(spec[1:])
    types = [r for r in rest if isinstance(r, MPI.Datatype)]
    if any(t.Get_size() != buf.itemsize for t in types):
        raise ValueError("a message's datatype must be the size of its array's items")
    numbers = [r for r in rest if not isinstance(r, MPI.Datatype) and r is not None]
    flat: list[int] = []
    for r in numbers:
        items = list(r) if isinstance(r, list | tuple) else [r]
        if not all(isinstance(i, int) and 0 <= i for i in items):
            raise ValueError("a message's counts and displacements must be whole numbers >= 0")
        flat.append(sum(items) if len(numbers) == 1 else max(items, default=0))
    if len(numbers) == 1 and flat[0] > buf.size:
        raise ValueError(f"a message counts {flat[0]} items in an array of {buf.size}")
    if len(numbers) == 2:
        counts, displs = (list(n) if isinstance(n, list | tuple) else [n] for n in numbers)
        if any(c + d > buf.size for c, d in zip(counts, displs, strict=False)):
            raise ValueError(f"a message's counts and displacements reach past its array of "
                             f"{buf.size} items")
    if len(numbers) > 2:
        raise ValueError("a message is [array, counts, displacements, datatype] at most")


def trial(ranks: int, spec: tuple, timeout: float) -> dict | None:
    """A check's trial at ``ranks`` ranks (on every rank of the job): run in this rank's
    learner process, which this rank makes (and records) the MPI calls of (:func:`serve`)."""
    from pcourse.tools.grading.trials import subworld

    sub = subworld(ranks)  # every rank, inside the trial's world or not
    if sub == _mpi().COMM_NULL:
        return None
    return serve(sub.Dup(), spec, timeout)  # a fresh context: a failed trial's messages
    #                                          stay on the old one
