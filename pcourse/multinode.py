"""Going to several nodes: hostfiles and ipyparallel's launchers, generated, not submitted.

:func:`hostfile_text` writes a hostfile for MPICH or Open MPI;
:func:`mpi_engine_command` and :func:`slurm_engine_script` return the command and
the ``sbatch`` script ipyparallel would run to start engines on other nodes, without
running anything, so a notebook can show them. ``start_cluster(n, hostfile=...)`` and
``start_cluster(n, slurm=...)`` (:mod:`pcourse.cluster.engines`) really start them.

Lesson 09 explains hostfiles, schedulers and the interface variables.
"""

from __future__ import annotations

import logging
import re
import sys
import tempfile
from pathlib import Path

import ipyparallel as ipp

FLAVOURS = ("mpich", "openmpi")


def hostfile_text(hosts: dict[str, int], flavour: str = "mpich") -> str:
    """A hostfile: MPICH's ``host:slots`` lines or Open MPI's ``host slots=N`` lines.

    Used as ``mpiexec -f FILE`` (MPICH's Hydra) or ``mpirun --hostfile FILE`` (Open
    MPI). Ranks fill the first host's slots, then the next host's, and so on.
    """
    if flavour not in FLAVOURS:
        raise ValueError(f"flavour must be one of {FLAVOURS}, got {flavour!r}")
    if not hosts or any(n < 1 for n in hosts.values()):
        raise ValueError(f"every host needs at least one slot, got {hosts}")
    form = "{host}:{n}" if flavour == "mpich" else "{host} slots={n}"
    return "".join(form.format(host=h, n=n) + "\n" for h, n in hosts.items())


def _launcher(cluster: ipp.Cluster, work_dir: str):
    return cluster.engine_launcher_class(
        work_dir=work_dir, config=cluster.config, cluster_id="demo",
        profile_dir=str(Path(work_dir) / "profile"), log=cluster.log)


def mpi_engine_command(n: int, hostfile: str, mpiexec: str = "mpiexec") -> list[str]:
    """The command ``ipp.Cluster(engines="mpi")`` would run to start n engines on the hosts."""
    cluster = ipp.Cluster(engines="mpi", n=n, cluster_id="demo", log_level=logging.WARNING)
    cluster.config.MPILauncher.mpi_cmd = [mpiexec]
    cluster.config.MPILauncher.mpi_args = ["-f", hostfile]
    with tempfile.TemporaryDirectory() as tmp:
        launcher = _launcher(cluster, tmp)
        launcher.n = n
        # this machine's interpreter path would make the text differ between machines
        return ["python" if a == sys.executable else a for a in launcher.find_args()]


def slurm_engine_script(n: int, timelimit: str = "00:30:00", queue: str | None = None,
                        account: str | None = None, mpi: bool = True) -> str:
    """The sbatch script ``ipp.Cluster(engines="slurm")`` would submit for n engines.

    ``mpi`` passes ``--mpi`` to every engine (``SlurmEngineSetLauncher.engine_args``),
    as ``engines="mpi"`` does: each engine then initialises MPI, so the n tasks that
    ``srun`` starts are the ranks of one MPI job and the course's backends bootstrap
    as on one machine. Written to a temporary folder and read back; nothing is
    submitted. The log path holds this process's id and a temporary folder,
    replaced by placeholders so the text is the same on every run.
    """
    cluster = ipp.Cluster(engines="slurm", n=n, cluster_id="demo", log_level=logging.WARNING)
    cluster.config.SlurmLauncher.timelimit = timelimit
    if queue:
        cluster.config.SlurmLauncher.queue = queue
    if account:
        cluster.config.SlurmLauncher.account = account
    if mpi:
        cluster.config.SlurmEngineSetLauncher.engine_args = ["--mpi"]
    with tempfile.TemporaryDirectory() as tmp:
        launcher = _launcher(cluster, tmp)
        launcher.write_batch_script(n)
        text = Path(launcher.batch_file).read_text()
        text = text.replace(tmp, "<work_dir>").replace(sys.executable, "python")
    return re.sub(r"-demo-\d+\.log", "-demo-<pid>.log", text)
