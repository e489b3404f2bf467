"""How much of a sharded step's communication is hidden: a traced step, per rank.

:class:`TracedBackend` wraps a backend (as :class:`pcourse.backends.counting.CountingBackend`
does) and timestamps, for every collective, the call that starts it, the wait for it
and so its time in flight; :func:`record` runs one strategy of
:mod:`pcourse.tools.bench.sharding` for a few steps on it and keeps the last step's
events, with the step's phases (forward, backward, finish, optimizer) on the same
clock. :func:`chrome_trace` merges the ranks into lesson 07's trace format (a
process per rank: thread 0 the phases, thread 1 the calls that start and wait,
thread 2 + k collective k in flight; open it at https://ui.perfetto.dev), and
:func:`exposure` reads back from it, per rank, the communication in flight and the
part of it the rank spent inside a collective's call or wait (exposed): the rest
was hidden behind computation. Lesson 10 and ``python -m pcourse.tools.bench
sharding`` use it.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from pcourse.backends.base import Backend, Work
from pcourse.utils.show import legend_beside

PHASES = ("forward", "backward", "finish", "optimizer")


class _Timed(Work):
    """A started collective whose ``wait()`` is timed."""

    def __init__(self, inner: Work, owner: TracedBackend, k: int) -> None:
        self.inner, self.owner, self.k = inner, owner, k

    def test(self) -> bool:
        return self.inner.test()

    def wait(self) -> None:
        t0 = self.owner.now()
        self.inner.wait()
        self.owner.log("wait", self.k, t0)


class TracedBackend(Backend):
    """Pass every collective on to ``inner``; record when each started and was waited for.

    ``events``: (what, k, start ms, end ms), what one of "call" (the call that
    started collective k, or the whole of a blocking one), "wait"; ``kinds[k]`` its
    name ("reduce_scatter", "all_gather", "allreduce"); ``phases``: (name, start,
    end). Times in ms from :meth:`reset`.
    """

    def __init__(self, inner: Backend) -> None:
        self.inner = inner
        self.name, self.rank, self.size = inner.name, inner.rank, inner.size
        self.device, self.any_device = inner.device, inner.any_device
        # None for a stand-in without one (the tests' one-rank fake), which a float
        # attribute cannot say: hence the ignore (every real backend sets it)
        self.timeout = getattr(inner, "timeout", None)  # type: ignore[assignment]
        self.needs_gpu, self.native_avg = inner.needs_gpu, inner.native_avg
        self.reset()

    def reset(self) -> None:
        self.t0 = time.perf_counter()
        self.events: list[tuple[str, int, float, float]] = []
        self.kinds: list[str] = []
        self.phases: list[tuple[str, float, float]] = []

    def now(self) -> float:
        return (time.perf_counter() - self.t0) * 1e3

    def log(self, what: str, k: int, start: float) -> None:
        self.events.append((what, k, start, self.now()))

    @contextmanager
    def phase(self, name: str) -> Iterator[None]:
        t0 = self.now()
        yield
        self.phases.append((name, t0, self.now()))

    def _start(self, kind: str, call: Any, *args: Any, **kw: Any) -> Work:
        k, t0 = len(self.kinds), self.now()
        self.kinds.append(kind)
        work = call(*args, **kw)
        self.log("call", k, t0)
        return _Timed(work, self, k)

    def allreduce(self, tensor: Any, op: str = "sum", *, check: bool = True) -> Any:
        self._start("allreduce", self.inner.allreduce, tensor, op, check=check)
        return tensor

    def allreduce_async(self, tensor: Any, op: str = "sum", *, check: bool = True) -> Work:
        return self._start("allreduce", self.inner.allreduce_async, tensor, op, check=check)

    def reduce_scatter(self, output: Any, input: Any, op: str = "sum", *,
                       check: bool = True) -> Any:
        self._start("reduce_scatter", self.inner.reduce_scatter, output, input, op, check=check)
        return output

    def reduce_scatter_async(self, output: Any, input: Any, op: str = "sum", *,
                             check: bool = True) -> Work:
        return self._start("reduce_scatter", self.inner.reduce_scatter_async, output, input,
                           op, check=check)

    def all_gather(self, output: Any, input: Any, *, check: bool = True) -> Any:
        self._start("all_gather", self.inner.all_gather, output, input, check=check)
        return output

    def all_gather_async(self, output: Any, input: Any, *, check: bool = True) -> Work:
        return self._start("all_gather", self.inner.all_gather_async, output, input,
                           check=check)

    def broadcast(self, tensor: Any, root: int = 0, *, check: bool = True) -> Any:
        return self.inner.broadcast(tensor, root, check=check)

    def max_over_ranks(self, v: Any) -> Any:
        return self.inner.max_over_ranks(v)

    def barrier(self) -> None:
        self.inner.barrier()

    def close(self) -> None:
        return None  # the wrapped backend belongs to the caller


def record(strategy: str, workload: str, backend: Backend, steps: int = 4) -> dict:
    """On every rank: ``steps`` steps of ``strategy`` (a variant of ours in
    :data:`pcourse.tools.bench.sharding.OURS`, built by :mod:`.sharded`), the last traced.
    Collective."""
    from pcourse.tools.bench.sharded import build, model_and_loss

    traced = TracedBackend(backend)
    make_model, loss = model_and_loss(workload)
    module, opt, finish = build(strategy, make_model, traced)
    for step in range(steps):
        backend.barrier()
        with traced.phase("step"):
            with traced.phase("forward"):
                opt.zero_grad()
                out = loss(module, backend.rank, step)
            with traced.phase("backward"):
                out.backward()
            with traced.phase("finish"):
                if finish is not None:
                    finish()
            with traced.phase("optimizer"):
                opt.step()
    if hasattr(opt, "synchronize"):
        opt.synchronize()
    return {"rank": backend.rank, "strategy": strategy, "workload": workload,
            "backend": backend.name, **last_step(traced)}


def last_step(traced: TracedBackend) -> dict:
    """The last step's phases, calls, waits and collectives in flight, in ms from its start.

    A collective started in the step before (ZeRO's all-gathers, waited for in this
    forward) is in flight from the step's start; one waited for after the step ends
    (this step's all-gathers) until its end: each step counts its own share.
    """
    (s0, s1) = [(t0, t1) for name, t0, t1 in traced.phases if name == "step"][-1]
    span: dict[int, list[float]] = {}
    for _, k, t0, t1 in traced.events:
        lo, hi = span.get(k, [t0, t1])
        span[k] = [min(lo, t0), max(hi, t1)]
    flights = [(k, max(t0, s0) - s0, min(t1, s1) - s0) for k, (t0, t1) in sorted(span.items())
               if t1 > s0 and t0 < s1]
    return {"phases": [(n, t0 - s0, t1 - s0) for n, t0, t1 in traced.phases if s0 <= t0 <= s1],
            "events": [(w, k, t0 - s0, t1 - s0) for w, k, t0, t1 in traced.events
                       if s0 <= t0 < s1],
            "flights": flights, "kinds": traced.kinds}


def chrome_trace(records: list[dict]) -> dict:
    """The ranks' records as one Chrome trace, in lesson 07's layout."""
    events: list[dict] = []
    for rec in records:
        pid = rec["rank"]
        events.append({"ph": "M", "name": "process_name", "pid": pid,
                       "args": {"name": f"rank {pid}"}})
        for name, t0, t1 in rec["phases"]:
            events.append({"ph": "X", "name": name, "pid": pid, "tid": 0, "ts": t0 * 1e3,
                           "dur": (t1 - t0) * 1e3, "cat": "phase"})
        for what, k, t0, t1 in rec["events"]:
            events.append({"ph": "X", "name": f"{what} {rec['kinds'][k]} {k}", "pid": pid,
                           "tid": 1, "ts": t0 * 1e3, "dur": (t1 - t0) * 1e3, "cat": what})
        first = min((k for k, _, _ in rec["flights"]), default=0)
        for k, t0, t1 in rec["flights"]:
            events.append({"ph": "X", "name": f"{rec['kinds'][k]} {k}", "pid": pid,
                           "tid": 2 + k - first, "ts": t0 * 1e3, "dur": (t1 - t0) * 1e3,
                           "cat": "in flight"})
    meta = {key: records[0][key] for key in ("strategy", "workload", "backend")}
    return {"traceEvents": events, "displayTimeUnit": "ms", "otherData": meta}


def _union(spans: list[tuple[float, float]]) -> float:
    """The length of the union of the intervals."""
    total, end = 0.0, float("-inf")
    for t0, t1 in sorted(spans):
        if t1 > end:
            total += t1 - max(t0, end)
            end = t1
    return total


def exposure(trace: dict) -> list[dict]:
    """Per rank (ms): the step; the time some collective was in flight; the part of the
    step spent inside a collective's call or wait (exposed); the share of the time in
    flight that the rank computed through (hidden)."""
    out = []
    events = [e for e in trace["traceEvents"] if e["ph"] == "X"]
    for pid in sorted({e["pid"] for e in events}):
        mine = [e for e in events if e["pid"] == pid]
        (step,) = [e["dur"] / 1e3 for e in mine if e["name"] == "step"]

        def union(cats: tuple[str, ...], mine: list[dict] = mine) -> float:
            return _union([(e["ts"] / 1e3, (e["ts"] + e["dur"]) / 1e3) for e in mine
                           if e["cat"] in cats])

        flight, exposed = union(("in flight",)), union(("call", "wait"))
        out.append({"rank": pid, "step_ms": step, "in_flight_ms": flight,
                    "exposed_ms": exposed,
                    "hidden": 1 - exposed / flight if flight else 0.0})
    return out


def plot(trace: dict, ax: Any, rank: int = 0, title: str = "") -> None:
    """One rank's step: the phases, the calls and waits (black), each collective in flight."""
    events = [e for e in trace["traceEvents"] if e["ph"] == "X" and e["pid"] == rank]
    colour = dict(zip(PHASES, ("C7", "C0", "C3", "C2"), strict=True))
    shade = {"reduce_scatter": "C1", "all_gather": "C4", "allreduce": "C5"}
    for e in events:
        start, ms = e["ts"] / 1e3, e["dur"] / 1e3
        if e["cat"] == "phase" and e["name"] in colour:
            ax.barh(3, ms, left=start, color=colour[e["name"]], label=e["name"])
        elif e["cat"] == "in flight":
            kind = e["name"].split()[0]
            ax.barh(2, ms, left=start, height=0.5, color=shade[kind], alpha=0.45,
                    edgecolor="k", lw=0.3, label=f"{kind} in flight")
        elif e["cat"] in ("call", "wait"):
            ax.barh(1.2, max(ms, 0.01), left=start, height=0.5, color="k",
                    label="inside a call or wait (exposed)")
    legend_beside(ax)
    ax.set_yticks([3, 2, 1.2], ["step", "collectives", "rank blocked"])
    ax.set_title(title, fontsize=9)
