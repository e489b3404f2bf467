"""A checkpoint written by one number of ranks, resumed by another (lesson 14).

Some of a rank's shard is the same on every rank and some is not:

- the weights, a replicated optimizer's state (DDP-style: every rank steps the same
  averaged gradient), the schedule and the data's position are the same everywhere: a
  new rank takes old rank 0's;
- a ZeRO-1 rank's optimizer state is its slice of every bucket (lesson 10's
  :func:`~pcourse.sharding.zero.shard_range`: a flat vector padded to a multiple of the
  rank count). The old ranks' slices, put back end to end, are each bucket's whole state;
  cut off the old padding, padded for the new count and cut again, they are the new
  ranks' slices. The bucket layout does not depend on the rank count, only the cuts do;
  and the padding's state is zero at any count (its gradient always is);
- the generators are each rank's own, and there is no splitting them: new rank r takes
  old rank r's, and a rank beyond the old count keeps its fresh seeding.

The data's position maps as it is: with the strided partition (lesson 02) the ranks'
k-th batches together are the global k-th batch at any rank count, so "epoch e, batch k"
names the same samples before and after, provided the global batch stays the same.
Nothing here does arithmetic on a value: the state loaded is the state saved, bit for bit.
"""

from __future__ import annotations

from typing import Any

import torch

from pcourse.sharding.zero import ShardedOptimizer, shard_range

__all__ = ["recut"]


def recut(shards: list[dict[str, Any]], rank: int, size: int,
          optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """Rank ``rank`` of ``size``'s shard, made from every old rank's (``shards[r]``: old
    rank r's, as :func:`pcourse.resume.save` wrote it). ``optimizer``: the new rank's,
    which says how its state is laid out (a :class:`ShardedOptimizer`'s buckets)."""
    first = shards[0]
    mine = {**first, "rng": shards[rank]["rng"] if rank < len(shards) else None}
    if isinstance(optimizer, ShardedOptimizer):
        mine["optimizer"] = _recut_zero([s["optimizer"] for s in shards], rank, size,
                                        optimizer)
    return mine


def _recut_zero(old: list[dict[str, Any]], rank: int, size: int,
                optimizer: ShardedOptimizer) -> dict[str, Any]:
    """A ZeRO-1 state dict for ``rank`` of ``size`` from the old ranks' (in rank order)."""
    if [o["rank"] for o in old] != list(range(len(old))):
        raise ValueError(f"the old shards are ranks {[o['rank'] for o in old]}, "
                         f"expected 0 to {len(old) - 1} in order")
    locals_ = [o["local"] for o in old]
    state: dict[int, dict[str, Any]] = {}
    for i, bucket in enumerate(optimizer.buckets):
        numel = sum(p.numel() for p in bucket.params)
        lo, hi, padded = shard_range(numel, rank, size)
        slot: dict[str, Any] = {}
        for key, value in locals_[0]["state"].get(i, {}).items():
            if key == "step" or value.dim() == 0:  # a count, the same on every rank
                slot[key] = value.clone()
                continue
            whole = torch.cat([loc["state"][i][key] for loc in locals_])[:numel]
            slot[key] = torch.cat([whole, whole.new_zeros(padded - numel)])[lo:hi].clone()
        if slot:
            state[i] = slot
    return {"rank": rank, "size": size, "stage": old[0]["stage"],
            "local": {"state": state, "param_groups": locals_[0]["param_groups"]}}
