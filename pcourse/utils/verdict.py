"""Comparisons printed to a learner decide only beyond the noise (every lesson).

A machine shared with other work times the same step differently every run. So a
lesson that says "A is faster than B" says it only when every repeat of A beat every
repeat of B, and only when there are enough repeats for that to mean something: two
sets of repeats of *equal* timings fall apart like that by chance 2 / C(n + m, n) of
the time (10% at 3 and 3, 3% at 4 and 4, 0.8% at 5 and 5), and a verdict needs that
chance at most :data:`FALSE_CALL`. Otherwise it says what was decided: nothing, and
why (the repeats overlap, or are too few), with the ratio of the medians for what it
is worth. That is the one rule for timings; :func:`differs` is for one-off values
with no repeats (a loss, a count), against a tolerance the caller states.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from statistics import median

# The most often a verdict may be called between equal timings: 2 / C(n + m, n) for n
# and m repeats, the chance that their ranges fall apart by chance alone.
FALSE_CALL = 0.05


def chance_apart(n: int, m: int) -> float:
    """How often n and m repeats of one and the same timing fall apart by chance alone:
    every one of a set below every one of the other (either way), 2 / C(n + m, n) of
    all the orders the n + m values can come in."""
    return 2 / math.comb(n + m, n)


def smaller(a: Sequence[float], b: Sequence[float]) -> int:
    """-1 when every value of ``a`` is below every value of ``b``, 1 when every one is
    above, 0 when not decided: the two ranges overlap, or there are too few repeats for
    their falling apart to mean anything (:func:`chance_apart` above :data:`FALSE_CALL`).

    The one rule behind every timing verdict here; needs two values of each (a spread).
    """
    if min(len(a), len(b)) < 2:
        raise ValueError(f"need at least two repeats of each to see their spread, got "
                         f"{len(a)} and {len(b)}")
    if chance_apart(len(a), len(b)) > FALSE_CALL:
        return 0
    return _apart(a, b)


def _apart(a: Sequence[float], b: Sequence[float]) -> int:
    return -1 if max(a) < min(b) else 1 if max(b) < min(a) else 0


def faster(a: Sequence[float], b: Sequence[float], names: tuple[str, str] = ("A", "B"),
           spread: str = "repeat") -> str:
    """One sentence: which of two sets of repeated timings is faster, beyond their spread,
    or that it was not decided and why.

    Decided as :func:`smaller` decides; needs two repeats of each. ``spread`` names
    what the values are ("repeat"; :func:`faster_quartiles` says "quartile").
    """
    (x, tx), (y, ty) = zip(names, (a, b), strict=True)
    ratio = median(tx) / median(ty)
    order = smaller(tx, ty) if spread == "repeat" else _apart(tx, ty)
    if order < 0:
        return f"{x} is faster than {y}: {ratio:.2f}× its time, every {spread} faster"
    if order > 0:
        return f"{y} is faster than {x}: {1 / ratio:.2f}× its time, every {spread} faster"
    if spread == "repeat" and chance_apart(len(tx), len(ty)) > FALSE_CALL:
        return (f"not decided between {x} and {y}: {len(tx)} and {len(ty)} repeats are too "
                f"few (equal timings fall apart {chance_apart(len(tx), len(ty)):.0%} of the "
                f"time; a verdict allows {FALSE_CALL:.0%}; ratio of the medians {ratio:.2f})")
    return (f"not decided between {x} and {y}: their {spread}s overlap "
            f"(ratio of the medians {ratio:.2f})")


def faster_quartiles(a: Sequence[float], b: Sequence[float],
                     names: tuple[str, str] = ("A", "B")) -> str:
    """:func:`faster` for timings summarised as (25th percentile, median, 75th
    percentile) of many repeats: decided only when the two interquartile ranges do not
    overlap (each range already holds half of its repeats)."""
    for q in (a, b):
        if len(q) != 3 or not q[0] <= q[1] <= q[2]:
            raise ValueError(f"quartiles are (p25, median, p75), in that order; got {q}")
    return faster(a, b, names, spread="quartile")


def differs(a: float, b: float, tolerance: float, names: tuple[str, str] = ("A", "B"),
            ratio: bool = True) -> str:
    """One sentence: whether ``a`` is larger or smaller than ``b`` by more than a stated
    relative ``tolerance`` (0.1: 10%), for one-off values that have no repeats (a loss,
    a count; never a timing: those go through :func:`faster`). Within it, the sentence
    says so. ``ratio=False`` leaves out a/b, for an output that tests compare (its last
    digit may differ on another machine)."""
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
    within = f"{x} is within the tolerance of {tolerance:.0%} of {y}"
    return f"{within} ({r:.2f}×)" if ratio else within
