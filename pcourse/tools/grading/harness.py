"""What the check cells of the graded exercises share: run, count, compare, say.

A grader's worst case is a check that passes a wrong answer; a learner's is a check
that fails without saying why. So every check cell

- runs the learner's function on the engines through :func:`run`, as the ranks of
  a world of a given size (:data:`SIZES`: 2, where left and right neighbours
  coincide, and 3, where they do not; under the grader also 4, where a rank's ring
  neighbours no longer reach every other rank), with a deadline and with the failing rank's
  error as a short message instead of a wall of ipyparallel internals;
- compares the result with a reference computed independently of the learner's
  code, here in the kernel (a sum in one process, a single-process run, torch's own
  sampler), never on the engines, where the learner's code could read it;
- prints one deterministic verdict line, ``check 2/3 <what>: PASS`` or
  ``... FAIL: at 3 ranks, rank 1: <why>``, which the grader compares with the line
  the solution printed.

The grader runs the check cells from ``solutions/``, never the learner's copy, and
attaches every notebook to a cluster it started (:func:`start_cluster`). Under the
grader the learner's code never runs in the kernel that prints the verdicts: its
cells run in a learner process behind each engine (:mod:`pcourse.tools.grading.relay`;
on the engines themselves where there is none) and nowhere else (:func:`define`), the
kernel holds a stand-in for each name they bind (:class:`OnEngines`), and what comes
back is read as data only (:func:`safe_loads`: numbers, strings, arrays, tensors, the checks' own
records; anything else arrives as :class:`Refused`, never run). So no learner code
can patch ``print``, ``verdict`` or a module of the process that decides a grade.
"""

from __future__ import annotations

import inspect
import os
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType
from typing import Any

import numpy as np
import torch

from pcourse.tools.grading import relay as _relay
from pcourse.tools.grading import trials as _trials
from pcourse.tools.grading.data import Refused, _refused, safe_loads  # noqa: F401 - re-exported
from pcourse.tools.grading.data import refusals as _refusals

# re-exported
from pcourse.tools.grading.trials import Call, CountingComm, DeadlockError  # noqa: F401

SIZES = (2, 3)  # world sizes every check runs at: the engines a notebook starts
GRADER_SIZES = (2, 3, 4)  # and under the grader, whose clusters have 4 engines: at 4 ranks
#                           comparing each rank only with its ring neighbours misses pairs
# Deadlines on learner code, sized for a machine that other MPI jobs load too (a class graded
# beside other work, a test suite run two files at a time): a correct answer must never meet one.
CELL_TIMEOUT = 20.0  # seconds for a learner's cell, which should only define functions
RUN_TIMEOUT = 60.0  # seconds for one trial on every rank: a Gloo group's start waits on sockets
ERROR_GRACE = 3.0  # seconds the other ranks get to finish once one rank has failed
CLUSTER_ENV = "PCOURSE_GRADER_CLUSTER"  # set by the grader: its cluster's client file
RELAY_SUFFIX = ".relay"  # beside it, "1" where the learner's code runs behind the relay

ENGINE_DIED = _relay.ENGINE_DIED

_stuck = False  # set when a run never finished: the engines are still busy with it


class ExerciseError(RuntimeError):
    """The learner's code raised on an engine, or never finished."""


class TamperError(RuntimeError):
    """A learner cell replaced something the checks rely on."""


# ---------------------------------------------------------------- the cluster

@dataclass
class Attached:
    """The grader's running cluster, as a notebook kernel sees it (no processes owned)."""

    client: Any
    view: Any
    engines: list[int] = field(default_factory=list)  # engine ids in MPI rank order
    relay: bool = False  # the learner's code runs in the engines' learner processes (relay)

    @property
    def n(self) -> int:
        return len(self.engines)


def start_cluster(n: int = max(SIZES)) -> Any:
    """``n`` MPI engines for the checks: the grader's, when a grader runs the notebook.

    A learner gets a cluster of their own (:func:`pcourse.tools.cluster.start_cluster`).
    Under the grader (``$PCOURSE_GRADER_CLUSTER`` names its cluster's connection
    file) the notebook attaches to the cluster the grader keeps for many
    notebooks, and :func:`stop_cluster` only detaches.
    """
    where = os.environ.get(CLUSTER_ENV)
    if not where:
        from pcourse.tools.cluster import start_cluster as start

        return start(n)
    import ipyparallel as ipp

    client = ipp.Client(where)
    client.wait_for_engines(max(n, max(GRADER_SIZES)), timeout=60, interactive=False)
    ids = sorted(client.ids)  # all of them: the grader checks at more sizes than n
    view = client[ids]
    view.block = False
    view.use_cloudpickle().get(timeout=60)
    read_results_as_data()
    ranks = view.apply_async(_trials.world_rank).get(timeout=60)
    flag = Path(where + RELAY_SUFFIX)
    return Attached(client, view, [i for _, i in sorted(zip(ranks, ids, strict=True))],
                    relay=flag.exists() and flag.read_text() == "1")


def stop_cluster(mc: Any) -> None:
    """Stop the learner's own cluster; from the grader's, only detach."""
    if isinstance(mc, Attached):
        mc.client.close()
        return
    from pcourse.tools.cluster import stop_cluster as stop

    stop(mc)


def _engine_ids(mc: Any) -> list[int]:
    """Engine ids in MPI rank order (a learner's own cluster numbers engines by rank)."""
    return mc.engines if isinstance(mc, Attached) else sorted(mc.client.ids)


# ---------------------------------------------------------------- the learner's code

class OnEngines:
    """A name a learner's cell binds, standing in the checking kernel for its engine value.

    Passed to :func:`run` (or named by a function shipped there) it arrives on the
    engine as that engine's own object of the name
    (:func:`pcourse.tools.grading.trials.learner_global`);
    here it only has a name: calling it is a mistake of the check, said plainly.
    """

    def __init__(self, name: str) -> None:
        self.__name__ = self.__qualname__ = name

    def __reduce__(self) -> tuple:
        return (_trials.learner_global, (self.__name__,))

    def __repr__(self) -> str:
        return f"<{self.__name__}, defined on the engines>"

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        raise TypeError(f"{self.__name__} runs on the engines only: pass it to run()")


def define(mc: Any, source: str, names: Sequence[str], namespace: dict,
           imports: str = "") -> None:
    """Run a learner's cell on every engine, never here; bind ``names`` here to stand-ins.

    ``imports`` (the setup's imports) run first, so the cell finds the modules the
    setup gave it. A cell that raises fails with the learner's error; one that kills
    an engine, or does not finish within :data:`CELL_TIMEOUT`, says so.
    """
    import ipyparallel as ipp

    global _stuck
    if getattr(mc, "relay", False):
        _define_behind_relay(mc, (imports, source))
        for name in names:
            namespace[name] = OnEngines(name)
        return
    try:
        for code in (imports, source):
            if code:
                mc.view.execute(code, block=False).get(timeout=CELL_TIMEOUT)
    except ipp.error.TimeoutError:
        _stuck = True
        raise ExerciseError(f"your cell did not finish within {CELL_TIMEOUT:g} s on the engines: "
                            "a cell should only define functions (or an engine died)") from None
    except ipp.error.CompositeError as exc:
        ename, evalue = exc.elist[0][:2]
        raise _learner_error(ename, evalue) from None
    except ipp.error.RemoteError as exc:
        raise _learner_error(exc.ename, exc.evalue) from None
    except ipp.error.EngineError:
        raise ExerciseError(ENGINE_DIED) from None
    for name in names:
        namespace[name] = OnEngines(name)


def _define_behind_relay(mc: Any, codes: Sequence[str]) -> None:
    """:func:`define` where the learner's code runs in the engines' learner processes."""
    global _stuck
    for code in codes:
        if not code:
            continue
        try:
            answers = mc.view.apply_async(_relay.relay_define, code, CELL_TIMEOUT).get(
                timeout=CELL_TIMEOUT + 30)
        except Exception:  # noqa: BLE001 - an engine (ours) that does not answer: gone
            _stuck = True
            raise ExerciseError(ENGINE_DIED) from None
        for answer in answers:
            kind = answer[0] if isinstance(answer, tuple) and answer else "?"
            if kind == "timeout":
                _stuck = True
                raise ExerciseError(f"your cell did not finish within {CELL_TIMEOUT:g} s on the "
                                    "engines: a cell should only define functions")
            if kind == "died":
                raise ExerciseError(ENGINE_DIED)
            if kind == "error" and len(answer) == 3:
                raise _learner_error(str(answer[1]), str(answer[2]))
            if kind != "ok":
                raise ExerciseError(f"the engines answered the cell with {answer!r}")


def _learner_error(ename: str, evalue: str) -> ExerciseError:
    if ename == "EngineError":
        return ExerciseError(ENGINE_DIED)
    return ExerciseError(f"your code raised {ename}: {evalue}")


# ---------------------------------------------------------------- what comes back, as data

class _DataOnly:
    """ipyparallel's serializer here: pickles as before, unpickles data only."""

    def __init__(self, real: Any) -> None:
        self.real = real

    def dumps(self, *args: Any, **kwargs: Any) -> bytes:
        return self.real.dumps(*args, **kwargs)

    def loads(self, data: Any) -> Any:
        return safe_loads(data)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.real, name)


def read_results_as_data() -> None:
    """From now on, this process reads what engines send back as data only (:func:`safe_loads`).

    The engines ran the learner's code, so a result may be a pickle that would run code
    here when rebuilt; this kernel decides the verdicts.
    """
    from ipyparallel.serialize import serialize

    if not isinstance(serialize.pickle, _DataOnly):
        serialize.pickle = _DataOnly(serialize.pickle)


# ---------------------------------------------------------------- running a trial

def run(mc: Any, fn: Callable, *args: Any, ranks: int, timeout: float = RUN_TIMEOUT,
        **kwargs: Any) -> list:
    """``fn(*args, **kwargs)`` on every rank of a ``ranks``-rank world; results in rank order.

    The world is a sub-communicator of the cluster (see :mod:`pcourse.tools.grading.trials`);
    the learner's functions among ``args`` (and those they call) are pushed to the
    engines first, so one may call another. Raises :class:`ExerciseError` saying at
    which size and on which rank the code failed, or that it never finished.
    """
    global _stuck
    if _stuck:
        raise ExerciseError(
            "the engines are still stuck in an earlier check that never finished. Fix "
            "the code, then restart the kernel and run all cells again.")
    ids = _engine_ids(mc)
    if not 1 <= ranks <= len(ids):
        raise ValueError(f"cannot run at {ranks} ranks on {len(ids)} engines")
    relayed = getattr(mc, "relay", False)
    if relayed:  # opened in the learner's processes only
        import cloudpickle

        payload = cloudpickle.dumps((fn, args, kwargs))
        pending = [mc.client[i].apply_async(_relay.relay_trial, ranks, payload, timeout)
                   for i in ids]
    else:
        mine = _learner_functions(args)
        if mine:
            mc.view.push(mine, block=True)
        pending = [mc.client[i].apply_async(_trials.on_ranks, ranks, fn, args, kwargs)
                   for i in ids]
    # each engine's rank in the trial's world (trials.subworld), known here: never read from it
    place = [len(ids) - 1 - k if k >= len(ids) - ranks else None for k in range(len(ids))]
    outcomes, finished = _collect(pending, timeout, place)
    if not finished:
        _stuck = True
    failed = sorted((o for o in outcomes if o and "error" in o),
                    key=lambda o: (o["rank"] is None, o["rank"] or 0))
    if failed:
        name, message, where = failed[0]["error"]
        detail = f"\n{where}" if where else ""
        left = "" if finished else " (and the other ranks never finished)"
        who = "an engine outside it" if failed[0]["rank"] is None else f"rank {failed[0]['rank']}"
        raise ExerciseError(f"at {ranks} ranks, {who} raised {name}: {message}{left}{detail}")
    if not finished:
        raise ExerciseError(
            f"at {ranks} ranks, the code did not finish within {timeout:.0f} s on every rank. "
            "A deadlock? Every send needs a matching receive on the neighbour, and every "
            "rank must call the same collectives in the same order.")
    misplaced = [k for k, o in enumerate(outcomes) if place[k] != (o or {}).get("rank")]
    if misplaced:
        k = misplaced[0]
        raise ExerciseError(
            f"at {ranks} ranks, the engine of world rank {k} sent back a result as rank "
            f"{(outcomes[k] or {}).get('rank')}, where it is rank {place[k]} of the check's "
            "world: did the code replace the checks' functions?")
    done = sorted((o for o in outcomes if o), key=lambda o: o["rank"])
    for o in done:
        if relayed:
            o["value"] = _relayed_value(o, ranks, getattr(fn, "reports_calls", False))
        refused = _refusals(o["value"])
        if refused:
            raise ExerciseError(
                f"at {ranks} ranks, rank {o['rank']} returned a {refused}, which the grader "
                "does not rebuild: return plain numbers, strings, arrays or tensors")
    return [o["value"] for o in done]


def _relayed_value(outcome: dict, ranks: int, reports_calls: bool) -> Any:
    """A learner process's result, opened as data only; where the trial reports the calls
    it made, they must be the engine's own record of them, in order (:mod:`.relay`)."""
    rank, data = outcome["rank"], outcome["value"]
    try:
        value = safe_loads(data) if isinstance(data, bytes) else _refused("non-bytes")()
    except Exception as exc:  # noqa: BLE001 - a pickle that does not open is the learner's
        raise ExerciseError(f"at {ranks} ranks, rank {rank} sent back a result that does not "
                            f"open ({type(exc).__name__}): did the code replace the checks' "
                            "functions?") from None
    made = [tuple(c) for c in outcome.get("calls") or []]
    if reports_calls and [tuple(c) for c in _calls_in(value)] != made:
        raise ExerciseError(
            f"at {ranks} ranks, rank {rank} reported MPI calls other than the {len(made)} its "
            "engine made for it: did the code replace the checks' functions?")
    return value


def _calls_in(value: Any, depth: int = 0) -> list:
    """Every Call in a result (nested in lists, tuples and dicts), in order."""
    if isinstance(value, _trials.Call):
        return [value]
    if depth < 8 and isinstance(value, list | tuple):
        return [c for v in value for c in _calls_in(v, depth + 1)]
    if depth < 8 and isinstance(value, dict):
        return [c for v in value.values() for c in _calls_in(v, depth + 1)]
    return []


def _collect(pending: list, timeout: float, place: list[int | None]) -> tuple[list, bool]:
    """Every engine's outcome (None where unfinished), and whether all finished.

    ``place``: each engine's rank in the trial's world (None: outside it), the rank an
    error of the engine's own is said at.

    Stops waiting ``ERROR_GRACE`` seconds after the first error: the other ranks are
    then usually waiting for the failed one, forever.
    """
    import ipyparallel as ipp

    deadline, failed_at = time.monotonic() + timeout, None
    outcomes: list = [None] * len(pending)
    while True:
        for k, result in enumerate(pending):
            if outcomes[k] is None and result.ready():
                try:
                    outcomes[k] = result.get(0) or {}
                    if outcomes[k] != {} and not (isinstance(outcomes[k], dict)
                                                  and "rank" in outcomes[k]):
                        outcomes[k] = {"rank": place[k], "error": (
                            "TamperError", f"the engine sent back {outcomes[k]!r}, not what "
                            "the check asked for: did the code replace the checks' functions?",
                            "")}
                except (ipp.error.EngineError, ipp.error.RemoteError) as exc:
                    died = isinstance(exc, ipp.error.EngineError) \
                        or getattr(exc, "ename", "") == "EngineError"
                    outcomes[k] = {"rank": place[k], "error": (
                        ("EngineError", ENGINE_DIED, "") if died else
                        (getattr(exc, "ename", type(exc).__name__), str(exc), ""))}
        if all(o is not None for o in outcomes):
            return outcomes, True
        now = time.monotonic()
        if failed_at is None and any(o and "error" in o for o in outcomes):
            failed_at = now
        if now > deadline or (failed_at is not None and now > failed_at + ERROR_GRACE):
            return outcomes, False
        time.sleep(0.01)


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


def at_sizes(check: Callable[[int], str | None], sizes: Sequence[int] | None = None
             ) -> str | None:
    """``check(p)`` for every world size p, stopping at the first problem.

    The sizes are :data:`SIZES`, or :data:`GRADER_SIZES` under the grader.

    The problem says at which size it showed; an :class:`ExerciseError` (the code
    raised, or never finished) is a problem like any other.
    """
    if sizes is None:
        sizes = GRADER_SIZES if os.environ.get(CLUSTER_ENV) else SIZES
    for p in sizes:
        try:
            problem = check(p)
        except ExerciseError as exc:
            return str(exc)
        if problem:
            return f"at {p} ranks, {problem}"
    return None


# ---------------------------------------------------------------- saying and comparing

def verdict(i: int, n: int, what: str, problem: str | None) -> None:
    """Print the check's one line: PASS when ``problem`` is None, else FAIL and why.

    Only the first line of ``problem`` is on the verdict line; the rest (the failing
    rank's traceback) follows, indented.
    """
    if problem is None:
        print(f"check {i}/{n} {what}: PASS")
        return
    first, _, rest = problem.partition("\n")
    print(f"check {i}/{n} {what}: FAIL: {first}")
    if rest.strip():
        print(rest)


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
    # results come back from the engines as read-only arrays: copy, torch wants to own them
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


# ---------------------------------------------------------------- the checks' own names

_snapshot: dict[str, int] = {}


def _watched(namespace: dict, names: Sequence[str]) -> dict[str, int]:
    """id() of every named global and of everything in the grading modules."""
    found = {f"name {n}": id(namespace.get(n)) for n in names}
    for module in _grading_modules():
        found.update({f"{module.__name__}.{k}": id(v) for k, v in vars(module).items()
                      if not k.startswith("__") and k not in ("_stuck", "_snapshot")})
    return found


def _grading_modules() -> list[ModuleType]:
    return [m for name, m in sys.modules.items() if name.startswith("pcourse.tools.grading")
            and isinstance(m, ModuleType)]


def remember(namespace: dict, names: Sequence[str]) -> None:
    """Note what the checks' names are bound to (the grader runs this after the setup)."""
    _snapshot.clear()
    _snapshot.update(_watched(namespace, names))


def unchanged(namespace: dict, names: Sequence[str]) -> None:
    """Raise TamperError if a learner cell rebound a name noted by :func:`remember`."""
    now = _watched(namespace, names)
    changed = sorted(k for k, v in _snapshot.items() if now.get(k) != v)
    if changed:
        raise TamperError(f"your code replaced {', '.join(changed[:3])}, which the checks use")
