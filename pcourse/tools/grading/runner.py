"""Run prepared notebooks on a few worker processes, each with a cluster per learner.

Each job names its ``owner`` (the learner): a worker starts a fresh cluster of
:data:`ENGINES` engines for every owner, in the jail of
:mod:`pcourse.tools.grading.sandbox` where bubblewrap is installed, each engine with a
learner process of its own, jailed apart, that runs the learner's code
(:mod:`pcourse.tools.grading.relay`), so no process that ran one learner's code ever
runs another's; the parent hands a worker the next
notebook of the learner it has, so each learner's cluster starts once. Each notebook
runs in a fresh kernel that attaches to the cluster
(:func:`pcourse.tools.grading.harness.start_cluster`), forked from the worker's warm
server (:mod:`pcourse.tools.grading.forkserver`) where it can be. Between one learner's
notebooks the worker checks that every engine still answers through MPI, and resets what the
code could leave behind (namespaces, a torch.distributed group, torch defaults,
environment variables); when a notebook left the engines stuck, killed one, or
ran out of time, the worker starts a fresh cluster. Jobs without an owner (the test
suite's own trusted notebooks) share one cluster per worker.

What can go wrong is contained at three levels: a cell past the notebook's time
limit is stopped and its kernel killed (by the worker); a worker that stops
answering is killed with everything it started (by the parent, which then starts
another); and at the end, every process that carries this run's mark in its
environment is killed, so no engine, controller or mpiexec outlives the run.
"""

from __future__ import annotations

import multiprocessing
import os
import shutil
import subprocess
import sys
import tempfile
import time
import uuid
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from multiprocessing.connection import Connection, wait
from pathlib import Path
from typing import Any

ENGINES = 4  # per worker: the checks run at 2, 3 and 4 ranks (checks.GRADER_SIZES)
START_ALLOWANCE = 180.0  # seconds a worker may spend (re)starting its cluster
RUN_MARK = "PCOURSE_GRADE_RUN"  # every process of one grading run carries it
WORKER_MARK = "PCOURSE_GRADE_WORKER"  # and every process of one worker this one
HIDE_ENV = "PCOURSE_GRADER_HIDE"  # paths the engines must not see (os.pathsep between)
FORK_ENV = "PCOURSE_GRADER_FORK"  # 0: every kernel a fresh Python, not forked (slower)
# Exercises whose learner code opens sockets between its ranks (04 starts Gloo): their
# learner processes share one jail (a network), where every other exercise's have one each.
NETWORKED = ("04_gloo_bootstrap",)


@dataclass
class Job:
    key: Any
    notebook: dict  # the notebook to run, as nbformat JSON
    limit: float  # seconds for the whole notebook, kernel start included
    owner: str | None = None  # whose code: a fresh cluster for each (None: trusted, shared)
    # Stop after the first of these cells that fails (raises, or prints other than its
    # text where one is given); None: run every cell.
    stop_at: dict[int, str | None] | None = None
    # The learner processes behind the engines (:mod:`pcourse.tools.grading.relay`) each
    # in a jail of its own; False: all in one (NETWORKED).
    apart: bool = True


@dataclass
class Executed:
    """What running a notebook gave: every code cell's output, and why it stopped early."""

    stdout: dict[int, str] = field(default_factory=dict)  # cell index -> stdout
    errors: dict[int, tuple[str, str]] = field(default_factory=dict)  # cell -> (ename, evalue)
    stopped: tuple[str, int] | None = None  # ("timeout" | "died", cell) or ("grader", -1)
    detail: str = ""  # for "grader": what went wrong
    seconds: float = 0.0
    first_failure: int | None = None  # the cell of Job.stop_at that failed (nothing ran after)

    def passed(self, cell: int, expected: str | None = None) -> bool:
        """The one rule for a cell that passed: it raised nothing and, where ``expected`` is
        given, printed exactly that (blank space around it aside): a check passes by
        printing the solution's line, so a check that prints PASS beside more fails."""
        return cell not in self.errors and (
            expected is None or self.stdout.get(cell, "").strip() == expected.strip())


# ---------------------------------------------------------------- in the worker

def _healthy(mc: Any, engines: int) -> bool:
    from pcourse.tools.grading import relay

    try:
        if len(mc.client.ids) < engines:
            return False
        view = mc.client[sorted(mc.client.ids)]
        return all(view.apply_async(relay.health).get(timeout=15))
    except Exception:  # noqa: BLE001 - any failure means: start afresh
        return False


def _ready(mc: Any, engines: int, where: Path, apart: bool = True) -> Any:
    """A cluster whose engines all answer, reset for the next notebook.

    Its client connection file is copied to ``where``, the one path every kernel of
    this worker is told about, so kernels started before a restart find the new one.
    The cluster runs in the jail (:mod:`pcourse.tools.grading.sandbox`) where it can,
    with a learner process per engine (:mod:`pcourse.tools.grading.relay`), each in a
    jail of its own, or all in one where not ``apart`` (started afresh when that
    changes); a file beside ``where`` says whether there are learner processes.
    """
    from pcourse.tools.cluster import start_cluster
    from pcourse.tools.grading import relay, sandbox
    from pcourse.tools.grading.harness import RELAY_SUFFIX
    from pcourse.utils.io import atomic_write

    if mc is not None and not _healthy(mc, engines):
        _discard(mc)
        mc = None
    if mc is None:
        hidden = [h for h in os.environ.get(HIDE_ENV, "").split(os.pathsep) if h]
        jail = sandbox.jail if sandbox.available()[0] else None
        mc = start_cluster(engines, contain=True, hide=hidden, jail=jail)
        mc.jailed = sandbox.namespaces(mc) if jail else set()
        mc.workers, mc.apart = [], None  # started below, of the kind the notebook needs
        mc.relayable = jail is not None
        c = mc.cluster
        source = Path(c.profile_dir) / "security" / f"ipcontroller-{c.cluster_id}-client.json"
        with atomic_write(where) as f:
            f.write(source.read_text())
    ids = sorted(mc.client.ids)
    if mc.relayable and mc.apart != apart:  # of the other kind: none of theirs survives
        mc.client[ids].apply_async(relay.forget).get(timeout=30)
        sandbox.stop_workers(mc.workers)
        mc.workers = sandbox.start_workers(mc.folder, engines, apart)
        mc.jailed |= sandbox.worker_namespaces(mc.workers)
        mc.apart = apart
    mc.client.clear(targets=ids, block=False).result(timeout=30)
    mc.client[ids].apply_async(relay.reset).get(timeout=180)  # the first waits for the workers
    with atomic_write(Path(f"{where}{RELAY_SUFFIX}")) as f:
        f.write("1" if mc.workers else "0")
    return mc


def _ready_or_retry(mc: Any, engines: int, where: Path, apart: bool = True) -> Any:
    """:func:`_ready`, and once more with a fresh cluster if that fails.

    A cluster that fails to start or reset on a loaded machine is the grader's
    problem: it must not cost a learner the grade of the notebook that came next.
    """
    try:
        return _ready(mc, engines, where, apart)
    except Exception:  # noqa: BLE001 - the second attempt's error is the one reported
        if mc is not None:
            _discard(mc)
        return _ready(None, engines, where, apart)


def _discard(mc: Any) -> None:
    """Kill a cluster whose engines no longer answer (stuck in MPI, or dead).

    Not through stop_cluster: that asks the engines to shut down and waits for
    their answer, which stuck engines never give.
    """
    from pcourse.tools.grading import sandbox

    mc.client.close()
    _reap(WORKER_MARK, os.environ[WORKER_MARK], spare=_own_pids())
    sandbox.stop_workers(getattr(mc, "workers", []))
    sandbox.end(getattr(mc, "jailed", set()), mc.folder)
    try:
        mc.cluster.stop_cluster_sync()  # its processes are gone: this only tidies up
    except Exception:  # noqa: BLE001 - nothing left to stop
        pass


def _retire(mc: Any, engines: int) -> None:
    """Stop a cluster for good, and wait until every process of its jail is gone: asked to
    stop where its engines answer, and killed (:func:`_discard`) where they do not or
    where stopping it failed."""
    from pcourse.tools.cluster import stop_cluster
    from pcourse.tools.grading import sandbox

    try:
        if _healthy(mc, engines):
            stop_cluster(mc)
            sandbox.stop_workers(getattr(mc, "workers", []))
            sandbox.end(getattr(mc, "jailed", set()), mc.folder)
            return
    except Exception:  # noqa: BLE001 - killed below, whatever was left
        pass
    _discard(mc)


def _kernel_manager() -> Any:
    """A kernel on this very Python (the venv's), whatever kernelspecs are installed: forked
    from this worker's warm server (:mod:`pcourse.tools.grading.forkserver`) where it has one."""
    from jupyter_client.kernelspec import KernelSpec, KernelSpecManager
    from jupyter_client.manager import AsyncKernelManager

    from pcourse.tools.grading import forkserver

    class ThisPython(KernelSpecManager):
        def get_kernel_spec(self, kernel_name: str) -> KernelSpec:
            return KernelSpec(argv=[sys.executable, "-m", "ipykernel_launcher", "-f",
                                    "{connection_file}"], display_name="grader",
                              language="python")

    km = AsyncKernelManager(kernel_spec_manager=ThisPython(), kernel_name="python3",
                            kernel_id=str(uuid.uuid4()))
    km.provisioner = forkserver.Provisioner(kernel_id=km.kernel_id, kernel_spec=km.kernel_spec,
                                            parent=km)
    km.provisioner.server = _server
    return km


# What every exercise's first cell imports: a kernel started ahead of its notebook
# imports it while the worker runs the notebook before.
WARM_UP = "import numpy, torch, mpi4py.MPI, ipyparallel\nimport pcourse.tools.grading.refs"

_kernels: list[Kernel] = []
_server: Any = None  # the worker's kernel fork server, where it has one


def _own_pids() -> set[int]:
    """The grader's own processes in a worker, spared when a cluster is killed by its mark."""
    return {k.km.provisioner.pid for k in _kernels if k.km and k.km.provisioner
            and getattr(k.km.provisioner, "pid", None)} | (
        {_server.process.pid} if _server is not None else set())


class Kernel:
    """A fresh kernel in a fresh folder, started now, warming up in the background."""

    def __init__(self) -> None:
        from jupyter_core.utils import run_sync

        self.cwd = tempfile.mkdtemp(prefix="pcourse-grade-")
        self.km = _kernel_manager()
        run_sync(self.km.start_kernel)(cwd=self.cwd, stdout=subprocess.DEVNULL,
                                       stderr=subprocess.DEVNULL)
        self.kc = self.km.client()
        self.kc.start_channels()
        self.warming = self.kc.execute(WARM_UP, store_history=False)
        _kernels.append(self)

    def alive(self) -> bool:
        """Is the kernel's process still running (a spare may have been killed meanwhile)?"""
        process = getattr(self.km.provisioner, "process", None) if self.km.provisioner else None
        return process is not None and process.poll() is None

    def warm(self, timeout: float) -> None:
        """Wait until the warm-up has run (a kernel that died is caught when used)."""
        from jupyter_core.utils import run_sync

        deadline = time.monotonic() + timeout
        try:
            while time.monotonic() < deadline:
                reply = run_sync(self.kc.get_shell_msg)(timeout=deadline - time.monotonic())
                if reply["parent_header"].get("msg_id") == self.warming:
                    break
        except Exception:  # noqa: BLE001 - queue.Empty on timeout: the notebook's limit decides
            pass
        self.kc.stop_channels()

    def close(self) -> None:
        from jupyter_core.utils import run_sync

        try:
            if self.km.has_kernel:
                run_sync(self.km.shutdown_kernel)(now=True)
        except Exception:  # noqa: BLE001 - already dead
            pass
        shutil.rmtree(self.cwd, ignore_errors=True)
        if self in _kernels:
            _kernels.remove(self)


def execute(notebook: dict, limit: float, kernel: Kernel | None = None,
            stop_at: dict[int, str | None] | None = None) -> Executed:
    """Run every code cell of ``notebook`` in ``kernel`` (or a new one), within ``limit`` s.

    With ``stop_at`` (cell -> the text it must print, or None), stop after the first of
    those cells that raises or prints anything else.
    """
    import nbformat
    from nbclient import NotebookClient
    from nbclient.exceptions import CellTimeoutError, DeadKernelError

    nb = nbformat.from_dict(notebook)
    out = Executed()
    start = time.monotonic()
    kernel = kernel or Kernel()
    try:
        kernel.warm(limit)
        client = NotebookClient(nb, km=kernel.km, allow_errors=True, shutdown_kernel="immediate",
                                startup_timeout=max(1, int(start + limit - time.monotonic())))
        with client.setup_kernel(cleanup_kc=True):
            for i, cell in enumerate(nb.cells):
                client.timeout = max(1, int(start + limit - time.monotonic()))
                try:
                    client.execute_cell(cell, i)
                except CellTimeoutError:
                    out.stopped = ("timeout", i)
                    break
                except DeadKernelError:
                    out.stopped = ("died", i)
                    break
                out.stdout[i] = "".join(o.get("text", "") for o in cell.outputs
                                        if o.output_type == "stream" and o.name == "stdout")
                error = next((o for o in cell.outputs if o.output_type == "error"), None)
                if error is not None:
                    out.errors[i] = (error.ename, error.evalue)
                if stop_at and i in stop_at and not out.passed(i, stop_at[i]):
                    out.first_failure = i
                    break
    finally:
        kernel.close()
    out.seconds = time.monotonic() - start
    return out


def _worker(conn: Connection, mark: str, engines: int) -> None:
    """Take jobs from ``conn`` until None; answer each with an Executed."""
    global _server
    from pcourse.tools.grading import forkserver
    from pcourse.tools.grading.harness import CLUSTER_ENV

    os.environ[WORKER_MARK] = mark
    os.environ["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}"
    where = Path(tempfile.mkdtemp(prefix="pcourse-grader-")) / "cluster.json"
    os.environ[CLUSTER_ENV] = str(where)
    if os.environ.get(FORK_ENV, "1") != "0":
        _server = forkserver.Server()  # with this environment: its kernels carry the marks
    mc, spare, owner = None, None, None
    try:
        while (job := conn.recv()) is not None:
            try:
                if mc is not None and job.owner != owner:
                    # another learner: nothing of this one survives (forgotten first, so
                    # that a cluster that fails to stop is not stopped again for each job)
                    old, mc = mc, None
                    _retire(old, engines)
                owner = job.owner
                mc = _ready_or_retry(mc, engines, where, job.apart)
                if spare is not None and not spare.alive():  # killed while it waited
                    spare.close()
                    spare = None
                kernel, spare = spare or Kernel(), Kernel()
                result = execute(job.notebook, job.limit, kernel, job.stop_at)
            except Exception as exc:  # noqa: BLE001 - reported, and the next job goes on
                result = Executed(stopped=("grader", -1), detail=f"{type(exc).__name__}: {exc}")
            conn.send(result)
    except (EOFError, KeyboardInterrupt):
        pass
    finally:
        for k in list(_kernels):
            k.close()
        if _server is not None:
            _server.close()
        if mc is not None:
            _retire(mc, engines)
        shutil.rmtree(where.parent, ignore_errors=True)
        from pcourse.tools.grading import sandbox

        sandbox.release()  # those of clusters that failed to start, too


# ---------------------------------------------------------------- in the parent

class _Worker:
    """A worker process (``python -m pcourse.tools.grading.runner``) and the job it is running."""

    def __init__(self, engines: int) -> None:
        self.mark = uuid.uuid4().hex
        self.conn, theirs = multiprocessing.Pipe()
        self.process = subprocess.Popen(
            [sys.executable, "-m", "pcourse.tools.grading.runner", str(theirs.fileno()), self.mark,
             str(engines)], pass_fds=[theirs.fileno()], start_new_session=True)
        theirs.close()
        self.job: Job | None = None
        self.owner: str | None = None  # whose cluster the worker holds
        self.since = 0.0
        self.done = 0

    def give(self, job: Job) -> None:
        self.job, self.owner, self.since = job, job.owner, time.monotonic()
        self.conn.send(job)

    def overdue(self) -> bool:
        return self.job is not None and time.monotonic() > self.since + self.job.limit \
            + START_ALLOWANCE

    def stop(self, grace: float = 60.0) -> None:
        try:
            if self.job is None and self.process.poll() is None:
                self.conn.send(None)
                self.process.wait(grace)
        except (OSError, subprocess.TimeoutExpired):
            pass
        if self.process.poll() is None:
            self.process.kill()
            self.process.wait()
        _reap(WORKER_MARK, self.mark)
        from pcourse.tools.grading import sandbox

        sandbox.release(owner=self.process.pid)  # a worker killed leaves its cgroups behind
        self.conn.close()


class _Results(dict):
    """Every job's Executed, by key; ``on_result(key, executed)`` hears of each as it comes."""

    def __init__(self, on_result: Callable[[Any, Executed], None] | None) -> None:
        super().__init__()
        self.on_result = on_result

    def __setitem__(self, key: Any, executed: Executed) -> None:
        super().__setitem__(key, executed)
        if self.on_result is not None:
            self.on_result(key, executed)


def run_jobs(jobs: Iterable[Job], workers: int = 2, engines: int = ENGINES,
             on_result: Callable[[Any, Executed], None] | None = None) -> dict[Any, Executed]:
    """Every job's Executed, by key, run on ``workers`` worker processes.

    ``on_result(key, executed)`` is called as each job finishes (the grader writes
    its row at once: a crash later loses no finished row).
    """
    todo = deque(jobs)
    results = _Results(on_result)
    run_mark = uuid.uuid4().hex
    previous = os.environ.get(RUN_MARK)
    os.environ[RUN_MARK] = run_mark  # inherited by workers, kernels, controllers, engines
    pool: list[_Worker] = []
    failed_starts = 0  # workers that died before finishing any job, in a row
    try:
        while todo or any(w.job for w in pool):
            while todo and (len(pool) < workers or any(w.job is None for w in pool)):
                idle = next((w for w in pool if w.job is None), None)
                if idle is None:
                    if failed_starts >= 3:
                        detail = "the grader's workers keep dying as they start (see above)"
                        for j in todo:
                            results[j.key] = Executed(stopped=("grader", -1), detail=detail)
                        todo.clear()
                        break
                    idle = _Worker(engines)
                    pool.append(idle)
                idle.give(_next_for(todo, idle.owner, {w.owner for w in pool if w.job}))
            for conn in wait([w.conn for w in pool if w.job], timeout=1.0):
                w = next(w for w in pool if w.conn is conn)
                try:
                    results[w.job.key] = conn.recv()
                    w.job, w.done, failed_starts = None, w.done + 1, 0
                except (EOFError, OSError):
                    results[w.job.key] = Executed(stopped=("grader", -1),
                                                  detail="the grader's worker process died")
                    failed_starts += w.done == 0
                    pool.remove(w)
                    w.stop()
            for w in [w for w in pool if w.overdue()]:
                results[w.job.key] = Executed(stopped=("timeout", -1),
                                              seconds=time.monotonic() - w.since)
                pool.remove(w)
                w.stop()
    finally:
        for w in pool:
            w.stop()
        _reap(RUN_MARK, run_mark)
        if previous is None:
            os.environ.pop(RUN_MARK, None)
        else:
            os.environ[RUN_MARK] = previous
    return dict(results)


def _next_for(todo: deque[Job], owner: str | None, others: set[str | None]) -> Job:
    """The next job for a worker holding ``owner``'s cluster: one of that owner's, else
    the first of an owner no other worker (``others``) holds, else the first.

    So each learner's cluster starts once, not once per worker."""
    mine = next((j for j in todo if owner is not None and j.owner == owner), None) \
        or next((j for j in todo if j.owner is None or j.owner not in others), None)
    if mine is None:
        return todo.popleft()
    todo.remove(mine)
    return mine


def _reap(variable: str, value: str, spare: Iterable[int] = ()) -> None:
    """Kill every process (but this one and ``spare``) whose environment has ``variable=value``."""
    from pcourse.tools.cluster.reaping import kill_marked

    kill_marked(value, grace=0, variable=variable, spare=spare, settle=10)


if __name__ == "__main__":
    # Through the package's module, not __main__: what the worker sends back must
    # unpickle as pcourse.tools.grading.runner.Executed in the parent.
    from multiprocessing.connection import Connection as _Connection

    from pcourse.tools.grading import runner as _runner

    _runner._worker(_Connection(int(sys.argv[1])), sys.argv[2], int(sys.argv[3]))
