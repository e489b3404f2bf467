"""Run under mpiexec with 2 ranks: mpi4py's object messages between the grader's ranks.

The grader's ranks read each other's objects with the wire format (as
pcourse.tools.grading.rank sets up): rank 0 sends a plain list, then the bytes of a pickle
that runs code when rebuilt, as a buffer (what a learner's code may make its rank send);
rank 1 reads both with the pickle-based recv. The list arrives; the pickle is refused,
and runs nothing. Exits non-zero with a message on the first failure.
"""

from __future__ import annotations

import builtins
import sys

import numpy as np
from mpi4py import MPI

from pcourse.tools.grading import wire

MPI.pickle.__init__(wire.dumps, wire.loads)  # as pcourse.tools.grading.rank does
WORLD = MPI.COMM_WORLD
PAYLOAD = b"cbuiltins\nexec\n(Vimport builtins; builtins.pcourse_ran = 1\ntR."


def main() -> None:
    if WORLD.rank == 0:
        WORLD.send([1, "two", np.arange(3.0)], dest=1, tag=1)
        WORLD.Send(np.frombuffer(PAYLOAD, dtype=np.uint8), dest=1, tag=2)
    else:
        got = WORLD.recv(source=0, tag=1)
        if got[:2] != [1, "two"] or not np.array_equal(got[2], np.arange(3.0)):
            sys.exit(f"rank 1 received {got!r}")
        try:
            WORLD.recv(source=0, tag=2)
            sys.exit("rank 1 read a pickle as an object")
        except wire.WireError:
            pass
        if hasattr(builtins, "pcourse_ran"):
            sys.exit("the pickle ran on rank 1")
    WORLD.Barrier()
    if WORLD.rank == 0:
        print("wire between ranks OK")


if __name__ == "__main__":
    main()
