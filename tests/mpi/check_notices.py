"""Run under mpiexec: a rank that raises inside :func:`pcourse.notices.failing_loudly`
tells the others, whose collective then times out with an error naming it and its
reason; a rank that says nothing (it only stalls) is not named: the others' error is
the timeout as it was. Prints "notices OK on p ranks".
"""

from __future__ import annotations

import sys
import time

from harness import RANK, SIZE, WORLD, expect, verdict

from pcourse.backends import make_backend
from pcourse.notices import RankFailed, failing_loudly
from pcourse.runtime.waits import CollectiveTimeout
from pcourse.tools.bench import restart

DEADLINE = 2.0


def raised() -> None:
    """The last rank raises before step 3 of the run; every other rank must name it."""
    backend = make_backend("mpi", timeout=DEADLINE)
    ending, _ = restart.how_it_ends(backend, 24, (SIZE - 1, 3))
    if RANK == SIZE - 1:
        expect(ending == f"RuntimeError: rank {SIZE - 1} fails on purpose before step 3",
               f"the failing rank's own ending: {ending!r}")
    else:
        expect(ending.startswith(f"RankFailed: rank {SIZE - 1} failed (RuntimeError: rank "
                                 f"{SIZE - 1} fails on purpose before step 3), and said so"),
               f"a survivor's ending: {ending!r}")
        expect(f"rank {RANK}: allreduce did not complete within" in ending,
               f"a survivor's ending does not keep its timeout: {ending!r}")


def stalled() -> None:
    """The last rank stalls past the deadline and raises nothing: nobody may be named."""
    backend = make_backend("mpi", timeout=DEADLINE)
    try:
        with failing_loudly(backend):
            if RANK == SIZE - 1:
                time.sleep(2 * DEADLINE)
            else:
                restart.barrier(backend)
        ending = "finished" if RANK == SIZE - 1 else "the barrier completed"
    except RankFailed as exc:
        ending = f"named: {exc}"
    except CollectiveTimeout:
        ending = "timeout"
    expect(ending == ("finished" if RANK == SIZE - 1 else "timeout"), f"stalled: {ending!r}")


def healthy() -> None:
    """No failure: every rank finishes, and the channel is freed."""
    backend = make_backend("mpi", timeout=30)
    with failing_loudly(backend) as notices:
        restart.barrier(backend)
    expect(notices.comm is None and notices.heard() == [], "the channel was left open")
    backend.close()


def main() -> int:
    healthy()
    raised()
    WORLD.Barrier()
    stalled()
    WORLD.Barrier()
    code = verdict(f"notices on {SIZE} ranks")
    if code == 0 and RANK == 0:
        print(f"notices OK on {SIZE} ranks", flush=True)
    return code


if __name__ == "__main__":
    sys.exit(main())
