"""Nothing outlives the notebook or script that started a cluster, however it ends.

Every process of a cluster (controller, its schedulers, mpiexec, engines and their
nannies) carries ``PCOURSE_CLUSTER=<its folder>`` in its environment, inherited even
by processes that leave their parent's process group. :func:`kill_marked` ends
exactly those, and nobody else's; the grader marks its workers' processes with a
variable of its own and ends them the same way.

A normal exit stops the cluster through ``atexit``. A kernel that is killed
(``kill -9``, SIGTERM, an out-of-memory kill) runs no Python at all, so
``start_cluster`` also starts this module as a small watcher process: when its
parent, the owner, is gone, it ends the cluster and deletes its folder (connection
files and logs). It leaves as soon as the folder is gone, which is how a normal
``stop_cluster`` ends it.

Ranks that are killed cannot run ``MPI_Finalize``, which is what deletes MPICH's
shared-memory segment (``/dev/shm/mpich_shm_<job id>_<node>``). Left there, a segment
holds memory, and a later job that draws the same id attaches to the dead job's
segment and fails in ``MPI_Init`` ("Message truncated", "failed to unpack
address"). Open MPI's ranks leave theirs (``/dev/shm/sm_segment.*``) the same way.
:func:`sweep_mpi_segments` deletes the segments no running process has mapped;
killing a cluster's processes ends with it.

Run as ``python -m pcourse.tools.cluster.reaping OWNER_PID FOLDER``.
"""

from __future__ import annotations

import os
import shutil
import signal
import sys
import time
from collections.abc import Collection, Iterable
from pathlib import Path

import psutil

MARK = "PCOURSE_CLUSTER"
POLL = 0.25  # seconds between looks at the owner
DEAD_OWNER_GRACE = 0.2  # seconds SIGTERM gets before SIGKILL once the owner is gone: nobody
#                         waits for a clean shutdown, and the processes must not linger
SHM = Path("/dev/shm")
# MPICH's, and Open MPI's shared-memory transport's (5: "sm", 4: "vader"), by file name
MPI_SEGMENTS = ("mpich_shm_*", "mpich_vci_*", "sm_segment.*", "vader_segment.*")


def marked(value: str, variable: str = MARK, spare: Iterable[int] = ()) -> list[psutil.Process]:
    """The running processes (but this one and ``spare``) whose environment has
    ``variable=value``: by default, the cluster in folder ``value``."""
    keep = {os.getpid(), *spare}
    found = []
    for proc in psutil.process_iter():
        try:
            if proc.pid not in keep and proc.environ().get(variable) == value:
                found.append(proc)
        except (psutil.Error, OSError):  # gone, a zombie, or another user's
            continue
    return found


def kill_marked(value: str, grace: float = 1.0, *, variable: str = MARK,
                spare: Iterable[int] = (), settle: float | None = None) -> None:
    """End the processes :func:`marked` finds: SIGTERM to each, SIGKILL after ``grace``.

    SIGTERM first so that mpiexec passes it on to the ranks it started (on other
    nodes too); SIGKILL for whatever is blocked or ignores it; then up to ``settle``
    seconds (default ``grace``) for them to be gone, and the MPI segments their ranks
    shared are swept.
    """
    spare = tuple(spare)
    procs = marked(value, variable, spare)
    theirs = mapped_files(p.pid for p in procs)  # the MPI segments their ranks share
    for proc in procs:
        try:
            proc.send_signal(signal.SIGTERM)
        except psutil.Error:
            pass
    _, alive = psutil.wait_procs(procs, timeout=grace)
    for proc in alive + marked(value, variable, spare):  # and any started meanwhile
        try:
            proc.kill()
        except psutil.Error:
            pass
    psutil.wait_procs(alive, timeout=grace if settle is None else settle)
    sweep_mpi_segments(dead=theirs)


def sweep_mpi_segments(min_age: float = 1.0, dead: Collection[str] = ()) -> list[str]:
    """Delete this user's MPI segments (MPICH's, Open MPI's) that no process maps; their names.

    ``min_age`` seconds spare a segment that a job starting now has created and is
    about to map; ``dead`` names segments known to be a killed job's, deleted at once
    (their ranks may have written to them, which renews the age, until the end).
    """
    found = [p for pattern in MPI_SEGMENTS for p in SHM.glob(pattern)]
    if not found:
        return []
    in_use = mapped_files()
    removed = []
    for path in found:
        try:
            st = path.stat()
            if (st.st_uid == os.getuid() and str(path) not in in_use
                    and (str(path) in dead or time.time() - st.st_mtime >= min_age)):
                path.unlink()
                removed.append(path.name)
        except OSError:  # gone meanwhile, or not ours to delete
            continue
    return removed


def mapped_files(pids: Iterable[int] | None = None) -> set[str]:
    """Every /dev/shm file that these processes (default: all this user can see) map."""
    paths: set[str] = set()
    where = Path("/proc")
    files = where.glob("[0-9]*/maps") if pids is None else (where / f"{p}/maps" for p in pids)
    for maps in files:
        try:
            text = maps.read_text()
        except OSError:  # the process ended, or is another user's
            continue
        paths.update(line.split(maxsplit=5)[-1] for line in text.splitlines()
                     if f" {SHM}/" in line)
    return paths


def owner_alive(pid: int) -> bool:
    """Is the process ``pid``, which named a cluster or namespace after itself, still running?

    This process counts as gone: what it finds under its own name is left from an
    earlier, failed attempt, since nothing it runs now would be looking for it.
    """
    return pid != os.getpid() and psutil.pid_exists(pid)


def end_cluster(folder: str, grace: float = 1.0) -> None:
    """Kill the cluster's processes, then delete its folder."""
    kill_marked(folder, grace)
    shutil.rmtree(folder, ignore_errors=True)


def watch(owner: int, folder: str) -> None:
    """Wait until the owner is gone (then end the cluster) or the folder is (then leave)."""
    while os.path.isdir(folder):
        if os.getppid() != owner:  # re-parented: the owner has died
            end_cluster(folder, grace=DEAD_OWNER_GRACE)
            return
        time.sleep(POLL)


if __name__ == "__main__":
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # only the owner's fate decides
    watch(int(sys.argv[1]), sys.argv[2])
