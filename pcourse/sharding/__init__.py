"""Sharded data parallelism: ZeRO-1, ZeRO-2 and FSDP, built on reduce-scatter and all-gather.

Data parallelism as lessons 01-08 teach it keeps everything on every rank: the
parameters, the gradients and the optimizer's state (with fp32 Adam 4 + 4 + 8 bytes
per parameter: 16Ψ for Ψ parameters). Sharding cuts what only one rank needs into p
pieces, one per rank:

- :class:`ShardedOptimizer` ``stage=1`` (ZeRO-1): each rank keeps the optimizer
  state of, and steps, only its own slice of the parameters. It needs the averaged
  gradient of that slice only: a reduce-scatter, the allreduce's first half, brings
  it; an all-gather, the second half, brings everyone's updated slices to every
  rank. The whole gradient buffer stays allocated, as in DDP: 8Ψ + 8Ψ/p bytes at rest.
- ``stage=2`` (ZeRO-2): the same messages, but the full gradients are freed once
  reduce-scattered; each rank keeps its slice's only. 4Ψ + 12Ψ/p at rest.
- With ``overlap=True`` the gradients are reduce-scattered in buckets as backward
  fills them (lesson 07's hooks), so ZeRO-2 never holds them all, and the updated
  slices' all-gathers are waited for only when the next forward needs them.
- :class:`FullyShardedDataParallel` (ZeRO-3, FSDP): the parameters themselves are
  sharded. Each unit (a submodule the caller names) is all-gathered just before its
  forward, freed after it, gathered again before its backward, and its gradient is
  reduce-scattered: the gradient of an all-gather is a reduce-scatter. 16Ψ/p, plus
  the unit being computed and, in its backward, its gradient. ``prefetch`` gathers
  the next units while one computes; ``overlap`` waits for the reduce-scatters later.

Slices are cut from one flat vector per parameter group (or unit), padded with zeros
to a multiple of p so every rank's slice has the same length. Every rank then runs
the same elementwise optimizer arithmetic on its slice as one process would on the
whole, so the result equals single-process training up to the order of the sums.

The wire: DDP, ZeRO-1 and ZeRO-2 send 2(p-1)/p·Ψ elements per rank and step (an
allreduce is a reduce-scatter plus an all-gather); FSDP 3(p-1)/p·Ψ (two all-gathers
and one reduce-scatter). :class:`pcourse.backends.counting.CountingBackend`
counts what goes through a backend (the ring's bytes for the sizes it is handed);
:func:`state_bytes` what is held at rest, :func:`held_in_step` the most a step holds
(the allocator's count, :class:`AllocatorLog`) and :func:`peak_theory_bytes` why.

Both classes take a pcourse backend, a torch.distributed process group, or nothing
(torch's default group, as under torchrun: :func:`pcourse.backends.groups.as_backend`).
Lesson 10 builds and measures all of it. One idea a module: :mod:`.zero` (ZeRO-1
and ZeRO-2, and the slicing all three share), :mod:`.fsdp` (ZeRO-3) and
:mod:`.memory` (what a rank holds, measured and in theory).
"""

from pcourse.sharding.fsdp import FullyShardedDataParallel
from pcourse.sharding.memory import (
    AllocatorLog,
    held_in_step,
    peak_bytes,
    peak_theory_bytes,
    state_bytes,
    theory_bytes,
)
from pcourse.sharding.zero import ShardedOptimizer, shard_range

__all__ = ["AllocatorLog", "FullyShardedDataParallel", "ShardedOptimizer", "held_in_step",
           "peak_bytes", "peak_theory_bytes", "shard_range", "state_bytes", "theory_bytes"]
