"""What one rank holds in a training step, predicted before it runs (lesson 13).

Between steps a rank holds its **state**: parameters, the gradients its code keeps (DDP's
buckets and ZeRO-1's buffer keep theirs; a ``zero_grad()`` that sets them to None frees
the others) and AdamW's two numbers per parameter it steps: lesson 10's table
(:func:`pcourse.sharding.memory.theory_bytes`) where the code keeps its gradients. During
the step it holds more, and the **peak** comes at one of a few moments, each predicted:

- when the backward begins, every block's saved activations are alive
  (:meth:`~pcourse.cost_model.shapes.Stack.saved`), plus the backward's first
  temporaries (:func:`backward_transient`);
- ZeRO-2 also holds the flat gradient of the bucket being filled; FSDP, in the last
  unit's backward, that unit gathered again and its parameters' gradients (two units:
  the gathered copy is freed before the gradients are joined, lesson 10), and one more
  per unit prefetched, beside every activation saved (the last block's own are still
  held while its first products run);
- a pipeline stage holds what its schedule keeps in flight (:func:`pipeline_memory`
  walks the schedule action by action), and every message it sent, until the step's
  end, where the course's ``Stage`` waits for its sends.

Checkpointing (:mod:`pcourse.checkpointing`) changes only the activations: L segment
inputs, and during the backward one block's activations recomputed.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from pcourse.buckets import DEFAULT_CAP_BYTES, plan_buckets
from pcourse.cost_model.machine import CostModelError
from pcourse.cost_model.shapes import Stack
from pcourse.pipeline import gpipe_order, one_f_one_b_order
from pcourse.sharding.memory import theory_bytes
from pcourse.sharding.zero import shard_range

ADAM = 2  # AdamW keeps two numbers per parameter it steps
SCHEDULES = {"gpipe": gpipe_order, "1f1b": one_f_one_b_order}


@dataclass(frozen=True)
class Memory:
    """Bytes one rank holds: its state at rest (parameters, gradients kept, optimizer),
    the activations saved by the end of the forward, and the peak, with its moment."""

    parameters: int
    gradients: int
    optimizer: int
    activations: int
    peak: int
    when: str

    @property
    def rest(self) -> int:
        return self.parameters + self.gradients + self.optimizer


# ------------------------------------------------------------------ the pieces
def param_tensors(shape: Stack) -> list[torch.Tensor]:
    """One meta tensor per parameter of the stack, in registration order (no memory):
    what lesson 07's bucket planner needs to cut buckets as the real model's."""
    d, h = shape.d, shape.hidden
    block = [(d,), (d,), (d,), (d,)] + [(d, d), (d,)] * 4 + [(h, d), (h,), (d, h), (d,)]
    dtype = {4: torch.float32, 8: torch.float64, 2: torch.bfloat16}[shape.itemsize]
    return [torch.empty(s, dtype=dtype, device="meta") for _ in range(shape.layers)
            for s in block]


def buckets(shape: Stack, cap: int = DEFAULT_CAP_BYTES) -> list[int]:
    """Parameters per bucket, as lesson 07's reducer and ZeRO cut them (last layers first)."""
    return [sum(t.numel() for t in group) for group in
            plan_buckets(param_tensors(shape)[::-1], cap)]


def padded(n: int, p: int) -> int:
    """n elements padded to a multiple of p (lesson 10's slices: :func:`shard_range`)."""
    return shard_range(n, 0, p)[2]


def backward_transient(shape: Stack, batch: int, t: int = 1, sp: bool = False
                       ) -> tuple[int, str]:
    """Bytes the backward's first steps hold beside the saved activations, and where.

    Either the loss's backward (the mean's gradient, twice the output, their product:
    three outputs), or the last block's first product (fc2): the gradient of its input,
    hidden wide, and of its weight, with the gradient arriving (gathered whole under
    sequence parallelism) in place of the loss's saved output, freed by then.
    """
    s = shape.itemsize
    whole = shape.unit(batch)
    out = whole // t if sp else whole
    loss = 3 * out
    product = (shape.seq * batch * shape.hidden // t + shape.d * shape.hidden // t) * s
    product += whole - out if sp else 0
    return max((loss, "the loss's backward"), (product, "the last block's first backward"))


def _checkpointed(shape: Stack, batch: int, policy: str) -> int:
    """What a checkpointed block adds while its backward runs: its activations, recomputed."""
    u = shape.unit(batch)
    return {"none": 0, "full": shape.block_saved(batch=batch),
            "selective": 3 * u + u * shape.hidden // shape.d}[policy]


# ------------------------------------------------------------------ strategies
def dp_memory(shape: Stack, p: int, *, policy: str = "none") -> Memory:
    """DDP with lesson 07's buckets, each rank ``batch/p`` samples: 16Ψ for good (the
    gradients live in the buckets), and at the backward's start every activation."""
    batch = _share(shape.batch, p, "the batch")
    psi = shape.params()
    rest = int(theory_bytes("ddp", psi, p, bytes_per=shape.itemsize))
    acts = shape.saved(batch=batch, policy=policy)
    extra, moment = backward_transient(shape, batch)
    peak = rest + acts + _checkpointed(shape, batch, policy) + extra
    return Memory(psi * shape.itemsize, psi * shape.itemsize, ADAM * psi * shape.itemsize,
                  acts, peak, f"backward: {moment}")


def zero_memory(shape: Stack, p: int, stage: int, cap: int = DEFAULT_CAP_BYTES) -> Memory:
    """ZeRO-1 or ZeRO-2 (lesson 10) on flat buckets padded to a multiple of p."""
    if stage not in (1, 2):
        raise CostModelError(f"ZeRO stage {stage!r}: 1 or 2 (FSDP is fsdp_memory)")
    batch, s = _share(shape.batch, p, "the batch"), shape.itemsize
    sizes = [padded(n, p) for n in buckets(shape, cap)]
    full, mine = sum(sizes), sum(sizes) // p
    acts = shape.saved(batch=batch)
    extra, moment = backward_transient(shape, batch)
    if stage == 1:  # the gradient buffer stays; my averaged slice is written into it
        grads, peak = full * s, (2 * full + ADAM * mine) * s + acts + extra
    else:  # my averaged slice stays; a bucket's whole gradient lives while it is filled
        grads = mine * s
        weight = shape.d * shape.hidden * s  # copied into the bucket and freed at once
        peak = (full + (ADAM + 1) * mine + max(sizes)) * s + acts + extra - weight
        moment = "the last block's backward, the bucket's gradient being filled"
    return Memory(full * s, grads, ADAM * mine * s, acts, peak, f"backward: {moment}")


def fsdp_memory(shape: Stack, p: int, prefetch: int = 0) -> Memory:
    """FSDP (lesson 10), one unit per block: slices of 1/p, and the units gathered."""
    batch, s = _share(shape.batch, p, "the batch"), shape.itemsize
    unit = padded(shape.block_params(), p)
    mine = shape.layers * unit // p
    acts = shape.saved(batch=batch)
    peak = (mine + ADAM * mine + (2 + prefetch) * unit) * s + acts
    return Memory(mine * s, 0, ADAM * mine * s, acts, peak,
                  "backward: the last unit's, gathered again, beside its gradients")


def tp_memory(shape: Stack, t: int, sp: bool = False) -> Memory:
    """Tensor (and sequence) parallelism over t ranks (lesson 11), the whole batch on each."""
    shape.check_split(t, sp)
    psi, s = shape.params(t), shape.itemsize
    acts = shape.saved(t=t, sp=sp)
    extra, moment = backward_transient(shape, shape.batch, t, sp)
    return Memory(psi * s, 0, ADAM * psi * s, acts, (1 + ADAM) * psi * s + acts + extra,
                  f"backward: {moment}")


def pipeline_memory(shape: Stack, p: int, rank: int, m: int, schedule: str = "1f1b"
                    ) -> Memory:
    """Stage ``rank`` of p (lesson 12), m micro-batches, walking its schedule's actions.

    Per micro-batch in flight: its input (received, or cut from the batch), what the
    stage's blocks saved, and its output; every output sent on and every input gradient
    sent back stays until the step ends (``Stage.finish`` waits for the sends there).
    The parameters' gradients appear at the first backward.
    """
    if schedule not in SCHEDULES:
        raise CostModelError(f"unknown schedule {schedule!r}; use one of {', '.join(SCHEDULES)}")
    batch = _share(shape.batch, m, "the batch (into micro-batches)")
    layers = _stage_layers(shape.layers, p, rank)
    s, u = shape.itemsize, shape.unit(batch)
    psi = layers * shape.block_params()
    saved = shape.saved(batch=batch, layers=layers) - (0 if rank == p - 1 else u)
    held = u + saved + (0 if rank == p - 1 else u)
    extra = backward_transient(shape, batch)[0]
    rest = (1 + ADAM) * psi * s
    walk = _walk(SCHEDULES[schedule](p, rank, m), held, u, rank, p)
    peak, moment = max((rest + (psi * s if grads else 0) + now + (extra if kind == "B" else 0),
                        f"{'forward' if kind == 'F' else 'backward'} of micro-batch {i}")
                       for kind, i, now, grads in walk)
    most = max(n for _, _, n, _ in walk)
    return Memory(psi * s, 0, ADAM * psi * s, most, peak, f"schedule: {moment}")


def _walk(order: Sequence[tuple[str, int]], held: int, u: int, rank: int, p: int
          ) -> list[tuple[str, int, int, bool]]:
    """(action, micro-batch, bytes in flight at its peak, gradients exist) per action."""
    inflight, sent, grads, out = 0, 0, False, []
    for kind, i in order:
        if kind == "F":
            inflight += held
            out.append((kind, i, inflight + sent, grads))
            sent += u if rank < p - 1 else 0  # the output, kept by its send
            inflight -= u if rank < p - 1 else 0
        else:
            out.append((kind, i, inflight + sent, grads))  # its gradients grow as its
            grads = True  # activations go: at its start, those of earlier backwards only
            inflight -= held - (u if rank < p - 1 else 0)
            sent += u if rank > 0 else 0  # the input's gradient, kept by its send
    return out


def _stage_layers(layers: int, p: int, rank: int) -> int:
    """Blocks on stage ``rank``: lesson 12's cut (the first ``layers % p`` one more)."""
    if not 0 <= rank < p or layers < p:
        raise CostModelError(f"stage {rank} of p = {p} stages of {layers} blocks: need "
                             f"0 <= rank < p <= layers")
    return layers // p + (rank < layers % p)


def _share(n: int, p: int, what: str) -> int:
    if isinstance(p, bool) or not isinstance(p, int) or p < 1:
        raise CostModelError(f"p = {p!r}: a whole number of ranks, at least 1")
    if n % p:
        raise CostModelError(f"{what} ({n}) does not divide by {p}: choose sizes that divide")
    return n // p


MEMORY: dict[str, Callable[..., Memory]] = {
    "ddp": dp_memory, "zero": zero_memory, "fsdp": fsdp_memory, "tp": tp_memory,
    "pipeline": pipeline_memory}
