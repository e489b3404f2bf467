"""Comparisons printed to a learner decide only beyond the noise (every lesson).

A machine shared with other work times the same step differently every run. So a
lesson that says "A is faster than B" says it only when every repeat of A beat every
repeat of B; otherwise it says that no difference was measured, and gives the ratio of
the medians for what it is worth.
"""

from __future__ import annotations

from collections.abc import Sequence
from statistics import median


def faster(a: Sequence[float], b: Sequence[float], names: tuple[str, str] = ("A", "B")) -> str:
    """One sentence: which of two sets of repeated timings is faster, beyond their spread.

    Decided only when the two ranges of repeats do not overlap; needs two repeats of each.
    """
    if min(len(a), len(b)) < 2:
        raise ValueError(f"need at least two repeats of each to see their spread, got "
                         f"{len(a)} and {len(b)}")
    (x, tx), (y, ty) = zip(names, (a, b), strict=True)
    ratio = median(tx) / median(ty)
    if max(tx) < min(ty):
        return f"{x} is faster than {y}: {ratio:.2f}× its time, every repeat faster"
    if max(ty) < min(tx):
        return f"{y} is faster than {x}: {1 / ratio:.2f}× its time, every repeat faster"
    return (f"no difference was measured between {x} and {y}: their repeats overlap "
            f"(ratio of the medians {ratio:.2f})")


def faster_by_spread(a: tuple[float, float], b: tuple[float, float],
                     names: tuple[str, str] = ("A", "B"), k: float = 2.0) -> str:
    """:func:`faster` for timings summarised as (mean, standard deviation) of their
    repeats, where the repeats themselves are not kept (a benchmark's table).

    Decided only when the means differ by more than ``k`` times the two spreads
    together; otherwise no difference was measured.
    """
    (ma, sa), (mb, sb) = a, b
    if min(sa, sb) < 0 or k <= 0:
        raise ValueError(f"spreads and k must be positive, got {sa}, {sb} and k = {k}")
    (x, y), ratio, margin = names, ma / mb, k * (sa + sb)
    if ma < mb - margin:
        return f"{x} is faster than {y}: {ratio:.2f}× its time, beyond {k:g}× their spreads"
    if mb < ma - margin:
        return f"{y} is faster than {x}: {1 / ratio:.2f}× its time, beyond {k:g}× their spreads"
    return (f"no difference was measured between {x} and {y}: the means are within {k:g}× "
            f"their spreads (ratio {ratio:.2f})")
