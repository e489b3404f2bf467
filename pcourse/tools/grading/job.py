"""One learner's grading job, as the grader holds it: MPI ranks and their learner processes.

A :class:`Job` starts :data:`RANKS` learner processes (:mod:`pcourse.tools.grading.learner`),
each in a jail of its own where there is bubblewrap
(:func:`pcourse.tools.grading.sandbox.start_workers`), and one MPI job of as many ranks
(:mod:`pcourse.tools.grading.rank`), in a jail of its own too, whose rank k makes rank
k's MPI calls. The ranks connect to a unix socket of the grader's, the only channel
between the job and the grader: the grader asks, each rank answers, in
:mod:`~pcourse.tools.grading.wire` data (never a pickle).

For each exercise the grader opens the learner's code (:meth:`Job.open`: a fresh child
of every learner process runs it), then runs the checks' trials (:meth:`Job.trial`).
Every wait has a deadline; a job that misses one, or whose ranks or learner processes
died, is :attr:`Job.broken`, and the grader starts another for the learner's next
exercise. :meth:`Job.close` kills all of it and waits until every process of its jails
is gone.
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from pcourse.tools.grading import relay, sandbox
from pcourse.tools.grading.checks import ExerciseError
from pcourse.tools.grading.relay import ENGINE_DIED, die_with_parent

RANKS = 4  # the checks run at 2, 3 and 4 ranks (checks.GRADER_SIZES)
START_TIMEOUT = 120.0  # seconds for the ranks to start and say hello (a loaded machine)
SLACK = 15.0  # seconds a rank may answer after its own deadline (it gives up before)


class JobError(RuntimeError):
    """The job could not do what was asked: it died, or missed a deadline (then broken)."""


def _environment() -> dict[str, str]:
    """What the job's processes see: no variable of the grader's (nothing there says
    "graded"), what MPI needs, one thread each (ranks share the cores)."""
    from pcourse.tools.cluster.launch import ONE_MACHINE_ENV

    keep = ("LANG", "LC_ALL", "TZ", "UCX_NET_DEVICES", "OMPI_MCA_btl_tcp_if_include")
    env = {k: os.environ[k] for k in keep if k in os.environ}
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}/usr/local/bin:/usr/bin:/bin"
    env.update(ONE_MACHINE_ENV, OMP_NUM_THREADS="1", PYTHONDONTWRITEBYTECODE="1")
    return env


class Job:
    """One learner's ranks and learner processes, jailed where ``jailed``."""

    runs_trials = True  # what the checks run their trials on (checks.run), not a cluster

    def __init__(self, jailed: bool, n: int = RANKS, timeout: float = START_TIMEOUT) -> None:
        self.n, self.jailed, self.broken = n, jailed, ""
        self.opened = 0  # exercises opened so far: the version of the learner's code
        self.folder = Path(tempfile.mkdtemp(prefix=f"pcourse-grade-{os.getpid()}-"))
        self.processes: list[subprocess.Popen] = []
        self.spaces: set[int] = set()  # the PID namespaces of its jails
        self.networked: list[subprocess.Popen] = []  # the shared jail's, while one is open
        self.ranks: list[socket.socket] = []
        try:
            self._start(timeout)
        except BaseException:
            self.close()
            raise

    # ------------------------------------------------------------ starting

    def _start(self, timeout: float) -> None:
        sockets = self.folder / "sockets"
        for d in (sockets, self.folder / "relay"):
            d.mkdir()
            os.chmod(d, 0o777)  # the jail's nobody connects and listens there
        server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        server.bind(str(sockets / "grader"))
        os.chmod(sockets / "grader", 0o777)
        server.listen(self.n)
        try:
            self.processes += self._learners(apart=True)
            self.processes.append(self._mpi(sockets))
            self.ranks = self._accept(server, timeout)
        finally:
            server.close()

    def _learners(self, apart: bool) -> list[subprocess.Popen]:
        """The learner processes: each in a jail of its own, or (not ``apart``) all in one."""
        if self.jailed:
            started = sandbox.start_workers(self.folder, self.n, apart, env=_environment())
            self.spaces |= sandbox.worker_namespaces(started)
            return started
        relay_dir = self.folder / "relay"
        where = [relay_dir / (str(k) if apart else f"net-{k}") for k in range(self.n)]
        for w in where:
            w.mkdir(exist_ok=True)
        command = [sys.executable, "-m", "pcourse.tools.grading.learner"]
        groups = [[w] for w in where] if apart else [where]
        return [subprocess.Popen([*command, *(str(w / "sock") for w in mine)],
                                 env=_environment(), stdin=subprocess.DEVNULL,
                                 stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                 start_new_session=True, preexec_fn=die_with_parent)
                for mine in groups]

    def _mpi(self, sockets: Path) -> subprocess.Popen:
        from pcourse.tools.cluster.launch import mpi_launcher

        launcher = mpi_launcher()
        env = {**_environment(), **launcher.env}
        prefix = sandbox.prefix(self.folder, sockets, self.folder / "seccomp.bpf",
                                groups=sandbox.cgroups(self.folder, fresh=False),
                                relay=self.folder / "relay", env=env) if self.jailed else []
        command = [*prefix, *launcher.command, "-n", str(self.n), *launcher.wrap,
                   sys.executable, "-m", "pcourse.tools.grading.rank", str(sockets / "grader")]
        with open(self.folder / "mpi.log", "wb") as log:
            process = subprocess.Popen(command, env=env, stdin=subprocess.DEVNULL,
                                       stdout=subprocess.DEVNULL, stderr=log,
                                       start_new_session=True, preexec_fn=die_with_parent)
        if self.jailed:
            self.spaces |= sandbox.worker_namespaces([process])
        return process

    def _accept(self, server: socket.socket, timeout: float) -> list[socket.socket]:
        deadline = time.monotonic() + timeout
        found: dict[int, socket.socket] = {}
        while len(found) < self.n:
            server.settimeout(max(0.1, min(1.0, deadline - time.monotonic())))
            try:
                sock, _ = server.accept()
            except TimeoutError:
                ended = self.processes[-1].poll()
                if ended is not None or time.monotonic() > deadline:
                    raise JobError(self._start_failure(ended, timeout)) from None
                continue
            hello = relay.receive(sock, deadline)
            if not (isinstance(hello, tuple) and len(hello) == 2 and hello[0] == "hello"
                    and isinstance(hello[1], int) and 0 <= hello[1] < self.n
                    and hello[1] not in found):
                raise JobError(f"a rank said {hello!r} where it says hello and its rank")
            found[hello[1]] = sock
        return [found[k] for k in range(self.n)]

    def _start_failure(self, ended: int | None, timeout: float) -> str:
        if ended is None:
            return f"the grader's {self.n} ranks did not start within {timeout:g} s"
        log = (self.folder / "mpi.log").read_text(errors="replace")
        tail = "\n".join(log.strip().splitlines()[-5:])
        return f"the grader's MPI job ended as it started (exit {ended}): {tail or 'no output'}"

    # ------------------------------------------------------------ asking

    def _ask(self, messages: list[tuple], timeout: float) -> list:
        """Send rank k ``messages[k]``; their answers in rank order, or JobError (then broken)."""
        if self.broken:
            raise JobError(self.broken)
        try:
            for sock, message in zip(self.ranks, messages, strict=True):
                relay.send(sock, message)
            deadline = time.monotonic() + timeout + SLACK
            return [relay.receive(sock, deadline) for sock in self.ranks]
        except TimeoutError:
            self.broken = (f"the ranks are still busy with code that did not finish within "
                           f"{timeout:g} s")
        except (EOFError, OSError):
            self.broken = ENGINE_DIED
        raise JobError(self.broken)

    def open(self, codes: Sequence[str], networked: bool, timeout: float) -> tuple:
        """Run the learner's ``codes`` (imports, then cells) in a fresh child of every learner
        process; ``("ok",)``, or the first rank's other answer (``("error", name,
        message)``, ``("timeout",)``, ``("died",)``). ``networked``: in learner processes
        that share one jail (a network), started for the exercise.
        """
        self._share_network(networked)
        self.opened += 1
        where = [self.folder / "relay" / (f"net-{k}" if networked else str(k)) / "sock"
                 for k in range(self.n)]
        answers = self._ask([("open", str(w), list(codes), timeout) for w in where],
                            timeout * (len(codes) + 1) + relay.CONNECT_TIMEOUT)
        return next((a for a in answers if a != ("ok",)), ("ok",))

    def _share_network(self, networked: bool) -> None:
        """Learner processes in one shared jail while an exercise needs them, none after."""
        if networked and not self.networked:
            self.networked = self._learners(apart=False)
        elif not networked and self.networked:
            self._stop(self.networked)
            self.networked = []

    def trial(self, spec: tuple, ranks: int, timeout: float) -> tuple[list[dict | None], bool]:
        """Every rank's outcome of ``spec`` (module, name, args, kwargs) at ``ranks`` ranks,
        in world-rank order (None outside the trial's world), and whether all finished;
        ExerciseError where the job died, or was broken before."""
        if self.broken:
            raise ExerciseError(f"at {ranks} ranks, {self.broken}: the checks after it cannot "
                                "run on this job")
        try:
            answers = self._ask([("trial", ranks, spec, timeout)] * self.n, timeout)
        except JobError:
            if self.broken == ENGINE_DIED:
                raise ExerciseError(f"at {ranks} ranks, {ENGINE_DIED}") from None
            return [None] * self.n, False
        return [a if isinstance(a, dict) or a is None else
                {"rank": None, "error": ("TamperError", f"a rank answered {a!r}", "")}
                for a in answers], True

    # ------------------------------------------------------------ ending

    def _stop(self, processes: list[subprocess.Popen]) -> None:
        """Kill ``processes`` and what they started, and wait for them."""
        below = [] if self.jailed else [c for p in processes for c in _descendants(p)]
        for p in processes:
            _kill_group(p)
        for c in below:  # unjailed: the children of each exercise, in groups of their own
            _kill_group(c)
        sandbox.stop_workers(processes)

    def close(self) -> None:
        """Kill every process of the job and its jails, and wait until they are gone."""
        for sock in self.ranks:
            sock.close()
        self._stop([*self.processes, *self.networked])
        if self.jailed:
            sandbox.end(self.spaces, self.folder)
        shutil.rmtree(self.folder, ignore_errors=True)


def _kill_group(process: Any) -> None:
    import signal

    for kill, target in ((os.killpg, process.pid), (os.kill, process.pid)):
        try:
            kill(target, signal.SIGKILL)
        except OSError:
            pass


def _descendants(process: subprocess.Popen) -> list[Any]:
    import psutil

    try:
        return psutil.Process(process.pid).children(recursive=True)
    except psutil.Error:
        return []


def leftovers() -> list[Any]:
    """This process's descendants still alive (unjailed learner code that left a process
    behind: this process is their subreaper, :func:`adopt_orphans`)."""
    import psutil

    return psutil.Process().children(recursive=True)


def adopt_orphans() -> None:
    """Make this process the subreaper of what it starts: a process a learner's code leaves
    behind (double-forked, in a session of its own) is re-parented here, not to init, and
    :func:`leftovers` finds it. (Linux; elsewhere nothing happens.)"""
    import ctypes

    try:
        ctypes.CDLL(None, use_errno=True).prctl(36, 1, 0, 0, 0)  # PR_SET_CHILD_SUBREAPER
    except (OSError, AttributeError):
        pass
