"""A trace of one training step with BucketedAllreduce: per rank, as Perfetto reads it.

On each engine, :func:`record_step` runs a few steps of a course workload (the step
benchmark's step: :mod:`pcourse.tools.bench.steps`) and profiles the last with
``torch.profiler``. The reducer's event hook (``BucketedAllreduce(on_event=...)``,
no private names; :func:`pcourse.buckets.profiler_hook`) opens a ``record_function`` range from a
bucket's launch until
its call returns, and from the start of its wait until its average is in place,
so backward's autograd nodes and the buckets are on one clock. In the kernel,
:func:`chrome_trace` merges the ranks (one process each) and adds each bucket's
time in flight, from its launch to the end of its wait: an upper bound on when
the reduction really ended. :func:`write` saves the JSON atomically (open it at
https://ui.perfetto.dev); :func:`summary` reads the numbers back from the trace;
:func:`plot` draws it. Lesson 07 uses all of them.

:func:`record_progress` traces the overlapped MPI step three ways (:data:`PROGRESS`):
as MPICH is configured, a nonblocking allreduce moves only inside MPI calls; with the
reducer's hooks testing the requests in flight; with MPICH's asynchronous progress
thread. MPICH reads its progress setting once, when MPI starts, so each setting of
MPICH's is an MPI job of its own; the modes that share one (the first two) share its
job and take turns, repeat by repeat, so that a machine that slows down part-way
slows both alike. ``python -m pcourse.tools.bench.trace`` is one such job's rank.
The last is MPICH's alone: under Open MPI :func:`record_progress` says so and runs nothing.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from pcourse.utils.io import atomic_write
from pcourse.utils.show import legend_beside

PHASES = ("forward", "backward", "finish", "optimizer")
MiB = 1 << 20
# How an MPI allreduce in flight moves, mode -> (the environment MPICH starts with, whether
# the reducer's hooks test the requests): inside MPI calls only (as the course runs it),
# tested from the hooks (drive_progress=True), or by MPICH's asynchronous progress thread
PROGRESS = {
    "inside MPI calls": ({"MPIR_CVAR_ASYNC_PROGRESS": "0"}, False),
    "tested in hooks": ({"MPIR_CVAR_ASYNC_PROGRESS": "0"}, True),
    "progress thread": ({"MPIR_CVAR_ASYNC_PROGRESS": "1"}, False),
}


def record_step(workload: str = "mnist", backend: str = "gloo", cap: int = MiB,
                overlap: bool = True, steps: int = 4, drive_progress: bool = False) -> dict:
    """On every engine: ``steps`` steps, the last profiled; its events, in ms from its start.

    ``cap``: the reducer's bucket cap, in bytes. Collective: every engine must call it
    with the same arguments.
    """
    import copy

    import torch
    from mpi4py import MPI
    from torch.profiler import ProfilerActivity, profile, record_function

    from pcourse.backends import make_backend
    from pcourse.buckets import BucketedAllreduce, profiler_hook
    from pcourse.tools.bench.steps import workload_config
    from pcourse.utils.profiler import chrome_events
    from pcourse.workloads import make_workload
    from pcourse.workloads.config import batch_sizes

    # kineto logs every profiler start and stop on stderr unless its level is this high;
    # it reads the variable when the first profile starts
    os.environ.setdefault("KINETO_LOG_LEVEL", "9")
    comm = MPI.COMM_WORLD
    if steps < 1 or cap < 1:
        raise ValueError(f"steps and cap must be at least 1, got {steps}, {cap}")
    config = workload_config(workload)
    wl = make_workload(workload, config, torch.device("cpu"))
    local, _ = batch_sizes(config.scaling, config.batch_size, comm.size, wl.n_train)
    gen = torch.Generator().manual_seed(100 + comm.rank)

    with make_backend(backend) as be:
        model = copy.deepcopy(wl.model)
        reducer = BucketedAllreduce(model, be, cap, overlap=overlap, on_event=profiler_hook(),
                                    drive_progress=drive_progress)
        opt, _ = wl.make_optimizer(model)

        def step() -> None:
            idx = torch.randint(0, wl.n_train, (local,), generator=gen)
            with record_function("step"):
                opt.zero_grad(set_to_none=False)
                with record_function("forward"):
                    loss = wl.loss_sum(model, idx, 0) / len(idx)
                with record_function("backward"):
                    loss.backward()
                with record_function("finish"):
                    reducer.finish()
                with record_function("optimizer"):
                    opt.step()

        for _ in range(steps - 1):
            step()
        be.barrier()
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            step()
        reducer.remove()
        buckets = len(reducer.buckets)
    raw = chrome_events(prof)
    return {"rank": comm.rank, "buckets": buckets, "overlap": overlap, "backend": backend,
            "workload": workload, "cap": cap, "drive_progress": drive_progress,
            "events": _keep(raw)}


def _keep(raw: list[dict]) -> list[dict]:
    """The step's ranges and backward's autograd nodes, in ms from the step's start."""
    mine = [e for e in raw if e.get("ph") == "X" and (
        e.get("cat") == "user_annotation"
        or e.get("name", "").startswith("autograd::engine::evaluate_function"))]
    t0 = min(e["ts"] for e in mine if e["name"] == "step")
    return [{"name": e["name"], "start": (e["ts"] - t0) / 1e3, "ms": e["dur"] / 1e3,
             "kind": "annotation" if e.get("cat") == "user_annotation" else "autograd"}
            for e in mine if e["ts"] >= t0]


def in_flight(events: Sequence[dict]) -> dict[int, tuple[float, float]]:
    """Bucket k -> (launch start, wait end) in ms: the time its reduction may be moving."""
    starts = {int(e["name"].split()[-1]): e["start"] for e in events
              if e["name"].startswith("launch bucket")}
    ends = {int(e["name"].split()[-1]): e["start"] + e["ms"] for e in events
            if e["name"].startswith("wait bucket")}
    return {k: (starts[k], ends[k]) for k in sorted(starts)}


def chrome_trace(records: Sequence[dict]) -> dict:
    """The ranks' records as one Chrome trace: a process per rank; thread 0 the step,
    thread 1 backward's autograd nodes, thread 2 + k bucket k in flight."""
    events: list[dict] = []
    for rec in records:
        pid = rec["rank"]
        events.append({"ph": "M", "name": "process_name", "pid": pid,
                       "args": {"name": f"rank {pid}"}})
        names = {0: "step", 1: "autograd"} | {2 + k: f"bucket {k} in flight"
                                              for k in range(rec["buckets"])}
        events += [{"ph": "M", "name": "thread_name", "pid": pid, "tid": tid,
                    "args": {"name": name}} for tid, name in names.items()]
        for e in rec["events"]:
            events.append({"ph": "X", "name": e["name"], "pid": pid,
                           "tid": 0 if e["kind"] == "annotation" else 1,
                           "ts": e["start"] * 1e3, "dur": e["ms"] * 1e3,
                           "cat": e["kind"]})
        for k, (start, end) in in_flight(rec["events"]).items():
            events.append({"ph": "X", "name": f"allreduce bucket {k}", "pid": pid,
                           "tid": 2 + k, "ts": start * 1e3, "dur": (end - start) * 1e3,
                           "cat": "in flight"})
    meta = {key: records[0][key] for key in ("workload", "backend", "cap", "overlap")}
    return {"traceEvents": events, "displayTimeUnit": "ms", "otherData": meta}


def write(trace: dict, path: str | os.PathLike[str]) -> Path:
    """Save ``trace`` as JSON at ``path``, atomically (a reader never sees half a file)."""
    with atomic_write(path) as f:
        json.dump(trace, f)
    return Path(path)


def _span(events: list[dict], pid: int, name: str) -> tuple[float, float]:
    (e,) = [e for e in events if e["pid"] == pid and e.get("name") == name and e["ph"] == "X"]
    return e["ts"] / 1e3, (e["ts"] + e["dur"]) / 1e3


def summary(trace: dict) -> list[dict]:
    """Per rank, read from the trace (ms): backward, finish, the buckets' time in flight,
    the share of it inside backward (``hidden``) and the time finish() spent waiting."""
    events = trace["traceEvents"]
    out = []
    for pid in sorted({e["pid"] for e in events}):
        b0, b1 = _span(events, pid, "backward")
        flights = [(e["ts"] / 1e3, (e["ts"] + e["dur"]) / 1e3) for e in events
                   if e["pid"] == pid and e.get("cat") == "in flight"]
        total = sum(end - start for start, end in flights)
        inside = sum(max(0.0, min(end, b1) - max(start, b0)) for start, end in flights)
        waits = sum(e["dur"] / 1e3 for e in events if e["pid"] == pid and e["ph"] == "X"
                    and e["name"].startswith(("wait bucket", "launch bucket"))
                    and e["ts"] / 1e3 >= b1)
        f0, f1 = _span(events, pid, "finish")
        out.append({"rank": pid, "backward_ms": b1 - b0, "finish_ms": f1 - f0,
                    "in_flight_ms": total, "hidden": inside / total if total else 0.0,
                    "exposed_ms": waits, "buckets": len(flights)})
    return out


def plot(trace: dict, ax: Any, rank: int = 0, title: str = "") -> None:
    """One rank's step: phases, autograd nodes, each bucket's launch, flight and wait."""
    events = [e for e in trace["traceEvents"] if e["ph"] == "X" and e["pid"] == rank]
    colour = dict(zip(PHASES, ("C7", "C0", "C3", "C2"), strict=True))
    for e in events:
        start, ms, name = e["ts"] / 1e3, e["dur"] / 1e3, e["name"]
        if name in colour:
            ax.barh(3, ms, left=start, color=colour[name], label=name)
        elif e["cat"] == "autograd":
            ax.barh(2.4, ms, left=start, height=0.4, color="C0", alpha=0.5, edgecolor="k", lw=0.3)
        elif e["cat"] == "in flight":
            k = int(name.split()[-1])
            ax.barh(1.6 - 0.15 * k, ms, left=start, height=0.12, color=f"C{k % 10}", alpha=0.6)
        elif name.startswith(("launch bucket", "wait bucket")):
            k = int(name.split()[-1])
            ax.barh(1.6 - 0.15 * k, max(ms, 0.02), left=start, height=0.12, color="k")
    legend_beside(ax)
    ax.set_yticks([3, 2.4, 1.6], ["step", "autograd nodes", "buckets (black: launch, wait)"])
    ax.set_title(title, fontsize=9)



def record_progress(ranks: int = 2, workload: str = "mnist", cap: int = MiB, repeats: int = 3,
                    timeout: float = 300.0) -> dict[str, list[dict]]:
    """The overlapped MPI step traced in each :data:`PROGRESS` mode: mode -> Chrome traces,
    one per repeat. One MPI job per setting of MPICH's (the modes that share one take
    turns in its job, repeat by repeat), one torch thread per rank (as the benchmarks);
    each trace's ``otherData`` says how many threads the rank process had."""
    from pcourse.tools.cluster.launch import mpich_only, mpirun_rows

    if repeats < 1:
        raise ValueError(f"repeats must be at least 1, got {repeats}")
    # Open MPI (5.0, as pip installs it) has no progress thread to compare with: `ompi_info`
    # says "OMPI progress: no"; its btl_tcp_progress_thread moves TCP only, not shared memory.
    mpich_only("record_progress's 'progress thread' mode (MPIR_CVAR_ASYNC_PROGRESS)")
    jobs: dict[tuple, list[str]] = {}  # MPICH's environment -> the modes that run in its job
    for mode, (env, _) in PROGRESS.items():
        jobs.setdefault(tuple(sorted(env.items())), []).append(mode)
    traces: dict[str, list[dict]] = {mode: [] for mode in PROGRESS}
    for setting, modes in jobs.items():
        drives = [("on" if PROGRESS[m][1] else "off") for m in modes]
        args = ["-m", "pcourse.tools.bench.trace", "--workload", workload, "--cap", str(cap),
                "--repeats", str(repeats), "--drive-progress", *drives]
        rows, _ = mpirun_rows(ranks, args, timeout=timeout,
                              env={**dict(setting), "OMP_NUM_THREADS": "1"})
        for mode in modes:
            for k in range(repeats):
                records = [r for r in rows if r["repeat"] == k
                           and r["drive_progress"] == PROGRESS[mode][1]]
                trace = chrome_trace(records)
                trace["otherData"]["threads"] = max(r["threads"] for r in records)
                traces[mode].append(trace)
    return traces


def progress_table(traces: dict[str, list[dict]]) -> list[dict]:
    """Per mode: the median over repeats of the slowest rank's communication left after
    backward (ms), of the share in flight inside backward, and the rank's threads."""
    import statistics

    rows = []
    for mode, repeats in traces.items():
        summaries = [summary(t) for t in repeats]
        rows.append({"mode": mode,
                     "exposed_ms": statistics.median(max(s["exposed_ms"] for s in r)
                                                     for r in summaries),
                     "backward_ms": statistics.median(max(s["backward_ms"] for s in r)
                                                      for r in summaries),
                     "hidden": statistics.median(min(s["hidden"] for s in r) for r in summaries),
                     "threads": repeats[0]["otherData"]["threads"]})
    return rows


def main(argv: list[str] | None = None) -> int:
    """One rank of :func:`record_progress`'s job: trace the step, rank 0 reports every rank's."""
    import psutil
    from mpi4py import MPI

    from pcourse.tools.cluster.launch import report_rows

    p = argparse.ArgumentParser(prog="python -m pcourse.tools.bench.trace",
                                description="One rank of a traced MPI step (record_progress).")
    p.add_argument("--workload", choices=("franke", "mnist"), default="mnist")
    p.add_argument("--cap", type=int, default=MiB, help="the bucket cap, in bytes (default 1 MiB)")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--drive-progress", nargs="+", choices=("off", "on"), default=["off"],
                   help="whether the hooks test the requests in flight: each one given takes "
                        "its turn in every repeat (default: off)")
    args = p.parse_args(argv)
    if len(set(args.drive_progress)) != len(args.drive_progress):
        p.error(f"--drive-progress: each of off and on once, got {args.drive_progress}")
    mine = []
    for k in range(args.repeats):
        # every other repeat in the other order: neither mode always runs first (the first
        # of all runs cold)
        for drive in args.drive_progress[::-1] if k % 2 else args.drive_progress:
            record = record_step(args.workload, "mpi", args.cap, overlap=True,
                                 drive_progress=drive == "on")
            # threads of this process: MPICH's progress thread, if it started, is one of them
            mine.append({**record, "repeat": k, "threads": psutil.Process().num_threads()})
    gathered = MPI.COMM_WORLD.gather(mine, root=0)  # None on every rank but 0
    if MPI.COMM_WORLD.rank == 0:
        assert gathered is not None
        rows = [r for rank_rows in gathered for r in rank_rows]
        if not report_rows(rows):
            json.dump(rows, sys.stdout)
    return 0


if __name__ == "__main__":
    sys.exit(main())
