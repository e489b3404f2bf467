"""``python -m pcourse.tools.bench.predict``: lesson 13's predictions, then the runs, side by side.

For every strategy of :mod:`pcourse.tools.bench.strategies` at every rank count asked for,
on one stack of the course's transformer blocks:

1. **predicted** first, from the model's sizes and the machine's calibration
   (:mod:`pcourse.cost_model`): each rank's state at rest and peak memory, from
   :mod:`pcourse.cost_model.memory`; the step's time, from its computation counted
   operator by operator (the strategy built on a stand-in group,
   :class:`~pcourse.tools.bench.strategies.Absent`, and priced by
   :func:`pcourse.cost_model.counting.compute_time`) and its messages priced by the
   calibrated links (:mod:`pcourse.cost_model.step_time`);
2. **measured**, in one MPI job (or on a lesson's engines): the allocator's peak
   (:mod:`pcourse.tools.bench.measured`), then the step timed, the strategies taking
   turns each round so that the machine's moods fall on all of them alike.

The report sets them side by side with each error, and the bars of lesson 13: every
peak within 10%; over the step times, the median and worst |error| and Kendall's τ
over the pairs of configurations the timed repeats decide
(:mod:`pcourse.cost_model.compare`).
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import statistics
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from pcourse.tools.bench import jobs
from pcourse.tools.bench.strategies import STRATEGIES

FIELDS = ["strategy", "ranks", "rank", "rest_predicted", "rest", "peak_predicted", "peak",
          "peak_error", "when_predicted", "when", "time_predicted", "time", "time_min",
          "time_max", "time_error", "compute_predicted", "compute"]
MEMORY_BAR, MEDIAN_BAR, WORST_BAR, TAU_BAR = 0.10, 0.25, 0.40, 0.8


@dataclasses.dataclass(frozen=True)
class Spec:
    """The model (a :class:`~pcourse.cost_model.shapes.Stack`), the strategies, the rank
    counts, ``micro`` micro-batches for the pipelines, ``bucket_cap`` bytes for
    ``ddp-buckets``, timed ``repeats``, the ``backend``; ``timed``: the rank counts whose
    steps are timed as well as profiled (None: all of them)."""

    ranks: tuple[int, ...] = (2, 3)
    strategies: tuple[str, ...] = STRATEGIES
    layers: int = 6
    d: int = 192
    heads: int = 12
    hidden: int = 768
    seq: int = 48
    batch: int = 12
    micro: int = 4
    bucket_cap: int = 1 << 20
    repeats: int = 7
    backend: str = "mpi"
    timed: tuple[int, ...] | None = None

    @classmethod
    def quick(cls, **changes: Any) -> Spec:
        """A lesson's quick mode: four blocks instead of six, four repeats (the fewest
        whose ranges falling apart decides an order: :mod:`pcourse.utils.verdict`),
        steps timed at 2 ranks only (the widths stay: at smaller ones a step is mostly
        fixed costs, and less telling)."""
        base = cls(layers=4, repeats=4, timed=(2,))
        return dataclasses.replace(base, **changes)

    def shape(self) -> Any:
        from pcourse.cost_model.shapes import Stack

        return Stack(self.layers, self.d, self.heads, self.hidden, self.seq, self.batch)

    def check(self, world: int | None = None) -> None:
        """Every configuration can run, or a CostModelError naming the value: the same
        on every rank, since every rank checks the same spec."""
        from pcourse.cost_model.machine import BACKENDS, CostModelError

        shape = self.shape()
        if self.backend not in BACKENDS:
            raise CostModelError(f"unknown backend {self.backend!r}; use one of "
                                 f"{', '.join(BACKENDS)}")
        unknown = [s for s in self.strategies if s not in STRATEGIES]
        if unknown:
            raise CostModelError(f"unknown strategy {unknown[0]!r}; use one of "
                                 f"{', '.join(STRATEGIES)}")
        if isinstance(self.micro, bool) or not isinstance(self.micro, int) or self.micro < 1:
            raise CostModelError(f"micro = {self.micro!r}: at least 1 micro-batch")
        if self.repeats < 2:
            raise CostModelError(f"repeats = {self.repeats}: at least 2, for a spread")
        for p in self.ranks:
            if p < 1 or (world is not None and p > world):
                raise CostModelError(f"{p} ranks: at least 1" + (
                    f" and at most the job's {world}" if world is not None else ""))
            _check_mesh(shape, p, self)


def _check_mesh(shape: Any, p: int, spec: Spec) -> None:
    """Refuse a rank count the model does not divide by, per strategy, naming the value."""
    from pcourse.cost_model.machine import CostModelError

    uses = set(spec.strategies)
    if uses - {"tp", "sp", "gpipe", "1f1b"} and shape.batch % p:
        raise CostModelError(f"the batch ({shape.batch}) does not divide by {p} ranks")
    if uses & {"tp", "sp"}:
        shape.check_split(p, "sp" in uses)
    if uses & {"gpipe", "1f1b"}:
        if shape.layers < p:
            raise CostModelError(f"{shape.layers} blocks cannot make {p} pipeline stages")
        if shape.batch % spec.micro:
            raise CostModelError(f"the batch ({shape.batch}) does not divide into "
                                 f"micro = {spec.micro} micro-batches")


# ------------------------------------------------------------------ predicting
def predict(spec: Spec, machine: Any) -> list[dict]:
    """Every configuration's prediction, one row per (strategy, ranks, rank)."""
    spec.check()
    return [row for p in spec.ranks for s in spec.strategies for row in predict_one(s, p, spec,
                                                                                      machine)]


def predict_one(strategy: str, p: int, spec: Spec, machine: Any) -> list[dict]:
    """One configuration's rows: each rank's memory, and the step's time (the same on
    every row: the slowest rank's) where the spec times it (None elsewhere: a time
    no run will check is not worth the counting)."""
    seconds = alone = None
    if spec.timed is None or p in spec.timed:
        seconds = _time(strategy, p, spec, machine)
        alone = (_pipeline_time(p, spec, machine, alone=True) if strategy in ("gpipe", "1f1b")
                 else _time(strategy, p, spec, _silent(machine)))
    return [{"strategy": strategy, "ranks": p, "rank": r, "rest_predicted": m.rest,
             "peak_predicted": m.peak, "when_predicted": m.when, "time_predicted": seconds,
             "compute_predicted": alone}
            for r, m in enumerate(_memory(strategy, p, spec))]


def _silent(machine: Any) -> Any:
    """The machine with every message free: what the step's computation alone takes
    (a pipeline's: :func:`_pipeline_time` ``alone``, its bubble being no computation)."""
    from pcourse.cost_model.machine import Link

    return dataclasses.replace(machine, links={k: Link(0.0, 0.0, 0.0) for k in machine.links},
                               meeting={})


def _memory(strategy: str, p: int, spec: Spec) -> list[Any]:
    from pcourse.cost_model import memory

    shape = spec.shape()
    if strategy in ("gpipe", "1f1b"):
        return [memory.pipeline_memory(shape, p, r, spec.micro, strategy) for r in range(p)]
    if strategy.startswith("ddp"):
        policy = {"ddp-full": "full", "ddp-selective": "selective"}.get(strategy, "none")
        one = memory.dp_memory(shape, p, policy=policy)
    elif strategy.startswith("zero"):
        one = memory.zero_memory(shape, p, int(strategy[-1]))
    elif strategy.startswith("fsdp"):
        one = memory.fsdp_memory(shape, p, int(strategy != "fsdp"))
    else:
        one = memory.tp_memory(shape, p, strategy == "sp")
    return [one] * p


@functools.lru_cache(maxsize=64)
def _counted(strategy: str, p: int, rank: int, spec: Spec) -> dict[str, Any]:
    """Counts per phase of this rank's step, the strategy built on a stand-in group
    (counted once per configuration: the counts depend on nothing measured)."""
    import torch

    from pcourse.cost_model.counting import count_ops
    from pcourse.tools.bench import strategies

    shape = spec.shape()
    group = strategies.Absent(rank, p)
    x = torch.randn(shape.seq, shape.batch, shape.d)
    run = strategies.build(strategy, group, shape, strategies.local_input(strategy, group, x),
                           micro=spec.micro, bucket_cap=spec.bucket_cap)
    run.step()  # a first step: the optimizer's state exists, as in every later step
    group.calls.clear()
    counts, result = {}, None
    for name, phase in run.phases:
        counts[name], result = count_ops(lambda: phase(result))  # noqa: B023
    return counts


def phases(strategy: str, p: int, spec: Spec, machine: Any, repeats: int = 5
           ) -> list[tuple[str, float, float]]:
    """Where a step's computation goes: per phase, (name, predicted seconds, measured
    seconds), rank 0's phases run one by one in this process on a stand-in group, one
    thread (the median of ``repeats``): a miss located by the clock, phase by phase."""
    import time

    import torch

    from pcourse.cost_model.counting import compute_time
    from pcourse.runtime.ranks import threads
    from pcourse.tools.bench import strategies

    counted = _counted(strategy, p, 0, spec)
    shape = spec.shape()
    group = strategies.Absent(0, p)
    x = torch.randn(shape.seq, shape.batch, shape.d)
    run = strategies.build(strategy, group, shape, strategies.local_input(strategy, group, x),
                           micro=spec.micro, bucket_cap=spec.bucket_cap)
    times: dict[str, list[float]] = {name: [] for name, _ in run.phases}
    with threads(1):
        run.step()
        for _ in range(repeats):
            result = None
            for name, phase in run.phases:
                start = time.perf_counter()
                result = phase(result)
                times[name].append(time.perf_counter() - start)
    return [(name, compute_time(counted[name], machine.stepping() if name == "optimizer"
                                else machine, 1), statistics.median(times[name]))
            for name, _ in run.phases]


def _work(strategy: str, p: int, spec: Spec, machine: Any) -> Any:
    from pcourse.cost_model.counting import compute_time
    from pcourse.cost_model.step_time import Work

    c = _counted(strategy, p, 0, spec)
    return Work(compute_time(c["forward"], machine, p),
                compute_time(c["backward"] + c["sync"], machine, p),
                compute_time(c["optimizer"], machine.stepping(), p))


def _time(strategy: str, p: int, spec: Spec, machine: Any) -> float:
    from pcourse.cost_model import memory, step_time
    from pcourse.step_model import bucket_bytes

    if strategy in ("gpipe", "1f1b"):
        return _pipeline_time(p, spec, machine)
    shape, s = spec.shape(), spec.shape().itemsize
    work, meet = _work(strategy, p, spec, machine), machine.meet(p)

    def link(kind: str) -> Any:
        return machine.link(spec.backend, kind, p)

    if strategy.startswith("ddp"):
        from pcourse.buckets import DEFAULT_CAP_BYTES

        cap = DEFAULT_CAP_BYTES if strategy == "ddp" else spec.bucket_cap
        sizes = bucket_bytes(memory.param_tensors(shape)[::-1], cap)
        return step_time.dp_step_time(work, sizes, link("allreduce"), meet=meet,
                                      overlap=step_time.PROGRESSES_ALONE[spec.backend])
    if strategy.startswith("zero"):
        sizes = [memory.padded(n, p) * s for n in memory.buckets(shape)]
        return step_time.zero_step_time(work, sizes, link("reduce_scatter"), link("all_gather"),
                                        meet=meet)
    if strategy.startswith("fsdp"):
        units = [memory.padded(shape.block_params(), p) * s] * shape.layers
        return step_time.fsdp_step_time(work, units, link("all_gather"), link("reduce_scatter"),
                                        meet=meet)
    if strategy == "tp":
        return step_time.tp_step_time(work, shape.layers, shape.unit(), link("allreduce"),
                                      meet=meet)
    return step_time.sp_step_time(work, shape.layers, shape.unit(), link("all_gather"),
                                  link("reduce_scatter"), link("allreduce"),
                                  [shape.d * s] * 6 * shape.layers, meet=meet)


def _pipeline_time(p: int, spec: Spec, machine: Any, alone: bool = False) -> float:
    """Per stage, one micro-batch's forward and backward counted on its own module;
    ``alone``: the busiest stage's own work, no bubble, no message (what it computes)."""
    from pcourse.cost_model.counting import compute_time
    from pcourse.cost_model.step_time import pipeline_step_time

    shape = spec.shape()
    stages = _stage_counts(p, spec)
    forward = [compute_time(f, machine, p) for f, _, _ in stages]
    backward = [compute_time(b, machine, p) for _, b, _ in stages]
    update = [compute_time(u, machine.stepping(), p) for _, _, u in stages]
    if alone:
        return max(spec.micro * (f + b) + u for f, b, u in zip(forward, backward, update,
                                                                  strict=True))
    return pipeline_step_time(forward, backward, spec.micro, machine.link(spec.backend, "send", p),
                              shape.unit(shape.batch // spec.micro), max(update),
                              meet=machine.meet(p))


@functools.lru_cache(maxsize=16)
def _stage_counts(p: int, spec: Spec) -> list[tuple[Any, Any, Any]]:
    """Per stage: one micro-batch's forward and backward, and the optimizer's step, counted."""
    import torch

    from pcourse.cost_model.counting import count_ops
    from pcourse.pipeline import split_model
    from pcourse.tools.bench import strategies

    shape = spec.shape()
    b = shape.batch // spec.micro
    out = []
    for r in range(p):
        module = strategies.BatchFirst(list(split_model(strategies.stack_blocks(shape), p, r)))
        x = torch.randn(b, shape.seq, shape.d, requires_grad=r > 0)

        def stage_forward() -> torch.Tensor:
            y = module(x)  # noqa: B023
            return strategies.loss_of(y) if r == p - 1 else y  # noqa: B023

        f, y = count_ops(stage_forward)
        grad = None if r == p - 1 else torch.ones_like(y)
        bw, _ = count_ops(lambda: y.backward(grad))  # noqa: B023
        out.append((f, bw, _stage_update(module)))
    return out


def _stage_update(module: Any) -> Any:
    """One AdamW step and zero_grad of a stage's parameters, counted."""
    import torch

    from pcourse.cost_model.counting import count_ops

    opt = torch.optim.AdamW(module.parameters())
    for q in module.parameters():
        q.grad = torch.zeros_like(q)
    opt.step()

    def update() -> None:
        opt.step()
        opt.zero_grad()

    return count_ops(update)[0]


# ------------------------------------------------------------------ measuring
def measure_ranks(comm: Any, spec: Spec, progress: jobs.Progress) -> None:
    """On p ranks: each strategy built and its memory profiled; then timed, in turns."""
    import torch

    from pcourse.backends import make_backend
    from pcourse.tools.bench import measured, strategies

    shape, p = spec.shape(), comm.size
    torch.manual_seed(1)
    x = torch.randn(shape.seq, shape.batch, shape.d)
    timing = spec.timed is None or p in spec.timed
    with make_backend(spec.backend, comm=comm) as group:
        runs, alone, memory = {}, {}, {}
        for s in spec.strategies:
            mine = strategies.local_input(s, group, x)
            runs[s], *memory[s] = measured.profiled(
                lambda: strategies.build(s, group, shape, mine, micro=spec.micro,  # noqa: B023
                                         bucket_cap=spec.bucket_cap), group.barrier)
            if not timing:
                runs.pop(s)  # its memory is what was wanted: let it go now
                progress.done(f"{s} at {p} ranks: memory", [])
                continue
            absent = strategies.Absent(comm.rank, p)  # the same step, no message sent
            alone[s] = strategies.build(s, absent, shape, strategies.local_input(s, absent, x),
                                        micro=spec.micro, bucket_cap=spec.bucket_cap)
            alone[s].step()
            progress.done(f"{s} at {p} ranks: memory", [])
        times: dict[str, list[float]] = {s: [] for s in spec.strategies}
        compute: dict[str, list[float]] = {s: [] for s in spec.strategies}
        for _ in range(spec.repeats if timing else 0):  # the strategies take turns: the
            for s in spec.strategies:  # machine's moods fall on all of them alike
                times[s] += measured.timed(runs[s].step, comm, 1)
                compute[s] += measured.timed(alone[s].step, comm, 1)
        every = comm.gather(memory)
    progress.done(f"{p} ranks: timed", [] if comm.rank else [
        {"strategy": s, "ranks": p, "rank": r, "rest": every[r][s][0], "peak": every[r][s][1],
         "when": every[r][s][2], **({"time": statistics.median(times[s]),
                                     "time_min": min(times[s]), "time_max": max(times[s]),
                                     "times": times[s], "compute": statistics.median(compute[s])}
                                    if timing else {"time": None})}
        for s in spec.strategies for r in range(p)])


def measure(comm: Any, spec: Spec, progress: jobs.Progress) -> None:
    spec.check(comm.size)
    progress.total = sum(len(spec.strategies) + 1 for _ in spec.ranks)
    with jobs.RankGroups(comm, spec.ranks) as groups:
        for p in spec.ranks:
            groups.run(p, lambda sub: measure_ranks(sub, spec, progress))


def run_on(view: Any, spec: Spec, *, progress: bool = True, timeout: float = 600.0
           ) -> list[dict]:
    """The measurements on a running cluster's engines (``mc.view``): one row per
    (strategy, ranks, rank)."""
    spec.check(jobs.cluster_size(view))
    return jobs.on_cluster(view, measure, spec, desc="predict, then measure", timeout=timeout,
                           progress=progress).rows


# ------------------------------------------------------------------ side by side
def side_by_side(predicted: Sequence[dict], measured: Sequence[dict]) -> list[dict]:
    """Predictions joined with the measurements, each with its errors."""
    from pcourse.cost_model.compare import error

    got = {(m["strategy"], m["ranks"], m["rank"]): m for m in measured}
    rows = []
    for pr in predicted:
        m = got[(pr["strategy"], pr["ranks"], pr["rank"])]
        rows.append({**pr, **m, "peak_error": error(pr["peak_predicted"], m["peak"]),
                     "time_error": None if m["time"] is None else
                     error(pr["time_predicted"], m["time"])})
    return rows


def bars(rows: Sequence[dict]) -> dict[str, Any]:
    """The lesson's bars over ``side_by_side`` rows: memory on every rank; time over the
    configurations (one each), τ over the pairs their timed repeats decide."""
    from pcourse.cost_model.compare import summary

    configs = [r for r in rows if r["rank"] == 0 and r["time"] is not None]
    times = summary([r["time_predicted"] for r in configs], [r["time"] for r in configs],
                    [r["times"] for r in configs])
    worst_peak = max(abs(r["peak_error"]) for r in rows)
    return {"worst_peak": worst_peak, "peaks_met": worst_peak <= MEMORY_BAR, **times,
            "ranked": times["pairs"] >= times["n"] - 1,  # the fewest that can chain n in order
            "times_met": (times["median"] <= MEDIAN_BAR and times["worst"] <= WORST_BAR
                          and times["pairs"] >= times["n"] - 1 and times["tau"] >= TAU_BAR)}


def bar_lines(b: dict[str, Any], peaks: int) -> list[str]:
    """The bars, one sentence each, saying which are within and which beyond."""
    def said(ok: bool) -> str:
        return "within it" if ok else "beyond it"

    return [f"memory: the worst of {peaks} peaks (every rank of every configuration) is "
            f"{b['worst_peak']:.1%} from its prediction; the bar, every one within "
            f"{MEMORY_BAR:.0%}: {said(b['peaks_met'])}",
            f"time over {b['n']} configurations: median |error| {b['median']:.0%} (bar "
            f"{MEDIAN_BAR:.0%}: {said(b['median'] <= MEDIAN_BAR)}), worst {b['worst']:.0%} "
            f"(bar {WORST_BAR:.0%}: {said(b['worst'] <= WORST_BAR)}), "
            + (f"Kendall's tau {b['tau']:.2f} over the {b['pairs']} of {b['all']} pairs the "
               f"repeats decide (bar {TAU_BAR}: {said(b['tau'] >= TAU_BAR)})" if b["ranked"]
               else f"Kendall's tau: the repeats decide {b['pairs']} of {b['all']} pairs, fewer "
                    f"than the {b['n'] - 1} that can put {b['n']} configurations in an order: "
                    f"no ranking to judge (bar {TAU_BAR}: not met)")
            + f"; over every pair's medians, decided or not, {b['tau_medians']:.2f}"]


def print_predictions(rows: Sequence[dict]) -> None:
    """The predictions alone, before anything runs."""
    print(f"{'strategy':14} {'p':>2} {'rank':>4} {'at rest MB':>10} {'peak MB':>8} "
          f"{'step ms':>8}  peak when")
    for r in rows:
        said = "not timed" if r["time_predicted"] is None else f"{r['time_predicted'] * 1e3:.1f}"
        print(f"{r['strategy']:14} {r['ranks']:>2} {r['rank']:>4} "
              f"{r['rest_predicted'] / 1e6:>10.2f} {r['peak_predicted'] / 1e6:>8.2f} "
              f"{said:>8}  {r['when_predicted']}")


def print_side_by_side(rows: Sequence[dict]) -> None:
    print(f"{'strategy':14} {'p':>2} {'rank':>4} {'peak MB pred':>12} {'measured':>9} "
          f"{'error':>7}   {'step ms pred':>12} {'measured':>9} {'error':>7}")
    for r in rows:
        t = (f"{r['time_predicted'] * 1e3:>12.1f} {r['time'] * 1e3:>9.1f} "
             f"{r['time_error']:>+7.0%}") if r["rank"] == 0 and r["time"] is not None else (
            f"{'not timed':>12}" if r["rank"] == 0 else "")
        print(f"{r['strategy']:14} {r['ranks']:>2} {r['rank']:>4} "
              f"{r['peak_predicted'] / 1e6:>12.2f} {r['peak'] / 1e6:>9.2f} "
              f"{r['peak_error']:>+7.1%}   {t}")


def report(predicted: Sequence[dict], measured: Sequence[dict], out: str) -> list[dict]:
    from pcourse.utils.io import save, write_csv

    rows = side_by_side(predicted, measured)
    print_side_by_side(rows)
    for line in bar_lines(bars(rows), len(rows)):
        print(line)
    print(f"wrote {save(out, lambda path: write_csv(path, rows, FIELDS))}")
    return rows


# ------------------------------------------------------------------ the command line
def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m pcourse.tools.bench.predict",
                                description=__doc__.split("\n")[0])
    p.add_argument("--ranks", nargs="+", type=jobs.whole(1), default=[2, 3])
    p.add_argument("--strategies", nargs="+", default=list(STRATEGIES))
    p.add_argument("--micro", type=int, default=4, help="micro-batches of the pipelines")
    p.add_argument("--repeats", type=jobs.whole(2), default=None)
    p.add_argument("--quick", action="store_true", help="a smaller model, fewer repeats")
    p.add_argument("--calibration", default=str(Path("results") / "calibration.json"),
                   help="the constants (python -m pcourse.tools.bench.calibrate)")
    p.add_argument("--out", default=str(Path("results") / "predict.csv"))
    p.add_argument("--timeout", type=jobs.seconds, default=900.0)
    p.add_argument("--oversubscribe", action="store_true")
    return p


def main(argv: list[str] | None = None) -> int:
    from pcourse.cost_model.machine import CostModelError, NotCalibrated, load
    from pcourse.utils.io import check_writable

    argv = list(sys.argv[1:] if argv is None else argv)
    args = parser().parse_args(argv)
    base = Spec.quick() if args.quick else Spec()
    spec = dataclasses.replace(base, ranks=tuple(sorted(set(args.ranks))),
                               strategies=tuple(args.strategies), micro=args.micro,
                               repeats=args.repeats or base.repeats)
    predicted = []  # the launcher's predictions: a rank of the user's own mpiexec has none

    def prepare() -> str:
        spec.check()
        predicted.extend(predict(spec, load(args.calibration)))
        note = jobs.check_ranks(spec.ranks, args.oversubscribe)
        check_writable(args.out, "file")
        print("predicted, before anything runs:")
        print_predictions(predicted)
        return note

    def reported(outcome: jobs.Outcome) -> None:
        if predicted:
            print("\npredicted beside measured:")
            report(predicted, outcome.rows, args.out)

    return jobs.run_command(
        "pcourse.tools.bench.predict", argv, measure, spec, reported, ranks=max(spec.ranks),
        timeout=args.timeout, prepare=prepare, error=parser().error,
        refused=(CostModelError, NotCalibrated), what="runs", env={"OMP_NUM_THREADS": "1"})


if __name__ == "__main__":
    sys.exit(main())
