"""Exercise 09, tensor parallelism: f and g, the blocks, and the column- and row-parallel
layers of an MLP.

The references are one process's MLP in float64 (:func:`one_process_mlp`) and the closed
forms of f and g (:func:`fg_reference`), computed here; the checks run each tensor-parallel
size as many groups as the ranks hold (at tp = 2 on 4 ranks, a 2x2 mesh), and inside a
mesh whose two groups are both used by one process. Their cases are drawn from
:data:`CONTRACT`: the text's float64 case first, then each dtype, in other shapes and
layouts, with gradients already there (:func:`fg_cases`, :func:`mlp_cases`).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch

from pcourse.tools.grading.checks import (
    Check,
    ExerciseError,
    Learner,
    at_sizes,
    checker,
    once,
    per_rank,
    run,
    tensors_differ,
)
from pcourse.tools.grading.refs import conjugates
from pcourse.tools.grading.refs.common import (
    Case,
    as_view,
    case_error,
    close,
    each_case,
    old_grad,
    to_leaf,
)
from pcourse.tools.grading.refs.conjugates import (
    MLP_SAID,
    TP_HIDDEN,
    TPGroup,
    at_tp,
    cases_at,
    fg_cases,
    fg_problem,
    fg_reference,
    fg_trial,
    fg_two_problem,
    fg_two_reference,
    group_members,
    mlp_cases,
    ranks_said,
    tp_batch,
    tp_layout,
    tp_mlp,
    tp_ranks,
    two_groups,
)

F, G = Learner("f"), Learner("g")
COLUMN_BLOCK, ROW_BLOCK = Learner("column_block"), Learner("row_block")
COLUMN, ROW = Learner("column_parallel_linear"), Learner("row_parallel_linear")
CONTRACT = conjugates.CONTRACT  # exercise 09's, stated beside the cases drawn from it

def _pair(value: Any, who: str) -> tuple[torch.Tensor, torch.Tensor]:
    if not (isinstance(value, tuple | list) and len(value) == 2
            and all(isinstance(t, torch.Tensor) for t in value)):
        raise TypeError(f"{who} returned {type(value).__name__}, not a pair of tensors "
                        "(weight, bias)")
    return value[0], value[1]


def _whole(mlp: Any) -> list[torch.Tensor]:  # an MLP: fc1, fc2
    return [t.detach() for t in (mlp.fc1.weight, mlp.fc1.bias, mlp.fc2.weight, mlp.fc2.bias)]


def tp_blocks(column_block: Callable, row_block: Callable, group: Any,
              case: Case | None = None) -> tuple[list[torch.Tensor], bool]:
    """This rank's blocks of the case's MLP, by the learner's ``column_block`` and
    ``row_block``, and whether they changed the whole weights they were given."""
    given = [t.clone() for t in _whole(tp_mlp(case))]
    kept = [t.clone() for t in given]
    w1, b1 = _pair(column_block(given[0], given[1], group), "column_block")
    w2, b2 = _pair(row_block(given[2], given[3], group), "row_block")
    changed = any(not torch.equal(a, b) for a, b in zip(given, kept, strict=True))
    return [t.detach().clone() for t in (w1, b1, w2, b2)], changed


def tp_blocks_trial(column_block: Callable, row_block: Callable, tp: int) -> list[dict]:
    """This rank's four blocks (fc1's weight and bias, fc2's weight and bias) in every case
    of :func:`cases_at` ``tp``, and whether the whole weights changed."""
    with TPGroup(tp) as group:
        def one(k: int) -> dict:
            blocks, changed = tp_blocks(column_block, row_block, group.backend, mlp_cases()[k])
            return {"blocks": blocks, "changed": changed}

        return each_case(one, cases_at(tp))


def tp_mlp_trial(column_block: Callable, row_block: Callable, column_linear: Callable,
                 row_linear: Callable, tp: int, strided: bool = False) -> list[dict]:
    """The MLP split over this rank's group by the learner's four functions, on the
    group's batch, in every case :func:`cases_at` ``tp``: its output, the gradients of the
    input and of this rank's blocks, and whether the caller's input changed."""
    with TPGroup(tp, strided) as group:
        return each_case(lambda k: _mlp_case(column_block, row_block, column_linear,
                                             row_linear, group, mlp_cases()[k]),
                         cases_at(tp, mlp=True))


def _mlp_case(column_block: Callable, row_block: Callable, column_linear: Callable,
              row_linear: Callable, group: TPGroup, case: Case, index: int | None = None,
              backward: bool = True) -> dict:
    """One case of :func:`tp_mlp_trial` (``index``: another group's batch; ``backward``
    False: the caller runs it, and reads the gradients after)."""
    blocks, _ = tp_blocks(column_block, row_block, group.backend, case)
    params = [t.requires_grad_() for t in blocks]
    x, weights = tp_batch(group.index if index is None else index, case)
    leaf = to_leaf(x, case.layout).requires_grad_()
    for j, t in enumerate([leaf, *params] if case.accumulate else []):
        t.grad = old_grad(tuple(t.shape), case.dtype, 700 + j)
    before = leaf.detach().clone()
    w1, b1, w2, b2 = params
    hidden = column_linear(as_view(leaf, case.layout), w1, b1, group.backend)
    out = row_linear(torch.nn.functional.gelu(hidden), w2, b2, group.backend)
    if not isinstance(out, torch.Tensor) or out.shape != weights.shape:
        raise TypeError(f"the MLP's output is {type(out).__name__} "
                        f"{tuple(getattr(out, 'shape', ()))}, expected a tensor "
                        f"{tuple(weights.shape)}")
    result: dict[str, Any] = {"out": out.detach().clone(), "dtype": str(out.dtype),
              "leaf": leaf, "params": params, "case": case, "before": before}
    if out.requires_grad:
        result["loss"] = (out * weights).sum()
        if backward:
            result.pop("loss").backward()
    return _mlp_result(result) if backward else result


def _mlp_result(r: dict) -> dict:
    """What goes back of one MLP case: data only."""
    leaf, case = r["leaf"], r["case"]
    grads = [None if leaf.grad is None else as_view(leaf.grad, case.layout).clone()]
    return {"out": r["out"], "dtype": r["dtype"],
            "input_changed": not torch.equal(leaf.detach(), r["before"]),
            "grads": grads + [None if t.grad is None else t.grad.clone() for t in r["params"]]}


def tp_mesh_trial(column_block: Callable, row_block: Callable, column_linear: Callable,
                  row_linear: Callable) -> dict:
    """Both axes of a 2x2 mesh in one process: the MLP split over the consecutive group
    ("a", its batch) and over the strided one ("b", another batch), both forwards before
    one backward of both losses."""
    case = mlp_cases()[0]
    with TPGroup(2) as a, TPGroup(2, strided=True) as b:
        runs = {"a": _mlp_case(column_block, row_block, column_linear, row_linear, a, case,
                               backward=False),
                "b": _mlp_case(column_block, row_block, column_linear, row_linear, b, case,
                               index=2 + b.index, backward=False)}
        losses = [r.pop("loss") for r in runs.values() if "loss" in r]
        if losses:
            torch.autograd.backward(losses)
        return {k: _mlp_result(r) for k, r in runs.items()}


TP_NAMES = ["the input x", "fc1's weight block", "fc1's bias block", "fc2's weight block",
            "fc2's bias"]


@functools.lru_cache(maxsize=64)
def one_process_mlp(group_index: int, case: Case | None = None) -> dict:
    """One process, the whole MLP, on group ``group_index``'s batch: output and gradients,
    in float64 of the case's rounded weights and input.

    ``hidden``: the gradient of fc1's output, from which each rank's own part of the
    input's gradient follows (what a rank holds before f sums them).
    """
    mlp = tp_mlp(case).double()
    x, weights = (t.double() for t in tp_batch(group_index, case))
    x.requires_grad_()
    hidden = mlp.fc1(x)
    hidden.retain_grad()
    out = mlp.fc2(torch.nn.functional.gelu(hidden))
    (out * weights).sum().backward()
    return {"out": out.detach(), "bias": mlp.fc2.bias.detach(), "hidden": hidden.grad,
            "fc1": mlp.fc1.weight.detach(), "case": case or mlp_cases()[0],
            "grads": [x.grad, mlp.fc1.weight.grad, mlp.fc1.bias.grad, mlp.fc2.weight.grad,
                      mlp.fc2.bias.grad]}


def tp_block_reference(full: list[torch.Tensor], tp: int, rank: int) -> list[torch.Tensor]:
    """Rank ``rank``'s blocks of [fc1 weight, fc1 bias, fc2 weight, fc2 bias] (or of their
    gradients): fc1 split by its output features (rows), fc2 by its input features
    (columns), fc2's bias whole."""
    n = full[0].shape[0] // tp
    rows = slice(rank * n, (rank + 1) * n)
    return [full[0][rows], full[1][rows], full[2][:, rows], full[3]]


@functools.lru_cache(maxsize=8)
def _whole_of(case: Case | None) -> list[torch.Tensor]:
    return _whole(tp_mlp(case))


def tp_blocks_problem(got: list[torch.Tensor], tp: int, rank: int,
                      case: Case | None = None) -> str | None:
    """What is wrong with one rank's four blocks of the MLP, in plain words; None if nothing."""
    whole = _whole_of(case)
    want = tp_block_reference(whole, tp, rank)
    hidden = whole[0].shape[0]
    n = hidden // tp
    first, last = rank * n, (rank + 1) * n
    names = ["column_block's weight", "column_block's bias", "row_block's weight",
             "row_block's bias"]
    should = [f"rows {first} to {last} (this rank's output features) of the whole "
              f"{tuple(whole[0].shape)} weight: torch stores a weight as [out_features, "
              "in_features]",
              f"elements {first} to {last} of the whole bias",
              f"columns {first} to {last} (this rank's input features) of the whole "
              f"{tuple(whole[2].shape)} weight",
              "the whole bias (added once, after the sum)"]
    for mine, right, name, block in zip(got, want, names, should, strict=True):
        if isinstance(mine, torch.Tensor) and mine.dtype != right.dtype:
            return (f"{name} is {str(mine.dtype).removeprefix('torch.')}, but the layer is "
                    f"{str(right.dtype).removeprefix('torch.')}: keep the weight's own dtype")
        problem = tensors_differ([mine], [right], [name], rtol=0, atol=0)
        if problem and hidden != TP_HIDDEN and isinstance(mine, torch.Tensor) and \
                TP_HIDDEN // tp in mine.shape and n not in mine.shape:
            return (f"{problem}: with a hidden size of {hidden}, a block has {n} features, "
                    f"not {TP_HIDDEN // tp}: the exercise's {TP_HIDDEN} is hard-coded; take "
                    "the size from the weight (weight.shape[0] // group.size)")
        if problem:
            return f"{problem}: it should be {block}"
    return None


def tp_forward_problem(got: dict, want: dict, tp: int) -> str | None:
    """What is wrong with one rank's MLP output; None if nothing."""
    case = want["case"]
    if got.get("dtype", str(case.dtype)) != str(case.dtype):
        return (f"the MLP's output is {got['dtype'].removeprefix('torch.')} for a "
                f"{str(case.dtype).removeprefix('torch.')} model: keep the model's dtype")
    if got.get("input_changed"):
        return "the layers changed the caller's input x in place: leave it as it was given"
    problem = close(got["out"], want["out"], "the MLP's output", case.dtype)
    if problem and close(got["out"], want["out"] + (tp - 1) * want["bias"], "",
                         case.dtype) is None:
        return (f"{problem}: fc2's bias was added {tp} times, once on every rank; add it "
                "once, after the sum")
    return problem


def tp_backward_problem(got: dict, want: dict, tp: int, rank: int) -> str | None:
    """What is wrong with one rank's gradients (the input's, its blocks'); None if nothing.
    Where the case had gradients already there, they must have been added to."""
    case = want["case"]
    right = [want["grads"][0], *tp_block_reference(want["grads"][1:], tp, rank)]
    old = _old_grads(case, right)
    for mine, expected, before, name in zip(got["grads"], right, old, TP_NAMES, strict=True):
        if mine is None or (case.accumulate and torch.equal(mine.double(), before)):
            return (f"no gradient reached {name}: the backward pass never got there (was "
                    "something computed outside autograd, or detached?)")
        problem = close(mine, expected + before, f"the gradient of {name}", case.dtype)
        if problem and case.accumulate and close(mine, expected, "", case.dtype) is None:
            return (f"{problem}: the gradient already there was replaced, not added to (a "
                    "caller that accumulates over steps loses it)")
        if problem and name == TP_NAMES[0]:
            n = want["fc1"].shape[0] // tp
            rows = slice(rank * n, (rank + 1) * n)
            own = want["hidden"][..., rows] @ want["fc1"][rows]
            if close(mine, own + before, "", case.dtype) is None:
                return (f"{problem}: it is this rank's own part only; the parts of the group's "
                        "ranks must be summed (x enters the column-parallel layer through f)")
        if problem:
            return problem
    return None


def _old_grads(case: Case, right: list[torch.Tensor]) -> list[torch.Tensor]:
    """The gradients a case put there before the backward (zeros where none), as the
    trial did: on the input's leaf, then on each block."""
    if not case.accumulate:
        return [torch.zeros_like(t) for t in right]
    leaf = to_leaf(right[0], case.layout)
    first = as_view(old_grad(tuple(leaf.shape), case.dtype, 700), case.layout).double()
    return [first] + [old_grad(tuple(t.shape), case.dtype, 701 + j).double()
                      for j, t in enumerate(right[1:])]


def _case_said(case: Case, problem: str | None) -> str | None:
    """A problem, said with its case where it is not the text's."""
    if problem is None or case == mlp_cases()[0]:
        return problem
    return f"{case.said(*MLP_SAID)}, {problem}"


def _blocks(mc: Any, tp: int) -> str | None:
    got = run(mc, tp_blocks_trial, COLUMN_BLOCK, ROW_BLOCK, tp, ranks=tp_ranks(tp, mc.n))

    def test(r: int, cases: list[dict]) -> str | None:
        for at, (one, case) in enumerate(zip(cases, [mlp_cases()[k] for k in cases_at(tp)],
                                             strict=False)):
            if "error" in one:
                raise ExerciseError(case_error(got, at, case.said(*MLP_SAID)))
            if one["changed"]:
                return (f"{case.said(*MLP_SAID)}, column_block or row_block changed the whole "
                        "weight or bias it was given: take blocks, never change the layer")
            problem = tp_blocks_problem(one["blocks"], tp, r % tp, case)
            if problem:
                return _case_said(case, problem)
        return None

    return per_rank(got, test)


def _conjugates(mc: Any, tp: int) -> str | None:
    n = tp_ranks(tp, mc.n)
    got = run(mc, fg_trial, F, G, tp, ranks=n)
    want = [fg_reference(tp, n, k) for k in cases_at(tp)]
    two = fg_two_reference(tp, n) if two_groups(tp, n) else None

    def test(r: int, o: dict) -> str | None:
        for k, case_got in enumerate(o["cases"]):
            if "error" in case_got:
                raise ExerciseError(case_error([g["cases"] for g in got], k,
                                               fg_cases()[cases_at(tp)[k]].said("input")))
            problem = fg_problem(case_got, want[k][r], tp, n)
            if problem:
                return problem
        return fg_two_problem(o["two"], two[r]) if two else None

    return per_rank(got, test)


def _mlp(mc: Any, tp: int) -> list:
    """The MLP's trial at ``tp``, run once for the forward's check and the backward's."""
    learner = (COLUMN_BLOCK, ROW_BLOCK, COLUMN, ROW)
    return once(mc, ("tp_mlp", tp, *learner, F, G), lambda: run(
        mc, tp_mlp_trial, *learner, tp, ranks=tp_ranks(tp, mc.n)))


def _group_of(mc: Any, r: int, tp: int, strided: bool = False) -> int:
    """Rank r's group, as the check's world lays them out."""
    return tp_layout(r, tp_ranks(tp, mc.n), tp, strided)[0]


def _per_case(mc: Any, tp: int, problem: Callable[[dict, dict, int], str | None]) -> str | None:
    got = _mlp(mc, tp)

    def test(r: int, cases: list[dict]) -> str | None:
        for at, (one, case) in enumerate(zip(cases, [mlp_cases()[k] for k in cases_at(tp, True)],
                                             strict=False)):
            if "error" in one:
                raise ExerciseError(case_error(got, at, case.said(*MLP_SAID)))
            said = _case_said(case, problem(one, one_process_mlp(_group_of(mc, r, tp), case), r))
            if said:
                return said
        return None

    return per_rank(got, test)


def _forward(mc: Any, tp: int) -> str | None:
    return _per_case(mc, tp, lambda o, want, r: tp_forward_problem(o, want, tp))


def _backward(mc: Any, tp: int) -> str | None:
    return _per_case(mc, tp, lambda o, want, r: tp_backward_problem(o, want, tp, r % tp))


def _mesh(mc: Any, p: int) -> str | None:
    # 4 ranks, both axes in every process: groups {0, 1} and {2, 3} ("a"), then {0, 2} and
    # {1, 3} ("b"), each with a batch of its own, one backward of both
    def test(r: int, o: dict) -> str | None:
        for way, strided, index in (("a", False, 0), ("b", True, 2)):
            group = _group_of(mc, r, 2, strided)
            want = one_process_mlp(index + group)
            rank = tp_layout(r, 4, 2, strided)[1]
            problem = tp_forward_problem(o[way], want, 2) or \
                tp_backward_problem(o[way], want, 2, rank)
            if problem:
                members = ranks_said(group_members(r, 4, 2, strided))
                return (f"in the group {members}, with both groups of the mesh in this "
                        f"process, {problem} (is a group kept in a module global, set by the "
                        "last forward, rather than on ctx?)")
        return None

    return per_rank(run(mc, tp_mesh_trial, COLUMN_BLOCK, ROW_BLOCK, COLUMN, ROW, ranks=4),
                    test)


CHECKS = (
    Check("column_block and row_block take this rank's rows and columns",
          lambda mc: at_tp(mc, lambda tp: _blocks(mc, tp))),
    Check("f and g sum over the group, each in its own direction",
          lambda mc: at_tp(mc, lambda tp: _conjugates(mc, tp))),
    Check("the split MLP's output equals one process's",
          lambda mc: at_tp(mc, lambda tp: _forward(mc, tp))),
    Check("its gradients (input, weight and bias blocks) equal one process's",
          lambda mc: at_tp(mc, lambda tp: _backward(mc, tp))),
    Check("inside a 2x2 mesh, both of its groups in one process, forward and backward",
          lambda mc: at_sizes(mc, lambda p: _mesh(mc, p), only=[4])),
)
check = checker(CHECKS)
