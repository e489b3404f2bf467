"""How long one training step takes, predicted before it runs (lesson 13).

A step is a rank's computation (:class:`Work`: forward, backward, optimizer, priced from
counted operators, :mod:`pcourse.cost_model.counting`) plus the communication the
computation could not hide, each call priced by its :class:`~pcourse.cost_model.machine.Link`
(``a + b·n``, lesson 03's α-β model fitted on this machine, plus the agreement check where
the caller asks for one), and each time the ranks must meet after computing, what meeting
costs (``meet``: on a CPU with more ranks than cores, one of them is often off its core).
What can hide behind what is lesson 07's model
(:func:`pcourse.step_model.exposed_time`) for a library that moves bytes on a thread of
its own (Gloo). MPI without a progress thread moves a nonblocking collective only
inside MPI calls: a reduction started during the backward waits for the wait, and
prefetching a unit gathers it no earlier (:data:`PROGRESSES_ALONE`).

A pipeline of p stages and m micro-batches keeps its slowest stage busy m times and
the others' work in front of and behind it: ``(m - 1)·max_r(F_r + B_r) + Σ_r (F_r + B_r)``,
which for equal stages is m(F + B)/(1 - bubble), lesson 12's bubble (p-1)/(m+p-1)
(:func:`pcourse.pipeline.bubble_fraction`), plus one message per stage boundary each way
on the critical path.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from pcourse.cost_model.machine import CostModelError, Link
from pcourse.step_model import exposed_time

PROGRESSES_ALONE = {"gloo": True, "mpi": False}


@dataclass(frozen=True)
class Work:
    """Seconds one rank computes in a step: forward, backward, optimizer."""

    forward: float
    backward: float
    optimizer: float

    @property
    def total(self) -> float:
        return self.forward + self.backward + self.optimizer


def dp_step_time(work: Work, buckets: Sequence[int], allreduce: Link, *,
                 overlap: bool = False, meet: float = 0.0) -> float:
    """DDP with buckets of ``buckets`` bytes (lesson 07): one allreduce each, started as
    backward fills it if ``overlap`` (and the library progresses alone), else after;
    the ranks meet once, at the first."""
    return (work.total + exposed_time(buckets, allreduce.a, allreduce.b, work.backward, overlap)
            + meet)


def zero_step_time(work: Work, buckets: Sequence[int], reduce_scatter: Link,
                   all_gather: Link, *, meet: float = 0.0) -> float:
    """ZeRO-1 or ZeRO-2 (lesson 10): per padded bucket of n bytes, a reduce-scatter of n
    after the backward and an all-gather of n after the step (the optimizer's work
    ``work.optimizer`` is this rank's slice's); the ranks meet before each."""
    return (work.total + sum(reduce_scatter.time(n) + all_gather.time(n) for n in buckets)
            + 2 * meet)


def fsdp_step_time(work: Work, units: Sequence[int], all_gather: Link,
                   reduce_scatter: Link, *, meet: float = 0.0) -> float:
    """FSDP (lesson 10): per unit of n bytes gathered, two all-gathers (forward and
    backward) and one reduce-scatter, on the critical path, each a meeting."""
    return work.total + sum(2 * all_gather.time(n) + reduce_scatter.time(n) + 3 * meet
                            for n in units)


def tp_step_time(work: Work, layers: int, activation: int, allreduce: Link, *,
                 meet: float = 0.0) -> float:
    """Tensor parallelism (lesson 11): per block, g's two allreduces of the activation
    (``activation`` bytes) in the forward and f's two in the backward, each checked
    and each a meeting."""
    return work.total + 4 * layers * (allreduce.time(activation, checked=True) + meet)


def sp_step_time(work: Work, layers: int, activation: int, all_gather: Link,
                 reduce_scatter: Link, allreduce: Link, replicated: Sequence[int], *,
                 meet: float = 0.0) -> float:
    """Sequence parallelism (lesson 11): per block four all-gathers and four
    reduce-scatters of the whole activation (two of each forward, two backward), each a
    meeting, then one allreduce per replicated parameter's gradient (``replicated``:
    their bytes, called one after the other: one meeting)."""
    halves = all_gather.time(activation, checked=True) + reduce_scatter.time(activation,
                                                                             checked=True)
    return (work.total + 4 * layers * (halves + 2 * meet) + meet
            + sum(allreduce.time(n, checked=True) for n in replicated))


def pipeline_step_time(forward: Sequence[float], backward: Sequence[float], m: int,
                       send: Link, message: int, optimizer: float, *,
                       meet: float = 0.0) -> float:
    """GPipe or 1F1B (lesson 12): ``forward[r]``, ``backward[r]`` seconds of one
    micro-batch on stage r; ``message`` bytes cross each boundary, each message on the
    critical path a meeting; the slowest stage's ``optimizer``. Both schedules take the
    same time: only memory differs."""
    if isinstance(m, bool) or not isinstance(m, int) or m < 1:
        raise CostModelError(f"m = {m!r} micro-batches: a whole number, at least 1")
    if len(forward) != len(backward) or not forward:
        raise CostModelError("one forward and one backward time per stage")
    stages = [f + b for f, b in zip(forward, backward, strict=True)]
    p = len(stages)
    return ((m - 1) * max(stages) + sum(stages) + 2 * (p - 1) * (send.time(message) + meet)
            + optimizer)
