"""How far a prediction was from the run, in the three numbers lesson 13 reads.

A prediction's **error** is (predicted - measured) / measured: +0.1 predicted 10% too
much. Over many configurations, the **median** of |error| says how close the model
usually is and the **worst** how far it can be; Kendall's **τ** says whether it put the
configurations in the order the runs did (1: the same order; 0: no relation; -1:
reversed), which is what choosing between strategies needs, even where the absolute
times are off.

A measured order is only as sure as the measurement: two configurations whose timed
repeats overlap were not put in any order by the run (the course's one rule for
timings, :func:`pcourse.utils.verdict.smaller`). Given the repeats, τ is counted over
the pairs the run decided, and says how many those were; a pair it left undecided
neither agrees nor disagrees with the model (how far the model put them apart is
what the |error| figures judge). Without repeats (a reference computed, not
measured), every pair is decided by its values.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Callable, Sequence

from pcourse.utils.verdict import smaller


def error(predicted: float, measured: float) -> float:
    """(predicted - measured) / measured."""
    if measured <= 0:
        raise ValueError(f"a measurement of {measured}: errors are relative to a positive one")
    return (predicted - measured) / measured


def kendall_tau(predicted: Sequence[float], measured: Sequence[float],
                order: Callable[[int, int], int] | None = None) -> float:
    """Kendall's τ-b of two orderings of the same configurations (ties counted out).

    ``order(i, j)``: the measured order of configurations i and j (-1: i faster, 1: i
    slower, 0: not decided), where the measurement says more than its medians; a pair
    it does not decide is left out altogether. NaN when no pair is decided."""
    if len(predicted) != len(measured) or len(predicted) < 2:
        raise ValueError("need two equally long lists of at least two values")
    concordant = discordant = ties_p = ties_m = decided = 0
    n = len(predicted)
    for i in range(n):
        for j in range(i + 1, n):
            a = (predicted[i] > predicted[j]) - (predicted[i] < predicted[j])
            b = ((measured[i] > measured[j]) - (measured[i] < measured[j]) if order is None
                 else order(i, j))
            if order is not None and b == 0:
                continue  # the measurement did not decide this pair
            decided += 1
            if a == 0 and b == 0:
                continue
            if a == 0:
                ties_p += 1
            elif b == 0:
                ties_m += 1
            elif a == b:
                concordant += 1
            else:
                discordant += 1
    if not decided:
        return math.nan
    denominator = ((concordant + discordant + ties_p) * (concordant + discordant + ties_m)) ** 0.5
    return (concordant - discordant) / denominator if denominator else 0.0


def decided_pairs(repeats: Sequence[Sequence[float]]) -> int:
    """How many pairs of configurations their timed repeats put in an order."""
    return sum(smaller(repeats[i], repeats[j]) != 0 for i in range(len(repeats))
               for j in range(i + 1, len(repeats)))


def summary(predicted: Sequence[float], measured: Sequence[float],
            repeats: Sequence[Sequence[float]] | None = None) -> dict[str, float]:
    """Median and worst |error|, and Kendall's τ, of paired predictions and measurements
    (``measured``: each configuration's median); given each configuration's timed
    ``repeats``, τ over the pairs they decide (``pairs``: how many, of ``all``), and
    beside it ``tau_medians``, over every pair's medians, decided or not."""
    errors = [abs(error(p, m)) for p, m in zip(predicted, measured, strict=True)]
    n = len(errors)
    if repeats is not None and len(repeats) != n:
        raise ValueError(f"{len(repeats)} sets of repeats for {n} configurations")
    order = None if repeats is None else (lambda i, j: smaller(repeats[i], repeats[j]))
    every = n * (n - 1) // 2
    return {"median": statistics.median(errors), "worst": max(errors),
            "tau": kendall_tau(predicted, measured, order), "n": n, "all": every,
            "pairs": every if repeats is None else decided_pairs(repeats),
            "tau_medians": kendall_tau(predicted, measured)}
