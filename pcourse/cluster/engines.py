"""Start an MPI cluster of ipyparallel engines from a notebook, quietly and safely.

One call gives the notebook ``n`` engines that are also the ranks of one MPI job
(``engines="mpi"``): the notebook drives them through ipyparallel, and they talk
to each other through MPI, Gloo or NCCL. What this module adds to ipyparallel is
what a course needs and ipyparallel leaves to the user:

- quiet, deterministic output (no progress bar, no timings, no log dumps), so
  nbval can compare the cells that start and stop a cluster;
- a clear error with the engines' own log tail when they fail to start, instead
  of a hang;
- one cluster per kernel: running the start cell again replaces the old cluster,
  and the cluster stops when the kernel exits;
- engines that know their rank, world size, local rank and device.
"""

from __future__ import annotations

import atexit
import logging
import os
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

import ipyparallel as ipp

from pcourse.cluster.launch import MPINotFound, find_mpiexec, max_engines
from pcourse.cluster.rankinfo import RankInfo, gpu_count

START_TIMEOUT = 90.0  # seconds for all engines to register; a cold start takes ~6 s
STOP_TIMEOUT = 30.0

# Run on every engine once it is up: puts rank, size, local_rank and device in the
# engine namespace, so %%px cells can use them directly.
_ENGINE_INIT = """
from pcourse.cluster.rankinfo import init_rank as _pcourse_init_rank
_pcourse_me = _pcourse_init_rank()
rank, size, local_rank, device = (
    _pcourse_me.rank, _pcourse_me.size, _pcourse_me.local_rank, _pcourse_me.device)
"""


class ClusterError(RuntimeError):
    """The engine cluster could not be started; the message says why and what to do."""


@dataclass
class MPICluster:
    """A running cluster: what a notebook needs to drive the engines."""

    cluster: ipp.Cluster
    client: ipp.Client
    view: ipp.DirectView  # all engines, in rank order (engine id == MPI rank)
    engines: list[RankInfo]  # one entry per rank, in rank order

    @property
    def n(self) -> int:
        return len(self.engines)

    def table(self) -> str:
        """Rank, host and device of every engine, one line each."""
        lines = [f"{'rank':>4}  {'local':>5}  {'host':<24} device"]
        for e in self.engines:
            lines.append(f"{e.rank:>4}  {e.local_rank:>5}  {e.host:<24} {e.device}")
        return "\n".join(lines)

    def stop(self) -> None:
        stop_cluster(self)

    def __enter__(self) -> MPICluster:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


_current: MPICluster | None = None


def default_engines() -> int:
    """One engine per GPU where there are GPUs, else 2."""
    return gpu_count() or 2


def _check_n(n: int) -> int:
    if isinstance(n, bool) or not isinstance(n, int):
        raise ClusterError(f"n must be a whole number of engines, got {n!r}.")
    if n < 1:
        raise ClusterError(f"n must be at least 1 engine, got {n}.")
    limit = max_engines()
    if n > limit:
        raise ClusterError(
            f"n={n} engines is far beyond this machine ({os.cpu_count()} CPU cores, "
            f"{gpu_count()} GPUs; at most {limit} here). Use fewer engines, or start "
            "engines on several nodes (see notebook 09)."
        )
    return n


def _exited(launcher: object) -> bool:
    """Has a launcher's process (mpiexec or ipcontroller) already exited?"""
    process = getattr(launcher, "process", None)
    if process is None:
        return getattr(launcher, "state", "running") == "after"
    try:
        return not process.is_running() or process.status() == "zombie"
    except Exception:  # noqa: BLE001 - psutil.NoSuchProcess and friends: it is gone
        return True


def _log_tail(launcher: object, lines: int = 20) -> str:
    try:
        text = launcher.get_output() or ""  # type: ignore[attr-defined]
    except Exception:  # noqa: BLE001 - best effort: the error message matters more
        text = ""
    tail = text.strip().splitlines()[-lines:]
    return "\n".join(tail) if tail else "(no output)"


def start_cluster(
    n: int | None = None,
    *,
    timeout: float = START_TIMEOUT,
    env: dict[str, str] | None = None,
) -> MPICluster:
    """Start ``n`` MPI engines on this machine and return them, ready to use.

    Replaces a cluster this kernel started before. ``env`` adds environment
    variables for the engines (for example ``GLOO_SOCKET_IFNAME``).
    """
    n = default_engines() if n is None else _check_n(n)
    if timeout <= 0:
        raise ClusterError(f"timeout must be positive, got {timeout}.")
    stop_cluster()
    try:
        mpiexec = find_mpiexec()
    except MPINotFound as exc:
        raise ClusterError(str(exc)) from None

    path_env = {"PATH": f"{Path(mpiexec).parent}{os.pathsep}{os.environ.get('PATH', '')}"}
    engine_env = {**path_env, **(env or {})}
    cluster = ipp.Cluster(
        engines="mpi",
        n=n,
        cluster_id=f"pcourse-{os.getpid()}-{uuid.uuid4().hex[:8]}",
        controller_ip="127.0.0.1",
        log_level=logging.WARNING,
        shutdown_atexit=True,
    )
    cluster.config.MPILauncher.mpi_cmd = [mpiexec]
    cluster.config.MPIEngineSetLauncher.environment = engine_env
    cluster.config.LocalControllerLauncher.environment = path_env

    try:
        cluster.start_controller_sync()
        cluster.start_engines_sync(n)
        client = cluster.connect_client_sync()
    except Exception as exc:
        _force_stop(cluster)
        raise ClusterError(f"could not launch the cluster: {exc}") from exc

    try:
        _wait_for_engines(cluster, client, n, timeout)
        view = client[:]
        # cloudpickle ships a notebook-defined function together with the globals it
        # uses (helpers, constants, imports), so learners need no push/import dance.
        # init_rank runs an MPI collective: a rank that never joins must not hang us.
        view.block = False
        for step in (view.use_cloudpickle, lambda: view.execute(_ENGINE_INIT)):
            step().get(timeout=timeout)
        engines = sorted(view.pull("_pcourse_me").get(timeout=timeout), key=lambda e: e.rank)
        view.block = True
    except ipp.error.TimeoutError as exc:
        client.close()
        _force_stop(cluster)
        raise ClusterError(
            f"the engines registered but did not finish initialising within {timeout:.0f} s "
            "(MPI between them may be broken: try `mpiexec -n 2 python -m mpi4py.bench "
            "helloworld`)."
        ) from exc
    except BaseException:
        client.close()
        _force_stop(cluster)
        raise

    global _current
    _current = MPICluster(cluster=cluster, client=client, view=view, engines=engines)
    return _current


def _wait_for_engines(cluster: ipp.Cluster, client: ipp.Client, n: int, timeout: float) -> None:
    """Wait until n engines register; fail fast, with their log, if they die."""
    deadline = time.monotonic() + timeout
    while len(client.ids) < n:
        for launcher in list(cluster.engines.values()):
            if _exited(launcher):
                raise ClusterError(
                    f"the engines exited during start ({len(client.ids)} of {n} had "
                    f"registered). Last lines of their log:\n{_log_tail(launcher)}\n"
                    "Check that `mpiexec -n 2 python -c 'import mpi4py.MPI'` works in "
                    "this environment."
                )
        if cluster.controller is None or _exited(cluster.controller):
            tail = _log_tail(cluster.controller) if cluster.controller else "(none)"
            raise ClusterError(f"the ipcontroller exited during start. Its log:\n{tail}")
        if time.monotonic() > deadline:
            tails = "\n".join(_log_tail(lau) for lau in cluster.engines.values())
            raise ClusterError(
                f"only {len(client.ids)} of {n} engines registered within {timeout:.0f} s. "
                f"Last lines of their log:\n{tails}\nThe machine may be overloaded: try "
                "fewer engines or a longer timeout."
            )
        time.sleep(0.1)


def _force_stop(cluster: ipp.Cluster) -> None:
    try:
        cluster.stop_cluster_sync()
    except Exception:  # noqa: BLE001 - already failing; stopping is best effort
        pass


def stop_cluster(mc: MPICluster | None = None) -> None:
    """Stop a cluster (by default the current one) and reap all its processes.

    Engines are asked to shut down first, so they leave through their own exit
    path rather than SIGTERM. mpiexec still reports exit code 1 for engines that
    stop (seen with ipyparallel 9.2 and MPICH 5), and ipyparallel then dumps every
    engine's log at WARNING level: noise for a stop we asked for, and output that
    nbval would compare. So the cluster's log is raised to ERROR while stopping.
    """
    global _current
    mc = mc or _current
    if mc is None:
        return
    if mc is _current:
        _current = None
    mc.cluster.log.setLevel(logging.ERROR)
    try:
        mc.client.shutdown(targets="all", hub=False, block=True)
    except Exception:  # noqa: BLE001 - dead engines cannot answer; the kill below reaps them
        pass
    deadline = time.monotonic() + STOP_TIMEOUT
    while time.monotonic() < deadline and not all(_exited(x) for x in mc.cluster.engines.values()):
        time.sleep(0.05)
    mc.client.close()
    _force_stop(mc.cluster)


def current_cluster() -> MPICluster | None:
    """The cluster this kernel started last, if it is still running."""
    return _current


atexit.register(stop_cluster)
