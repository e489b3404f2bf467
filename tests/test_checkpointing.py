"""Activation checkpointing (lesson 13): exact, and keeping exactly what it is predicted to.

- From scratch and through torch, full, segmented and selective: the gradients of a stack
  of the course's blocks equal those without checkpointing, in float64.
- What autograd saves, counted by ``saved_tensors_hooks`` (lesson 11's ``count_saved``),
  equals :meth:`pcourse.cost_model.shapes.Stack.block_saved`, at several shapes, dtypes,
  tensor-parallel degrees, with and without sequence parallelism; selective
  checkpointing keeps its products outside those hooks, so its bytes are read from the
  allocator.
- The √-rule's segment length is the brute-force minimum of its own memory formula.
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from pcourse.activations import count_saved
from pcourse.checkpointing import best_segment, recompute, run_segments, segment_bytes
from pcourse.cost_model.shapes import Stack
from pcourse.workloads.transformer import Block


def blocks(shape: Stack, seed: int = 0) -> list[nn.Module]:
    torch.manual_seed(seed)
    return [Block(shape.d, shape.heads, shape.hidden) for _ in range(shape.layers)]


@pytest.fixture
def float64():
    before = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    yield
    torch.set_default_dtype(before)


def gradients(model: list[nn.Module], x: torch.Tensor, k: int, how: str) -> torch.Tensor:
    model = copy.deepcopy(model)
    x = x.clone().requires_grad_()
    run_segments(model, x, k, how).square().mean().backward()
    grads = [p.grad.reshape(-1) for b in model for p in b.parameters()]
    return torch.cat(grads + [x.grad.reshape(-1)])


@pytest.mark.parametrize("how, k", [("scratch", 1), ("scratch", 2), ("scratch", 3),
                                    ("torch", 1), ("torch", 4), ("selective", 1)])
def test_checkpointing_is_exact_against_none_in_float64(float64, how, k):
    shape = Stack(layers=5, d=24, heads=4, hidden=48, seq=8, batch=3, itemsize=8)
    model, x = blocks(shape), torch.randn(shape.seq, shape.batch, shape.d)
    reference = gradients(model, x, 1, "none")
    got = gradients(model, x, k, how)
    assert (got - reference).abs().max().item() <= 1e-12 * reference.abs().max().item()


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("dims", [(48, 12, 96, 12, 4), (32, 4, 128, 6, 5)])
def test_saved_bytes_per_block_are_the_prediction_exactly(dtype, dims):
    d, heads, hidden, seq, batch = dims
    shape = Stack(2, d, heads, hidden, seq, batch, itemsize=dtype.itemsize)
    model = [b.to(dtype) for b in blocks(shape)]
    x = torch.randn(seq, batch, d, dtype=dtype)
    params = [p for b in model for p in b.parameters()]
    for how, policy in (("none", "none"), ("scratch", "full"), ("torch", "full")):
        with count_saved(params) as saved:
            run_segments(model, x, 1, how)
        assert saved.bytes == shape.layers * shape.block_saved(policy=policy), (how, dtype)


@pytest.mark.parametrize("t, sp", [(2, False), (2, True), (3, False), (4, True)])
def test_saved_bytes_split_over_t_ranks_are_lesson_11s_and_the_prediction(t, sp):
    from pcourse.tensor_parallel import ParallelBlock
    from pcourse.tools.bench.strategies import Absent

    shape = Stack(1, 48, 12, 96, 12, 4)
    block = ParallelBlock(blocks(shape)[0], Absent(0, t), sp)
    x = torch.randn(shape.seq // t if sp else shape.seq, shape.batch, shape.d)
    with count_saved(block.parameters()) as saved:
        block(x.requires_grad_())
    assert saved.bytes == shape.block_saved(t=t, sp=sp)


def test_selective_keeps_its_products_which_the_allocator_counts():
    from pcourse.tools.bench.measured import kept

    shape = Stack(3, 48, 12, 96, 12, 4)
    model, x = blocks(shape), torch.randn(shape.seq, shape.batch, shape.d)
    params = [p for b in model for p in b.parameters()]
    with count_saved(params) as hooked:
        held, y = kept(lambda: run_segments(model, x, 1, "selective"))
    # the hooks see only the blocks' inputs; the products are kept outside them
    assert hooked.bytes == shape.layers * shape.unit()
    # the allocator sees all the forward kept (x, the first input, was made before it)
    assert held - y.numel() * y.element_size() + shape.unit() == (
        shape.layers * shape.block_saved(policy="selective"))


def test_recompute_passes_no_gradient_it_should_not():
    layer = nn.Linear(4, 4)
    x = torch.randn(2, 4)  # no gradient wanted for the input
    recompute(layer, x).sum().backward()
    assert layer.weight.grad is not None and x.grad is None


def test_the_sqrt_rule_is_the_minimum_of_its_own_formula():
    for layers in (1, 4, 9, 30, 64):
        for kept, block in ((1, 16), (1, 2), (3, 5), (1, 1)):
            brute = min(range(1, layers + 1),
                        key=lambda k: (segment_bytes(layers, k, kept, block), k))
            best = best_segment(layers, kept, block)
            assert segment_bytes(layers, best, kept, block) == segment_bytes(
                layers, brute, kept, block), (layers, kept, block)


@pytest.mark.parametrize("k, how, says", [(0, "scratch", "k = 0"), (1, "half", "how = 'half'"),
                                          (1.5, "scratch", "k = 1.5")])
def test_bad_arguments_are_named(k, how, says):
    with pytest.raises(ValueError, match=says):
        run_segments([nn.Identity()], torch.zeros(1), k, how)
