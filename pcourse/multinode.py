"""Going to several nodes: hostfiles and ipyparallel's launchers, generated, not submitted.

:func:`hostfile_text` writes a hostfile for MPICH or Open MPI;
:func:`mpi_engine_command` and :func:`slurm_engine_script` return the command and
the ``sbatch`` script ipyparallel would run to start engines on other nodes, without
running anything, so a notebook can show them. ``start_cluster(n, hostfile=...)`` and
``start_cluster(n, slurm=...)`` (:mod:`pcourse.tools.cluster.engines`) really start them.

GPUs are asked for in the job script, as Slurm wants them: ``gpus_per_task`` (one GPU
per engine: the NCCL backends need that) writes ``#SBATCH --gpus-per-task=N``, ``gres``
(``gpu:2``, ``gpu:a100:4``: per node, for sites that count GPUs that way) writes
``#SBATCH --gres=...``. :class:`SlurmGPUEngineSetLauncher` is ipyparallel's Slurm
launcher that writes them; :func:`configure_gpus` sets a cluster up to use it.

:func:`torchrun_allreduce` is one rank of torch's own launcher at work (``torchrun
--standalone --nproc-per-node=N -m pcourse.multinode``): no MPI, the rank and the
meeting point from the variables torchrun sets.

Lesson 09 explains hostfiles, schedulers, torchrun and the interface variables.
"""

from __future__ import annotations

import logging
import os
import re
import sys
import tempfile
from pathlib import Path

import ipyparallel as ipp
from ipyparallel.cluster.launcher import SlurmEngineSetLauncher

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


GPU_REQUEST = "pcourse_gpu_request"  # the key of the #SBATCH GPU lines in the template's namespace


class SlurmGPUEngineSetLauncher(SlurmEngineSetLauncher):
    """ipyparallel's Slurm engine launcher, which also writes a GPU request into the script.

    Configured like the launcher it extends (``config.SlurmEngineSetLauncher`` applies to
    it too); the request's ``#SBATCH`` lines are its template namespace's
    :data:`GPU_REQUEST` (:func:`configure_gpus` puts them there).
    """

    def _insert_options_in_script(self) -> None:
        super()._insert_options_in_script()
        request = self.namespace.get(GPU_REQUEST, "")
        if request:
            first, rest = self.batch_template.split("\n", 1)
            self.batch_template = "\n".join([first, request, rest])


def sbatch_gpu_lines(gpus_per_task: int = 0, gres: str = "") -> list[str]:
    """The ``#SBATCH`` lines that ask for GPUs; ValueError naming a bad value."""
    if isinstance(gpus_per_task, bool) or not isinstance(gpus_per_task, int) \
            or gpus_per_task < 0:
        raise ValueError(f"gpus_per_task must be a whole number >= 0 (0: no GPUs), "
                         f"got {gpus_per_task!r}")
    if not isinstance(gres, str) or any(c.isspace() for c in gres):
        raise ValueError(f"gres must be Slurm's resource text without spaces, such as "
                         f"'gpu:2', got {gres!r}")
    lines = [f"#SBATCH --gpus-per-task={gpus_per_task}"] if gpus_per_task else []
    return lines + ([f"#SBATCH --gres={gres}"] if gres else [])


def configure_gpus(cluster: ipp.Cluster, gpus_per_task: int = 0, gres: str = "") -> None:
    """Make ``cluster`` (``engines="slurm"``) ask for GPUs in its engines' job script."""
    lines = sbatch_gpu_lines(gpus_per_task, gres)  # bad values refused before anything runs
    if lines:
        cluster.engine_launcher_class = SlurmGPUEngineSetLauncher
        space = cluster.config.SlurmEngineSetLauncher
        space.namespace = {**space.get("namespace", {}), GPU_REQUEST: "\n".join(lines)}


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
                        account: str | None = None, mpi: bool = True, *,
                        gpus_per_task: int = 0, gres: str = "") -> str:
    """The sbatch script ``ipp.Cluster(engines="slurm")`` would submit for n engines.

    ``gpus_per_task`` / ``gres`` ask for GPUs (see the module docstring).

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
    configure_gpus(cluster, gpus_per_task, gres)
    with tempfile.TemporaryDirectory() as tmp:
        launcher = _launcher(cluster, tmp)
        launcher.write_batch_script(n)
        text = Path(launcher.batch_file).read_text()
        text = text.replace(tmp, "<work_dir>").replace(sys.executable, "python")
    return re.sub(r"-demo-\d+\.log", "-demo-<pid>.log", text)


def torchrun_allreduce() -> None:
    """One rank under torchrun: a Gloo allreduce of ``rank + 1``, one line saying what it saw.

    torchrun sets ``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``MASTER_ADDR`` and
    ``MASTER_PORT``; the Gloo backend reads them (``env://``) when no MPI started the
    process. The line is written in one call, so the ranks' lines never interleave
    mid-line; nothing run-specific (the port) is printed.
    """
    import torch

    from pcourse.backends import make_backend
    from pcourse.runtime.ranks import launcher

    with make_backend("gloo") as be:
        total = torch.tensor([be.rank + 1.0])
        be.allreduce(total, "sum")
        meeting = all(v in os.environ for v in ("MASTER_ADDR", "MASTER_PORT"))
        sys.stdout.write(f"rank {be.rank} of {be.size}: started by {launcher()}, "
                         f"LOCAL_RANK={os.environ['LOCAL_RANK']}, MASTER_ADDR and MASTER_PORT "
                         f"set: {meeting}; sum of rank + 1 over the ranks: {total.item():g} "
                         f"(n(n+1)/2 = {be.size * (be.size + 1) / 2:g})\n")
        sys.stdout.flush()


if __name__ == "__main__":
    torchrun_allreduce()
