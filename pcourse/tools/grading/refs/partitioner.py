"""Exercise 01, partition the data: ``shard(n, rank, size, seed, epoch)``.

The reference is torch's own ``DistributedSampler`` (``drop_last=True``), which draws the
same seeded permutation; the checks run at every world size, for n that leave a remainder
and for indices above what 16 bits hold.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from pcourse.tools.grading.checks import (
    Check,
    Contract,
    Learner,
    at_sizes,
    checker,
    per_rank,
    run,
)
from pcourse.tools.grading.refs.common import _said
from pcourse.tools.grading.trials import world

SHARD = Learner("shard")

def _numpy_key() -> np.ndarray:
    """numpy's global generator's key (MT19937's state array)."""
    state = np.random.get_state(legacy=True)
    assert isinstance(state, tuple) and isinstance(state[1], np.ndarray)  # legacy: a tuple
    return state[1]


def partition_trial(shard: Callable, cases: list[tuple[int, int, int]]) -> dict:
    """This rank's indices for every (n, seed, epoch), and whether the global RNGs were spared."""
    comm = world()
    before = (torch.get_rng_state(), _numpy_key().copy(), random.getstate())
    shares = [_share(shard, n, comm.rank, comm.size, seed, epoch) for n, seed, epoch in cases]
    after = (torch.get_rng_state(), _numpy_key(), random.getstate())
    spared = (torch.equal(before[0], after[0]) and np.array_equal(before[1], after[1])
              and before[2] == after[2])
    return {"shares": shares, "rng_spared": spared}


def _share(shard: Callable, n: int, rank: int, size: int, seed: int, epoch: int) -> list[int]:
    """The learner's share as plain ints; an index type too small for n said so."""
    try:
        return [int(i) for i in shard(n, rank, size, seed=seed, epoch=epoch)]
    except (RuntimeError, OverflowError) as exc:
        if n > 32_767 and ("int16" in str(exc) or "overflow" in str(exc)):
            raise _said(exc, f"n = {n}: {exc}: an index above 32,767 does not fit in int16 "
                        "(nor above 127 in int8); let randperm keep its int64") from exc
        raise


def sampler_reference(n: int, size: int, seed: int, epoch: int) -> list[list[int]]:
    """Every rank's segment, from torch's DistributedSampler with drop_last=True.

    The sampler draws the same permutation (``randperm`` seeded with seed + epoch)
    and drops the same tail, but deals it out strided (rank r gets every size-th
    index). Interleaving its shares gives back the permutation, which the
    segment layout cuts into contiguous blocks.
    """
    from torch.utils.data.distributed import DistributedSampler

    shares = []
    for r in range(size):
        dataset: Any = range(n)  # a sampler needs only len() of it
        sampler: DistributedSampler = DistributedSampler(
            dataset, num_replicas=size, rank=r, shuffle=True, seed=seed, drop_last=True)
        sampler.set_epoch(epoch)
        shares.append(list(sampler))
    order = [shares[i % size][i // size] for i in range(len(shares[0]) * size)]
    per = len(shares[0])
    return [order[r * per:(r + 1) * per] for r in range(size)]


def _equal_shares(mc, p: int) -> str | None:
    # n = 101 and 11 leave a remainder at 2 ranks and at 3; n = 2 leaves 3 ranks nothing at all
    cases = [(101, 7, 0), (11, 3, 0), (2, 0, 0)]
    got = run(mc, partition_trial, SHARD, cases, ranks=p)
    for k, (n, _, _) in enumerate(cases):
        shares, per = [o["shares"][k] for o in got], n // p
        if [len(s) for s in shares] != [per] * p:
            return (f"n = {n}: the ranks hold {[len(s) for s in shares]} samples; expected "
                    f"n // size = {per} each")
        if len(set().union(*shares)) != per * p:
            return f"n = {n}: a sample is on two ranks: do all ranks shuffle with the same seed?"
        if not set().union(*shares) <= set(range(n)):
            return f"n = {n}: an index lies outside 0..n-1"
    return None


def _like_the_sampler(mc, p: int, cases: list[tuple[int, int, int]]) -> str | None:
    got = run(mc, partition_trial, SHARD, cases, ranks=p)
    for k, (n, seed, epoch) in enumerate(cases):
        want = sampler_reference(n, p, seed=seed, epoch=epoch)
        for r, mine in enumerate(o["shares"][k] for o in got):
            if mine != want[r]:
                return (f"rank {r}: n={n}, seed={seed}, epoch={epoch}: holds {mine[:3]}..., "
                        f"expected {want[r][:3]}...")
    return None


def _rng_spared(mc, p: int) -> str | None:
    got = run(mc, partition_trial, SHARD, [(101, 7, 1)], ranks=p)
    return per_rank(got, lambda r, o: None if o["rng_spared"] else
                    "shard changed the global random state (torch.manual_seed, np.random.seed or "
                    "random.seed): draw from a torch.Generator of its own")


CONTRACT = Contract(
    shapes=((101,), (11,), (2,)),  # n with a remainder at 2 and 3 ranks, and n below size
    why_not={"dtypes": "shard takes and returns Python integers (indices), no tensor",
             "aliasing": "shard takes numbers only: nothing of the caller's to change",
             "groups": "shard takes a rank and a size, no group or communicator",
             "orders": "shard takes no order of actions",
             "accumulation": "shard takes no gradients, so none accumulate"},
)

CHECKS = (
    Check("every rank gets n // size samples, none twice",
          lambda mc: at_sizes(mc, lambda p: _equal_shares(mc, p))),
    # n = 40,000: indices above 32,767, which a 16-bit index cannot hold
    Check("segments of one seeded shuffle, as DistributedSampler draws it",
          lambda mc: at_sizes(mc, lambda p: _like_the_sampler(
              mc, p, [(101, 7, 0), (11, 3, 0), (4, 0, 0), (40_000, 5, 0)]))),
    Check("each epoch reshuffles with seed + epoch",
          lambda mc: at_sizes(mc, lambda p: _like_the_sampler(
              mc, p, [(101, 7, 1), (101, 7, 5), (30, 2, 3)]))),
    # shuffling must not reseed the generators that initialisation and dropout draw from
    Check("the global random state is left alone",
          lambda mc: at_sizes(mc, lambda p: _rng_spared(mc, p))),
)
check = checker(CHECKS)
