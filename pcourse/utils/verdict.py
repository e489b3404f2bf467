"""Comparisons printed to a learner decide only beyond the noise (every lesson).

A machine shared with other work times the same step differently every run. So a
lesson that says "A is faster than B" says it only when every repeat of A beat every
repeat of B; otherwise it says that no difference was measured, and gives the ratio of
the medians for what it is worth.
"""

from __future__ import annotations

from collections.abc import Sequence
from statistics import median


def smaller(a: Sequence[float], b: Sequence[float]) -> int:
    """-1 when every value of ``a`` is below every value of ``b``, 1 when every one is
    above, 0 when the two ranges overlap: no difference measured.

    The one rule behind every verdict here; needs two values of each (a spread).
    """
    if min(len(a), len(b)) < 2:
        raise ValueError(f"need at least two repeats of each to see their spread, got "
                         f"{len(a)} and {len(b)}")
    return -1 if max(a) < min(b) else 1 if max(b) < min(a) else 0


def faster(a: Sequence[float], b: Sequence[float], names: tuple[str, str] = ("A", "B"),
           spread: str = "repeat") -> str:
    """One sentence: which of two sets of repeated timings is faster, beyond their spread.

    Decided only when the two ranges of repeats do not overlap; needs two repeats of each.
    ``spread`` names what the values are ("repeat"; :func:`faster_quartiles` says
    "quartile").
    """
    (x, tx), (y, ty) = zip(names, (a, b), strict=True)
    order = smaller(tx, ty)
    ratio = median(tx) / median(ty)
    if order < 0:
        return f"{x} is faster than {y}: {ratio:.2f}× its time, every {spread} faster"
    if order > 0:
        return f"{y} is faster than {x}: {1 / ratio:.2f}× its time, every {spread} faster"
    return (f"no difference was measured between {x} and {y}: their {spread}s overlap "
            f"(ratio of the medians {ratio:.2f})")


def faster_quartiles(a: Sequence[float], b: Sequence[float],
                     names: tuple[str, str] = ("A", "B")) -> str:
    """:func:`faster` for timings summarised as (25th percentile, median, 75th
    percentile): decided only when the two interquartile ranges do not overlap."""
    for q in (a, b):
        if len(q) != 3 or not q[0] <= q[1] <= q[2]:
            raise ValueError(f"quartiles are (p25, median, p75), in that order; got {q}")
    return faster(a, b, names, spread="quartile")


def differs(a: float, b: float, tolerance: float, names: tuple[str, str] = ("A", "B"),
            ratio: bool = True) -> str:
    """One sentence: whether ``a`` is larger or smaller than ``b`` by more than a stated
    relative ``tolerance`` (0.1: 10%), for one-off values that have no repeats (a loss,
    a count). Within it: no difference was measured. ``ratio=False`` leaves out a/b, for
    an output that tests compare (its last digit may differ on another machine)."""
    if tolerance <= 0 or b <= 0:
        raise ValueError(f"need a positive tolerance and a positive reference, got "
                         f"{tolerance} and {b}")
    (x, _), (y, _) = zip(names, (a, b), strict=True)
    r = a / b
    said = f"{r:.2f}×, " if ratio else ""
    if r > 1 + tolerance:
        return f"{x} is larger than {y}: {said}beyond the tolerance of {tolerance:.0%}"
    if r < 1 - tolerance:
        return f"{x} is smaller than {y}: {said}beyond the tolerance of {tolerance:.0%}"
    return (f"no difference was measured between {x} and {y}: {said}within the "
            f"tolerance of {tolerance:.0%}")
