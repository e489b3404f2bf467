"""Activation checkpointing: keep a block's input, recompute the rest in the backward (lesson 13).

Autograd keeps, from the forward to the backward, every tensor an operator needs to
compute its gradient (lesson 11 counts them: :func:`pcourse.activations.count_saved`).
A checkpointed block keeps only its input. Its forward runs without recording
anything (``torch.no_grad``); its backward runs the forward again, this time recording,
and backpropagates through that fresh graph: the same gradients, exactly, for the
price of one more forward (Chen et al. 2016, arXiv:1604.06174). :class:`Recompute` is
that, from scratch; ``torch.utils.checkpoint.checkpoint`` is torch's own, which also
keeps and restores the random-number state so that dropout draws the same masks.

Checkpointing every k-th block (segments of k, :func:`run_segments`) keeps L/k segment
inputs of c bytes for the whole step and, while one segment's backward runs, its k
blocks' activations of A bytes each: (L/k)·c + k·A, least at k* = √(L·c/A)
(:func:`best_segment`): the √-rule.

*Selective* checkpointing recomputes only what is cheap to recompute: torch's
``create_selective_checkpoint_contexts`` with a policy that saves the outputs of the
matrix products and recomputes the norms and activations between them
(:func:`save_products`).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from functools import partial
from typing import Any

import torch
from torch import nn
from torch.utils.checkpoint import (
    CheckpointPolicy,
    checkpoint,
    create_selective_checkpoint_contexts,
)

_PRODUCTS = {torch.ops.aten.mm.default, torch.ops.aten.addmm.default,
             torch.ops.aten.bmm.default,
             torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default}


class Recompute(torch.autograd.Function):
    """``Recompute.apply(fn, x, *params)``: ``fn(x)``, keeping only ``x`` for the backward.

    ``params``: the parameters ``fn`` uses, passed so that autograd knows the output
    depends on them, and hands their gradients on as it does any other's.
    """

    @staticmethod
    def forward(ctx: Any, fn: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor,
                *params: torch.Tensor) -> torch.Tensor:
        ctx.fn, ctx.params = fn, params
        ctx.save_for_backward(x)
        with torch.no_grad():
            return fn(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        (x,) = ctx.saved_tensors
        x = x.detach().requires_grad_(ctx.needs_input_grad[1])
        with torch.enable_grad():
            out = ctx.fn(x)  # the forward again, recorded this time
        need = ctx.needs_input_grad[1:]
        wanted = [t for t, n in zip((x, *ctx.params), need, strict=True) if n]
        grads = iter(torch.autograd.grad(out, wanted, grad, allow_unused=True))
        return (None, *(next(grads) if n else None for n in need))


def recompute(block: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """``block(x)`` checkpointed from scratch: only ``x`` is kept for the backward."""
    return Recompute.apply(block, x, *block.parameters())


def save_products(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
    """Selective checkpointing's policy: keep what the matrix products (and attention)
    computed, recompute everything else (norms, activations, additions)."""
    return CheckpointPolicy.MUST_SAVE if op in _PRODUCTS else CheckpointPolicy.PREFER_RECOMPUTE


def run_segments(blocks: Sequence[nn.Module], x: torch.Tensor, k: int,
                 how: str = "scratch") -> torch.Tensor:
    """The blocks in turn, each run of ``k`` consecutive blocks checkpointed as one
    segment (the last may be shorter); ``how``: ``"scratch"`` (:func:`recompute`),
    ``"torch"`` (``torch.utils.checkpoint``), ``"selective"`` (torch's, with
    :func:`save_products`; per block, k ignored) or ``"none"``."""
    if how not in ("scratch", "torch", "selective", "none"):
        raise ValueError(f"how = {how!r}: use 'scratch', 'torch', 'selective' or 'none'")
    if isinstance(k, bool) or not isinstance(k, int) or not 1 <= k:
        raise ValueError(f"segment length k = {k!r}: a whole number of blocks, at least 1")
    if how == "none":
        return nn.Sequential(*blocks)(x)
    if how == "selective":
        context = partial(create_selective_checkpoint_contexts, save_products)
        for block in blocks:
            x = checkpoint(block, x, use_reentrant=False, context_fn=context)
        return x
    for start in range(0, len(blocks), k):
        segment = nn.Sequential(*blocks[start:start + k])
        x = recompute(segment, x) if how == "scratch" else checkpoint(segment, x,
                                                                       use_reentrant=False)
    return x


def segment_bytes(layers: int, k: int, kept: int, block: int) -> int:
    """Activation bytes at the backward's peak with segments of ``k``: every segment's
    input (``kept`` bytes each) and one segment's ``k`` blocks (``block`` bytes each)."""
    return math.ceil(layers / k) * kept + min(k, layers) * block


def best_segment(layers: int, kept: int, block: int) -> int:
    """The √-rule: the whole k nearest √(L·c/A) that :func:`segment_bytes` says is least."""
    guess = math.sqrt(layers * kept / block)
    candidates = {max(1, min(layers, k)) for k in (math.floor(guess), math.ceil(guess))}
    return min(sorted(candidates), key=lambda k: segment_bytes(layers, k, kept, block))
