"""Start an MPI cluster of ipyparallel engines from a notebook, quietly and safely.

One call, ``start_cluster(n)``, gives the notebook ``n`` engines that are also the
ranks of one MPI job: the notebook drives them through ipyparallel (``mc.view``),
and they talk to each other through MPI, Gloo or NCCL. Where they run:

- on this machine (the default): ``mpiexec -n N``, every listener on loopback only,
  at most :func:`~pcourse.tools.cluster.launch.max_engines` unless ``oversubscribe=True``;
- on the nodes of a hostfile: ``start_cluster(n, hostfile="hosts")`` (lesson 09);
- as one Slurm job: ``start_cluster(n, slurm=Slurm(...))``, or unchanged lessons
  with ``$PCOURSE_SLURM`` set (:class:`~pcourse.tools.cluster.slurm.Slurm`, INSTRUCTORS.md).

What this module adds to ipyparallel is what a course needs and ipyparallel leaves
to the user: output that nbval can compare (progress that leaves nothing behind);
a clear error with the engines' log when they fail to start, instead of a hang; one
cluster per kernel (a re-run start cell replaces it); nothing left behind however
the kernel ends (every process carries a mark, a watcher process,
:mod:`pcourse.tools.cluster.reaping`, ends them if the owner dies); interrupts that land
(:mod:`pcourse.runtime.waits`; the view that passes them on to the engines is
:mod:`pcourse.tools.cluster.view`); engines that know their rank, world size, local rank
and device. The errors and what the launchers' logs say are
:mod:`pcourse.tools.cluster.failures`; the Slurm job, :mod:`pcourse.tools.cluster.slurm`.
"""

from __future__ import annotations

import atexit
import logging
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import ipyparallel as ipp

from pcourse.runtime import private
from pcourse.runtime.ranks import RankInfo, gpu_count
from pcourse.tools.cluster import slurm as slurm_jobs
from pcourse.tools.cluster.failures import (
    ClusterError,
    exited,
    how_it_ended,
    log_tail,
    log_text,
    rank_exits,
    who_died,
)
from pcourse.tools.cluster.launch import (
    Launcher,
    MPINotFound,
    find_mpiexec,
    max_engines,
    mpi_launcher,
)
from pcourse.tools.cluster.reaping import (
    MARK,
    end_cluster,
    kill_marked,
    owner_alive,
    sweep_mpi_segments,
)
from pcourse.tools.cluster.slurm import SLURM_ENV, SLURM_START_TIMEOUT, Slurm
from pcourse.tools.cluster.view import InterruptibleView
from pcourse.utils.progress import Bar

# What lessons, tools and tests import from here; each is defined where its role is.
__all__ = ["SLURM_ENV", "ClusterError", "MPICluster", "Slurm", "default_engines",
           "start_cluster", "stop_cluster", "sweep_stale_clusters"]

START_TIMEOUT = 90.0  # seconds for all engines to register and initialise
_FOLDER = re.compile(r"^pcourse-cluster-(\d+)-")  # pcourse-cluster-<owner pid>-<random>

# Run on every engine once it is up: makes interrupts final, and puts rank, size,
# local_rank and device in the engine namespace, so %%px cells can use them directly.
TEARDOWN_GRACE = 0.25  # seconds between SIGTERM and SIGKILL when a cluster stops
HEARTBEAT_MS = 1000  # the hub's heartbeat period (ipyparallel's default: 3000)

# What every engine runs: ipyparallel's engine, with torch imported in a thread from the
# start. An engine's start waits (for mpiexec's other ranks, for the hub's heartbeat that
# registers it); the import fills those waits instead of following them in _ENGINE_INIT,
# whose own `import torch` (init_rank's) then waits for this one to end.
_ENGINE_MAIN = ("import threading; "
                "threading.Thread(target=__import__, args=('torch',), daemon=True).start(); "
                "from ipyparallel.engine.app import main; main()")

_ENGINE_INIT = """
from pcourse.tools.cluster.interrupts import watch_interrupts as _pcourse_watch
_pcourse_watch()
from pcourse.runtime.ranks import init_rank as _pcourse_init_rank
_pcourse_me = _pcourse_init_rank()
rank, size, local_rank, device = (
    _pcourse_me.rank, _pcourse_me.size, _pcourse_me.local_rank, _pcourse_me.device)
"""


@dataclass
class MPICluster:
    """A running cluster: what a notebook needs to drive the engines."""

    cluster: ipp.Cluster
    client: ipp.Client
    view: ipp.DirectView  # all engines, in rank order (engine id == MPI rank)
    engines: list[RankInfo]  # one entry per rank, in rank order
    folder: Path  # its profile: connection files and logs, deleted when it stops
    reaper: subprocess.Popen | None = field(default=None, repr=False)
    _told: bool = field(default=False, repr=False)

    @property
    def n(self) -> int:
        return len(self.engines)

    def table(self) -> str:
        """Rank, host, device and torch threads of every engine, one line each.

        The threads are what each engine's torch uses unless a run sets its own
        (:func:`pcourse.runtime.ranks.init_rank` shares the cores among the ranks
        of a host); a lesson that compares speeds says the threads it ran with.
        """
        lines = [f"{'rank':>4}  {'local':>5}  {'host':<24} {'device':<8} torch threads"]
        for e in self.engines:
            lines.append(f"{e.rank:>4}  {e.local_rank:>5}  {e.host:<24} {e.device:<8} "
                         f"{e.threads}")
        return "\n".join(lines)

    def problem(self) -> str:
        """One line on why this cluster cannot run code any more; empty while it can."""
        controller = self.cluster.controller
        if controller is None or exited(controller):
            what = "controller"
        elif any(exited(x) for x in self.cluster.engines.values()):
            what = "engines"
        else:
            job = slurm_jobs.ended_job(self.cluster)
            return (f"The cluster's Slurm job has ended ({job}): its engines are gone. "
                    f"Restart it: run start_cluster({self.n}) again.") if job else ""
        log = "".join(log_text(x) for x in self.cluster.engines.values())
        stuck = re.search(r"rank \d+ did not stop within [\d.]+ s of the interrupt", log)
        died = who_died(log)
        why = f" ({stuck.group(0)})" if stuck else f" ({died})" if died else ""
        return (f"The cluster's {what} stopped{why}. Restart it: run "
                f"start_cluster({self.n}) again.")


    def who_died(self, within: float = 10.0) -> str:
        """Which rank ended first and how, and how the others ended, from the exits the
        engines' launcher reported (one line; empty if none exited within ``within`` s).
        Waits until every rank's exit is reported: the launcher ends the rest of the job
        after the first (MPICH's does), so the line is complete."""
        from pcourse.runtime.waits import CollectiveTimeout, wait_until

        def log() -> str:
            return "".join(log_text(x) for x in self.cluster.engines.values())

        try:
            wait_until(lambda: len(rank_exits(log())) >= self.n, within, "the ranks' exits")
        except CollectiveTimeout:
            pass  # say what there is: some ranks may live on
        return who_died(log())


_current: MPICluster | None = None


def default_engines() -> int:
    """One engine per GPU where there are GPUs, else 2."""
    return gpu_count() or 2


def _check_n(n: int, here: bool = True, oversubscribe: bool = False) -> int:
    """``n`` if it is a sane engine count; ``here``: the engines run on this machine."""
    if isinstance(n, bool) or not isinstance(n, int):
        raise ClusterError(f"n must be a whole number of engines, got {n!r}.")
    if n < 1:
        raise ClusterError(f"n must be at least 1 engine, got {n}.")
    limit = max_engines()
    if here and n > limit and not oversubscribe:
        raise ClusterError(
            f"n={n} engines is far beyond this machine ({os.cpu_count()} CPU cores, "
            f"{gpu_count()} GPUs; at most {limit} here). Use fewer engines, pass "
            "oversubscribe=True to insist, or start engines on several nodes "
            "(hostfile=, slurm=; see notebook 09)."
        )
    return n


def start_cluster(
    n: int | None = None,
    *,
    timeout: float | None = None,
    env: dict[str, str] | None = None,
    hostfile: str | os.PathLike[str] | None = None,
    slurm: Slurm | None = None,
    oversubscribe: bool = False,
) -> MPICluster:
    """Start ``n`` engines, the ranks of one MPI job, and return them ready to use.

    ``n`` defaults to one engine per visible GPU, or 2 without GPUs. A cluster this
    kernel started before is stopped first. ``env`` adds environment variables for
    the engines (for example ``GLOO_SOCKET_IFNAME``). ``timeout`` bounds the start, in
    seconds (default 90; 600 under Slurm, where the job may queue first).

    Where the engines run (lesson 09 explains the multi-node cases):

    - by default here, listening on loopback only; more than
      :func:`~pcourse.tools.cluster.launch.max_engines` only with ``oversubscribe=True``;
    - ``hostfile`` (MPICH's ``host:slots`` lines): on the nodes it lists, through
      ``mpiexec -f hostfile``; the controller then listens on every interface;
    - ``slurm`` (:class:`Slurm`; by default from ``$PCOURSE_SLURM``): as one Slurm job;
      the controller runs here, listening on every interface.
    """
    slurm = Slurm.from_env() if slurm is None and hostfile is None else slurm
    if slurm is not None and hostfile is not None:
        raise ClusterError("give either a hostfile or a Slurm job, not both.")
    if slurm is not None and slurm_jobs.missing():
        raise ClusterError(f"a Slurm job was asked for, but {slurm_jobs.missing()}")
    here = slurm is None and hostfile is None
    n = default_engines() if n is None else _check_n(n, here, oversubscribe)
    timeout = (SLURM_START_TIMEOUT if slurm else START_TIMEOUT) if timeout is None else timeout
    if timeout <= 0:
        raise ClusterError(f"timeout must be positive, got {timeout}.")
    stop_cluster()
    sweep_stale_clusters()
    try:
        launcher = None if slurm else mpi_launcher(hostfile)
    except MPINotFound as exc:
        raise ClusterError(str(exc)) from None

    folder = _new_folder(slurm)
    reaper = _start_reaper(folder)
    if slurm:
        cluster = _make_slurm_cluster(n, folder, env or {}, slurm)
    else:
        assert launcher is not None  # made above whenever slurm is not given
        cluster = _make_cluster(n, folder, launcher, env or {}, hostfile)
    progress = Bar(n, desc="engines", unit="engine")
    progress.update(0)
    client = None
    try:
        try:
            cluster.start_controller_sync()
            cluster.start_engines_sync(n)
            client = cluster.connect_client_sync()
        except Exception as exc:
            raise ClusterError(f"could not launch the cluster: {exc}") from exc
        _wait_for_engines(cluster, client, n, timeout, progress)
        engines, view = _initialise(client, timeout)
    except BaseException:
        progress.close()
        _teardown(cluster, client, folder, reaper)
        raise
    progress.close()
    _watch_cells()

    global _current
    _current = MPICluster(cluster, client, view, engines, folder, reaper)
    view.problem = _current.problem
    return _current


def _new_folder(slurm: Slurm | None) -> Path:
    """The cluster's own folder (profile, connection files, logs), named after its owner."""
    parent = None
    if slurm is not None:  # where the compute nodes can write the engines' log
        parent = Path(slurm.folder).expanduser()
        parent.mkdir(parents=True, exist_ok=True)
    return Path(tempfile.mkdtemp(prefix=f"pcourse-cluster-{os.getpid()}-", dir=parent))


def _ipp_cluster(engines: str, n: int, folder: Path, everywhere: bool) -> ipp.Cluster:
    """ipyparallel's cluster, configured but not started; ``everywhere``: other nodes
    must reach the controller."""
    return ipp.Cluster(
        engines=engines,
        n=n,
        profile_dir=str(folder),
        cluster_id="pcourse",
        controller_ip="*" if everywhere else "127.0.0.1",
        # An engine counts as registered at the hub's first heartbeat after it asks:
        # ipyparallel's 3 s period made every start wait about two of them. A beat a
        # second, and 30 missed in a row (ipyparallel's 30 s) before an engine is
        # dropped, so a rank busy on a loaded machine is not lost.
        controller_args=[f"--HeartMonitor.period={HEARTBEAT_MS}",
                         f"--HeartMonitor.max_heartmonitor_misses={30_000 // HEARTBEAT_MS}"],
        log_level=logging.WARNING,
        shutdown_atexit=False,  # ours (stop_cluster) is bounded and leaves nothing behind
    )


def _make_cluster(n: int, folder: Path, launcher: Launcher, env: dict[str, str],
                  hostfile: str | os.PathLike[str] | None) -> ipp.Cluster:
    """The cluster of MPI engines started by ``mpiexec``: where it listens, what it runs."""
    mpi_bin = Path(find_mpiexec()).parent
    path_env = {"PATH": f"{mpi_bin}{os.pathsep}{os.environ.get('PATH', '')}", MARK: str(folder)}
    cluster = _ipp_cluster("mpi", n, folder, everywhere=hostfile is not None)
    cluster.config.MPILauncher.mpi_cmd = launcher.command
    cluster.config.MPIEngineSetLauncher.engine_cmd = [*launcher.wrap, sys.executable, "-c",
                                                      _ENGINE_MAIN]
    cluster.config.MPIEngineSetLauncher.environment = {**path_env, **launcher.env, **env}
    cluster.config.LocalControllerLauncher.environment = path_env
    return cluster


def _make_slurm_cluster(n: int, folder: Path, env: dict[str, str], slurm: Slurm) -> ipp.Cluster:
    """The cluster of engines started as one Slurm job, by ipyparallel's own launcher."""
    from pcourse.multinode import configure_gpus  # the lesson's GPU request, written once

    cluster = _ipp_cluster("slurm", n, folder, everywhere=True)
    job = cluster.config.SlurmEngineSetLauncher
    job.engine_args = ["--mpi"]  # each engine joins MPI: srun's tasks become one MPI job
    job.timelimit, job.queue, job.account = slurm.time, slurm.partition, slurm.account
    job.batch_file_name = str(folder / "slurm_engine.sbatch")  # not in the notebook's folder
    configure_gpus(cluster, slurm.gpus_per_task, slurm.gres)
    cluster.engine_launcher_class = slurm_jobs.SlurmJobLauncher  # sees its job; GPU lines too
    job.environment = {MARK: str(folder), **env}
    cluster.config.LocalControllerLauncher.environment = {MARK: str(folder)}
    return cluster


def _start_reaper(folder: Path) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", "pcourse.tools.cluster.reaping", str(os.getpid()), str(folder)],
        stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        start_new_session=True)  # out of reach of the terminal's Ctrl-C and hang-up


def _initialise(client: ipp.Client, timeout: float) -> tuple[list[RankInfo], ipp.DirectView]:
    """Engines in rank order, and a view of all of them, ready for the notebook."""
    view = InterruptibleView(client=client, socket=private.mux_stream(client),
                              targets=sorted(client.ids))
    # cloudpickle ships a notebook-defined function together with the globals it
    # uses (helpers, constants, imports), so learners need no push/import dance.
    # init_rank runs an MPI collective: a rank that never joins must not hang us.
    view.block = False
    try:
        for step in (view.use_cloudpickle, lambda: view.execute(_ENGINE_INIT)):
            step().get(timeout=timeout)
        engines = sorted(view.pull("_pcourse_me").get(timeout=timeout), key=lambda e: e.rank)
    except ipp.error.TimeoutError as exc:
        raise ClusterError(
            f"the engines registered but did not finish initialising within {timeout:.0f} s "
            "(MPI between them may be broken: try `mpiexec -n 2 python -m mpi4py.bench "
            "helloworld`)."
        ) from exc
    view.block = True
    return engines, view


def _wait_for_engines(cluster: ipp.Cluster, client: ipp.Client, n: int, timeout: float,
                      progress: Bar) -> None:
    """Wait until n engines register; fail fast, with their log, if they die.

    A Slurm job is asked how it stands (once a second): one that Slurm ended fails at
    once, and one still in the queue at the deadline fails with Slurm's reason.
    """
    deadline = time.monotonic() + timeout
    asked = 0.0
    while len(client.ids) < n:
        progress.update(len(client.ids))
        if time.monotonic() - asked > 1.0:
            asked = time.monotonic()
            slurm_jobs.check_job(cluster, len(client.ids), n)
        for launcher in list(cluster.engines.values()):
            if exited(launcher):
                raise ClusterError(
                    f"the engines exited during start ({len(client.ids)} of {n} had "
                    f"registered; {how_it_ended(launcher)}). Last lines of their log:\n"
                    f"{log_tail(launcher)}\n"
                    "Check that `mpiexec -n 2 python -c 'import mpi4py.MPI'` works in "
                    "this environment."
                )
        if cluster.controller is None or exited(cluster.controller):
            how, tail = ((how_it_ended(cluster.controller), log_tail(cluster.controller))
                         if cluster.controller else ("never started", "(none)"))
            raise ClusterError(f"the ipcontroller exited during start ({how}). Its log:\n{tail}")
        if time.monotonic() > deadline:
            slurm_jobs.check_job(cluster, len(client.ids), n, timeout)
            tails = "\n".join(log_tail(lau) for lau in cluster.engines.values())
            raise ClusterError(
                f"only {len(client.ids)} of {n} engines registered within {timeout:.0f} s. "
                f"Last lines of their log:\n{tails}\nThe machine may be overloaded: try "
                "fewer engines or a longer timeout."
            )
        time.sleep(0.1)
    progress.update(n)


def _watch_cells() -> None:
    """In IPython, say before each cell if the cluster has died (once per cluster)."""
    ipython = sys.modules.get("IPython")
    shell = ipython.get_ipython() if ipython is not None else None
    if shell is None:
        return
    if _tell_if_dead not in shell.events.callbacks["pre_run_cell"]:
        shell.events.register("pre_run_cell", _tell_if_dead)


def _tell_if_dead(*_: object) -> None:
    mc = _current
    if mc is None or mc._told:
        return
    problem = mc.problem()
    if problem:
        mc._told = True
        print(problem, file=sys.stderr)


def stop_cluster(mc: MPICluster | None = None) -> None:
    """Stop a cluster (by default the current one), reap all its processes, delete its files.

    Its processes get SIGTERM, and SIGKILL a moment later if they are still there
    (an engine blocked in MPI, or finishing MPI's shutdown with a rank that is
    gone), so stopping takes about that moment whatever state the cluster is in.
    mpiexec then reports the engines' exit codes, and ipyparallel dumps every
    engine's log at WARNING level: noise for a stop we asked for, and output that
    nbval would compare. So the cluster's log is raised to ERROR first.
    """
    global _current
    mc = mc or _current
    if mc is None:
        return
    if mc is _current:
        _current = None
    _teardown(mc.cluster, mc.client, mc.folder, mc.reaper)


def _teardown(cluster: ipp.Cluster, client: ipp.Client | None, folder: Path,
              reaper: subprocess.Popen | None) -> None:
    cluster.log.setLevel(logging.ERROR)
    if client is not None:
        client.close()
    # The engines leave at SIGTERM; mpiexec's forker and ipyparallel's nannies notice
    # only on their next poll (a second or two) and hold nothing we keep: a short grace.
    kill_marked(str(folder), grace=TEARDOWN_GRACE)
    try:
        cluster.stop_cluster_sync()  # ipyparallel's bookkeeping: its processes are gone
    except Exception:  # noqa: BLE001 - already stopped; nothing left to do
        pass
    shutil.rmtree(folder, ignore_errors=True)
    if reaper is not None:  # it would leave by itself once the folder is gone
        reaper.kill()
        reaper.wait()


def sweep_stale_clusters() -> list[str]:
    """Remove clusters whose owner has died, and their files; return what was removed.

    Their reaper does this at once; this catches what it could not (a machine that
    went down, a reaper that was killed too). Only clusters of owners that are gone
    are touched.
    """
    removed = []
    for folder in Path(tempfile.gettempdir()).glob("pcourse-cluster-*"):
        owner = _FOLDER.match(folder.name)
        if owner and folder.is_dir() and not owner_alive(int(owner.group(1))):
            end_cluster(str(folder))
            removed.append(str(folder))
    return removed + sweep_mpi_segments()


atexit.register(stop_cluster)
