"""A graded learner's process: where, under the grader, one rank's learner code runs.

It runs the learner's cells and the checks' trials, and makes no MPI call of its own:
its communicator (``RelayComm``, mpi4py's own type, so ``isinstance`` holds) and
requests send every call to this rank's grading rank, which makes it and records it
(:mod:`pcourse.tools.grading.relay`). Buffers come back as MPI filled them, into the
learner's own arrays. ``MPI.COMM_WORLD`` is the ranks' world inside a check and refuses
to be used outside one; ``mpi4py`` is imported without initialising MPI. Every message
either way is :mod:`~pcourse.tools.grading.wire` data.

``python -m pcourse.tools.grading.learner SOCKET...`` starts one process per socket (the
grader starts them, each in a jail of its own where it can:
:func:`pcourse.tools.grading.sandbox.start_workers`). Each imports torch and the checks
once, then listens at its socket: for every exercise its rank connects, and a child forked
for that connection runs the exercise's cells and trials, in a namespace of its own,
with the checks' modules as they were imported. The child of the exercise before is
killed first, so nothing a learner's code did in one exercise (a patched module, a
torch.distributed group, a thread) reaches the next.
"""

from __future__ import annotations

import builtins
import importlib
import os
import signal
import socket
import sys
from collections.abc import Callable
from typing import Any

import numpy as np

from pcourse.tools.grading.relay import completed, constants, die_with_parent, receive, send
from pcourse.tools.grading.wire import Made, Mpi, Obj, Ref


def _mpi() -> Any:
    from mpi4py import MPI

    return MPI


class _Link:
    """This process's connection to its rank."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.constants = constants()

    def ask(self, message: tuple) -> tuple:
        send(self.sock, message)
        answer = receive(self.sock)
        if answer[0] == "raise":
            raise _exception(answer[1], answer[2])
        return answer

    def call(self, ref: int | None, method: str, args: tuple, kwargs: dict) -> Any:
        if ref is None:
            raise RuntimeError("under the grader, MPI is reached only inside a check, through "
                               "the comm your function is given")
        views: list[np.ndarray] = []
        lower = method[0].islower()
        _, result, arrays = self.ask((
            "call", ref, method,
            tuple(self.encode(a, views, lower and i == 0) for i, a in enumerate(args)),
            {k: self.encode(v, views, lower and k in ("obj", "sendobj"))
             for k, v in kwargs.items()}))
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
            return value.value
        return value

    def encode(self, value: Any, views: list[np.ndarray], as_object: bool = False) -> Any:
        """An argument as the rank takes it: an object as plain data, a buffer as an array."""
        import torch

        from pcourse.tools.grading import wire

        MPI = _mpi()
        if as_object:
            try:
                wire.dumps(value)
            except TypeError as exc:
                raise TypeError(f"under the grader, MPI's pickle-based calls carry plain data "
                                f"only (numbers, strings, lists, dicts, arrays, tensors): "
                                f"{exc}") from None
            return Obj(value)
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
            if value.dtype.hasobject:
                raise TypeError("an array of Python objects is not a buffer MPI can send")
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
    """What MPI wrote into the rank's buffers, into the learner's own arrays."""
    for view, new in zip(views, arrays, strict=False):
        if not isinstance(new, np.ndarray) or view.shape != new.shape \
                or view.dtype != new.dtype:
            continue
        if view.flags.writeable:
            np.copyto(view, new)  # bit for bit: a send buffer gets its own bytes back
        elif view.tobytes("A") != new.tobytes("A"):
            raise BufferError("MPI received into an array that is read-only")


def _exception(name: str, message: str) -> BaseException:
    from pcourse.runtime.waits import CollectiveTimeout
    from pcourse.tools.grading.trials import DeadlockError, LeftBehind

    known = {"DeadlockError": DeadlockError, "CollectiveTimeout": CollectiveTimeout,
             "LeftBehind": LeftBehind}
    kind = known.get(name) or getattr(builtins, name, None)
    if isinstance(kind, type) and issubclass(kind, Exception):
        return kind(message)
    return RuntimeError(f"{name}: {message}")


def _relay_classes() -> tuple[type, type]:
    """The learner process's communicator and request: mpi4py's own types, so
    ``isinstance`` holds, whose every call goes to the rank (their MPI handles are null:
    nothing is local)."""
    MPI = _mpi()
    # mpi4py's classes, as _mpi() gives them (Any): mypy takes no base class from a variable
    intracomm: Any = MPI.Intracomm
    request: Any = MPI.Request

    class Comm(intracomm):
        def __new__(cls, *args: Any) -> Any:
            return super().__new__(cls)

        def __init__(self, ln: _Link | None, ref: int | None, rank: int, size: int) -> None:
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
            """A CountingComm of this communicator, held by the rank (trials.CountingComm)."""
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

    class Request(request):
        def __new__(cls, *args: Any) -> Any:
            return super().__new__(cls)

        def __init__(self, ln: _Link, ref: int, views: list[np.ndarray]) -> None:
            self._ln, self._ref, self._views, self._done = ln, ref, views, False

        def _ask(self, method: str) -> Any:
            if self._done:
                return (True, None) if method in ("test", "wait") else (
                    True if method == "Test" else None)
            _, result, arrays = self._ln.ask(("call", self._ref, method, (), {}))
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


RelayComm: Any = None  # the classes, made once mpi4py is imported
RelayRequest: Any = None


# ---------------------------------------------------------------- one exercise (a child)

def _define(namespace: dict, code: str) -> tuple:
    try:
        exec(compile(code, "<your cell>", "exec"), namespace)  # the learner's cell
    except BaseException as exc:  # noqa: BLE001 - SystemExit too: it is the learner's error
        return ("error", type(exc).__name__, str(exc))
    return ("ok",)



def _trial(ln: _Link, namespace: dict, module: str, name: str, args: tuple, kwargs: dict,
           rank: int, size: int, wrank: int, wsize: int) -> tuple:
    from pcourse.tools.grading import trials, wire

    MPI = _mpi()
    try:
        if not module.startswith("pcourse.tools.grading."):
            raise ValueError(f"{module} holds no trial")
        fn = getattr(importlib.import_module(module), name)
        args, kwargs = wire.resolve(args, namespace), wire.resolve(kwargs, namespace)
        trials._current = RelayComm(ln, 0, rank, size)
        MPI.COMM_WORLD = RelayComm(ln, 1, wrank, wsize)
        value = fn(*args, **kwargs)
    except BaseException as exc:  # noqa: BLE001 - SystemExit too: it is the learner's error
        return ("error", type(exc).__name__, str(exc), trials._learner_tb(exc))
    finally:
        trials._current = None
        MPI.COMM_WORLD = RelayComm(ln, None, 0, 1)
    try:
        return ("done", wire.dumps(value))
    except TypeError as exc:
        return ("error", "TypeError", f"the result could not be sent back: {exc}", "")


def serve(sock: socket.socket) -> None:
    """One exercise: the learner's cells and the checks' trials, as the rank asks."""
    global RelayComm, RelayRequest
    import pcourse.runtime.waits as waits
    from pcourse.tools.grading import trials

    MPI = _mpi()
    RelayComm, RelayRequest = _relay_classes()
    ln = _Link(sock)
    MPI.COMM_WORLD = RelayComm(ln, None, 0, 1)
    MPI.Request = RelayRequest
    waits._rank = lambda: getattr(trials._current, "rank", -1)
    namespace: dict = {"__name__": "__main__", "__builtins__": builtins}
    handlers: dict[str, Callable[..., tuple]] = {
        "define": lambda code: _define(namespace, code),
        "trial": lambda *a: _trial(ln, namespace, *a), "ping": lambda: ("ok",)}
    while True:
        try:
            message = receive(sock)
        except (EOFError, OSError):
            return
        try:
            answer = handlers[message[0]](*message[1:])
        except Exception as exc:  # noqa: BLE001 - said to the rank, which gives this one up
            answer = ("error", type(exc).__name__, str(exc))
        send(sock, answer)


# ---------------------------------------------------------------- the process (a zygote)

# What an exercise's cells and trials import: imported once here, before any fork.
WARM = ("numpy", "torch", "torch.distributed", "pcourse.backends", "pcourse.workloads.transformer",
        "pcourse.tools.grading.trials", "pcourse.tools.grading.refs")


def warm_up() -> None:
    """What a process pays for once, paid here, before any fork: the modules an exercise
    imports, and torch's first optimizer step and backward (seconds on a busy machine,
    which each exercise's child would otherwise pay again)."""
    import torch

    for name in WARM:
        importlib.import_module(name)
    importlib.import_module("pcourse.tools.grading.refs").load_all()
    weight = torch.zeros(2, requires_grad=True)
    torch.nn.functional.gelu(weight * 2).sum().backward()
    torch.optim.AdamW([weight]).step()


def _no_mpi_here() -> None:
    import mpi4py

    mpi4py.rc.initialize = False  # no MPI here: every call goes to the rank
    mpi4py.rc.finalize = False


def listen(path: str) -> None:
    """Listen at ``path`` for this rank's connections: a fresh child for each (the one
    before it killed first). The process is warmed up (:func:`warm_up`) before."""
    signal.signal(signal.SIGCHLD, signal.SIG_IGN)  # children are reaped by the kernel
    if os.path.lexists(path):
        os.unlink(path)
    server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    server.bind(path)
    server.listen(4)
    child = 0
    while True:
        sock, _ = server.accept()
        if child:
            _kill(child)
        child = os.fork()
        if child == 0:
            server.close()
            die_with_parent()
            os.setpgid(0, 0)  # its process group: killed whole when the next one comes
            signal.signal(signal.SIGCHLD, signal.SIG_DFL)
            try:
                serve(sock)
            finally:
                os._exit(0)
        sock.close()


def _kill(pid: int) -> None:
    for target in (-pid, pid):
        try:
            os.kill(target, signal.SIGKILL)
        except OSError:
            pass


def main(paths: list[str]) -> None:
    """:func:`listen` for each of ``paths``: one process each (the ranks of a shared jail),
    forked after one warm-up, so that a shared jail pays for torch's import once, not once
    per rank."""
    _no_mpi_here()
    warm_up()
    if len(paths) == 1:
        listen(paths[0])
        return
    children = []
    for path in paths:
        pid = os.fork()
        if pid == 0:
            die_with_parent()
            try:
                listen(path)
            finally:
                os._exit(0)
        children.append(pid)
    for pid in children:
        os.waitpid(pid, 0)


if __name__ == "__main__":
    main(sys.argv[1:])
