"""Exercise 09's cases and its conjugate operators f and g: the contract the checks
draw their cases from (:data:`CONTRACT`), each rank's group in a trial (:class:`TPGroup`),
and f's and g's trials, closed-form references and problems. The layers, the MLP and the
checks are :mod:`.tensor_parallel`'s, which imports these."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from pcourse.tools.grading.checks import (
    Contract,
    ExerciseError,
    sizes,
)
from pcourse.tools.grading.refs.common import (
    Case,
    as_view,
    close,
    each_case,
    old_grad,
    to_leaf,
)
from pcourse.tools.grading.trials import world

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


def tp_mlp(case: Case | None = None) -> Any:  # an MLP: fc1, fc2
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


class TPGroup:
    """This rank's tensor-parallel group of the trial's world, as a course Backend."""

    def __init__(self, tp: int, strided: bool = False) -> None:
        from pcourse.backends import make_backend
        from pcourse.tools.grading.trials import OP_TIMEOUT

        comm = world()
        self.index, key = tp_layout(comm.rank, comm.size, tp, strided)
        sub = comm.Split(self.index, key)
        self.backend = make_backend("mpi", comm=sub, timeout=OP_TIMEOUT)
        sub.Free()

    def __enter__(self) -> TPGroup:
        return self

    def __exit__(self, *exc: object) -> None:
        self.backend.close()


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
    with TPGroup(tp) as group:
        cases = each_case(lambda k: {
            name: _fg_one(op, name, group.backend, *fg_data(world().rank, k), fg_cases()[k],
                          600 + k) for name, op in (("f", f), ("g", g))}, cases_at(tp))
        two = _fgtwo_groups(f, g, tp, group.backend) \
            if two_groups(tp, world().size) and "error" not in cases[-1] else None
        return {"cases": cases, "two": two}


def two_groups(tp: int, size: int) -> bool:
    """Do the ``size`` ranks hold groups of ``tp`` across each other (a 2x2 mesh)?"""
    return size == tp * tp


def _fgtwo_groups(f: Callable, g: Callable, tp: int, first: Any) -> dict:
    """f (then g) on the consecutive group and on the strided one in turn, both forwards
    before one backward: each output's gradient must be summed over its own group."""
    out = {}
    with TPGroup(tp, strided=True) as second:
        for name, op in (("f", f), ("g", g)):
            (xa, ca), (xb, cb) = fg_data(world().rank), fg_data(world().rank + world().size)
            xa.requires_grad_(), xb.requires_grad_()
            ya, yb = op(xa, first), op(xb, second.backend)
            torch.autograd.backward([ya, yb], [ca, cb])
            out[name] = {way: {"forward": y.detach().clone(),
                               "backward": None if x.grad is None else x.grad.clone()}
                         for way, x, y in (("a", xa, ya), ("b", xb, yb))}
    return out


def group_members(r: int, size: int, tp: int, strided: bool = False) -> list[int]:
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
        members = group_members(r, size, tp)
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
        a, b = group_members(r, size, tp), group_members(r, size, tp, strided=True)
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
                what = f"{FG_WHAT[name, direction]} on the group {ranks_said(group)}"
                if mine is None:
                    return f"{what}: no gradient reached the input"
                problem = close(mine, right, what, torch.float64)
                if problem and name == "f" and way == "a" and direction == "backward" and \
                        close(mine, want["a_other"], what, torch.float64) is None:
                    return (f"{problem}: it is the sum over the other group this process holds "
                            f"({ranks_said(b)}), the one used last: keep each call's group on ctx "
                            "(ctx.group = group), never in a module global; one process may "
                            "hold two groups (a 2D mesh: tensor and data, sequence and tensor)")
                if problem:
                    return (f"with two groups in this process, {problem} (each group alone was "
                            "right: is a group kept where the other call overwrites it?)")
    return None


def ranks_said(group: list[int]) -> str:
    return "{" + ", ".join(map(str, group)) + "}"
