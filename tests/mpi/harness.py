"""What the MPI check scripts share: failures collected on every rank, and the verdict.

A script calls :func:`expect` as often as it likes (a failed expectation is noted,
not raised, so one launch reports everything), then returns :func:`verdict` from
``main``: rank 0 prints every rank's failures and one summary line, and every rank
returns the same exit code.
"""

from __future__ import annotations

from collections.abc import Callable

from mpi4py import MPI

WORLD = MPI.COMM_WORLD
RANK, SIZE = WORLD.Get_rank(), WORLD.Get_size()
failures: list[str] = []


def expect(cond: bool, what: str) -> None:
    if not cond:
        failures.append(f"rank {RANK}: {what}")


def raises(exc: type[BaseException], fn: Callable, *args, match: str = "", **kwargs) -> bool:
    """Whether ``fn(*args, **kwargs)`` raises ``exc`` with ``match`` in its message."""
    try:
        fn(*args, **kwargs)
    except exc as e:
        return match in str(e)
    return False


def verdict(summary: str, before: str = "") -> int:
    """Print ``before``, every failure and ``summary: ALL OK`` (or the count) on rank 0."""
    problems = [f for fs in WORLD.allgather(failures) for f in fs]
    if RANK == 0:
        print("\n".join(p for p in (before, *problems) if p))
        print(f"{summary}: " + ("ALL OK" if not problems else f"{len(problems)} FAILURES"),
              flush=True)
    return 1 if problems else 0
