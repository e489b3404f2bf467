"""Run under mpiexec: a benchmark's rank groups run a function on the first p ranks,
and a failure on any of them is the same error on every rank of the job, naming the
rank that failed (the others sit out in a sleeping barrier, then hear of it).

Prints "rank groups ok on N ranks" on rank 0.
"""

from __future__ import annotations

from mpi4py import MPI

from pcourse.tools.bench.jobs import BenchError, RankGroups

WORLD = MPI.COMM_WORLD
size = WORLD.size
assert size >= 3, "run at 3 ranks or more"

with RankGroups(WORLD, [1, 2, size]) as groups:
    got = groups.run(2, lambda sub: (sub.rank, sub.size, sub.allreduce(1)))
    assert got == ((WORLD.rank, 2, 2) if WORLD.rank < 2 else None), got

    def fails_on_sub_rank_1(sub):
        if sub.rank == 1:
            raise ValueError("planted")
        return sub.rank

    try:
        groups.run(2, fails_on_sub_rank_1)
    except BenchError as exc:
        said = str(exc)
    else:
        raise AssertionError(f"rank {WORLD.rank}: a failure on rank 1 went unheard")
    assert said == "a run at 2 rank(s) failed on rank 1: ValueError: planted", said

    # the groups still work after a failure, at every size
    assert groups.run(size, lambda sub: sub.allreduce(sub.rank)) == size * (size - 1) // 2
    assert groups.run(1, lambda sub: sub.size) == (1 if WORLD.rank == 0 else None)

if WORLD.rank == 0:
    print(f"rank groups ok on {size} ranks", flush=True)
