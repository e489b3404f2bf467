"""Exercise 09, tensor parallelism: f and g, the blocks, and the column- and row-parallel
layers of an MLP.

The references are one process's MLP in float64 (:func:`one_process_mlp`) and the closed
forms of f and g (:func:`fg_reference`), computed here; the checks run each tensor-parallel
size as many groups as the ranks hold (at tp = 2 on 4 ranks, a 2x2 mesh), and inside a
mesh whose groups are strided.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from pcourse.tools.grading.checks import (
    Check,
    ExerciseError,
    Learner,
    at_sizes,
    checker,
    per_rank,
    run,
    sizes,
    tensors_differ,
)
from pcourse.tools.grading.trials import world

F, G = Learner("f"), Learner("g")
COLUMN_BLOCK, ROW_BLOCK = Learner("column_block"), Learner("row_block")
COLUMN, ROW = Learner("column_parallel_linear"), Learner("row_parallel_linear")


TP_D, TP_HIDDEN = 5, 12  # the MLP's width and hidden size: 12 divides by 2, 3 and 4, and 5
#                          differs from it, so a block cut along the wrong axis has the wrong shape
TP_SHAPE = (4, 2, TP_D)  # an input [T, B, d], sequence-first as in lesson 11
TP_FG_SHAPE = (2, 3)  # what f and g are tried on alone


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


def tp_mlp() -> torch.nn.Module:
    """The one-process MLP the exercise splits, in float64 (lesson 11's, smaller)."""
    from pcourse.workloads.transformer import MLP

    torch.manual_seed(11)
    return MLP(TP_D, TP_HIDDEN).double()


def tp_batch(group_index: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Group ``group_index``'s input and the weights its output is summed with.

    Each group its own batch, as data parallelism across groups gives it; the weights
    depend on the position, since a plain sum of the output would hide a transposed block.
    """
    gen = torch.Generator().manual_seed(100 + group_index)
    return (torch.randn(TP_SHAPE, generator=gen, dtype=torch.float64),
            torch.randn(TP_SHAPE, generator=gen, dtype=torch.float64))


def fg_data(rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A rank's own input to f and g, and its own cotangent: every rank's differs."""
    gen = torch.Generator().manual_seed(300 + rank)
    return (torch.randn(TP_FG_SHAPE, generator=gen, dtype=torch.float64),
            torch.randn(TP_FG_SHAPE, generator=gen, dtype=torch.float64))


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


def tp_blocks(column_block: Callable, row_block: Callable, group: Any) -> list[torch.Tensor]:
    """This rank's blocks of the MLP, by the learner's ``column_block`` and ``row_block``."""
    mlp = tp_mlp()
    w1, b1 = _pair(column_block(mlp.fc1.weight.detach().clone(), mlp.fc1.bias.detach().clone(),
                                group), "column_block")
    w2, b2 = _pair(row_block(mlp.fc2.weight.detach().clone(), mlp.fc2.bias.detach().clone(),
                             group), "row_block")
    return [t.detach().clone() for t in (w1, b1, w2, b2)]


def tp_blocks_trial(column_block: Callable, row_block: Callable, tp: int) -> list[torch.Tensor]:
    """This rank's four blocks (fc1's weight and bias, fc2's weight and bias)."""
    with _TPGroup(tp) as group:
        return tp_blocks(column_block, row_block, group.backend)


def fg_trial(f: Callable, g: Callable, tp: int) -> dict:
    """f and g alone on this rank's own input: their outputs, and the input's gradient
    when this rank's own cotangent flows back (None where none reached it)."""
    with _TPGroup(tp) as group:
        out = {}
        for name, op in (("f", f), ("g", g)):
            x, cotangent = fg_data(world().rank)
            x.requires_grad_()
            y = op(x, group.backend)
            if not isinstance(y, torch.Tensor) or y.shape != x.shape:
                raise TypeError(f"{name} returned {type(y).__name__} "
                                f"{tuple(getattr(y, 'shape', ()))}, not a tensor shaped like "
                                f"its input {tuple(x.shape)}")
            if y.requires_grad:
                y.backward(cotangent)
            out[name] = {"forward": y.detach().clone(), "linked": y.requires_grad,
                         "backward": None if x.grad is None else x.grad.clone()}
        return out


def fg_reference(tp: int, size: int) -> list[dict]:
    """Every rank's f and g, from the closed forms: f is the identity forward and sums
    over the group backward; g sums over the group forward and is the identity backward.
    ``world_*``: the sums over all ``size`` ranks instead, what using the world gives."""
    data = [fg_data(r) for r in range(size)]
    xs, cots = [d[0] for d in data], [d[1] for d in data]
    out = []
    for r in range(size):
        members = [m for m in range(size) if tp_layout(m, size, tp)[0] == tp_layout(r, size,
                                                                                     tp)[0]]
        out.append({"f": {"forward": xs[r], "backward": sum(cots[m] for m in members)},
                    "g": {"forward": sum(xs[m] for m in members), "backward": cots[r]},
                    "world_forward": sum(xs), "world_backward": sum(cots)})
    return out


FG_WHAT = {("f", "forward"): "f's forward (the identity)",
           ("f", "backward"): "f's backward (the sum of the gradients over the group)",
           ("g", "forward"): "g's forward (the sum over the group)",
           ("g", "backward"): "g's backward (the identity)"}


def fg_problem(got: dict, want: dict, tp: int, size: int) -> str | None:
    """What is wrong with one rank's f and g, in plain words; None if nothing."""
    for name in ("f", "g"):
        if not got[name]["linked"]:
            return (f"{name}'s output does not require grad: it is cut off from its input, "
                    "so no gradient flows back through it")
        for way in ("forward", "backward"):
            mine, right = got[name][way], want[name][way]
            what = FG_WHAT[name, way]
            if mine is None:
                return f"{what}: no gradient reached the input (did backward return None?)"
            problem = tensors_differ([mine], [right], [what], rtol=1e-12, atol=1e-12)
            if problem and size > tp and tensors_differ([mine], [want[f"world_{way}"]],
                                                        rtol=1e-12, atol=1e-12) is None:
                return (f"{what} is the sum over all {size} ranks, not over this rank's group "
                        f"of {tp}: reduce over the group you are given, never the world")
            if problem:
                other, why = _fg_mixups(want)[name, way]
                if tensors_differ([mine], [other], rtol=1e-12, atol=1e-12) is None:
                    return f"{problem}: {why}"
                return problem
    return None


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


def tp_mlp_trial(column_block: Callable, row_block: Callable, column_linear: Callable,
                 row_linear: Callable, tp: int, strided: bool = False) -> dict:
    """The MLP split over this rank's group by the learner's four functions, on the
    group's batch: its output, and the gradients of the input and of this rank's blocks."""
    with _TPGroup(tp, strided) as group:
        params = [t.requires_grad_() for t in tp_blocks(column_block, row_block,
                                                        group.backend)]
        w1, b1, w2, b2 = params
        x, weights = tp_batch(group.index)
        x.requires_grad_()
        hidden = column_linear(x, w1, b1, group.backend)
        out = row_linear(torch.nn.functional.gelu(hidden), w2, b2, group.backend)
        if not isinstance(out, torch.Tensor) or out.shape != weights.shape:
            raise TypeError(f"the MLP's output is {type(out).__name__} "
                            f"{tuple(getattr(out, 'shape', ()))}, expected a tensor "
                            f"{tuple(weights.shape)}")
        if out.requires_grad:
            (out * weights).sum().backward()
        return {"out": out.detach().clone(),
                "grads": [None if t.grad is None else t.grad.clone() for t in [x, *params]]}


TP_NAMES = ["the input x", "fc1's weight block", "fc1's bias block", "fc2's weight block",
            "fc2's bias"]


def one_process_mlp(group_index: int) -> dict:
    """One process, the whole MLP, on group ``group_index``'s batch: output and gradients.

    ``hidden``: the gradient of fc1's output, from which each rank's own part of the
    input's gradient follows (what a rank holds before f sums them).
    """
    mlp = tp_mlp()
    x, weights = tp_batch(group_index)
    x.requires_grad_()
    hidden = mlp.fc1(x)
    hidden.retain_grad()
    out = mlp.fc2(torch.nn.functional.gelu(hidden))
    (out * weights).sum().backward()
    return {"out": out.detach(), "bias": mlp.fc2.bias.detach(), "hidden": hidden.grad,
            "fc1": mlp.fc1.weight.detach(),
            "grads": [x.grad, mlp.fc1.weight.grad, mlp.fc1.bias.grad, mlp.fc2.weight.grad,
                      mlp.fc2.bias.grad]}


def tp_block_reference(full: list[torch.Tensor], tp: int, rank: int) -> list[torch.Tensor]:
    """Rank ``rank``'s blocks of [fc1 weight, fc1 bias, fc2 weight, fc2 bias] (or of their
    gradients): fc1 split by its output features (rows), fc2 by its input features
    (columns), fc2's bias whole."""
    n = full[0].shape[0] // tp
    rows = slice(rank * n, (rank + 1) * n)
    return [full[0][rows], full[1][rows], full[2][:, rows], full[3]]


def tp_blocks_problem(got: list[torch.Tensor], tp: int, rank: int) -> str | None:
    """What is wrong with one rank's four blocks of the MLP, in plain words; None if nothing."""
    mlp = tp_mlp()
    whole = [t.detach() for t in (mlp.fc1.weight, mlp.fc1.bias, mlp.fc2.weight, mlp.fc2.bias)]
    want = tp_block_reference(whole, tp, rank)
    n = TP_HIDDEN // tp
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
        problem = tensors_differ([mine], [right], [name], rtol=0, atol=0)
        if problem:
            return f"{problem}: it should be {block}"
    return None


def tp_forward_problem(got: dict, want: dict, tp: int) -> str | None:
    """What is wrong with one rank's MLP output; None if nothing."""
    problem = tensors_differ([got["out"]], [want["out"]], ["the MLP's output"],
                             rtol=1e-12, atol=1e-12)
    if problem and tensors_differ([got["out"]], [want["out"] + (tp - 1) * want["bias"]],
                                  rtol=1e-12, atol=1e-12) is None:
        return (f"{problem}: fc2's bias was added {tp} times, once on every rank; add it "
                "once, after the sum")
    return problem


def tp_backward_problem(got: dict, want: dict, tp: int, rank: int) -> str | None:
    """What is wrong with one rank's gradients (the input's, its blocks'); None if nothing."""
    right = [want["grads"][0], *tp_block_reference(want["grads"][1:], tp, rank)]
    for mine, expected, name in zip(got["grads"], right, TP_NAMES, strict=True):
        if mine is None:
            return (f"no gradient reached {name}: the backward pass never got there (was "
                    "something computed outside autograd, or detached?)")
        problem = tensors_differ([mine], [expected], [f"the gradient of {name}"],
                                 rtol=1e-12, atol=1e-12)
        if problem and name == TP_NAMES[0]:
            n = TP_HIDDEN // tp
            rows = slice(rank * n, (rank + 1) * n)
            own = want["hidden"][..., rows] @ want["fc1"][rows]
            if tensors_differ([mine], [own], rtol=1e-12, atol=1e-12) is None:
                return (f"{problem}: it is this rank's own part only; the parts of the group's "
                        "ranks must be summed (x enters the column-parallel layer through f)")
        if problem:
            return problem
    return None


def _blocks(mc: Any, tp: int) -> str | None:
    got = run(mc, tp_blocks_trial, COLUMN_BLOCK, ROW_BLOCK, tp, ranks=tp_ranks(tp, mc.n))
    return per_rank(got, lambda r, o: tp_blocks_problem(o, tp, r % tp))


def _conjugates(mc: Any, tp: int) -> str | None:
    n = tp_ranks(tp, mc.n)
    got, want = run(mc, fg_trial, F, G, tp, ranks=n), fg_reference(tp, n)
    return per_rank(got, lambda r, o: fg_problem(o, want[r], tp, n))


def _mlp(mc: Any, tp: int, strided: bool = False) -> list:
    return run(mc, tp_mlp_trial, COLUMN_BLOCK, ROW_BLOCK, COLUMN, ROW, tp, strided,
               ranks=tp_ranks(tp, mc.n))


def _group_of(mc: Any, r: int, tp: int, strided: bool = False) -> int:
    """Rank r's group, as the check's world lays them out."""
    return tp_layout(r, tp_ranks(tp, mc.n), tp, strided)[0]


def _forward(mc: Any, tp: int) -> str | None:
    return per_rank(_mlp(mc, tp), lambda r, o: tp_forward_problem(
        o, one_process_mlp(_group_of(mc, r, tp)), tp))


def _backward(mc: Any, tp: int) -> str | None:
    return per_rank(_mlp(mc, tp), lambda r, o: tp_backward_problem(
        o, one_process_mlp(_group_of(mc, r, tp)), tp, r % tp))


def _mesh(mc: Any, p: int) -> str | None:
    # 4 ranks, tensor-parallel groups {0, 2} and {1, 3}: rank r is rank r // 2 of group r % 2
    def test(r: int, o: dict) -> str | None:
        want = one_process_mlp(_group_of(mc, r, 2, strided=True))
        return tp_forward_problem(o, want, 2) or tp_backward_problem(o, want, 2, r // 2)

    return per_rank(_mlp(mc, 2, strided=True), test)


CHECKS = (
    Check("column_block and row_block take this rank's rows and columns",
          lambda mc: at_tp(mc, lambda tp: _blocks(mc, tp))),
    Check("f and g sum over the group, each in its own direction",
          lambda mc: at_tp(mc, lambda tp: _conjugates(mc, tp))),
    Check("the split MLP's output equals one process's",
          lambda mc: at_tp(mc, lambda tp: _forward(mc, tp))),
    Check("its gradients (input, weight and bias blocks) equal one process's",
          lambda mc: at_tp(mc, lambda tp: _backward(mc, tp))),
    Check("inside a 2x2 mesh with groups {0, 2} and {1, 3}, forward and backward",
          lambda mc: at_sizes(mc, lambda p: _mesh(mc, p), only=[4])),
)
check = checker(CHECKS)
