"""How far a prediction was from the run, in the three numbers lesson 13 reads.

A prediction's **error** is (predicted - measured) / measured: +0.1 predicted 10% too
much. Over many configurations, the **median** of |error| says how close the model
usually is and the **worst** how far it can be; Kendall's **τ** says whether it put the
configurations in the order the runs did (1: the same order; 0: no relation; -1:
reversed), which is what choosing between strategies needs, even where the absolute
times are off.
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence


def error(predicted: float, measured: float) -> float:
    """(predicted - measured) / measured."""
    if measured <= 0:
        raise ValueError(f"a measurement of {measured}: errors are relative to a positive one")
    return (predicted - measured) / measured


def kendall_tau(predicted: Sequence[float], measured: Sequence[float]) -> float:
    """Kendall's τ-b of two orderings of the same configurations (ties counted out)."""
    if len(predicted) != len(measured) or len(predicted) < 2:
        raise ValueError("need two equally long lists of at least two values")
    concordant = discordant = ties_p = ties_m = 0
    n = len(predicted)
    for i in range(n):
        for j in range(i + 1, n):
            a = (predicted[i] > predicted[j]) - (predicted[i] < predicted[j])
            b = (measured[i] > measured[j]) - (measured[i] < measured[j])
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
    denominator = ((concordant + discordant + ties_p) * (concordant + discordant + ties_m)) ** 0.5
    return (concordant - discordant) / denominator if denominator else 0.0


def summary(predicted: Sequence[float], measured: Sequence[float]) -> dict[str, float]:
    """Median and worst |error|, and Kendall's τ, of paired predictions and measurements."""
    errors = [abs(error(p, m)) for p, m in zip(predicted, measured, strict=True)]
    return {"median": statistics.median(errors), "worst": max(errors),
            "tau": kendall_tau(predicted, measured), "n": len(errors)}
