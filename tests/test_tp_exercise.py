"""Exercise 09's references (pcourse.tools.grading.refs), checked against the course's own
tensor parallelism: the grader's answer and lesson 11's module must agree on every block.

The exercise itself is graded in tests/test_grading.py (its solution and wrong answers).
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from pcourse.tensor_parallel import ColumnParallelLinear, RowParallelLinear
from pcourse.tools.grading.refs import conjugates
from pcourse.tools.grading.refs import tensor_parallel as refs


@pytest.mark.parametrize("tp", [2, 3, 4])
def test_the_reference_blocks_are_the_modules_blocks(tp):
    mlp = refs.tp_mlp()
    whole = [t.detach() for t in (mlp.fc1.weight, mlp.fc1.bias, mlp.fc2.weight, mlp.fc2.bias)]
    for rank in range(tp):
        group = SimpleNamespace(rank=rank, size=tp)  # all that from_linear reads of a group
        column = ColumnParallelLinear.from_linear(mlp.fc1, group)
        row = RowParallelLinear.from_linear(mlp.fc2, group)
        module = [column.weight, column.bias, row.weight, row.bias]
        for got, want in zip(refs.tp_block_reference(whole, tp, rank), module, strict=True):
            assert torch.equal(got, want.detach())
        assert refs.tp_blocks_problem(refs.tp_block_reference(whole, tp, rank), tp, rank) is None
        neighbours = refs.tp_block_reference(whole, tp, (rank + 1) % tp)
        assert "column_block's weight is off" in refs.tp_blocks_problem(neighbours, tp, rank)


def test_the_one_process_reference_is_the_whole_mlp():
    want = refs.one_process_mlp(1)
    x, weights = refs.tp_batch(1)
    x.requires_grad_()
    mlp = refs.tp_mlp()
    out = mlp(x)
    (out * weights).sum().backward()
    assert torch.equal(want["out"], out.detach()) and torch.equal(want["grads"][0], x.grad)
    assert not torch.equal(refs.tp_batch(0)[0], x.detach())  # each group its own batch


@pytest.mark.parametrize("size,tp", [(4, 2), (3, 3), (4, 4)])
@pytest.mark.parametrize("strided", [False, True])
def test_every_group_has_tp_ranks_and_every_rank_one_place(size, tp, strided):
    places = [refs.tp_layout(r, size, tp, strided) for r in range(size)]
    assert sorted(places) == [(k, i) for k in range(size // tp) for i in range(tp)]


def test_f_and_g_references_sum_within_the_group_only():
    want = refs.fg_reference(2, 4)
    x = [conjugates.fg_data(r)[0] for r in range(4)]
    assert torch.equal(want[3]["g"]["forward"], x[2] + x[3])
    assert torch.equal(want[0]["f"]["forward"], x[0])
    assert refs.fg_problem({"f": {"linked": True, **want[0]["f"]},
                            "g": {"linked": True, **want[0]["g"]}}, want[0], 2, 4) is None
    world = {"linked": True, "forward": want[0]["world_forward"], "backward": want[0]["g"][
        "backward"]}
    problem = refs.fg_problem({"f": {"linked": True, **want[0]["f"]}, "g": world}, want[0], 2, 4)
    assert "sum over all 4 ranks" in problem
