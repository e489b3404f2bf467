"""Cluster plumbing: engines for notebooks, ``mpiexec`` jobs for tools.

``engines`` starts an MPI cluster of ipyparallel engines from a notebook (``slurm``:
as one Slurm job); ``view`` is the notebook's view of them, which passes an interrupt on
to the engines; ``failures`` is its error and what the launchers' logs say when a start
fails. ``launch`` runs a command under ``mpiexec`` with a deadline; ``rank_exit`` has each
rank report its own exit, so a failed job names the rank that ended first; ``netns``
stands up two "nodes" on one machine (lesson 09). ``reaping`` ends what a run left;
``interrupts`` is the engines' watcher. Rank and device are the runtime layer's
(:mod:`pcourse.runtime`).

``from pcourse.tools.cluster import start_cluster, stop_cluster`` is what notebooks use.
Those names load ipyparallel only when first asked for, so a rank that needs only
``launch`` never pays for importing it.
"""

from __future__ import annotations

from typing import Any

_ENGINE_NAMES = ("ClusterError", "MPICluster", "start_cluster", "stop_cluster")
__all__ = list(_ENGINE_NAMES)


def __getattr__(name: str) -> Any:
    if name in _ENGINE_NAMES:
        from pcourse.tools.cluster import engines

        return getattr(engines, name)
    raise AttributeError(f"module 'pcourse.tools.cluster' has no attribute {name!r}")
