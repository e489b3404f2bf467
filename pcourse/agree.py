"""Before any data moves, every rank checks that all ranks called a collective alike.

Collectives are matched by order, not by content: ranks that pass different lengths,
dtypes, ops or roots deadlock or silently mix data. One tiny allreduce settles it.
Each rank contributes ``[refused, v, -v, ...]`` for its facts ``v`` and the ranks take
the elementwise MAX, which gives every fact's largest and smallest value at once;
they agree when the two are equal. A rank whose own input failed its local checks
joins with ``refused`` set, so the others raise instead of waiting for it forever.

Used by the from-scratch collectives (lesson 03), every backend (lesson 04) and the
model fingerprint of :mod:`pcourse.data_parallel`. numpy only: no torch, no MPI here;
the caller passes the MAX-allreduce of its own transport.

:func:`checked_then_agreed` is the whole dance every collective does: this rank's own
checks of its input, then the agreement, joined as refused where the checks failed.

The same rule for a step that can fail on some ranks only (:func:`everyone`): the
ranks exchange how it went, and if it failed anywhere, every rank raises the same
error, naming the ranks, instead of some waiting forever for the others.
"""

from __future__ import annotations

import zlib
from collections.abc import Callable, Mapping, Sequence
from typing import Any, TypeVar

import numpy as np

MaxOverRanks = Callable[[np.ndarray], np.ndarray]  # int64 vector -> elementwise max over ranks


T = TypeVar("T")


class MismatchError(ValueError):
    """Ranks called one collective with different arguments, or a rank refused its own."""


class RankFailure(RuntimeError):
    """A step failed on some ranks; raised on every rank, naming each and its error."""


def everyone(comm: Any, step: Callable[[], T], what: str,
             before_gather: Callable[[], object] | None = None) -> T | None:
    """``step()`` on this rank of ``comm`` (an mpi4py communicator); its result, or
    RankFailure on every rank if it failed on any. Collective.

    ``before_gather``: how to wait for the slowest rank first (a benchmark's ranks
    that sat out sleep in a barrier rather than spin in the allgather).
    """
    try:
        result, error = step(), ""
    except Exception as exc:  # noqa: BLE001 - reported to every rank below
        result, error = None, f"{type(exc).__name__}: {exc}"
    if before_gather is not None:
        before_gather()
    failed = [f"rank {r}: {e}" for r, e in enumerate(comm.allgather(error)) if e]
    if failed:
        raise RankFailure(f"{what} failed on " + "; ".join(failed))
    return result


def _code(value: int | str) -> int:
    # crc32, not hash(): Python salts str hashes per process, crc32 is the same everywhere.
    return value if isinstance(value, int) else zlib.crc32(value.encode())


def agree(
    facts: Mapping[str, int | str],
    max_over_ranks: MaxOverRanks,
    *,
    subject: str,
    hint: str,
    refused: bool = False,
    error: type[ValueError] = MismatchError,
) -> None:
    """Raise ``error`` on every rank unless all ranks passed the same ``facts``.

    Collective: every rank calls it with the same keys, in the same order. Integers
    are reported as a range, strings (dtypes, ops, shapes) as "differs". ``refused``:
    this rank's input failed its local checks; it joins so that nobody hangs, and
    the caller raises its own error afterwards.
    """
    codes = [0 if refused else _code(v) for v in facts.values()]
    mine = np.array([int(refused)] + [x for c in codes for x in (c, -c)], dtype=np.int64)
    top = max_over_ranks(mine)
    if refused:
        return
    if top[0]:
        raise error(f"{subject}, but another rank refused its input (see that rank's error); "
                    "no data moved")
    diffs = []
    for i, (key, value) in enumerate(facts.items()):
        hi, lo = int(top[1 + 2 * i]), -int(top[2 + 2 * i])
        if hi != lo:
            if isinstance(value, str):
                shown = value if len(value) <= 60 else value[:57] + "..."
                diffs.append(f"{key} differs between ranks (this rank: {shown})")
            else:
                diffs.append(f"{key} ranges from {lo} to {hi} (this rank: {value})")
    if diffs:
        raise error(f"{subject}, but " + "; ".join(diffs) + f". {hint}")


def checked_then_agreed(checks: Callable[[], tuple[Mapping[str, int | str], T]],
                        keys: Sequence[str], max_over_ranks: MaxOverRanks, *, check: bool = True,
                        subject: str, hint: str, error: type[ValueError] = MismatchError) -> T:
    """This rank's own ``checks()`` of its input, then (``check``) :func:`agree` of all ranks.

    ``checks`` raises ValueError or TypeError when this rank's input is bad; else it
    returns ``(facts, value)``, the facts keyed by ``keys`` in that order. A rank whose
    input is bad still joins the agreement, as refused, so that no rank waits for it
    forever: it raises its own error, every other rank ``error``. Returns ``value``.
    Collective when ``check``; ``check=False`` where the caller knows the ranks agree.
    """
    try:
        facts, value = checks()
    except (ValueError, TypeError):
        if check:
            agree(dict.fromkeys(keys, 0), max_over_ranks, subject=subject, hint=hint,
                  refused=True)
        raise
    if check:
        agree({k: facts[k] for k in keys}, max_over_ranks, subject=subject, hint=hint,
              error=error)
    return value
