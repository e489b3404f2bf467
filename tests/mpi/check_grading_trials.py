"""Run under mpiexec with 3 ranks: the communicator a graded exercise's code gets.

It counts what is sent and to whom, sends synchronously (a send completes only
once its receive is posted, at any size), gives up on a wait that a correct
program never makes, and the sub-worlds of a check number their ranks in reverse.
Exits non-zero with a message on the first failure.
"""

from __future__ import annotations

import sys

import numpy as np
from mpi4py import MPI

from pcourse.tools.grading import wire
from pcourse.tools.grading.trials import CountingComm, DeadlockError, on_ranks, subworld, world

WORLD = MPI.COMM_WORLD
TIMEOUT = 1.0


def expect_deadlock(what: str, fn) -> None:
    try:
        fn()
    except DeadlockError:
        return
    sys.exit(f"rank {WORLD.rank}: {what} did not raise DeadlockError")


def main() -> None:
    rank, p = WORLD.rank, WORLD.size
    right, left = (rank + 1) % p, (rank - 1) % p
    x, y = np.full(5, float(rank)), np.empty(5)

    comm = CountingComm(WORLD.Dup(), timeout=TIMEOUT)
    comm.Sendrecv(x, dest=right, recvbuf=y, source=left)
    comm.Allreduce(MPI.IN_PLACE, x, op=MPI.SUM)
    assert y[0] == left and x[0] == sum(range(p)), (y, x)
    assert [c.name for c in comm.sends()] == ["Sendrecv"] and comm.sends()[0].peer == right
    assert [(c.name, c.count) for c in comm.collectives()] == [("Allreduce", 5)]
    assert comm.bcast(rank, root=1) == 1 and comm.allreduce(rank) == sum(range(p))

    # Every rank sends first: small messages would go eagerly; synchronous sends cannot.
    expect_deadlock("Send before Recv", lambda: CountingComm(WORLD.Dup(), timeout=TIMEOUT).Send(
        x, dest=right))
    blocked = CountingComm(WORLD.Dup(), timeout=TIMEOUT)
    expect_deadlock("Isend().Wait() before Recv",
                    lambda: blocked.Isend(x, dest=right).Wait())
    both = CountingComm(WORLD.Dup(), timeout=TIMEOUT)  # guarded requests are still Requests
    mine = np.full(5, float(rank))
    MPI.Request.Waitall([both.Isend(mine, dest=right), both.Irecv(y, source=left)])
    assert y[0] == left
    lonely = CountingComm(WORLD.Dup(), timeout=TIMEOUT)
    if rank != 0:
        expect_deadlock("a Bcast its root never joins", lambda: lonely.Bcast(x, root=0))
    WORLD.Barrier()
    # Object collectives have no nonblocking twin: a mismatch is found before the call.
    mixed = CountingComm(WORLD.Dup(), timeout=TIMEOUT)
    for what, call in (("bcast with different roots", lambda: mixed.bcast(rank, root=rank)),
                       ("bcast beside allreduce",
                        lambda: mixed.bcast(1) if rank == 0 else mixed.allreduce(1))):
        try:
            call()
        except DeadlockError as exc:
            assert "rank 0: comm.bcast(root=0)" in str(exc), exc
            continue
        sys.exit(f"rank {rank}: {what} did not raise DeadlockError")
    assert mixed.bcast(rank, root=p - 1) == p - 1  # and the communicator still works
    WORLD.Barrier()
    # Nor has making a communicator: one rank that never joins is found, not waited for.
    making = CountingComm(WORLD.Dup(), timeout=TIMEOUT)
    if rank != 0:
        expect_deadlock("a Split one rank never joins", lambda: making.Split(0, rank))
    splitting = CountingComm(WORLD.Dup(), timeout=TIMEOUT)
    try:
        splitting.Dup() if rank == 0 else splitting.Split(0, rank)
        sys.exit(f"rank {rank}: Dup beside Split did not raise DeadlockError")
    except DeadlockError as exc:
        assert "rank 0: comm.Dup, rank 1: comm.Split" in str(exc), exc
    WORLD.Barrier()

    # A world of 2: the last two ranks, numbered in reverse; rank 0 sits it out.
    sub = subworld(2)
    if rank == 0:
        assert sub == MPI.COMM_NULL
    else:
        assert (sub.rank, sub.size) == (p - 1 - rank, 2), (sub.rank, sub.size)
    got = on_ranks(2, lambda: world().rank * 10, (), {})  # results travel as wire data
    assert got is None if rank == 0 else (got["rank"], wire.loads(got["value"])) == (
        p - 1 - rank, (p - 1 - rank) * 10), got
    unsent = on_ranks(2, lambda: object(), (), {})  # what is not data is an error, said so
    assert rank == 0 or unsent["error"][:2] == (
        "TypeError", "the result could not be sent back: a builtins.object is not plain data "
        "(numbers, strings, lists, tuples, dicts, arrays, tensors)"), unsent
    failed = on_ranks(3, lambda: 1 / (world().rank - 1), (), {})
    if failed["rank"] == 1:
        assert failed["error"][0] == "ZeroDivisionError", failed
    print(f"rank {rank}: ok", flush=True)


if __name__ == "__main__":
    main()
