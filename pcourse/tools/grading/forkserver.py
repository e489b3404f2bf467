"""Kernels forked from a warm process, so that a grader's kernel starts in a blink.

A fresh kernel spends most of its start importing torch, numpy and the course, and the
grader starts one for every notebook: on a class, that import is a large part of the
grader's time. So each grader worker keeps one server that imports them once
(:data:`PRELOAD`) and forks for every kernel. A forked kernel is still a process of its
own: its own globals and kernel state, its own session (signalled as a group, like one
jupyter_client starts), nothing shared with the notebook before it.

Why forking is safe here: the server only imports. It starts no thread of its own (only
OpenBLAS's pool, which handles fork), opens no zmq context or event loop, and does not
initialise MPI (``mpi4py.MPI`` would, on import: each kernel imports it itself). A
fork's copy of numpy's global seed is replaced by one from the OS, as a fresh process
would have. The kernel runs the grader's trusted cells only; learner code runs on the
engines, in the jail (:mod:`pcourse.tools.grading.sandbox`).

The server is ``python -m pcourse.tools.grading.forkserver``: one JSON request per line
on its stdin (argv, env, cwd), the child's pid per line on its stdout; it ends at EOF.
"""

from __future__ import annotations

import json
import os
import select
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from jupyter_client.provisioning import LocalProvisioner

# What every kernel imports first (runner.WARM_UP), less mpi4py.MPI, which starts MPI.
PRELOAD = ("numpy", "torch", "ipyparallel", "ipykernel.kernelapp", "pcourse.tools.grading.refs")
LAUNCHER = ["-m", "ipykernel_launcher"]  # the kernelspec's argv after the Python


class Unavailable(RuntimeError):
    """The server did not start or stopped answering: the caller starts kernels as usual."""


class Server:
    """A warm process that forks kernels (started now; warm by the time the first is asked)."""

    def __init__(self) -> None:
        self.process = subprocess.Popen(
            [sys.executable, "-m", "pcourse.tools.grading.forkserver"], stdin=subprocess.PIPE,
            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
        self.ready = False

    def _line(self, deadline: float) -> str:
        while time.monotonic() < deadline:
            if select.select([self.process.stdout], [], [], deadline - time.monotonic())[0]:
                line = self.process.stdout.readline()
                if not line:
                    break
                return line.strip()
        raise Unavailable("the kernel fork server did not answer")

    def fork(self, argv: list[str], env: dict[str, str], cwd: str, timeout: float) -> Forked:
        """A kernel running ``argv`` (the kernelspec's, this Python's ipykernel) as a child of
        the server, within ``timeout`` seconds (the first call waits for the server's imports).

        A server that fails once is killed and never asked again, so that no kernel it forks
        late can take the ports of the one started instead."""
        if argv[0] != sys.executable or argv[1:3] != LAUNCHER:
            raise Unavailable(f"only this Python's ipykernel is forked, not {argv[:3]}")
        if self.process.poll() is not None:
            raise Unavailable("the kernel fork server has ended")
        deadline = time.monotonic() + timeout
        try:
            if not self.ready and self._line(deadline) != "ready":
                raise Unavailable("the kernel fork server did not start")
            self.ready = True
            self.process.stdin.write(json.dumps({"argv": argv[3:], "env": env, "cwd": cwd}) + "\n")
            self.process.stdin.flush()
            pid = int(self._line(deadline))
        except (OSError, ValueError, Unavailable) as exc:
            self.process.kill()
            raise Unavailable(f"the kernel fork server failed: {exc}") from exc
        try:
            return Forked(pid)
        except OSError as exc:  # no pidfd on this machine: nothing to watch it by
            os.kill(pid, signal.SIGKILL)
            self.process.kill()
            raise Unavailable(f"cannot watch a forked kernel: {exc}") from exc

    def close(self) -> None:
        """End the server (its kernels end as they notice: see :func:`_become_kernel`)."""
        try:
            self.process.stdin.close()
            self.process.wait(timeout=10)
        except (OSError, subprocess.TimeoutExpired):
            self.process.kill()
            self.process.wait()


class Forked:
    """A forked kernel, as jupyter_client uses a Popen: poll, wait, signals.

    It is the server's child, not ours, so it is watched through a pidfd (which names
    this process, never a later one given the same pid); the server reaps it, so its
    exit status is not known (``returncode`` is -1 once it has ended).
    """

    def __init__(self, pid: int) -> None:
        self.pid = pid
        self.returncode: int | None = None
        self.stdout = self.stderr = self.stdin = None
        try:
            self._fd: int | None = os.pidfd_open(pid)
        except ProcessLookupError:  # ended already
            self._fd, self.returncode = None, -1

    def poll(self) -> int | None:
        if self.returncode is None and select.select([self._fd], [], [], 0)[0]:
            self.returncode = -1
            os.close(self._fd)
            self._fd = None
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        if self.poll() is None and not select.select([self._fd], [], [], timeout)[0]:
            raise subprocess.TimeoutExpired(f"kernel {self.pid}", timeout)
        return self.poll()

    def send_signal(self, signum: int) -> None:
        if self.poll() is None:
            signal.pidfd_send_signal(self._fd, signum)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)


class Provisioner(LocalProvisioner):
    """jupyter_client's local provisioner, launching through a :class:`Server`, or as usual
    where the server is unavailable."""

    server: Server | None = None
    timeout: float = 120.0  # for the server's first answer: its imports, on a loaded machine

    async def launch_kernel(self, cmd: list[str], **kwargs: Any) -> Any:
        if self.server is None:
            return await super().launch_kernel(cmd, **kwargs)
        cwd = kwargs.get("cwd") or Path.cwd()
        try:
            self.process = self.server.fork(cmd, kwargs.get("env") or dict(os.environ), str(cwd),
                                            self.timeout)
        except Unavailable:
            return await super().launch_kernel(cmd, **kwargs)
        self.pid = self.pgid = self.process.pid  # a session of its own: its group is its pid
        self.cwd = cwd
        return self.connection_info


# ---------------------------------------------------------------- in the server

def _serve() -> dict:
    """Import, then fork for each request; return (in the child only) the request."""
    import importlib

    for name in PRELOAD:
        importlib.import_module(name)
    signal.signal(signal.SIGCHLD, signal.SIG_IGN)  # children reaped by the OS as they end
    print("ready", flush=True)
    while line := sys.stdin.readline():
        request = json.loads(line)
        pid = os.fork()
        if pid == 0:
            return request
        print(pid, flush=True)
    sys.exit(0)


def _become_kernel(request: dict) -> None:
    """Turn the forked child into what ``python -m ipykernel_launcher ARGV`` would be."""
    import numpy as np

    signal.signal(signal.SIGCHLD, signal.SIG_DFL)
    os.setsid()  # signalled as a group, as a kernel jupyter_client starts is
    null = os.open(os.devnull, os.O_RDWR)
    for fd in (0, 1, 2):  # the server's pipes closed; output goes where the grader's kernels' did
        os.dup2(null, fd)
    os.close(null)
    os.chdir(request["cwd"])
    os.environ.clear()
    os.environ.update(request["env"])
    np.random.seed()  # fresh from the OS, not the server's copy
    # The kernel ends when the server does (as when its worker is killed). Said in argv:
    # ipykernel read $JPY_PARENT_PID when the server imported it.
    argv = [*request["argv"], f"--IPKernelApp.parent_handle={os.getppid()}"]
    os.environ["JPY_PARENT_PID"] = str(os.getppid())
    sys.argv = [sys.executable, *argv]
    from ipykernel import kernelapp

    kernelapp.launch_new_instance(argv=argv)


if __name__ == "__main__":
    if sys.path[0] == "" or Path(sys.path[0]) == Path.cwd():
        del sys.path[0]  # as ipykernel_launcher: the kernel adds its own folder back
    _become_kernel(_serve())
