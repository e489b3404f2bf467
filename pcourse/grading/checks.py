"""What the check cells of the graded exercises share: run, count, compare, say.

A grader's worst case is a check that passes a wrong answer; a learner's is a check
that fails without saying why. So every check cell

- runs the learner's function on every engine through :func:`run`, with a deadline
  (a wrong ring allreduce can deadlock) and with the engine's error, rank included,
  as a short exception instead of a wall of ipyparallel internals;
- compares the result with a reference computed independently of the learner's
  code (MPI's own collectives, a single-process run, torch's own sampler);
- prints one deterministic verdict line, ``check 2/3 <what>: PASS`` or
  ``... FAIL: <why>``, which nbval compares with the solution's stored ``PASS``.
"""

from __future__ import annotations

import inspect
import sys
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch

RUN_TIMEOUT = 60.0  # seconds; every check finishes in a few seconds when correct

# Methods of an mpi4py communicator, by kind, as CountingComm records them.
POINT_TO_POINT = ("Send", "Recv", "Sendrecv", "Isend", "Irecv", "Ssend", "Sendrecv_replace",
                  "send", "recv", "sendrecv", "isend", "irecv", "ssend")
COLLECTIVES = ("Allreduce", "Iallreduce", "Reduce", "Bcast", "Ibcast", "Allgather",
               "Allgatherv", "Gather", "Scatter", "Reduce_scatter", "Reduce_scatter_block",
               "Alltoall", "Scan", "Exscan", "allreduce", "reduce", "bcast", "allgather",
               "gather", "scatter", "alltoall", "scan", "exscan")

SENDING = ("Send", "Isend", "Ssend", "Sendrecv", "Sendrecv_replace", "send", "isend", "ssend",
           "sendrecv")

_stuck = False  # set when a run timed out: the engines are still busy with it


class ExerciseError(RuntimeError):
    """The learner's code raised on an engine, or never finished."""


def verdict(i: int, n: int, what: str, problem: str | None) -> None:
    """Print the check's one line: PASS when ``problem`` is None, else FAIL and why."""
    print(f"check {i}/{n} {what}: " + ("PASS" if problem is None else f"FAIL: {problem}"))


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


def run(mc: Any, fn: Callable, *args: Any, timeout: float = RUN_TIMEOUT, **kwargs: Any) -> list:
    """``fn(*args, **kwargs)`` on every engine; the results in rank order.

    The learner's functions among ``args`` (and those they call) are pushed to the
    engines first, so one may call another.
    """
    global _stuck
    if _stuck:
        raise ExerciseError(
            "the engines are still stuck in an earlier check that never finished. Fix "
            "the code, then restart the kernel and run all cells again.")
    mine = _learner_functions(args)
    if mine:
        mc.view.push(mine, block=True)
    result = mc.view.apply_async(fn, *args, **kwargs)
    try:
        return result.get(timeout=timeout)
    except Exception as exc:  # noqa: BLE001 - translated below, or re-raised as is
        raise _explain(exc, timeout) from None


def _explain(exc: Exception, timeout: float) -> Exception:
    """One readable exception for an engine error or a timeout."""
    global _stuck
    import ipyparallel as ipp

    if isinstance(exc, ipp.error.TimeoutError):
        _stuck = True
        return ExerciseError(
            f"the code did not finish within {timeout:.0f} s on every rank. A deadlock? "
            "Every send needs a matching receive on the neighbour, and every rank must "
            "call the same collectives in the same order.")
    errors = getattr(exc, "elist", None)
    if errors is None and isinstance(exc, ipp.error.RemoteError):
        errors = [(exc.ename, exc.evalue, exc.traceback, exc.engine_info)]
    if not errors:
        return exc
    ename, evalue, tb, info = errors[0]
    rank = (info or {}).get("engine_id", "?")
    tail = "\n".join((tb or "").strip().splitlines()[-12:])
    return ExerciseError(f"rank {rank} raised {ename}: {evalue}\n\n{tail}")


class CountingComm:
    """An mpi4py communicator that records every call before making it.

    Checks use it to see *how* a result was computed: point-to-point only, how many
    messages and how large, one collective or one per parameter.
    """

    def __init__(self, comm: Any) -> None:
        self._comm = comm
        self.calls: list[tuple[str, int]] = []  # (method, elements sent)

    def __getattr__(self, name: str) -> Any:
        target = getattr(self._comm, name)
        if name not in POINT_TO_POINT + COLLECTIVES:
            return target

        def counted(*args: Any, **kwargs: Any) -> Any:
            buf = args[0] if args else next(iter(kwargs.values()), None)
            if _is_in_place(buf) and len(args) > 1:
                buf = args[1]  # Allreduce(MPI.IN_PLACE, buf): the data is the receive buffer
            self.calls.append((name, _elements(buf)))
            return target(*args, **kwargs)

        return counted

    def collectives(self) -> list[tuple[str, int]]:
        return [c for c in self.calls if c[0] in COLLECTIVES]

    def sends(self) -> list[tuple[str, int]]:
        """Calls that send data to another rank (receives excluded)."""
        return [c for c in self.calls if c[0] in SENDING]


def _is_in_place(buf: Any) -> bool:
    from mpi4py import MPI

    return buf is MPI.IN_PLACE


def _elements(buf: Any) -> int:
    """How many numbers a buffer argument holds (1 for a scalar or a Python object)."""
    if isinstance(buf, list | tuple) and buf and hasattr(buf[0], "size"):
        buf = buf[0]  # mpi4py's [array, MPI type] form
    size = getattr(buf, "size", None)
    if callable(size):  # a torch tensor
        return int(buf.numel())
    if isinstance(size, int):  # a numpy array
        return size
    return 1


def per_rank(results: Sequence[Any], test: Callable[[int, Any], str | None]) -> str | None:
    """The first rank whose result fails ``test(rank, result)``, with why; None if all pass."""
    for rank, result in enumerate(results):
        problem = test(rank, result)
        if problem:
            return f"rank {rank}: {problem}"
    return None


def uses(calls: Sequence[tuple[str, int]], method: str,
         instead_of: str | None = None) -> str | None:
    """None when ``method`` was called (and ``instead_of`` was not), else what was."""
    used = sorted({name for name, _ in calls})
    if method not in used:
        return f"comm.{method} was never called (calls made: {', '.join(used) or 'none'})"
    if instead_of and instead_of in used:
        return f"comm.{instead_of} was called; this exercise is about comm.{method}"
    return None


def tensors_differ(got: Sequence[torch.Tensor], want: Sequence[torch.Tensor],
                   names: Sequence[str] | None = None, rtol: float = 1e-5,
                   atol: float = 1e-6) -> str | None:
    """None when every tensor matches its reference, else which one and by how much."""
    if len(got) != len(want):
        return f"{len(got)} tensors where {len(want)} were expected"
    for i, (g, w) in enumerate(zip(got, want, strict=True)):
        name = names[i] if names else f"tensor {i}"
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
