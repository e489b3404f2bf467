"""Exercise 03, ring allreduce from point-to-point messages: ``ring_allreduce(x, comm)``.

The reference is the sum of every rank's data in one process, from the same seeds
(:func:`ring_reference`); the calls are the rank's record of them: 2(p - 1) sends of at
most ceil(n/p) numbers, to one neighbour, and no collective.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

from pcourse.tools.grading.checks import (
    NOT_YET,
    Check,
    Contract,
    Learner,
    at_sizes,
    checker,
    per_rank,
    run,
    tensors_differ,
)
from pcourse.tools.grading.refs.common import collectives, sends
from pcourse.tools.grading.trials import CountingComm, check_left_behind, reports_calls, world

RING = Learner("ring_allreduce")


def ring_data(n: int, seed: int, rank: int) -> np.ndarray:
    """Rank ``rank``'s numbers to sum: the trial's input, and the reference's."""
    return np.random.default_rng(seed + rank).standard_normal(n)


@reports_calls
def ring_trial(ring: Callable, n: int, seed: int = 0) -> dict:
    """The learner's ring sum of rank-dependent data, and the calls it made.

    No reference is where the learner's code runs: the sum is computed by the checks
    (:func:`ring_reference`), where the learner's code cannot read it from a frame.
    """
    comm = world()
    x = ring_data(n, seed, comm.rank)
    counting = CountingComm(comm)
    ring(x, counting)
    check_left_behind(counting, getattr(ring, "__name__", "the ring"))
    return {"got": x, "calls": counting.calls}


def ring_reference(n: int, size: int, seed: int = 0) -> np.ndarray:
    """The sum over ``size`` ranks of :func:`ring_data`, in one process."""
    return np.sum([ring_data(n, seed, rank) for rank in range(size)], axis=0)


def _sums(mc: Any, p: int, lengths: list[int]) -> str | None:
    for n in lengths:
        got = run(mc, ring_trial, RING, n, seed=n, ranks=p)
        want = ring_reference(n, p, seed=n)
        for r, o in enumerate(got):
            problem = tensors_differ([o["got"]], [want], [f"the sum (n = {n})"], rtol=1e-12,
                                     atol=1e-12)
            if problem:
                return f"rank {r}: {problem}"
    return None


def _ring_like(p: int, n: int) -> Callable[[int, dict], str | None]:
    largest = -(-n // p)  # ceil(n / p)

    def test(r: int, o: dict) -> str | None:
        sent, called = sends(o["calls"]), collectives(o["calls"])
        peers = sorted({c.peer for c in sent if c.peer is not None})  # a send names its peer
        if called:
            return f"it called comm.{called[0].name}, a collective; use point-to-point only"
        if len(sent) != 2 * (p - 1):
            return f"it sent {len(sent)} messages; a ring sends 2(p - 1) = {2 * (p - 1)}"
        if max(c.count for c in sent) > largest:
            return (f"it sent {max(c.count for c in sent)} numbers at once; ring chunks hold at "
                    f"most ceil(n/p) = {largest}")
        if peers not in ([(r + 1) % p], [(r - 1) % p]):  # the right or the left neighbour
            return (f"it sent to ranks {peers}; in a ring every rank sends to one neighbour, "
                    "always the same one")
        return None

    return test


def _traffic(mc: Any, p: int, n: int = 1001) -> str | None:
    return per_rank(run(mc, ring_trial, RING, n, ranks=p), _ring_like(p, n))


CONTRACT = Contract(
    shapes=((1000,), (1001,), (4,), (2,), (1,)),  # n divisible by p or not, n below p
    why_not={"dtypes": NOT_YET + " (one dtype of data)",
             "aliasing": NOT_YET,
             "groups": NOT_YET + " (the world's communicator only)",
             "orders": "ring_allreduce takes no order of actions",
             "accumulation": "ring_allreduce takes no gradients, so none accumulate"},
)

CHECKS = (
    Check("ring sum equals the sum of every rank's data (n = 1000)",
          lambda mc: at_sizes(mc, lambda p: _sums(mc, p, [1000]))),
    # lengths that p does not divide, and shorter than p
    Check("ring sum equals the sum of every rank's data for n = 1001, 4, 2, 1",
          lambda mc: at_sizes(mc, lambda p: _sums(mc, p, [1001, 4, 2, 1]))),
    Check("point-to-point only: 2(p-1) messages of at most ceil(n/p) numbers, to one neighbour",
          lambda mc: at_sizes(mc, lambda p: _traffic(mc, p))),
)
check = checker(CHECKS)
