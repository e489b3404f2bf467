"""What the exercises' trials and references share: a model, its data, a gradient step.

A *trial* runs where the learner's code runs (their notebook's engines, or under the
grader their learner process): it sets up the situation an exercise is about (a model, a
data shard, a communicator that counts its calls), calls the learner's function, and
returns what happened. A *reference* computes the right answer without the learner's code
and, where it can, without this course's code either: torch's own ``DistributedSampler``,
a sum in one process, a single process training on the whole batch, a serial simulation
of every rank. It runs where the verdict is printed, never in a trial: what a trial holds,
the learner's code can read (its caller's frames are its own process's).

Trials take the world from :func:`pcourse.tools.grading.trials.world` (the
sub-communicator the check runs at) and make their own MPI calls *before* the learner's
code, never after: a learner's rank that failed must not leave the others waiting in ours.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from pcourse.tools.grading.checks import tensors_differ
from pcourse.tools.grading.trials import (
    COLLECTIVES,
    SENDS,
    Call,
    CountingComm,
    check_left_behind,
    reports_calls,
    world,
)

BATCH = 60  # global batch of the gradient exercises: equal shards at 2, 3, 4, 5 and 6 ranks


class PartlyTrained(torch.nn.Module):
    """The gradient exercises' model with a frozen bias and an unused layer.

    Both end a backward pass with ``grad is None``, as fine-tuning (frozen layers) and
    models with optional branches do; gradient averaging must leave them alone.
    """

    def __init__(self, seed: int = 0, general: bool = False) -> None:
        super().__init__()
        self.body: Any = make_model(seed, general=general)  # a Sequential, indexed
        self.body[0].bias.requires_grad_(False)
        self.unused = torch.nn.Linear(2, 2).to(next(self.body.parameters()).dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.body(x)


def make_model(seed: int = 0, frozen: bool = False, general: bool = False) -> Any:  # Sequential
    """A small MLP whose parameters all differ in shape (wrong offsets show).

    ``general``: the model as the exercises' contracts allow it, not only as a first
    test would build it: float64 (a float32 copy or bucket rounds its numbers, about
    1e-8 apart, which float32's tolerance cannot see), and the last layer's weight stored
    transposed, as a tied or transposed weight is (not contiguous: ``view(-1)`` fails on
    it, ``contiguous()`` is a copy of it).
    """
    if frozen:
        return PartlyTrained(seed, general)
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(3, 8), torch.nn.Tanh(), torch.nn.Linear(8, 2))
    if general:
        model = model.double()
        last: Any = model[2]  # a Linear (Sequential's items are typed Module)
        last.weight = torch.nn.Parameter(last.weight.detach().t().contiguous().t())
    return model


def model_dtype(model: torch.nn.Module) -> torch.dtype:
    return next(model.parameters()).dtype


def make_data(n: int = BATCH, seed: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 3, generator=gen)
    return x, torch.stack([x.sin().sum(1), x.prod(1)], 1)


def shard_of(data: tuple[torch.Tensor, ...], rank: int, size: int) -> tuple[torch.Tensor, ...]:
    per = len(data[0]) // size
    return tuple(t[rank * per:(rank + 1) * per] for t in data)


def loss_of(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.mse_loss(model(x), y)


def grads(model: torch.nn.Module) -> list[torch.Tensor | None]:
    return [None if p.grad is None else p.grad.detach().clone() for p in model.parameters()]


def params(model: torch.nn.Module) -> list[torch.Tensor]:
    return [t.detach().clone() for t in model.state_dict().values()]


def addresses(model: torch.nn.Module) -> list[int]:
    """Where every parameter and buffer lives: unchanged by anything done in place."""
    return [t.data_ptr() for t in model.state_dict().values()]


def names(frozen: bool = False) -> list[str]:
    return [n for n, _ in make_model(frozen=frozen).named_parameters()]


def sgd_step(model: torch.nn.Module, lr: float) -> None:
    with torch.no_grad():
        for p in model.parameters():
            if p.grad is not None:
                p.sub_(lr * p.grad)


def learner_call(fn: Callable, comm: CountingComm, model: torch.nn.Module, *args: Any) -> Any:
    """``fn(model, comm, *args)``, the learner's; its error said in plain words where the
    general model explains it, and what it left behind (requests, communicators) refused."""
    try:
        value = fn(model, comm, *args)
    except NotImplementedError:
        raise
    except Exception as exc:
        odd = [n for n, t in model.named_parameters() if not t.is_contiguous()]
        if odd and ("view" in str(exc) or "contiguous" in str(exc)):
            raise _said(exc, f"{exc} (the parameter {odd[0]} is stored transposed, as a tied "
                    "or transposed weight is: it and its gradient are not contiguous, so "
                    ".view(-1) fails on them; .reshape(-1) copies where it must, and .numpy() "
                    "shares their memory as it is)") from exc
        raise
    check_left_behind(comm, getattr(fn, "__name__", "the function"))
    return value


def _said(exc: Exception, message: str) -> Exception:
    """``exc``'s type with ``message``, where that type can be made from a message."""
    try:
        return type(exc)(message)
    except Exception:  # noqa: BLE001 - an exception type with another constructor
        return RuntimeError(message)


FLOAT64_RTOL, FLOAT64_ATOL = 1e-10, 1e-13  # float64's summation-order differences, not more


def differ(got: list, want: list, names: list[str]) -> str | None:
    """:func:`~pcourse.tools.grading.checks.tensors_differ` at float64's precision, after
    the dtypes: a float64 model's numbers passed through float32 (``.float()``, a bucket
    made with ``torch.empty(n)``, ``np.float32``) are off by about 1e-8, which a float32
    tolerance lets through; said in plain words."""
    for g, w, name in zip(got, want, names, strict=False):
        if isinstance(g, torch.Tensor) and isinstance(w, torch.Tensor) and g.dtype != w.dtype:
            return (f"{name} is {str(g.dtype).removeprefix('torch.')}, but the model is "
                    f"{str(w.dtype).removeprefix('torch.')}: keep every tensor in the model's "
                    "own dtype")
    problem = tensors_differ(got, want, names, rtol=FLOAT64_RTOL, atol=FLOAT64_ATOL)
    if problem and tensors_differ(got, want, names) is None:
        return (f"{problem}, about float32's rounding: the model is float64, and its numbers "
                "went through float32 on the way (.float(), a bucket of torch.empty(n) or "
                "torch.zeros(n) without dtype=, np.float32): keep them in the model's dtype")
    return problem


# ---------------------------------------------------------------- cases (09, 10)

@dataclass(frozen=True)
class Case:
    """One case drawn from an exercise's ``CONTRACT`` (09's: :mod:`.tensor_parallel`): the
    dtype, the shape (an MLP's (d, hidden), or f's and g's input), the input's layout
    (:func:`to_leaf`, :func:`as_view`), and whether gradients are already there."""

    dtype: torch.dtype
    shape: tuple[int, ...]
    layout: str = "contiguous"
    accumulate: bool = False

    def said(self, what: str, shape: str = "of shape") -> str:
        """``with a float32 <what> of shape (4, 7) (the input a transposed view, ...)``."""
        parts = [{"contiguous": "", "transposed": "the input a transposed view",
                  "slice": "the input a slice of a larger tensor"}[self.layout],
                 "gradients already there" if self.accumulate else ""]
        notes = ", ".join(n for n in parts if n)
        return (f"with a {str(self.dtype).removeprefix('torch.')} {what} {shape} {self.shape}"
                + (f" ({notes})" if notes else ""))


def tolerance(dtype: torch.dtype, scale: float = 1.0) -> tuple[float, float]:
    """(rtol, atol) for a result of ``dtype`` against a float64 reference of the same rounded
    inputs; ``scale``: the reference's largest magnitude. float64 differs only in the order
    of additions; float32 and bfloat16 round every product and sum."""
    rtol = {torch.float64: 1e-12, torch.float32: 1e-4, torch.bfloat16: 5e-2}[dtype]
    return rtol, rtol * max(1.0, scale)


def close(got: Any, want: torch.Tensor, name: str, dtype: torch.dtype) -> str | None:
    """:func:`tensors_differ` at ``dtype``'s tolerance."""
    rtol, atol = tolerance(dtype, want.abs().max().item() if want.numel() else 1.0)
    return tensors_differ([got], [want], [name], rtol=rtol, atol=atol)


def to_leaf(t: torch.Tensor, layout: str) -> torch.Tensor:
    """The tensor a view of ``layout`` is taken of (:func:`as_view` of it equals ``t``)."""
    if layout == "transposed":
        return t.permute(*reversed(range(t.dim()))).contiguous()
    if layout == "slice":
        return torch.nn.functional.pad(t, (1, 1))
    return t.clone()


def as_view(leaf: torch.Tensor, layout: str) -> torch.Tensor:
    """The input a case hands on: ``leaf`` itself, transposed back, or its middle slice."""
    if layout == "transposed":
        return leaf.permute(*reversed(range(leaf.dim())))
    if layout == "slice":
        return leaf[..., 1:-1]
    return leaf


def old_grad(shape: tuple[int, ...], dtype: torch.dtype, seed: int) -> torch.Tensor:
    """A gradient already there before the call (a caller accumulating over steps)."""
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(shape, generator=gen, dtype=torch.float64).to(dtype)


def each_case(one: Callable[[int], Any], ks: list[int]) -> list:
    """``one(k)`` for each case in turn; the first that raises ends the list with its error,
    so that the problem of a case before it is still seen, and said first."""
    out = []
    for k in ks:
        try:
            out.append(one(k))
        except Exception as exc:  # noqa: BLE001 - the learner's error, said with its case
            out.append({"error": f"{type(exc).__name__}: {exc}"})
            break
    return out


def case_error(results: list[list], at: int, said: str) -> str:
    """The error the ranks' case ``at`` (said ``said``) raised: a rank's own before one
    that only waited for it."""
    errors = [(r, c[at]["error"]) for r, c in enumerate(results)
              if len(c) > at and "error" in c[at]]
    waited = ("DeadlockError", "CollectiveTimeout", "TimeoutError")
    r, error = min(errors, key=lambda e: (e[1].split(":")[0] in waited, e[0]))
    return f"rank {r}: {said}, the code raised {error}"



# ---------------------------------------------------------------- gradients (02, 06)

@reports_calls
def gradient_trial(average: Callable, steps: int = 1, lr: float = 0.1,
                   frozen: bool = False) -> dict:
    """Backward on this rank's shard, the learner's ``average(model, comm)``, SGD; repeat.

    The model is the general one (float64, a transposed weight: :func:`make_model`).
    Returns each step's gradients, the final parameters, whether every gradient
    stayed the same tensor (in place), and the communicator calls of each step.
    """
    comm = world()
    model = make_model(frozen=frozen, general=True)
    x, y = (t.double() for t in shard_of(make_data(), comm.rank, comm.size))
    out: dict = {"grads": [], "calls": [], "in_place": True}
    for _ in range(steps):
        model.zero_grad(set_to_none=False)
        loss_of(model, x, y).backward()
        before = [p.grad.data_ptr() if p.grad is not None else None for p in model.parameters()]
        counting = CountingComm(comm)
        learner_call(average, counting, model)
        out["in_place"] &= before == [p.grad.data_ptr() if p.grad is not None else None
                                      for p in model.parameters()]
        out["grads"].append(grads(model))
        out["calls"].append(counting.calls)
        sgd_step(model, lr)
    out["params"] = params(model)
    return out


def single_process_sgd(steps: int = 1, lr: float = 0.1, frozen: bool = False) -> dict:
    """The same steps in one process on the whole batch: what averaging must reproduce."""
    model = make_model(frozen=frozen, general=True)
    x, y = (t.double() for t in make_data())
    out: dict = {"grads": []}
    for _ in range(steps):
        model.zero_grad()
        loss_of(model, x, y).backward()
        out["grads"].append(grads(model))
        sgd_step(model, lr)
    out["params"] = params(model)
    return out


def sends(calls: list[Call]) -> list[Call]:
    """The calls that send data to one other rank."""
    return [c for c in calls if c.name in SENDS]


def collectives(calls: list[Call]) -> list[Call]:
    return [c for c in calls if c.name in COLLECTIVES]
