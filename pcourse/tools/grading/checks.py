"""What every exercise's checks share: run the learner's code, compare, say.

An exercise's checks live in its module of :mod:`pcourse.tools.grading.refs`, as a list of
:class:`Check`: what it verifies, and a function of the cluster that returns the problem
(None when there is none). The same functions run in two places:

- in the learner's notebook, on their own cluster: a check cell is one call,
  ``check(mc, 2)``, which prints ``check 2/4 <what>: PASS`` or ``... FAIL: at 3 ranks,
  rank 1: <why>``; nbval compares that line with the solution's;
- under the grader, on a learner's grading job (:class:`pcourse.tools.grading.job.Job`),
  where the grade is the same line.

Either way a check runs the learner's function through :func:`run`, as the ranks of a world
of a given size (:data:`SIZES`: 2, where left and right neighbours coincide, and 3, where
they do not; under the grader also 4, where a rank's ring neighbours no longer reach every
other rank), with a deadline, and compares what comes back with a reference computed
here, in the process that prints the verdict, never where the learner's code runs.
Results arrive as :mod:`~pcourse.tools.grading.wire` data: numbers, strings, arrays,
tensors, the checks' records of calls; under the grader, a trial's account of its calls
is taken only where it is the rank's own record (:mod:`pcourse.tools.grading.relay`).
"""

from __future__ import annotations

import inspect
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from pcourse.tools.grading import wire
from pcourse.tools.grading.relay import ENGINE_DIED
from pcourse.tools.grading.wire import Call, Learner

SIZES = (2, 3)  # world sizes every check runs at in a notebook (3 engines)
GRADER_SIZES = (2, 3, 4)  # and under the grader, whose jobs have 4 ranks: at 4 ranks
#                           comparing each rank only with its ring neighbours misses pairs
# Deadlines on learner code, sized for a machine that other MPI jobs load too (a class graded
# beside other work, a test suite run two files at a time): a correct answer must never meet one.
CELL_TIMEOUT = 20.0  # seconds for a learner's cell, which should only define functions
RUN_TIMEOUT = 60.0  # seconds for one trial on every rank: a Gloo group's start waits on sockets
ERROR_GRACE = 3.0  # seconds the other engines get to finish once one has failed (notebook)


class ExerciseError(RuntimeError):
    """The learner's code raised, never finished, or sent back what no check reads."""


@dataclass(frozen=True)
class Check:
    """One check of an exercise: what it verifies, and ``run(mc)``: the problem, or None."""

    what: str
    run: Callable[[Any], str | None]


# What every exercise's checks try, at least (issue 55): the dimensions of a contract, each
# with its bar. A refs module's CONTRACT meets each bar or says in ``why_not`` why it does
# not apply (tests/test_contracts.py reads every one).
DIMENSIONS = {
    "dtypes": "float64 and float32 at least (bfloat16 where the backend allows)",
    "shapes": "two shapes (or sizes) at least that the exercise's text does not name",
    "aliasing": "inputs that are views or shared with another consumer, the caller's tensors "
                "and the other consumer's gradient compared after the call",
    "groups": "two groups in one process, where a function takes a group",
    "orders": "any valid order (random ones drawn from the dependency rules), where a "
              "function takes an order",
    "accumulation": "gradients accumulated into existing ones, where a step may be one of "
                    "several",
}


NOT_YET = ("not drawn yet: issue 55 made exercises 09's and 10's checks as general as their "
           "contracts first; this one's are a follow-up")


@dataclass(frozen=True)
class Contract:
    """What an exercise's functions promise, as data, beside the checks that draw their
    cases from it: the dtypes, shapes (beyond the text's), layouts, what may alias what,
    groups per process, orders, and whether gradients accumulate. ``why_not`` names each
    dimension of :data:`DIMENSIONS` the exercise does not cover, and why."""

    dtypes: tuple[torch.dtype, ...] = ()
    shapes: tuple[tuple[int, ...], ...] = ()
    layouts: tuple[str, ...] = ()
    aliasing: tuple[str, ...] = ()
    groups: int = 0
    orders: tuple[str, ...] = ()
    accumulation: bool = False
    why_not: Mapping[str, str] = field(default_factory=dict)

    def covers(self, dimension: str) -> bool:
        """Does the contract meet ``dimension``'s bar (:data:`DIMENSIONS`)?"""
        return {"dtypes": {torch.float64, torch.float32} <= set(self.dtypes),
                "shapes": len(set(self.shapes)) >= 2,
                "aliasing": bool(self.aliasing),
                "groups": self.groups >= 2,
                "orders": any("random" in o for o in self.orders),
                "accumulation": self.accumulation}[dimension]

    def missing(self) -> list[str]:
        """The dimensions neither met nor said why not (with a reason of some words)."""
        return [d for d in DIMENSIONS if not self.covers(d)
                and len(self.why_not.get(d, "").split()) < 5]


def outcome(check: Check, mc: Any) -> str | None:
    """``check.run(mc)``: None when it passes, else the problem in words. What the learner's
    code sent back is never trusted to be well formed: a check that cannot read it fails,
    saying so, and never raises."""
    try:
        return check.run(mc)
    except ExerciseError as exc:
        return str(exc)
    except Exception as exc:  # noqa: BLE001 - the result, not the check, was not as asked
        return (f"the result could not be checked ({type(exc).__name__}: {exc}): return what "
                "the exercise asks for")


def line(i: int, n: int, what: str, problem: str | None) -> str:
    """A check's verdict: ``check i/n what: PASS``, or ``...: FAIL: why`` (its first line)."""
    if problem is None:
        return f"check {i}/{n} {what}: PASS"
    return f"check {i}/{n} {what}: FAIL: {problem.partition(chr(10))[0]}"


def checker(checks: Sequence[Check]) -> Callable[[Any, int], None]:
    """``check(mc, i)`` for an exercise's notebook: run check i (from 1) and print its line.

    Only the first line of a problem is on the verdict line; the rest (the failing rank's
    traceback) follows, indented.
    """
    def check(mc: Any, i: int) -> None:
        problem = outcome(checks[i - 1], mc)
        print(line(i, len(checks), checks[i - 1].what, problem))
        rest = (problem or "").partition("\n")[2]
        if rest.strip():
            print(rest)

    return check


# ---------------------------------------------------------------- running a trial

def _is_job(mc: Any) -> bool:
    """Is ``mc`` a grading job (:class:`pcourse.tools.grading.job.Job`), not a notebook's
    cluster? (Said by the job: this module imports nothing of the grader's.)"""
    return getattr(mc, "runs_trials", False) is True


def sizes(mc: Any) -> tuple[int, ...]:
    """The world sizes the checks run at: :data:`GRADER_SIZES` on a grading job."""
    return GRADER_SIZES if _is_job(mc) else SIZES


def run(mc: Any, fn: Callable, *args: Any, ranks: int, timeout: float = RUN_TIMEOUT,
        **kwargs: Any) -> list:
    """``fn(*args, **kwargs)`` on every rank of a ``ranks``-rank world; results in rank order.

    ``fn`` is a trial of :mod:`pcourse.tools.grading.refs` (run where the learner's code
    is: it calls it); a :class:`~pcourse.tools.grading.wire.Learner` among the arguments is
    the learner's object of that name there. Raises :class:`ExerciseError` saying at which
    size and on which rank the code failed, or that it never finished.
    """
    n = mc.n
    if not 1 <= ranks <= n:
        raise ValueError(f"cannot run at {ranks} ranks on {n} engines")
    if _is_job(mc):
        outcomes, finished = _on_job(mc, fn, args, kwargs, ranks, timeout)
    else:
        outcomes, finished = _on_cluster(mc, fn, args, kwargs, ranks, timeout)
    # each engine's rank in the trial's world (trials.subworld), known here: never read from it
    place = [n - 1 - k if k >= n - ranks else None for k in range(n)]
    failed = sorted((dict(o, rank=place[k]) for k, o in enumerate(outcomes)
                     if o and "error" in o), key=_cause_first)
    if failed:
        name, message, where = failed[0]["error"]
        detail = f"\n{where}" if where else ""
        left = "" if finished else " (and the other ranks never finished)"
        who = "a rank outside it" if failed[0]["rank"] is None else f"rank {failed[0]['rank']}"
        raise ExerciseError(f"at {ranks} ranks, {who} raised {name}: {message}{left}{detail}")
    if not finished:
        raise ExerciseError(
            f"at {ranks} ranks, the code did not finish within {timeout:.0f} s on every rank. "
            "A deadlock? Every send needs a matching receive on the neighbour, and every "
            "rank must call the same collectives in the same order.")
    misplaced = [k for k, o in enumerate(outcomes) if (place[k] is None) != (o is None)]
    if misplaced:
        raise ExerciseError(f"at {ranks} ranks, world rank {misplaced[0]} answered out of "
                            "turn: did the code replace the checks' functions?")
    recorded = _is_job(mc) and getattr(fn, "reports_calls", False)
    return [_value(outcomes[n - 1 - r], ranks, r, recorded) for r in range(ranks)]


def _cause_first(failed: dict) -> tuple:
    """Which rank's error to say: one that is not a wait past its deadline (a rank that
    waited on the one that failed), then the lowest rank."""
    waited = failed["error"][0] in ("DeadlockError", "CollectiveTimeout", "TimeoutError")
    return (waited, failed["rank"] is None, failed["rank"] or 0)


def _value(outcome: dict, ranks: int, rank: int, recorded: bool) -> Any:
    """A rank's result, read as wire data only; where the trial reports the calls it made,
    they must be the rank's own record of them, in order (:mod:`.relay`)."""
    data = outcome.get("value")
    try:
        if not isinstance(data, bytes):
            raise wire.WireError(f"a result is wire bytes, not {type(data).__name__}")
        value = wire.loads(data)
    except wire.WireError as exc:
        raise ExerciseError(f"at {ranks} ranks, rank {rank} sent back a result that is not "
                            f"data ({exc}): did the code replace the checks' functions?") \
            from None
    if recorded:
        made = [tuple(c) for c in outcome.get("calls") or []]
        if [tuple(c) for c in calls_in(value)] != made:
            raise ExerciseError(
                f"at {ranks} ranks, rank {rank} reported MPI calls other than the {len(made)} "
                "its rank made for it: did the code replace the checks' functions?")
    return value


def calls_in(value: Any, depth: int = 0) -> list[Call]:
    """Every Call in a result (nested in lists, tuples and dicts), in order."""
    if isinstance(value, Call):
        return [value]
    if depth < 8 and isinstance(value, list | tuple):
        return [c for v in value for c in calls_in(v, depth + 1)]
    if depth < 8 and isinstance(value, dict):
        return [c for v in value.values() for c in calls_in(v, depth + 1)]
    return []


def _on_job(job: Any, fn: Callable, args: tuple, kwargs: dict, ranks: int,
            timeout: float) -> tuple[list, bool]:
    """A trial on a grading job: named, never pickled (the learner process imports it)."""
    return job.trial((fn.__module__, fn.__name__, args, kwargs), ranks, timeout)


# ---------------------------------------------------------------- on the learner's cluster

_stuck = False  # set when a run never finished: the engines are still busy with it


def _on_cluster(mc: Any, fn: Callable, args: tuple, kwargs: dict, ranks: int,
                timeout: float) -> tuple[list, bool]:
    """A trial on the learner's own ipyparallel engines, their functions pushed first."""
    global _stuck
    if _stuck:
        raise ExerciseError(
            "the engines are still stuck in an earlier check that never finished. Fix "
            "the code, then restart the kernel and run all cells again.")
    main = vars(sys.modules["__main__"])
    try:
        args, kwargs = wire.resolve(args, main), wire.resolve(kwargs, main)
    except NameError as exc:
        raise ExerciseError(f"{exc}: run the cell that defines it") from None
    mine = _learner_functions([*args, *kwargs.values()])
    ids = sorted(mc.client.ids)
    if mine:
        mc.view.push(mine, block=True)
    from pcourse.tools.grading.trials import on_ranks

    pending = [mc.client[i].apply_async(on_ranks, ranks, fn, args, kwargs) for i in ids]
    outcomes, finished = _collect(pending, timeout)
    _stuck = _stuck or not finished
    return outcomes, finished



def _learner_functions(args: Sequence[Any]) -> dict[str, Callable]:
    """The notebook's functions among ``args``, and those they call, by name.

    Functions defined in a notebook reach the engines by value, with the engine's
    namespace as their globals; a learner's function that calls another one of theirs
    (``local_sgd`` calling ``average_parameters``) needs that one pushed too.
    """
    main = vars(sys.modules["__main__"])
    found: dict[str, Callable] = {}
    todo = [a for a in args if inspect.isfunction(a) and a.__module__ == "__main__"]
    while todo:
        f = todo.pop()
        if found.get(f.__name__) is f:
            continue
        found[f.__name__] = f
        todo += [main[name] for name in f.__code__.co_names
                 if inspect.isfunction(main.get(name)) and main[name].__module__ == "__main__"]
    return found


def _collect(pending: list, timeout: float) -> tuple[list, bool]:
    """Every engine's outcome (None where outside the trial), and whether all finished.

    Stops waiting ``ERROR_GRACE`` seconds after the first error: the other ranks are
    then usually waiting for the failed one, forever.
    """
    import ipyparallel as ipp

    deadline, failed_at = time.monotonic() + timeout, None
    outcomes: list = [...] * len(pending)
    while True:
        for k, result in enumerate(pending):
            if outcomes[k] is ... and result.ready():
                try:
                    outcomes[k] = result.get(0)
                except (ipp.error.EngineError, ipp.error.RemoteError) as exc:
                    died = isinstance(exc, ipp.error.EngineError) \
                        or getattr(exc, "ename", "") == "EngineError"
                    outcomes[k] = {"rank": None, "error": (
                        ("EngineError", ENGINE_DIED, "") if died else
                        (getattr(exc, "ename", type(exc).__name__), str(exc), ""))}
        if all(o is not ... for o in outcomes):
            return outcomes, True
        now = time.monotonic()
        if failed_at is None and any(isinstance(o, dict) and "error" in o for o in outcomes):
            failed_at = now
        if now > deadline or (failed_at is not None and now > failed_at + ERROR_GRACE):
            return [None if o is ... else o for o in outcomes], False
        time.sleep(0.01)


_memo: dict[tuple, Any] = {}


def once(mc: Any, key: tuple, compute: Callable[[], Any]) -> Any:
    """``compute()``, once for this cluster, ``key`` and the learner's code as it is now: for
    checks that read several facts of one slow trial (exercise 04's Gloo group). The
    learner's code is the exercise opened on a grading job, or in a notebook the objects
    the ``key``'s :class:`~pcourse.tools.grading.wire.Learner` records name: redefined,
    they run again."""
    if _is_job(mc):  # a job's folder is its own: id(mc) may be a closed job's again
        version: Any = (str(getattr(mc, "folder", "")), mc.opened)
    else:
        main = vars(sys.modules["__main__"])
        version = tuple(id(main.get(k.name)) for k in key if isinstance(k, Learner))
    full = (id(mc), version, key)
    if full not in _memo:
        _memo[full] = compute()
    return _memo[full]


def at_sizes(mc: Any, check: Callable[[int], str | None],
             only: Sequence[int] | None = None) -> str | None:
    """``check(p)`` for every world size p (:func:`sizes`, or ``only``), stopping at the
    first problem, which says at which size it showed; an :class:`ExerciseError` (the code
    raised, or never finished) is a problem like any other."""
    for p in only or sizes(mc):
        try:
            problem = check(p)
        except ExerciseError as exc:
            return str(exc)
        if problem:
            return f"at {p} ranks, {problem}"
    return None


# ---------------------------------------------------------------- comparing

def per_rank(results: Sequence[Any], test: Callable[[int, Any], str | None]) -> str | None:
    """The first rank whose result fails ``test(rank, result)``, with why; None if all pass."""
    for rank, result in enumerate(results):
        problem = test(rank, result)
        if problem:
            return f"rank {rank}: {problem}"
    return None


def uses(calls: Sequence[Call], method: str, instead_of: str | None = None) -> str | None:
    """None when ``method`` was called (and ``instead_of`` was not), else what was."""
    used = sorted({c.name for c in calls})
    if method not in used:
        return f"comm.{method} was never called (calls made: {', '.join(used) or 'none'})"
    if instead_of and instead_of in used:
        return f"comm.{instead_of} was called; this exercise is about comm.{method}"
    return None


def tensors_differ(got: Sequence[Any], want: Sequence[Any], names: Sequence[str] | None = None,
                   rtol: float = 1e-5, atol: float = 1e-6) -> str | None:
    """None when every tensor matches its reference, else which one and by how much.

    ``None`` stands for a missing gradient and matches only ``None``.
    """
    if len(got) != len(want):
        return f"{len(got)} tensors where {len(want)} were expected"
    for i, (g, w) in enumerate(zip(got, want, strict=True)):
        name = names[i] if names else f"tensor {i}"
        if g is None or w is None:
            if g is not w:
                return (f"{name} has no gradient, but should" if g is None else
                        f"{name} got a gradient, but it has none (frozen or unused): leave "
                        "p.grad None, as torch does")
            continue
        g, w = _tensor(g), _tensor(w)
        if g.shape != w.shape:
            return f"{name} has shape {tuple(g.shape)}, expected {tuple(w.shape)}"
        if not torch.allclose(g.double(), w.double(), rtol=rtol, atol=atol):
            err = (g.double() - w.double()).abs().max().item()
            ratio = _ratio(g, w)
            hint = f" (about {ratio:g} times the reference)" if ratio else ""
            return f"{name} is off by up to {err:.3g}{hint}"
    return None


def _tensor(x: Any) -> torch.Tensor:
    return torch.from_numpy(np.array(x)) if isinstance(x, np.ndarray) else torch.as_tensor(x)


def _ratio(got: torch.Tensor, want: torch.Tensor) -> float | None:
    """The factor got/want when got is a uniform multiple of want (e.g. 2: not divided)."""
    w, g = want.double().flatten(), got.double().flatten()
    mask = w.abs() > 1e-6
    if not mask.any():
        return None
    r = g[mask] / w[mask]
    if torch.allclose(r, r[0].expand_as(r), rtol=1e-4) and abs(r[0].item() - 1) > 1e-3:
        return round(r[0].item(), 3)
    return None
