"""Tensor parallelism (lesson 11): split the layer, not the batch.

Data parallelism (lessons 01-10) gives every rank the whole model and a slice of the
batch. Tensor parallelism gives every rank of a group a slice of each layer and the
*whole* batch, so a layer too big for one rank fits on several. Megatron-LM (Shoeybi
et al. 2019, arXiv:1909.08053) pairs the linear layers of a block:

- the first split by its **output** features (column-parallel): it needs the whole
  input, and each rank computes its slice of the output;
- the second split by its **input** features (row-parallel): it takes those slices,
  and each rank computes a partial sum of the whole output.

Two conjugate operators on the group's backend join them: ``f`` (identity forward,
allreduce backward), before the column-parallel layer, and ``g`` (allreduce forward,
identity backward), after the row-parallel one: one allreduce per block each way.
Sequence parallelism (Korthikanti et al. 2022, arXiv:2205.05198) replaces ``g`` by a
reduce-scatter over the sequence and ``f`` by an all-gather (lesson 10's halves of the
allreduce): the same bytes, and the norms between blocks run on a slice of the sequence.

Activations are sequence-first, ``[T, B, d]``, as Megatron lays them out, so that a
rank's part of the sequence is one contiguous block for the reduce-scatter.

Every parallel layer is made from a whole layer (``from_linear``), taking its rank's
block: the same model on one process and on ``tp`` ranks starts from the same numbers,
and the tests compare the two exactly.
"""

from __future__ import annotations

import copy
from typing import Any

import torch
from torch import nn
from torch.nn import functional as F

from pcourse.backends import Backend
from pcourse.workloads.transformer import MLP, Attention, Block, causal_attention


def block_of(n: int, group: Backend, what: str) -> slice:
    """This rank's block of ``n`` items split evenly over the group's ranks.

    Refused, naming both numbers, when ``n`` does not divide: an uneven split would
    need padding on some ranks, and every rank must hold the same shapes.
    """
    if n % group.size:
        raise ValueError(f"{what} ({n}) does not divide by the tensor-parallel size "
                         f"({group.size}): choose a size that is a multiple of {group.size}")
    step = n // group.size
    return slice(group.rank * step, (group.rank + 1) * step)


def local_block(whole: torch.Tensor, part: torch.Tensor, group: Backend) -> torch.Tensor:
    """The block of ``whole`` (a one-process tensor) that this rank's ``part`` holds.

    Along the one dimension where their shapes differ (a split weight's rows or
    columns); ``whole`` itself where they agree (a replicated tensor). For comparing a
    split model with one process, block by block.
    """
    differ = [d for d in range(whole.dim()) if whole.shape[d] != part.shape[d]]
    if not differ:
        return whole
    (dim,) = differ
    n = part.shape[dim]
    return whole.narrow(dim, group.rank * n, n)


# ------------------------------------------------------------- the two operators
class _CopyToGroup(torch.autograd.Function):
    """f: identity forward, allreduce (sum) backward."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: Backend) -> torch.Tensor:
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        grad = grad.contiguous().clone()  # the reduction is in place
        return ctx.group.allreduce(grad, "sum"), None


class _ReduceFromGroup(torch.autograd.Function):
    """g: allreduce (sum) forward, identity backward."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: Backend) -> torch.Tensor:
        return group.allreduce(x.contiguous().clone(), "sum")

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return grad, None


def f(x: torch.Tensor, group: Backend) -> torch.Tensor:
    """Identity forward, allreduce backward: where a replicated input enters the group."""
    return _CopyToGroup.apply(x, group)


def g(x: torch.Tensor, group: Backend) -> torch.Tensor:
    """Allreduce forward, identity backward: where partial sums leave the group."""
    return _ReduceFromGroup.apply(x, group)


# ------------------------------------------- sequence parallelism: g and f, halved
def _gather(x: torch.Tensor, group: Backend) -> torch.Tensor:
    x = x.contiguous()
    out = x.new_empty((group.size * x.shape[0], *x.shape[1:]))
    return group.all_gather(out, x)


def _scatter(x: torch.Tensor, group: Backend) -> torch.Tensor:
    x = x.contiguous()
    block_of(x.shape[0], group, "the sequence length")
    out = x.new_empty((x.shape[0] // group.size, *x.shape[1:]))
    return group.reduce_scatter(out, x, "sum")


class _GatherSequence(torch.autograd.Function):
    """All-gather over the sequence forward, reduce-scatter backward (replaces f)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: Backend) -> torch.Tensor:
        ctx.group = group
        return _gather(x, group)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return _scatter(grad, ctx.group), None


class _ScatterSequence(torch.autograd.Function):
    """Reduce-scatter over the sequence forward, all-gather backward (replaces g)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: Backend) -> torch.Tensor:
        ctx.group = group
        return _scatter(x, group)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return _gather(grad, ctx.group), None


def gather_sequence(x: torch.Tensor, group: Backend) -> torch.Tensor:
    """``[T/tp, ...]`` slices -> ``[T, ...]`` on every rank; backward reduce-scatters."""
    return _GatherSequence.apply(x, group)


def scatter_sequence(x: torch.Tensor, group: Backend) -> torch.Tensor:
    """Partial ``[T, ...]`` -> this rank's ``[T/tp, ...]`` of the sum; backward all-gathers."""
    return _ScatterSequence.apply(x, group)


# --------------------------------------------------------------- the two layers
class ColumnParallelLinear(nn.Module):
    """A linear layer split by output features: whole input in, this rank's slice out.

    ``sequence_parallel``: the input is this rank's slice of the sequence, gathered
    first (all-gather) instead of entering through ``f``.
    """

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, group: Backend,
                 sequence_parallel: bool = False) -> None:
        super().__init__()
        self.group, self.sequence_parallel = group, sequence_parallel
        self.weight = nn.Parameter(weight)
        self.bias = None if bias is None else nn.Parameter(bias)

    @classmethod
    def from_linear(cls, layer: nn.Linear, group: Backend,
                    sequence_parallel: bool = False) -> ColumnParallelLinear:
        """This rank's rows of ``layer.weight`` (and of its bias): its output features."""
        rows = block_of(layer.out_features, group, "out_features")
        bias = None if layer.bias is None else layer.bias.detach()[rows].clone()
        return cls(layer.weight.detach()[rows].clone(), bias, group, sequence_parallel)

    def enter(self, x: torch.Tensor) -> torch.Tensor:
        """The whole input on every rank: ``f``, or the all-gather of the sequence."""
        return gather_sequence(x, self.group) if self.sequence_parallel else f(x, self.group)

    def project(self, x: torch.Tensor) -> torch.Tensor:
        """This rank's output features of an input that has entered the group."""
        return F.linear(x, self.weight, self.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.project(self.enter(x))


class RowParallelLinear(nn.Module):
    """A linear layer split by input features: this rank's slice in, the sum out.

    The bias is added once, after the reduction: added on every rank before it, it
    would count ``tp`` times. ``sequence_parallel``: the sum leaves as this rank's
    slice of the sequence (reduce-scatter) instead of through ``g``.
    """

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, group: Backend,
                 sequence_parallel: bool = False) -> None:
        super().__init__()
        self.group, self.sequence_parallel = group, sequence_parallel
        self.weight = nn.Parameter(weight)
        self.bias = None if bias is None else nn.Parameter(bias)
        if self.bias is not None and sequence_parallel:
            # its gradient is a partial sum: see below. (A mark of ours on torch's
            # Parameter, which declares no such attribute: hence the ignore.)
            self.bias.sequence_parallel = True  # type: ignore[attr-defined]

    @classmethod
    def from_linear(cls, layer: nn.Linear, group: Backend,
                    sequence_parallel: bool = False) -> RowParallelLinear:
        """This rank's columns of ``layer.weight`` (its input features); the whole bias."""
        cols = block_of(layer.in_features, group, "in_features")
        bias = None if layer.bias is None else layer.bias.detach().clone()
        return cls(layer.weight.detach()[:, cols].clone(), bias, group, sequence_parallel)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        partial = F.linear(x, self.weight)
        if self.sequence_parallel:
            out = scatter_sequence(partial, self.group)
        else:
            out = g(partial, self.group)
        return out if self.bias is None else out + self.bias


def sync_sequence_parallel_grads(model: nn.Module, group: Backend) -> None:
    """Sum the gradients of the parameters that sequence parallelism replicates.

    With the sequence split, a replicated parameter (a norm's weight, a row-parallel
    bias) sees only this rank's tokens, so its gradient is a partial sum over the
    sequence: allreduce them over the tensor-parallel group after backward, all in one
    flat buffer (one call, as Megatron does: a call per parameter pays the latency each).
    """
    grads = [p.grad for p in model.parameters()
             if getattr(p, "sequence_parallel", False) and p.grad is not None]
    if grads:
        flat = group.allreduce(torch.cat([g.reshape(-1) for g in grads]), "sum")
        torch._foreach_copy_(grads, [piece.view_as(g) for piece, g in
                                     zip(flat.split([g.numel() for g in grads]), grads,
                                         strict=True)])


def mark_sequence_parallel(module: nn.Module) -> nn.Module:
    """Mark every parameter of ``module`` (a norm) as replicated over a split sequence."""
    for p in module.parameters():  # a mark of ours, which torch's Parameter does not declare
        p.sequence_parallel = True  # type: ignore[attr-defined]
    return module


# ------------------------------------------------------------------ the blocks
class ParallelMLP(nn.Module):
    """Column then row: one allreduce forward (``g``), one backward (``f``)."""

    def __init__(self, mlp: MLP, group: Backend, sequence_parallel: bool = False) -> None:
        super().__init__()
        self.fc1 = ColumnParallelLinear.from_linear(mlp.fc1, group, sequence_parallel)
        self.fc2 = RowParallelLinear.from_linear(mlp.fc2, group, sequence_parallel)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(F.gelu(self.fc1(x)))


class ParallelAttention(nn.Module):
    """Attention split by heads: q, k, v column-parallel (whole heads on each rank,
    one ``f`` for the three), the output projection row-parallel."""

    def __init__(self, attn: Attention, group: Backend, sequence_parallel: bool = False) -> None:
        super().__init__()
        block_of(attn.n_heads, group, "the number of heads")
        self.n_heads = attn.n_heads // group.size
        self.q, self.k, self.v = (ColumnParallelLinear.from_linear(layer, group,
                                                                   sequence_parallel)
                                  for layer in (attn.q, attn.k, attn.v))
        self.o = RowParallelLinear.from_linear(attn.o, group, sequence_parallel)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.q.enter(x)
        heads = causal_attention(self.q.project(x), self.k.project(x), self.v.project(x),
                                 self.n_heads)
        return self.o(heads)


class ParallelBlock(nn.Module):
    """:class:`~pcourse.workloads.transformer.Block` split over ``group``, same numbers.

    ``sequence_parallel``: the block takes and gives this rank's ``T/tp`` slice of the
    sequence, and its norms run on that slice; call :func:`sync_sequence_parallel_grads`
    after backward.
    """

    def __init__(self, block: Block, group: Backend, sequence_parallel: bool = False) -> None:
        super().__init__()
        self.ln1, self.ln2 = copy.deepcopy(block.ln1), copy.deepcopy(block.ln2)
        if sequence_parallel:
            mark_sequence_parallel(self.ln1)
            mark_sequence_parallel(self.ln2)
        self.attn = ParallelAttention(block.attn, group, sequence_parallel)
        self.mlp = ParallelMLP(block.mlp, group, sequence_parallel)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


def tensor_parallel_copy(model: nn.Module, group: Backend, sequence_parallel: bool = False
                         ) -> nn.Module:
    """A copy of ``model`` whose transformer blocks are split over ``group``.

    Everything else (embeddings, the final norm and head) stays whole on every rank;
    without sequence parallelism their gradients come out the same on every rank, since
    every block hands back the whole gradient of its input (``f``'s allreduce).
    """
    from pcourse.workloads.transformer import Block

    model = copy.deepcopy(model)
    for child in list(model.modules()):
        for attr, sub in list(child.named_children()):
            if isinstance(sub, Block):
                setattr(child, attr, ParallelBlock(sub, group, sequence_parallel))
    return model
