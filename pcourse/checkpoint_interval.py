"""How often to checkpoint: Young's interval, and a long run with failures that shows it.

Saving costs ``save_s`` each time; a failure loses the work since the last complete
checkpoint and costs ``restart_s`` to come back. Save often and the saves add up; save
rarely and each failure loses more. Young (1974) balanced the two to first order: with a
mean time between failures ``mtbf_s``, the interval between checkpoints that wastes least
is ``sqrt(2 * save_s * mtbf_s)``. :func:`simulate` checks that against a run in which the
failures are drawn, not averaged (lesson 14).
"""

from __future__ import annotations

import math
import random


def young_interval(save_s: float, mtbf_s: float) -> float:
    """Young's interval between checkpoints, in seconds of work: sqrt(2 C M)."""
    return math.sqrt(2 * save_s * mtbf_s)


def expected_waste(interval_s: float, save_s: float, mtbf_s: float) -> float:
    """Young's first-order wasted fraction of the time: the saves (C / tau) plus, per
    failure, half an interval's work lost (tau / 2M). Smallest at :func:`young_interval`."""
    return save_s / interval_s + interval_s / (2 * mtbf_s)


def simulate(interval_s: float, save_s: float, restart_s: float, mtbf_s: float,
             work_s: float, seed: int = 0) -> float:
    """The wall time a run of ``work_s`` seconds of work takes, checkpointing every
    ``interval_s`` seconds of work, with failures drawn at exponential times of mean
    ``mtbf_s`` (a failure can strike anywhere, during a save too). A failure sends the run
    back to its last complete checkpoint after ``restart_s`` (a restart itself never fails).
    One failure a loop turn, not one interval: a long run costs as many turns as it has
    failures."""
    if min(interval_s, mtbf_s, work_s) <= 0 or min(save_s, restart_s) < 0:
        raise ValueError("interval, MTBF and work must be positive; save and restart times "
                         f"not negative (got {interval_s}, {mtbf_s}, {work_s}, {save_s}, "
                         f"{restart_s})")
    draw = random.Random(seed)
    done, wall, segment = 0.0, 0.0, interval_s + save_s
    while True:
        up = draw.expovariate(1 / mtbf_s)  # until the next failure
        left = math.ceil((work_s - done) / interval_s - 1e-9)  # intervals still to do
        if up >= left * segment:  # the run ends before it fails
            return wall + (work_s - done) + left * save_s
        saved = math.floor(up / segment)  # complete checkpoints before the failure
        done += saved * interval_s
        wall += up + restart_s
