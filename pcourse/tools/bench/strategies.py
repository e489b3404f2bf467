"""Every strategy of lessons 05-12 as one training step on one rank, for lesson 13 to measure.

The model is a stack of the course's transformer blocks
(:class:`pcourse.cost_model.shapes.Stack`), trained with AdamW on the mean square of its
output. :func:`build` makes this rank's step for one strategy on a group of p ranks:

- ``ddp``: lesson 07's :class:`~pcourse.buckets.BucketedAllreduce` at DDP's default cap
  (the whole gradient one bucket), ``ddp-buckets`` at ``Spec.bucket_cap`` (several);
- ``zero1``, ``zero2``: :class:`~pcourse.sharding.ShardedOptimizer` (lesson 10);
- ``fsdp``, ``fsdp-prefetch``: :class:`~pcourse.sharding.FullyShardedDataParallel`, one
  unit per block, gathering one unit ahead or not;
- ``tp``, ``sp``: every block split over the p ranks (lesson 11), the whole batch on
  each, without and with sequence parallelism;
- ``gpipe``, ``1f1b``: the blocks cut into p stages (lesson 12), ``Spec.micro``
  micro-batches, each stage bare (no timeline);
- ``ddp-full``, ``ddp-selective``: ``ddp-buckets`` with every block checkpointed
  (:mod:`pcourse.checkpointing`), fully or selectively.

Each step marks its phases (``torch.profiler.record_function``: forward, backward,
sync, optimizer; a pipeline's schedule), so that a profile can say in which one the
memory peaked.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.profiler import record_function

from pcourse.backends.base import Backend, Work

STRATEGIES = ("ddp", "ddp-buckets", "zero1", "zero2", "fsdp", "fsdp-prefetch", "tp", "sp",
              "gpipe", "1f1b", "ddp-full", "ddp-selective")
PHASES = ("forward", "backward", "sync", "optimizer", "schedule")


class Absent(Backend):
    """A stand-in group of a given rank and size whose collectives move nothing: what one
    rank computes and holds in a strategy, without the others. Every call is written
    down in ``calls`` as (kind, bytes, checked). What a call would have received is zeros,
    written through numpy, past torch's dispatcher, so that no operator is counted or
    timed for it and no uninitialised memory (slow denormal numbers) is computed on:
    count and time with it, never train."""

    name = "absent"
    any_device = True

    def __init__(self, rank: int, size: int) -> None:
        self.rank, self.size, self.timeout = rank, size, 1.0
        self.device = torch.device("cpu")
        self.calls: list[tuple[str, int, bool]] = []

    def _note(self, kind: str, t: torch.Tensor, check: bool) -> None:
        self.calls.append((kind, t.numel() * t.element_size(), check))

    def allreduce(self, tensor: torch.Tensor, op: str = "sum", *,
                  check: bool = True) -> torch.Tensor:
        self._note("allreduce", tensor, check)
        return tensor

    def broadcast(self, tensor: torch.Tensor, root: int = 0, *,
                  check: bool = True) -> torch.Tensor:
        return tensor

    def barrier(self) -> None:
        return None

    def max_over_ranks(self, v: Any) -> Any:
        """Every rank is this one: the agreement checks pass on its own facts."""
        return v

    def reduce_scatter(self, output: torch.Tensor, input: torch.Tensor, op: str = "sum", *,
                       check: bool = True) -> torch.Tensor:
        self._note("reduce_scatter", input, check)
        return _zeros(output)

    def all_gather(self, output: torch.Tensor, input: torch.Tensor, *,
                   check: bool = True) -> torch.Tensor:
        self._note("all_gather", output, check)
        return _zeros(output)

    def send(self, tensor: torch.Tensor, dst: int) -> Work:
        self._note("send", tensor, False)
        return Work()

    def recv(self, tensor: torch.Tensor, src: int) -> torch.Tensor:
        return _zeros(tensor)


def _zeros(t: torch.Tensor) -> torch.Tensor:
    """``t`` filled with zeros by numpy (no torch operator runs); a tensor with no memory
    of its own (torch's fake tensors, for its estimators) by torch."""
    if type(t) is torch.Tensor or isinstance(t, nn.Parameter):
        t.detach().numpy()[...] = 0
    else:
        t.detach().zero_()
    return t


@dataclass
class Run:
    """One rank's step of one strategy, as named phases: each takes what the one before
    returned (the forward's loss goes to the backward). ``step()`` runs them all, each
    marked for the profiler; ``model``, ``optimizer``: the rank's."""

    phases: list[tuple[str, Callable[[Any], Any]]]
    model: nn.Module
    optimizer: torch.optim.Optimizer | None = None

    def step(self) -> None:
        result = None
        for name, phase in self.phases:
            with record_function(f"pcourse:{name}"):
                result = phase(result)


def stack_blocks(shape: Any, seed: int = 0) -> list[nn.Module]:
    """The blocks of ``shape`` (a :class:`~pcourse.cost_model.shapes.Stack`), seeded."""
    from pcourse.workloads.transformer import Block

    torch.manual_seed(seed)
    return [Block(shape.d, shape.heads, shape.hidden) for _ in range(shape.layers)]


class Checkpointed(nn.Module):
    """Blocks run one after another, each checkpointed as ``how`` says."""

    def __init__(self, blocks: list[nn.Module], how: str) -> None:
        super().__init__()
        self.blocks, self.how = nn.ModuleList(blocks), how

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        from pcourse.checkpointing import run_segments

        return run_segments(list(self.blocks), x, 1, {"full": "scratch"}.get(self.how, self.how))


class BatchFirst(nn.Module):
    """A pipeline stage's blocks on ``[batch, seq, d]`` micro-batches (lesson 12 cuts a
    batch along its first dimension; the blocks take the sequence first)."""

    def __init__(self, blocks: list[nn.Module]) -> None:
        super().__init__()
        self.blocks = nn.Sequential(*blocks)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.blocks(x.transpose(0, 1).contiguous()).transpose(0, 1).contiguous()


def loss_of(y: torch.Tensor) -> torch.Tensor:
    return y.square().mean()


def _train(model: nn.Module, x: torch.Tensor, sync: Callable[[], None],
           opt: torch.optim.Optimizer, set_to_none: bool = True) -> Run:
    def update(_: Any) -> None:
        opt.step()
        opt.zero_grad(set_to_none=set_to_none)

    return Run([("forward", lambda _: loss_of(model(x))),
                ("backward", lambda loss: loss.backward()),
                ("sync", lambda _: sync()), ("optimizer", update)], model, opt)


def local_input(strategy: str, group: Any, x: torch.Tensor) -> torch.Tensor | None:
    """What this rank of ``group`` trains on, from the whole batch ``x`` ``[seq, batch, d]``:
    its share of the batch (data parallelism, sharding), its share of the sequence
    (``sp``), all of it (``tp``), the batch first (a pipeline's first stage; None on the
    others). Made before anything is measured: the data is not the strategy's memory."""
    p, r = group.size, group.rank
    if strategy in ("tp",):
        return x
    if strategy == "sp":
        t = x.shape[0] // p
        return x[r * t:(r + 1) * t].contiguous()
    if strategy in ("gpipe", "1f1b"):
        return x.transpose(0, 1).contiguous() if r == 0 else None
    b = x.shape[1] // p
    return x[:, r * b:(r + 1) * b].contiguous()


def build(strategy: str, group: Any, shape: Any, mine: torch.Tensor | None, *,
          micro: int = 4, bucket_cap: int = 1 << 20) -> Run:
    """This rank's step of ``strategy`` on ``group`` (a pcourse backend or a stand-in of
    the same rank and size), on its input ``mine`` (:func:`local_input`)."""
    if strategy not in STRATEGIES:
        raise ValueError(f"unknown strategy {strategy!r}; use one of {', '.join(STRATEGIES)}")
    if strategy in ("gpipe", "1f1b"):
        return _pipeline(strategy, group, shape, mine, micro)
    assert mine is not None  # only a pipeline's later stages have no input of their own
    if strategy.startswith("ddp"):
        return _ddp(strategy, group, shape, mine, bucket_cap)
    if strategy in ("zero1", "zero2"):
        from pcourse.sharding import ShardedOptimizer

        model = nn.Sequential(*stack_blocks(shape))
        opt = ShardedOptimizer(model.parameters(), torch.optim.AdamW, group,
                               stage=int(strategy[-1]))
        return _train(model, mine, lambda: None, opt)
    if strategy in ("fsdp", "fsdp-prefetch"):
        from pcourse.sharding import FullyShardedDataParallel
        from pcourse.workloads.transformer import Block

        sharded = FullyShardedDataParallel(nn.Sequential(*stack_blocks(shape)), group,
                                           shard=Block, prefetch=int(strategy != "fsdp"))
        return _train(sharded, mine, sharded.finish, torch.optim.AdamW(sharded.parameters()))
    return _tp(strategy == "sp", group, shape, mine)  # "tp" or "sp": the rest


def _ddp(strategy: str, group: Any, shape: Any, mine: torch.Tensor, bucket_cap: int) -> Run:
    from pcourse.buckets import DEFAULT_CAP_BYTES, BucketedAllreduce

    blocks = stack_blocks(shape)
    how = strategy.partition("-")[2]
    model = Checkpointed(blocks, how) if how in ("full", "selective") else nn.Sequential(*blocks)
    cap = DEFAULT_CAP_BYTES if strategy == "ddp" else bucket_cap
    reducer = BucketedAllreduce(model, group, bucket_cap_bytes=cap, overlap=True)
    opt = torch.optim.AdamW(model.parameters())
    return _train(model, mine, reducer.finish, opt, set_to_none=False)


def _tp(sp: bool, group: Any, shape: Any, mine: torch.Tensor) -> Run:
    from pcourse.tensor_parallel import sync_sequence_parallel_grads, tensor_parallel_copy

    model = tensor_parallel_copy(nn.Sequential(*stack_blocks(shape)), group, sp)
    opt = torch.optim.AdamW(model.parameters())
    sync = (lambda: sync_sequence_parallel_grads(model, group)) if sp else (lambda: None)
    return _train(model, mine, sync, opt)


def _pipeline(strategy: str, group: Any, shape: Any, inputs: torch.Tensor | None,
              micro: int) -> Run:
    from pcourse import pipeline

    p, r = group.size, group.rank
    module = BatchFirst(list(pipeline.split_model(stack_blocks(shape), p, r)))
    opt = torch.optim.AdamW(module.parameters())
    # bare: lesson 12's timeline and saved-bytes count are instruments, not the strategy
    stage = pipeline.Stage(module, group, (shape.seq, shape.d),
                           loss_fn=lambda out, target: loss_of(out), instrumented=False)
    order = (pipeline.gpipe_order if strategy == "gpipe" else pipeline.one_f_one_b_order)(
        p, r, micro)
    targets = torch.zeros(shape.batch) if r == p - 1 else None  # the loss needs none

    def update(_: Any) -> None:
        opt.step()
        opt.zero_grad()

    return Run([("schedule", lambda _: pipeline.run_step(stage, order, micro, shape.batch,
                                                         inputs, targets)),
                ("optimizer", update)], module, opt)
