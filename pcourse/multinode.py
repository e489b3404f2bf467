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

:func:`node_aware_allreduce` is the allreduce that knows where the ranks are: reduced
inside each node, allreduced between one rank per node, broadcast inside each node again,
so that only one rank per node uses the network; :func:`node_groups` makes the process
groups it runs in.

Lesson 09 explains hostfiles, schedulers, torchrun and the interface variables.
"""

from __future__ import annotations

import logging
import os
import re
import sys
import tempfile
from pathlib import Path
from typing import Any

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

    # The base's traitlet (a Unicode), declared for mypy, which sees the base as Any:
    # an annotation alone, no class attribute, so the traitlet is untouched.
    batch_template: str

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


def node_groups(per_node: int) -> tuple[Any, Any, int]:
    """This rank's node's process group, the group of the nodes' first ranks (the
    leaders), and this node's leader (a global rank), for :func:`node_aware_allreduce`.

    Ranks are placed on the nodes in blocks of ``per_node`` (ranks 0 to per_node - 1 on
    the first), as a hostfile's slots and Slurm place them by default. Call it on every
    rank at once, before the allreduces: torch.distributed has every rank make every
    group, even those it is not in.
    """
    import torch.distributed as dist

    rank, size = dist.get_rank(), dist.get_world_size()
    if per_node < 1 or size % per_node:
        raise ValueError(f"{size} ranks do not fill nodes of {per_node}: per_node must "
                         "divide the world size")
    nodes = [list(range(first, first + per_node)) for first in range(0, size, per_node)]
    inside = [dist.new_group(ranks) for ranks in nodes]
    leaders = dist.new_group([ranks[0] for ranks in nodes])
    return inside[rank // per_node], leaders, rank - rank % per_node


def node_aware_allreduce(tensor: Any, node: Any, leaders: Any, leader: int) -> None:
    """Sum ``tensor`` over every rank, in place, with one rank per node on the network.

    ``node``, ``leaders`` and ``leader`` are :func:`node_groups`' answer for this rank.
    Why: between nodes the network is the slow link, inside one the memory is fast. A
    flat ring of p ranks sends 2(p-1)/p · N bytes over each of its links, some of which
    cross the network; here each node first reduces to its leader over the fast link,
    only the leaders allreduce across the network (N bytes each, for two nodes), and each
    leader broadcasts the sum inside its node. Lesson 09 counts the bytes on the network.
    """
    import torch.distributed as dist

    dist.reduce(tensor, dst=leader, group=node)
    if dist.get_rank() == leader:
        dist.all_reduce(tensor, group=leaders)
    dist.broadcast(tensor, src=leader, group=node)


if __name__ == "__main__":
    torchrun_allreduce()
