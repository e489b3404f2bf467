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
    Contract,
    ExerciseError,
    Learner,
    at_sizes,
    checker,
    once,
    per_rank,
    run,
    sizes,
    tensors_differ,
)
from pcourse.tools.grading.refs.common import (
    Case,
    as_view,
    case_error,
    close,
    each_case,
    old_grad,
    to_leaf,
)
from pcourse.tools.grading.trials import world

F, G = Learner("f"), Learner("g")
COLUMN_BLOCK, ROW_BLOCK = Learner("column_block"), Learner("row_block")
COLUMN, ROW = Learner("column_parallel_linear"), Learner("row_parallel_linear")


TP_D, TP_HIDDEN = 5, 12  # the MLP's width and hidden size: 12 divides by 2, 3 and 4, and 5
#                          differs from it, so a block cut along the wrong axis has the wrong shape
TP_SHAPE = (4, 2, TP_D)  # an input [T, B, d], sequence-first as in lesson 11
TP_FG_SHAPE = (2, 3)  # what f and g are tried on alone

CONTRACT = Contract(
    dtypes=(torch.float64, torch.float32, torch.bfloat16),  # MPI's backend sums bfloat16
    #                                                          in float32
    shapes=((7, 24), (3, 36)),  # the MLP's (d, hidden) beyond the text's (5, 12): 24 and 36
    #                             divide by 2, 3 and 4, and neither is 12
    layouts=("contiguous", "transposed", "slice"),  # the input: a tensor of its own, a
    #                                                 transposed view, a slice of a larger one
    aliasing=("f's and g's input and the MLP's: the caller's tensor, compared after the call",
              "the gradient handed to f's and g's backward: the caller's, compared after",
              "another consumer of that gradient (made before f or g): its gradient compared",
              "the whole weights column_block and row_block cut: compared after"),
    groups=2,  # at tp = 2 on 4 ranks, both axes of the 2x2 mesh in one process, interleaved
    accumulation=True,  # gradients added to those already there, as over several steps
    why_not={"orders": "f, g and the layers take no order of their own: autograd runs "
                       "their backward, in the order the graph gives"},
)
FG_SHAPES = ((4, 7), (3, 2, 5))  # f and g alone, beyond the text's (2, 3)
TP_BATCH = (3, 2)  # [T, B] of every MLP case but the text's
MLP_SAID = ("MLP", "of (d, hidden) =")  # how a case of the MLP is said


def _drawn(first: Case, shapes: tuple[tuple[int, ...], ...]) -> list[Case]:
    """The text's case, then one per dtype of the contract, cycling its shapes and layouts,
    every other one with gradients already there."""
    return [first] + [Case(dtype, shapes[k % len(shapes)],
                           CONTRACT.layouts[k % len(CONTRACT.layouts)], k % 2 == 0)
                      for k, dtype in enumerate(CONTRACT.dtypes)]


def fg_cases() -> list[Case]:
    """f's and g's cases: the text's (float64, (2, 3), a tensor of its own) first."""
    return _drawn(Case(torch.float64, TP_FG_SHAPE), FG_SHAPES)


def mlp_cases() -> list[Case]:
    """The blocks' and the MLP's cases: the text's (float64, (5, 12)) first."""
    return _drawn(Case(torch.float64, (TP_D, TP_HIDDEN)), CONTRACT.shapes)


ALL_CASES_AT = 2  # the tp whose checks run every case of the contract (on 4 ranks: two
#                   groups, a 2x2 mesh); every other tp runs the text's case, so the time a
#                   check takes grows by the contract's cases once, not at every size


def cases_at(tp: int, mlp: bool = False) -> list[int]:
    """Which cases (indices into :func:`fg_cases`, or ``mlp``, :func:`mlp_cases`) run at
    ``tp``. The MLP's float64 is the text's case, run at every other tp and in the mesh."""
    if tp != ALL_CASES_AT:
        return [0]
    return [k for k in range(1, len(CONTRACT.dtypes) + 1)
            if not (mlp and CONTRACT.dtypes[k - 1] == torch.float64)]


def tp_ranks(tp: int, engines: int) -> int:
    """The ranks a check at tensor-parallel size ``tp`` runs on: as many groups of ``tp``
    as the engines hold (at tp = 2 on 4 engines, two groups: a 2x2 mesh)."""
    return tp * (engines // tp)


def at_tp(mc: Any, check: Callable[[int], str | None]) -> str | None:
    """:func:`~pcourse.tools.grading.checks.at_sizes` over tensor-parallel sizes: the problem
    says at which tp it showed (a check at tp = 2 runs on more than 2 ranks)."""
    for tp in sizes(mc):
        try:
            problem = check(tp)
        except ExerciseError as exc:
            return f"at tp={tp}: {exc}"
        if problem:
            return f"at tp={tp}, {problem}"
    return None


def tp_mlp(case: Case | None = None) -> torch.nn.Module:
    """The one-process MLP the exercise splits (lesson 11's, smaller), in the case's dtype
    and shape (by default the text's: float64, Linear(5, 12), Linear(12, 5))."""
    from pcourse.workloads.transformer import MLP

    d, hidden = case.shape if case else (TP_D, TP_HIDDEN)
    torch.manual_seed(11)
    return MLP(d, hidden).double().to(case.dtype if case else torch.float64)


def tp_batch(group_index: int, case: Case | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Group ``group_index``'s input and the weights its output is summed with.

    Each group its own batch, as data parallelism across groups gives it; the weights
    depend on the position, since a plain sum of the output would hide a transposed block.
    """
    gen = torch.Generator().manual_seed(100 + group_index)
    shape = (*TP_BATCH, case.shape[0]) if case and case.shape != (TP_D, TP_HIDDEN) else TP_SHAPE
    dtype = case.dtype if case else torch.float64
    return (torch.randn(shape, generator=gen, dtype=torch.float64).to(dtype),
            torch.randn(shape, generator=gen, dtype=torch.float64).to(dtype))


def fg_data(rank: int, k: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """A rank's own input to f and g in case ``k`` of :func:`fg_cases`, and its own
    cotangent: every rank's differs."""
    case = fg_cases()[k]
    gen = torch.Generator().manual_seed(300 + rank + 1000 * k)
    return (torch.randn(case.shape, generator=gen, dtype=torch.float64).to(case.dtype),
            torch.randn(case.shape, generator=gen, dtype=torch.float64).to(case.dtype))


def tp_layout(rank: int, size: int, tp: int, strided: bool = False) -> tuple[int, int]:
    """(group, rank in the group) of ``rank`` of ``size``: groups of ``tp`` consecutive
    ranks, or, ``strided``, ranks ``size // tp`` apart (the other axis of a mesh)."""
    if strided:
        return rank % (size // tp), rank // (size // tp)
    return rank // tp, rank % tp


class _TPGroup:
    """This rank's tensor-parallel group of the trial's world, as a course Backend."""

    def __init__(self, tp: int, strided: bool = False) -> None:
        from pcourse.backends import make_backend
        from pcourse.tools.grading.trials import OP_TIMEOUT

        comm = world()
        self.index, key = tp_layout(comm.rank, comm.size, tp, strided)
        sub = comm.Split(self.index, key)
        self.backend = make_backend("mpi", comm=sub, timeout=OP_TIMEOUT)
        sub.Free()

    def __enter__(self) -> _TPGroup:
        return self

    def __exit__(self, *exc: object) -> None:
        self.backend.close()


def _pair(value: Any, who: str) -> tuple[torch.Tensor, torch.Tensor]:
    if not (isinstance(value, tuple | list) and len(value) == 2
            and all(isinstance(t, torch.Tensor) for t in value)):
        raise TypeError(f"{who} returned {type(value).__name__}, not a pair of tensors "
                        "(weight, bias)")
    return value[0], value[1]


def _whole(mlp: torch.nn.Module) -> list[torch.Tensor]:
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
    with _TPGroup(tp) as group:
        def one(k: int) -> dict:
            blocks, changed = tp_blocks(column_block, row_block, group.backend, mlp_cases()[k])
            return {"blocks": blocks, "changed": changed}

        return each_case(one, cases_at(tp))


def _fg_one(op: Callable, name: str, group: Any, x_full: torch.Tensor, cotangent: torch.Tensor,
            case: Case, seed: int) -> dict:
    """``op`` on a case's input, as the case lays it out, beside another consumer of the
    gradient: what it gave, and what it changed of the caller's tensors."""
    leaf = to_leaf(x_full, case.layout).requires_grad_()
    if case.accumulate:
        leaf.grad = old_grad(tuple(leaf.shape), case.dtype, seed)
    before, cot_before = leaf.detach().clone(), cotangent.clone()
    other_leaf = torch.zeros_like(x_full, requires_grad=True)
    other = other_leaf * 3  # another consumer, made first: its backward runs after op's
    y = op(as_view(leaf, case.layout), group)
    if not isinstance(y, torch.Tensor) or y.shape != x_full.shape:
        raise TypeError(f"{name} returned {type(y).__name__} {tuple(getattr(y, 'shape', ()))}, "
                        f"not a tensor shaped like its input {tuple(x_full.shape)}")
    if y.requires_grad:
        (y + other).backward(cotangent)
    grad = None if leaf.grad is None else as_view(leaf.grad, case.layout)
    return {"forward": y.detach().clone(), "dtype": str(y.dtype), "linked": y.requires_grad,
            "backward": None if grad is None else grad.clone(),
            "input_changed": not torch.equal(leaf.detach(), before),
            "cotangent_changed": not torch.equal(cotangent, cot_before),
            "other": None if other_leaf.grad is None else other_leaf.grad.clone()}


def fg_trial(f: Callable, g: Callable, tp: int) -> dict:
    """f and g alone on this rank's own input in every case :func:`cases_at` ``tp`` (their
    outputs, and the input's gradient when this rank's own cotangent flows back), and,
    where the world holds two groups of ``tp`` across each other, both used in turn."""
    with _TPGroup(tp) as group:
        cases = each_case(lambda k: {
            name: _fg_one(op, name, group.backend, *fg_data(world().rank, k), fg_cases()[k],
                          600 + k) for name, op in (("f", f), ("g", g))}, cases_at(tp))
        two = _fg_two_groups(f, g, tp, group.backend) \
            if _two_groups(tp, world().size) and "error" not in cases[-1] else None
        return {"cases": cases, "two": two}


def _two_groups(tp: int, size: int) -> bool:
    """Do the ``size`` ranks hold groups of ``tp`` across each other (a 2x2 mesh)?"""
    return size == tp * tp


def _fg_two_groups(f: Callable, g: Callable, tp: int, first: Any) -> dict:
    """f (then g) on the consecutive group and on the strided one in turn, both forwards
    before one backward: each output's gradient must be summed over its own group."""
    out = {}
    with _TPGroup(tp, strided=True) as second:
        for name, op in (("f", f), ("g", g)):
            (xa, ca), (xb, cb) = fg_data(world().rank), fg_data(world().rank + world().size)
            xa.requires_grad_(), xb.requires_grad_()
            ya, yb = op(xa, first), op(xb, second.backend)
            torch.autograd.backward([ya, yb], [ca, cb])
            out[name] = {way: {"forward": y.detach().clone(),
                               "backward": None if x.grad is None else x.grad.clone()}
                         for way, x, y in (("a", xa, ya), ("b", xb, yb))}
    return out


def _members(r: int, size: int, tp: int, strided: bool = False) -> list[int]:
    return [m for m in range(size)
            if tp_layout(m, size, tp, strided)[0] == tp_layout(r, size, tp, strided)[0]]


def fg_reference(tp: int, size: int, k: int = 0) -> list[dict]:
    """Every rank's f and g in case ``k``, from the closed forms: f is the identity forward
    and sums over the group backward; g sums over the group forward and is the identity
    backward. ``world_*``: the sums over all ``size`` ranks instead, what using the world
    gives. In float64, of the case's rounded numbers; gradients already there added."""
    case = fg_cases()[k]
    data = [[t.double() for t in fg_data(r, k)] for r in range(size)]
    xs, cots = [d[0] for d in data], [d[1] for d in data]
    old = (as_view(old_grad(tuple(to_leaf(xs[0], case.layout).shape), case.dtype,
                            600 + k), case.layout).double()
           if case.accumulate else torch.zeros(case.shape, dtype=torch.float64))
    out = []
    for r in range(size):
        members = _members(r, size, tp)
        out.append({"f": {"forward": xs[r], "backward": sum(cots[m] for m in members) + old},
                    "g": {"forward": sum(xs[m] for m in members), "backward": cots[r] + old},
                    "world_forward": sum(xs), "world_backward": sum(cots) + old,
                    "other": 3 * cots[r], "case": case, "old": old})
    return out


FG_WHAT = {("f", "forward"): "f's forward (the identity)",
           ("f", "backward"): "f's backward (the sum of the gradients over the group)",
           ("g", "forward"): "g's forward (the sum over the group)",
           ("g", "backward"): "g's backward (the identity)"}


def fg_problem(got: dict, want: dict, tp: int, size: int) -> str | None:
    """What is wrong with one rank's f and g in one case, in plain words; None if nothing."""
    case = want.get("case") or fg_cases()[0]
    for name in ("f", "g"):
        if not got[name]["linked"]:
            return (f"{name}'s output does not require grad: it is cut off from its input, "
                    "so no gradient flows back through it")
        problem = _fg_aliasing(got[name], want, name, case)
        if problem:
            return problem
        for way in ("forward", "backward"):
            problem = _fg_value(got[name][way], want, name, way, tp, size, case)
            if problem:
                return problem
    return None


def _fg_aliasing(got: dict, want: dict, name: str, case: Case) -> str | None:
    """The dtype f or g returned, and what it changed of its caller's tensors."""
    dtype = str(case.dtype)
    if got.get("dtype", dtype) != dtype:
        return (f"{name} returned {got['dtype'].removeprefix('torch.')} for a "
                f"{dtype.removeprefix('torch.')} input: keep the input's dtype (a float32 or "
                "bfloat16 model would change dtype after the layer)")
    if got.get("input_changed"):
        return (f"{case.said('input')}, {name}'s forward changed the caller's input in place "
                f"(it now holds the group's sum, so `{name}(t) + t` is twice the sum): "
                "reduce a copy (x.clone()), never the tensor you are given")
    if got.get("cotangent_changed") or (
            got.get("other") is not None and close(got["other"], want["other"], "",
                                                   case.dtype)):
        return (f"{case.said('input')}, {name}'s backward changed the gradient it was handed "
                "in place: the caller's gradient, and another consumer of it, then see the "
                "group's sum. Reduce a copy (grad.clone()), never the tensor you are given")
    return None


def _fg_value(mine: Any, want: dict, name: str, way: str, tp: int, size: int,
              case: Case) -> str | None:
    """One direction of f or g against its closed form, the likely mix-ups named."""
    right, what = want[name][way], FG_WHAT[name, way]
    if mine is None or (way == "backward" and case.accumulate and torch.equal(
            torch.as_tensor(mine).double(), want["old"])):
        return f"{what}: no gradient reached the input (did backward return None?)"
    problem = close(mine, right, what, case.dtype)
    if not problem:
        return None
    where = "" if case == fg_cases()[0] else f"{case.said('input')}, "
    if size > tp and close(mine, want[f"world_{way}"], what, case.dtype) is None:
        return (f"{where}{what} is the sum over all {size} ranks, not over this rank's group "
                f"of {tp}: reduce over the group you are given, never the world")
    other, why = _fg_mixups(want)[name, way]
    if close(mine, other, what, case.dtype) is None:
        return f"{where}{problem}: {why}"
    return where + problem


def _fg_mixups(want: dict) -> dict:
    """What each of f's and g's directions gives when it does the other's job, and why not."""
    return {("f", "forward"): (want["g"]["forward"], "it is the sum over the group; going "
                               "forward f is the identity (the sum is g's)"),
            ("f", "backward"): (want["g"]["backward"], "it is this rank's own gradient only; "
                                "going backward f sums the gradients over the group"),
            ("g", "forward"): (want["f"]["forward"], "it is this rank's own input only; going "
                               "forward g sums over the group"),
            ("g", "backward"): (want["f"]["backward"], "it is the sum over the group; going "
                                "backward g is the identity (the sum is f's)")}


def fg_two_reference(tp: int, size: int) -> list[dict]:
    """Every rank's f and g on the two groups in turn (:func:`_fg_two_groups`): the
    consecutive group's ("a") and the strided one's ("b"), and what the other group's sum
    would give ("a_other": a group kept from the last forward)."""
    xa, ca = zip(*(fg_data(r) for r in range(size)), strict=True)
    xb, cb = zip(*(fg_data(r + size) for r in range(size)), strict=True)
    out = []
    for r in range(size):
        a, b = _members(r, size, tp), _members(r, size, tp, strided=True)
        out.append({"f": {"a": {"forward": xa[r], "backward": sum(ca[m] for m in a)},
                          "b": {"forward": xb[r], "backward": sum(cb[m] for m in b)}},
                    "g": {"a": {"forward": sum(xa[m] for m in a), "backward": ca[r]},
                          "b": {"forward": sum(xb[m] for m in b), "backward": cb[r]}},
                    "a_other": sum(ca[m] for m in b), "groups": (a, b)})
    return out


def fg_two_problem(got: dict, want: dict) -> str | None:
    """What is wrong with one rank's f and g used on two groups in turn; None if nothing."""
    a, b = want["groups"]
    for name in ("f", "g"):
        for way, group in (("a", a), ("b", b)):
            for direction in ("forward", "backward"):
                mine, right = got[name][way][direction], want[name][way][direction]
                what = f"{FG_WHAT[name, direction]} on the group {_ranks(group)}"
                if mine is None:
                    return f"{what}: no gradient reached the input"
                problem = close(mine, right, what, torch.float64)
                if problem and name == "f" and way == "a" and direction == "backward" and \
                        close(mine, want["a_other"], what, torch.float64) is None:
                    return (f"{problem}: it is the sum over the other group this process holds "
                            f"({_ranks(b)}), the one used last: keep each call's group on ctx "
                            "(ctx.group = group), never in a module global; one process may "
                            "hold two groups (a 2D mesh: tensor and data, sequence and tensor)")
                if problem:
                    return (f"with two groups in this process, {problem} (each group alone was "
                            "right: is a group kept where the other call overwrites it?)")
    return None


def _ranks(group: list[int]) -> str:
    return "{" + ", ".join(map(str, group)) + "}"


def tp_mlp_trial(column_block: Callable, row_block: Callable, column_linear: Callable,
                 row_linear: Callable, tp: int, strided: bool = False) -> list[dict]:
    """The MLP split over this rank's group by the learner's four functions, on the
    group's batch, in every case :func:`cases_at` ``tp``: its output, the gradients of the
    input and of this rank's blocks, and whether the caller's input changed."""
    with _TPGroup(tp, strided) as group:
        return each_case(lambda k: _mlp_case(column_block, row_block, column_linear,
                                             row_linear, group, mlp_cases()[k]),
                         cases_at(tp, mlp=True))


def _mlp_case(column_block: Callable, row_block: Callable, column_linear: Callable,
              row_linear: Callable, group: _TPGroup, case: Case, index: int | None = None,
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
    result = {"out": out.detach().clone(), "dtype": str(out.dtype),
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
    with _TPGroup(2) as a, _TPGroup(2, strided=True) as b:
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
    two = fg_two_reference(tp, n) if _two_groups(tp, n) else None

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
                members = _ranks(_members(r, 4, 2, strided))
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
