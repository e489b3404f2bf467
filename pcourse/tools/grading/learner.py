"""A graded learner's process: where, under the grader, one rank's learner code runs.

It runs the learner's cells and the checks' trials, and makes no MPI call of its own:
its communicator (:class:`RelayComm`, mpi4py's own type, so ``isinstance`` holds) and
requests send every call to this rank's engine, which makes it and records it
(:mod:`pcourse.tools.grading.relay`). Buffers come back as MPI filled them, into the
learner's own arrays. ``MPI.COMM_WORLD`` is the engines' world inside a check and
refuses to be used outside one; ``mpi4py`` is imported without initialising MPI.

Started by the grader in a jail of its own
(:func:`pcourse.tools.grading.sandbox.start_workers`): ``python -m
pcourse.tools.grading.learner SOCKET``. It listens once at SOCKET, for its engine. Given
several sockets, one process for each, in the one jail.
"""

from __future__ import annotations

import os
import pickle
import socket
import sys
from collections.abc import Callable
from typing import Any

import numpy as np

from pcourse.tools.grading.relay import (
    PROTOCOL,
    Made,
    Mpi,
    Obj,
    Ref,
    completed,
    constants,
    recv_frame,
    send_frame,
)


def _mpi() -> Any:
    from mpi4py import MPI

    return MPI


class _EngineLink:
    """This process's connection to its engine."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.constants = constants()

    def call(self, ref: int | None, method: str, args: tuple, kwargs: dict) -> Any:
        if ref is None:
            raise RuntimeError("under the grader, MPI is reached only inside a check, through "
                               "the comm your function is given")
        views: list[np.ndarray] = []
        lower = method[0].islower()
        message = ("call", ref, method,
                   tuple(self.encode(a, views, lower and i == 0) for i, a in enumerate(args)),
                   {k: self.encode(v, views, lower and k in ("obj", "sendobj"))
                    for k, v in kwargs.items()})
        send_frame(self.sock, pickle.dumps(message, protocol=PROTOCOL))
        answer = pickle.loads(recv_frame(self.sock))
        if answer[0] == "raise":
            raise _exception(answer[1], answer[2])
        _, result, arrays = answer
        if isinstance(result, Ref):  # a nonblocking call's request: buffers come at its end
            return RelayRequest(self, result.id, views)
        _write_back(views, arrays)
        return self.result(result)

    def result(self, value: Any) -> Any:
        if isinstance(value, Made):
            return RelayComm(self, value.id, value.rank, value.size)
        if isinstance(value, Mpi):
            return getattr(_mpi(), value.name)
        if isinstance(value, Obj):
            return pickle.loads(value.data)
        return value

    def encode(self, value: Any, views: list[np.ndarray], as_object: bool = False) -> Any:
        """An argument as the engine takes it: an object pickled, a buffer as an array."""
        import torch

        MPI = _mpi()
        if as_object:
            return Obj(pickle.dumps(value, protocol=PROTOCOL))
        if isinstance(value, RelayComm):
            return Ref(object.__getattribute__(value, "_ref"))
        if value is MPI.IN_PLACE:
            return Mpi("IN_PLACE")
        if isinstance(value, MPI.Op | MPI.Datatype):
            name = next((n for n, c in self.constants.items() if type(c) is type(value)
                         and c == value), None)
            if name is None:
                raise ValueError(f"{value!r} is not one of MPI's named ops or datatypes")
            return Mpi(name)
        if isinstance(value, torch.Tensor):
            if value.device.type != "cpu":
                raise BufferError("MPI here sends a tensor's own memory: a CPU tensor")
            value = value.detach().numpy()
        if isinstance(value, bytearray | memoryview | bytes):
            value = np.frombuffer(value, dtype=np.uint8)
        if isinstance(value, np.ndarray):
            if not (value.flags.c_contiguous or value.flags.f_contiguous):  # as mpi4py asks
                raise BufferError("ndarray is not contiguous: MPI sends an array's own memory")
            views.append(value)
            return value
        if isinstance(value, list | tuple):
            return type(value)(self.encode(v, views) for v in value)
        if isinstance(value, np.integer | np.floating):
            return value.item()
        if value is None or isinstance(value, bool | int | float | str):
            return value
        if isinstance(value, MPI.Status):
            raise TypeError("under the grader, MPI calls take no Status: leave it out")
        raise TypeError(f"{type(value).__name__} is not something MPI can send or name")


def _write_back(views: list[np.ndarray], arrays: list[np.ndarray]) -> None:
    """What MPI wrote into the engine's buffers, into the learner's own arrays."""
    for view, new in zip(views, arrays, strict=False):
        if view.shape != new.shape or view.dtype != new.dtype:
            continue
        if view.flags.writeable:
            np.copyto(view, new)  # bit for bit: a send buffer gets its own bytes back
        elif view.tobytes("A") != new.tobytes("A"):
            raise BufferError("MPI received into an array that is read-only")


def _exception(name: str, message: str) -> BaseException:
    import builtins

    from pcourse.runtime.waits import CollectiveTimeout
    from pcourse.tools.grading.trials import DeadlockError, LeftBehind

    known = {"DeadlockError": DeadlockError, "CollectiveTimeout": CollectiveTimeout,
             "LeftBehind": LeftBehind}
    kind = known.get(name) or getattr(builtins, name, None)
    if isinstance(kind, type) and issubclass(kind, Exception):
        return kind(message)
    return RuntimeError(f"{name}: {message}")


def _relay_classes() -> tuple[type, type]:
    """The worker's communicator and request: mpi4py's own types, so ``isinstance`` holds,
    whose every call goes to the engine (their MPI handles are null: nothing is local)."""
    MPI = _mpi()

    class Comm(MPI.Intracomm):
        def __new__(cls, *args: Any) -> Any:
            return super().__new__(cls)

        def __init__(self, ln: _EngineLink | None, ref: int | None, rank: int, size: int
                     ) -> None:
            object.__setattr__(self, "_ln", ln)
            object.__setattr__(self, "_ref", ref)
            object.__setattr__(self, "_shape", (rank, size))

        def __getattribute__(self, name: str) -> Any:
            if name.startswith("_"):
                return object.__getattribute__(self, name)
            ref, (rank, size) = object.__getattribute__(self, "_ref"), \
                object.__getattribute__(self, "_shape")
            if name in ("rank", "size") or name in ("Get_rank", "Get_size"):
                if ref is None:
                    object.__getattribute__(self, "_ln").call(None, name, (), {})
                value = rank if name.endswith("rank") else size
                return value if name.islower() else (lambda: value)
            if name in ("collectives", "sends", "relay_counting"):
                return object.__getattribute__(self, name)
            ln = object.__getattribute__(self, "_ln")
            if name == "calls":
                return ln.call(ref, "calls", (), {})
            return lambda *args, **kwargs: ln.call(ref, name, args, kwargs)

        def relay_counting(self, timeout: float) -> Any:
            """A CountingComm of this communicator, held by the engine (trials.CountingComm)."""
            ln = object.__getattribute__(self, "_ln")
            return ln.call(object.__getattribute__(self, "_ref"), "relay_counting",
                           (float(timeout),), {})

        def collectives(self) -> list:
            from pcourse.tools.grading.trials import COLLECTIVES

            return [c for c in self.calls if c.name in COLLECTIVES]

        def sends(self) -> list:
            from pcourse.tools.grading.trials import SENDS

            return [c for c in self.calls if c.name in SENDS]

        def __eq__(self, other: object) -> bool:
            return self is other

        def __ne__(self, other: object) -> bool:
            return self is not other

        def __hash__(self) -> int:
            return id(self)

        def __bool__(self) -> bool:
            return True

        def __repr__(self) -> str:
            rank, size = object.__getattribute__(self, "_shape")
            return f"<communicator: rank {rank} of {size}, through the grader>"

    class Request(MPI.Request):
        def __new__(cls, *args: Any) -> Any:
            return super().__new__(cls)

        def __init__(self, ln: _EngineLink, ref: int, views: list[np.ndarray]) -> None:
            self._ln, self._ref, self._views, self._done = ln, ref, views, False

        def _ask(self, method: str) -> Any:
            if self._done:
                return (True, None) if method in ("test", "wait") else (
                    True if method == "Test" else None)
            message = ("call", self._ref, method, (), {})
            send_frame(self._ln.sock, pickle.dumps(message, protocol=PROTOCOL))
            answer = pickle.loads(recv_frame(self._ln.sock))
            if answer[0] == "raise":
                raise _exception(answer[1], answer[2])
            _, result, arrays = answer
            if arrays:
                _write_back(self._views, arrays)
            if completed(result) and method != "Cancel":
                self._done = True
            return result

        def Test(self, status: Any = None) -> bool:
            return bool(self._ask("Test"))

        def Wait(self, status: Any = None) -> bool:
            self._ask("Wait")
            return True

        def Cancel(self) -> None:
            self._ask("Cancel")

        def test(self, status: Any = None) -> tuple[bool, Any]:
            flag, obj = self._ask("test")
            return bool(flag), self._ln.result(obj) if obj is not None else None

        def wait(self, status: Any = None) -> Any:
            _, obj = self._ask("wait")
            return self._ln.result(obj) if obj is not None else None

        @classmethod
        def Waitall(cls, requests: list, statuses: Any = None) -> bool:
            for r in requests:
                r.Wait()
            return True

        @classmethod
        def waitall(cls, requests: list, statuses: Any = None) -> list:
            return [r.wait() for r in requests]

        @classmethod
        def Testall(cls, requests: list, statuses: Any = None) -> bool:
            return all([r.Test() for r in requests])

        def __eq__(self, other: object) -> bool:
            if other is MPI.REQUEST_NULL or (type(other) is MPI.Request
                                             and other == MPI.REQUEST_NULL):
                return self._done
            return self is other

        def __ne__(self, other: object) -> bool:
            return not self == other

        def __hash__(self) -> int:
            return id(self)

    return Comm, Request


RelayComm: Any = None  # the worker's classes, made by main() once mpi4py is imported
RelayRequest: Any = None


def _define(namespace: dict, code: str) -> tuple:
    try:
        exec(compile(code, "<your cell>", "exec"), namespace)  # noqa: S102 - the learner's cell
    except BaseException as exc:  # noqa: BLE001 - SystemExit too: it is the learner's error
        return ("error", type(exc).__name__, str(exc))
    return ("ok",)


def _trial(ln: _EngineLink, payload: bytes, rank: int, size: int, wrank: int, wsize: int
           ) -> tuple:
    from pcourse.tools.grading import trials

    MPI = _mpi()
    try:
        fn, args, kwargs = pickle.loads(payload)
        trials._current = RelayComm(ln, 0, rank, size)
        MPI.COMM_WORLD = RelayComm(ln, 1, wrank, wsize)
        value = fn(*args, **kwargs)
    except BaseException as exc:  # noqa: BLE001 - SystemExit too: it is the learner's error
        return ("error", type(exc).__name__, str(exc), trials._learner_tb(exc))
    finally:
        trials._current = None
        MPI.COMM_WORLD = RelayComm(ln, None, 0, 1)
    try:
        return ("done", pickle.dumps(value, protocol=PROTOCOL))
    except Exception as exc:  # noqa: BLE001 - what the learner's code returned
        return ("error", type(exc).__name__, f"the result could not be sent back: {exc}", "")


CHECK_MODULES = ("pcourse.tools.grading.trials", "pcourse.tools.grading.refs")


def _fresh(namespace: dict) -> None:
    """An empty namespace for the next notebook's cells, and the checks' modules imported
    afresh: what a learner's code patched in them does not outlive its notebook."""
    import importlib

    namespace.clear()
    namespace.update({"__name__": "__main__", "__builtins__": __builtins__})
    for name in CHECK_MODULES:
        sys.modules.pop(name, None)
    for name in CHECK_MODULES:
        importlib.import_module(name)
    sys.modules[CHECK_MODULES[0]].learner_namespace = namespace


def main(path: str) -> None:
    """The worker: listen once at ``path`` for this rank's engine, then do what it asks."""
    global RelayComm, RelayRequest
    import mpi4py

    mpi4py.rc.initialize = False  # no MPI here: every call goes to the engine
    mpi4py.rc.finalize = False
    server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    if os.path.lexists(path):  # one a learner process never connected to left it
        os.unlink(path)
    server.bind(path)
    server.listen(1)
    sock, _ = server.accept()  # the engine's: nobody else may connect afterwards
    server.close()
    os.unlink(path)
    import pcourse.runtime.waits as waits

    MPI = _mpi()
    RelayComm, RelayRequest = _relay_classes()
    ln = _EngineLink(sock)
    MPI.COMM_WORLD = RelayComm(ln, None, 0, 1)
    MPI.Request = RelayRequest
    waits._rank = lambda: getattr(sys.modules[CHECK_MODULES[0]]._current, "rank", -1)
    namespace: dict = {}
    _fresh(namespace)

    def reset() -> tuple:
        sys.modules[CHECK_MODULES[0]].reset()
        _fresh(namespace)
        return ("ok",)

    handlers: dict[str, Callable[..., tuple]] = {
        "define": lambda code: _define(namespace, code),
        "trial": lambda *a: _trial(ln, *a), "reset": reset, "ping": lambda: ("ok",)}
    while True:
        try:
            message = pickle.loads(recv_frame(sock))
        except (EOFError, OSError):
            return
        try:
            answer = handlers[message[0]](*message[1:])
        except Exception as exc:  # noqa: BLE001 - said to the engine, which gives this one up
            answer = ("error", type(exc).__name__, str(exc))
        send_frame(sock, pickle.dumps(answer, protocol=PROTOCOL))


def serve_all(paths: list[str]) -> None:
    """:func:`main` for each of ``paths``: one process each (the ranks of a shared jail)."""
    children = []
    for path in paths:
        pid = os.fork()
        if pid == 0:
            try:
                main(path)
            finally:
                os._exit(0)
        children.append(pid)
    for pid in children:
        os.waitpid(pid, 0)


if __name__ == "__main__":
    serve_all(sys.argv[1:])
