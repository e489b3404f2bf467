"""Pipeline parallelism measured: ``python -m pcourse.tools.bench pp [options]`` (lesson 12).

On p ranks of an MPI job (or p engines of the lesson), one pipeline of p equal
stages (:mod:`pcourse.pipeline`) runs steps of GPipe and 1F1B at several micro-batch
counts m. Per step, every rank records its timeline; from it come the **bubble** (the
idle fraction of the step on each rank: 1 - its forward and backward time / the step's
time, the step ending when the last rank ends) beside (p - 1)/(m + p - 1) and beside the
bubble of the stages as measured (:func:`pcourse.pipeline.simulated_step` with each
stage's own action times), and the **peak memory** per rank: the allocator's most above
the step's start, beside the activations held at the peak (GPipe m, 1F1B min(m, p - rank)
micro-batches, each (layers + 1 (+ 1 on the last stage, its targets)) tensors of rows x
width values, the count of what autograd saved beside it) and the stage's gradients.
Then torch's own, ``torch.distributed.pipelining`` (``PipelineStage``, ``ScheduleGPipe``,
``Schedule1F1B``), on Gloo, on the same model and batch: its gradients against ours, the
messages each sends (read alike for both from torch's profiler), and its step time
beside ours in one run, neither instrumented; or, where it does not run, its error. A
benchmark's figures, never a test's verdict.

With fewer cores than stages the stages take turns on the cores, and a stage waits
for a core as well as for its neighbours: the bubble measured is then not the
schedule's. ``cores_note`` says so, from the numbers.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import os
import statistics
import sys
import time
from typing import TYPE_CHECKING, Any

from pcourse.tools.bench import jobs
from pcourse.utils.show import legend_beside

if TYPE_CHECKING:
    import torch

SCHEDULES = ("gpipe", "1f1b")


@dataclasses.dataclass(frozen=True)
class Spec:
    """What one run measures."""

    ranks: int = 2
    ms: tuple[int, ...] = (1, 2, 4, 8)
    width: int = 256
    layers_per_stage: int = 4
    batch: int = 512
    repeats: int = 5

    @classmethod
    def quick(cls) -> Spec:
        return cls(width=128, batch=256, repeats=5)


def usable_cores() -> int:
    """The cores this process may run on (its affinity), not the machine's count."""
    # cpu_count() is None only where the count is unknown: 1 then, as tp.default_ranks does
    return (len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity")
            else os.cpu_count() or 1)


def cores_note(p: int, cores: int) -> str:
    """Whether a timeline of p stages on ``cores`` cores shows the schedule, in one line."""
    if p <= cores:
        return f"{p} stages on {cores} cores: every stage has a core; the bubble is the schedule's"
    return (f"{p} stages on {cores} cores: the stages time-share the cores, so waiting for a "
            f"core looks like the bubble; the bubble is measured at p = {cores} instead")


def make_layers(n: int, width: int, dtype: Any = None) -> list:
    """n blocks of (Linear, Tanh), seeded: the same model on every rank."""
    import torch
    from torch import nn

    torch.manual_seed(0)
    return [nn.Sequential(nn.Linear(width, width), nn.Tanh()).to(dtype or torch.float32)
            for _ in range(n)]


def first_ranks(p: int, others: bool = False) -> Any:
    """COMM_WORLD's first p ranks as a communicator; on the others COMM_NULL, or
    (``others``) a communicator of the rest (a Gloo backend is made by every rank)."""
    from mpi4py import MPI

    world = MPI.COMM_WORLD
    if not 1 <= p <= world.size:
        raise ValueError(f"{p} stages asked for, but there are {world.size} ranks")
    rest = 1 if others else MPI.UNDEFINED
    return world.Split(0 if world.rank < p else rest, world.rank)


def timed_steps(p: int, spec: Spec, backend: str = "mpi") -> dict | None:
    """On the first p ranks: per schedule and m, the median step's timeline, each action's
    median time, and what the step held: the micro-batches and their bytes (counted as
    autograd saves them) and the allocator's peak above the step's start (a step of its
    own, measured apart from the timed ones); None on the other ranks. Collective."""
    import torch
    from mpi4py import MPI
    from torch import nn

    from pcourse.backends import make_backend
    from pcourse.pipeline import (
        Stage,
        Timeline,
        gpipe_order,
        one_f_one_b_order,
        run_step,
        split_model,
    )
    from pcourse.sharding import peak_bytes

    comm = first_ranks(p)
    if comm == MPI.COMM_NULL:
        return None
    orders = {"gpipe": gpipe_order, "1f1b": one_f_one_b_order}
    out: dict[str, Any] = {"rank": comm.rank, "p": p, "cores": usable_cores(), "runs": {}}
    torch.manual_seed(1)
    x, y = torch.randn(spec.batch, spec.width), torch.randn(spec.batch, spec.width)
    with make_backend(backend, comm=comm) as group:
        module = split_model(make_layers(p * spec.layers_per_stage, spec.width), p, comm.rank)
        stage = Stage(module, group, (spec.width,), nn.functional.mse_loss)
        for schedule in SCHEDULES:
            for m in spec.ms:
                order = orders[schedule](p, comm.rank, m)
                steps = []
                for _ in range(spec.repeats + 1):  # the first warms up, and is dropped
                    module.zero_grad()
                    group.barrier()
                    tl = Timeline()
                    run_step(stage, order, m, spec.batch, x, y, tl)
                    end = comm.allreduce(tl.end_ms(), op=MPI.MAX)  # the step ends with the last
                    steps.append({"events": tl.events, "step_ms": end, "busy_ms": tl.busy_ms(),
                                  "held": max(tl.held), "held_bytes": max(tl.held_bytes)})
                steps = steps[1:]
                mid = sorted(steps, key=lambda s: s["step_ms"])[len(steps) // 2]
                mid["bubbles"] = [1 - s["busy_ms"] / s["step_ms"] for s in steps]
                mid["idle_ms"] = [s["step_ms"] - s["busy_ms"] for s in steps]
                mid["t_f"], mid["t_b"] = (statistics.median(
                    e["ms"] for s in steps for e in s["events"] if e["name"].startswith(k))
                    for k in ("F ", "B "))
                module.zero_grad()  # the gradients a step makes are part of its peak
                group.barrier()
                mid["peak_bytes"] = peak_bytes(functools.partial(
                    run_step, stage, order, m, spec.batch, x, y))
                out["runs"][schedule, m] = mid
        out["layers"] = len(module)
        out["itemsize"] = x.element_size()
        out["grad_bytes"] = sum(q.numel() for q in module.parameters()) * x.element_size()
        out["largest"] = max(q.numel() for q in module.parameters()) * x.element_size()
    comm.Free()
    return out


def predicted_bytes(schedule: str, p: int, rank: int, m: int, layers: int, spec: Spec,
                    itemsize: int) -> int:
    """Peak bytes of activations stage ``rank`` holds: micro-batches in flight x what
    one saves (its input, each Tanh's output, and on the last stage its targets)."""
    from pcourse.pipeline import in_flight_prediction, micro_sizes

    rows = max(micro_sizes(spec.batch, m))
    tensors = layers + 1 + (rank == p - 1)
    return in_flight_prediction(schedule, p, rank, m) * tensors * rows * spec.width * itemsize


def transient_bytes(m: int, spec: Spec, itemsize: int, largest: int) -> int:
    """What a backward holds for a moment beyond the activations and the gradients: the
    output's gradient received, two gradients on their way through a block, and a
    weight's gradient before it is added to ``.grad`` (``largest`` bytes), plus 4 KiB of
    small ones (the biases' gradients, the loss)."""
    from pcourse.pipeline import micro_sizes

    return 3 * max(micro_sizes(spec.batch, m)) * spec.width * itemsize + largest + 4096


def bubble_rows(results: list[dict | None], spec: Spec) -> list[dict]:
    """Per schedule, m and rank: the bubble measured, by the formula and simulated with
    the stages' measured action times; the memory, counted and by the allocator, beside
    the prediction."""
    from pcourse.pipeline import (
        bubble_fraction,
        gpipe_order,
        in_flight_prediction,
        one_f_one_b_order,
        simulated_step,
    )

    ranks = sorted((r for r in results if r is not None), key=lambda r: r["rank"])
    orders = {"gpipe": gpipe_order, "1f1b": one_f_one_b_order}
    rows = []
    for r in ranks:
        p = r["p"]
        for (schedule, m), run in sorted(r["runs"].items()):
            stages = [q["runs"][schedule, m] for q in ranks]
            step, busy = simulated_step([orders[schedule](p, k, m) for k in range(p)],
                                        [s["t_f"] for s in stages], [s["t_b"] for s in stages])
            activations = predicted_bytes(schedule, p, r["rank"], m, r["layers"], spec,
                                          r["itemsize"])
            rows.append({
                "schedule": schedule, "p": p, "m": m, "rank": r["rank"],
                "bubble": round(statistics.median(run["bubbles"]), 3),
                "bubble_predicted": round(bubble_fraction(p, m), 3),
                "bubble_simulated": round(1 - busy[r["rank"]] / step, 3),
                "idle_ms": round(statistics.median(run["idle_ms"]), 2),
                "busy_ms": round(run["busy_ms"], 2),
                "t_f": round(run["t_f"], 3), "t_b": round(run["t_b"], 3),
                "step_ms": round(run["step_ms"], 2),
                "held": run["held"], "held_predicted": in_flight_prediction(schedule, p,
                                                                            r["rank"], m),
                "bytes": run["held_bytes"], "bytes_predicted": activations,
                "peak": run["peak_bytes"], "peak_predicted": activations + r["grad_bytes"],
                "transients": transient_bytes(m, spec, r["itemsize"], r["largest"])})
    return rows


def per_micro_batch_ms(rows: list[dict], schedule: str, rank: int) -> float:
    """The fixed cost a micro-batch adds to a stage's busy time, ms: the slope of busy
    time against m (least squares), the same work cut into more pieces."""
    pts = [(r["m"], r["busy_ms"]) for r in rows if (r["schedule"], r["rank"]) == (schedule, rank)]
    mm = statistics.mean(m for m, _ in pts)
    mb = statistics.mean(b for _, b in pts)
    return (sum((m - mm) * (b - mb) for m, b in pts) / sum((m - mm) ** 2 for m, _ in pts))


def versus_torch(p: int, m: int, spec: Spec, repeats: int) -> dict | None:
    """On the first p ranks, on Gloo: ours and torch.distributed.pipelining, both schedules,
    on the same model and batch in float64: each one's largest gradient difference from
    one process, the messages each step sends (torch's profiler's record of the process
    group, the same for both), and step times in turns, neither instrumented (our stage
    bare: no timeline, no counting). torch's error, if it does not run."""
    import torch
    from mpi4py import MPI
    from torch import nn

    from pcourse.backends import make_backend
    from pcourse.backends.counting import calls_seen
    from pcourse.pipeline import Stage, gpipe_order, one_f_one_b_order, run_step, split_model

    comm = first_ranks(p, others=True)
    if MPI.COMM_WORLD.rank >= p:  # Gloo's groups are made by every rank: these sit out
        make_backend("gloo", comm=comm, timeout=60).close()
        comm.Free()
        return None
    torch.manual_seed(1)
    x, y = torch.randn(spec.batch, spec.width, dtype=torch.float64), \
        torch.randn(spec.batch, spec.width, dtype=torch.float64)
    layers = make_layers(p * spec.layers_per_stage, spec.width, torch.float64)
    whole = nn.Sequential(*make_layers(p * spec.layers_per_stage, spec.width, torch.float64))
    nn.functional.mse_loss(whole(x), y).backward()
    first = sum(len(split_model(layers, p, r)) for r in range(comm.rank))
    mine = split_model(layers, p, comm.rank)
    want = [_grad(q) for layer in list(whole)[first:first + len(mine)]
            for q in layer.parameters()]
    out: dict[str, Any] = {"errors": {}, "times": {}, "calls": {}, "error": ""}
    with make_backend("gloo", comm=comm, timeout=60) as group:
        stage = Stage(mine, group, (spec.width,), nn.functional.mse_loss, torch.float64,
                      instrumented=False)
        ours = {"gpipe": gpipe_order, "1f1b": one_f_one_b_order}
        runs = {f"ours {s}": (lambda s=s: run_step(stage, ours[s](p, comm.rank, m), m,
                                                   spec.batch, x, y)) for s in SCHEDULES}
        try:
            runs |= torch_schedules(mine, comm.rank, p, m, group, x, y)
        except Exception as exc:  # noqa: BLE001 - torch's refusal is a result to show
            out["error"] = f"{type(exc).__name__}: {str(exc).splitlines()[0]}"
        for name, step in runs.items():
            mine.zero_grad()
            try:
                step()
            except Exception as exc:  # noqa: BLE001 - shown, not hidden
                out["error"] = f"{name}: {type(exc).__name__}: {str(exc).splitlines()[0]}"
                break
            out["errors"][name] = max((_grad(q) - w).abs().max().item()
                                      for q, w in zip(mine.parameters(), want, strict=True))
        good = [n for n in runs if n in out["errors"]]
        for name in good:
            mine.zero_grad()
            out["calls"][name] = calls_seen(runs[name])[1]
        out["times"] = {n: [] for n in good}
        for _ in range(repeats + 1):
            for name in good:
                mine.zero_grad()
                group.barrier()
                t0 = time.perf_counter()
                runs[name]()
                out["times"][name].append(comm.allreduce(time.perf_counter() - t0, op=MPI.MAX))
        out["times"] = {n: t[1:] for n, t in out["times"].items()}
    comm.Free()
    return out


def _grad(q: torch.Tensor) -> torch.Tensor:
    """``q.grad``, which a backward has filled: every parameter compared here has one."""
    assert q.grad is not None, "no gradient: the step's backward did not reach it"
    return q.grad


def torch_schedules(module: Any, rank: int, p: int, m: int, group: Any, x: Any, y: Any
                    ) -> dict[str, Any]:
    """torch's PipelineStage on our Gloo group, and a step of each of its schedules."""
    import torch
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

    stage = PipelineStage(module, rank, p, torch.device("cpu"), group=group.group)

    def step_of(kind: type) -> Any:
        schedule = kind(stage, m, loss_fn=torch.nn.functional.mse_loss)

        def step() -> None:
            if rank == 0:
                schedule.step(x)
            elif rank == p - 1:
                schedule.step(target=y, losses=[])
            else:
                schedule.step()
        return step

    return {"torch's gpipe": step_of(ScheduleGPipe), "torch's 1f1b": step_of(Schedule1F1B)}


def trace_records(results: list[dict | None], schedule: str, m: int) -> list[dict]:
    """One step per rank as lesson 07's trace records
    (``pcourse.tools.bench.trace.chrome_trace``)."""
    return [{"rank": r["rank"], "buckets": 0, "events": r["runs"][schedule, m]["events"],
             "workload": f"pipeline {schedule} p={r['p']} m={m}", "backend": "mpi", "cap": 0,
             "overlap": False} for r in results if r is not None]


def plot_timeline(trace: dict, ax: Any, title: str = "") -> None:
    """Each rank's row of a trace: forwards, backwards, and the waits for a neighbour."""
    for e in (e for e in trace["traceEvents"] if e["ph"] == "X"):
        kind, start, ms = e["name"].split()[0], e["ts"] / 1e3, e["dur"] / 1e3
        colour = {"F": "C0", "B": "C1"}.get(kind, "0.85")
        ax.barh(e["pid"], ms, left=start, color=colour, edgecolor="k", lw=0.3,
                label={"F": "forward", "B": "backward"}.get(kind, "waiting"))
        if kind in "FB" and len(e["name"]) < 6:
            ax.text(start + ms / 2, e["pid"], e["name"].split()[1], ha="center",
                    va="center", fontsize=6)
    legend_beside(ax)
    ranks = sorted({e["pid"] for e in trace["traceEvents"]})
    ax.set_yticks(ranks, [f"stage {r}" for r in ranks])
    ax.invert_yaxis()
    ax.set_xlabel("ms from the step's start")
    ax.set_title(title, fontsize=9)


# ---- the command line -----------------------------------------------------------------


def measure(comm: Any, spec: Spec, progress: jobs.Progress) -> None:
    cores = usable_cores()
    timed = comm.gather(timed_steps(spec.ranks, spec))
    versus = versus_torch(spec.ranks, max(spec.ms), spec, spec.repeats)
    if comm.rank == 0:
        progress.outcome.rows = bubble_rows(timed, spec)
        load = os.getloadavg()[0]  # a fact to read the bubbles by, not a verdict on them
        notes = [cores_note(spec.ranks, cores), f"load average {load:.1f} on {cores} cores"]
        progress.outcome.notes = notes + versus_lines(versus)


def versus_lines(v: dict | None) -> list[str]:
    from pcourse.utils.verdict import faster

    if v is None:
        return []
    lines = [f"{n}: largest gradient difference from one process {e:.1e}; messages a step "
             f"(the process group's record): {v['calls'].get(n, {})}"
             for n, e in v["errors"].items()]
    for s in SCHEDULES:
        ours, theirs = v["times"].get(f"ours {s}"), v["times"].get(f"torch's {s}")
        if ours and theirs and min(len(ours), len(theirs)) >= 2:
            lines.append(f"{s}: ours {statistics.median(ours) * 1e3:.2f} ms, torch's "
                         f"{statistics.median(theirs) * 1e3:.2f} ms (medians of "
                         f"{len(ours)}): " + faster(ours, theirs, ("ours", "torch's")))
    if v["error"]:
        lines.append(f"torch.distributed.pipelining on Gloo failed here: {v['error']}")
    return lines


def report(outcome: jobs.Outcome) -> None:
    print(f"{'schedule':8} {'p':>2} {'m':>2} {'rank':>4} {'bubble':>7} {'formula':>8} "
          f"{'simulated':>9} {'idle ms':>8} {'held':>4} {'pred':>4} {'peak bytes':>11} "
          f"{'predicted':>11} {'within':>9}")
    for r in outcome.rows:
        print(f"{r['schedule']:8} {r['p']:>2} {r['m']:>2} {r['rank']:>4} {r['bubble']:>7.3f} "
              f"{r['bubble_predicted']:>8.3f} {r['bubble_simulated']:>9.3f} {r['idle_ms']:>8.2f} "
              f"{r['held']:>4} {r['held_predicted']:>4} {r['peak']:>11} {r['peak_predicted']:>11} "
              f"{r['transients']:>9}")
    print("peak bytes: the allocator's, above the step's start; predicted: the activations "
          "held at the peak and the stage's gradients, within a backward's transients "
          "(transient_bytes) either way")
    for line in outcome.notes:
        print(line)


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m pcourse.tools.bench pp",
                                description=__doc__.split("\n")[0])
    p.add_argument("--ranks", type=jobs.whole(2, 64), default=None, help="stages (default 2)")
    p.add_argument("--ms", nargs="+", type=jobs.whole(1), default=None,
                   help="micro-batch counts (default 1 2 4 8)")
    p.add_argument("--repeats", type=jobs.whole(1), default=None)
    p.add_argument("--quick", action="store_true", help="a narrower model, fewer repeats")
    p.add_argument("--timeout", type=float, default=600.0, help="seconds for the MPI job")
    p.add_argument("--oversubscribe", action="store_true")
    return p


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parser().parse_args(argv)
    base = Spec.quick() if args.quick else Spec()
    given: dict[str, Any] = {k: (tuple(v) if isinstance(v, list) else v)
                             for k in ("ranks", "ms", "repeats")
                             if (v := getattr(args, k)) is not None}
    spec = dataclasses.replace(base, **given)
    return jobs.run_command(
        "pcourse.tools.bench.pp", argv, measure, spec, report, ranks=spec.ranks,
        timeout=args.timeout, prepare=lambda: jobs.check_ranks([spec.ranks], args.oversubscribe),
        error=parser().error, what="pipeline benchmark", env={"OMP_NUM_THREADS": "1"})


if __name__ == "__main__":
    sys.exit(main())
