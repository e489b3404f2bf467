"""The scaling benchmark: training time per backend and rank count, as the source reports it.

Every backend at every rank count, several repeats, one CSV row per run: how long
the epochs took, the losses (the same at every rank count in strong scaling), the
time per update and the samples per second, and where the rest of the run's time
went (backend set-up, data and model, optimizer, evaluation). The summary table
and the plot judge strong scaling by training time against the ideal T1/p, and
weak scaling, where the global batch grows with the ranks and so each run makes
fewer updates, by throughput against the ideal p × the one-rank throughput.

Two front doors, one measurement (:func:`measure`):

- on the lesson's running cluster: ``run_on(mc.view, "franke", config, ...)``;
- from a terminal: ``python -m pcourse.tools.bench franke|mnist [options]`` starts one
  MPI job for the largest rank count, prints a breakdown of the job's time
  (start-up, imports, set-up, training, exit) next to the training time, and
  writes the CSV, the plot (and for MNIST pictures of reconstructions and a walk
  through the latent space) under ``--out``.

Repeats are rounds over all configurations, not back-to-back runs of one: a
machine that slows down part-way slows every configuration alike. Before its first
timed run, each (backend, ranks) trains a few untimed updates (:func:`warm_up`), so
that no configuration's time carries the first run's one-off costs.

Every row says which device its backend trained on (``device``: on a CUDA machine the
MPI and NCCL backends train on the GPU, Gloo on the CPU). The summary table shows it,
and says so when its backends ran on different devices: their times then compare
devices as well as libraries.
"""

from __future__ import annotations

import argparse
import dataclasses
import shutil
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pcourse.backends import BACKENDS
from pcourse.tools.bench import jobs
from pcourse.tools.bench.flops import print_limits
from pcourse.tools.bench.jobs import BenchError, Outcome
from pcourse.utils.io import check_writable, save, write_csv
from pcourse.workloads.config import (
    CONFIGS,
    FrankeConfig,
    MNISTConfig,
    WorkloadConfig,
    batch_sizes,
)

CPU_BACKENDS = ("mpi", "mpi-pickle", "gloo")
FIELDS = ["workload", "backend", "device", "ranks", "repeat", "scaling", "epochs", "global_batch",
          "local_batch", "steps_per_epoch", "train_time", "total_time", "wall_time",
          "final_loss", "test_loss", "max_deviation",
          "samples_per_epoch", "time_per_step", "samples_per_s",
          "backend_time", "data_time", "optimizer_time", "eval_time", "close_time",
          "threads", "flops_per_sample", "matmul_flops"]


@dataclass(frozen=True)
class ScalingSpec:
    """What to run: one workload and configuration, every backend × rank count, repeated."""

    workload: str
    config: WorkloadConfig
    backends: tuple[str, ...] = CPU_BACKENDS
    ranks: tuple[int, ...] = (1, 2)
    repeats: int = 1
    save_model: str | None = None  # rank 0 of each MNIST run saves its weights here

    def plan(self) -> list[tuple[str, int, int]]:
        """(backend, ranks, repeat) in the order they run: rounds over all configurations."""
        return [(b, p, r) for r in range(self.repeats) for b in self.backends for p in self.ranks]


# ---- measuring: every rank -------------------------------------------------------------


def skip_reason(backend: str, ranks: int) -> str:
    """Why this machine cannot run ``backend`` at ``ranks`` ("" if it can)."""
    from pcourse.backends import too_few_gpus, unavailable_reason

    return unavailable_reason(backend) or too_few_gpus(backend, ranks)


def measure(comm: Any, spec: ScalingSpec, progress: jobs.Progress) -> None:
    """Every runnable (backend, ranks, repeat) of ``spec`` on ``comm``; rows to ``progress``.

    Rank 0 decides what this machine can run and tells the others, so that every
    rank walks the same plan.
    """
    configs = dict.fromkeys((b, p) for b, p, _ in spec.plan())
    skips = {key: skip_reason(*key) for key in configs} if comm.rank == 0 else None
    skips = comm.bcast(skips, root=0)
    for (backend, ranks), reason in skips.items():
        if reason:
            progress.note(f"skip {backend} at {ranks} rank(s): {reason}")
    plan = [(b, p, r) for b, p, r in spec.plan() if not skips[b, p]]
    if not plan:
        raise BenchError("no configuration can run on this machine (see the skip reasons)")
    progress.total = len(plan)
    warm = set()
    with jobs.RankGroups(comm, [p for _, p, _ in plan]) as groups:
        # The lambdas bind the loop's values as defaults; mypy cannot infer such a lambda
        # as the one-argument callable it is (hence the ignores).
        for backend, ranks, repeat in plan:
            if (backend, ranks) not in warm:  # before its first timed run, untimed
                warm.add((backend, ranks))
                groups.run(ranks, lambda sub, b=backend, p=ranks: (  # type: ignore[misc]
                    warm_up(sub, spec, b, p)))
            row = groups.run(ranks, lambda sub, b=backend, r=repeat: (  # type: ignore[misc]
                run_once(sub, spec, b, r)))
            if row is not None:
                progress.done(f"{backend:>10} ×{ranks} run {repeat + 1}/{spec.repeats}: "
                              f"train {row['train_time']:.2f} s, wall {row['wall_time']:.2f} s, "
                              f"loss {row['final_loss']:.4g}", [row])


WARMUP_STEPS = 4  # updates of the untimed warm-up run before a configuration is timed


def warm_up(comm: Any, spec: ScalingSpec, backend_name: str, ranks: int) -> None:
    """An untimed run of a few updates, the same code path as the timed runs.

    The first run of a configuration pays for what later ones find ready (the
    backend's connections, the allocator's pools, the math library's kernels for
    these shapes, the data in the page cache): timed, it would make the first
    configuration look slow. Every run builds its data, model and optimiser afresh
    from the seeds, so the timed runs' results do not depend on this one.
    """
    run_once(comm, dataclasses.replace(spec, config=warm_up_config(spec.config, ranks),
                                       save_model=None), backend_name, -1)


def warm_up_config(config: WorkloadConfig, ranks: int) -> WorkloadConfig:
    """``config`` cut to one epoch of :data:`WARMUP_STEPS` updates at ``ranks`` ranks."""
    per_update = config.batch_size * (ranks if config.scaling == "weak" else 1)
    n = WARMUP_STEPS * per_update
    if isinstance(config, FrankeConfig):
        return dataclasses.replace(config, epochs=1, n_points=min(config.n_points, n),
                                   n_test=min(config.n_test, per_update))
    return dataclasses.replace(config, epochs=1, limit=min(config.limit or n, n))


def run_once(comm: Any, spec: ScalingSpec, backend_name: str, repeat: int) -> dict:
    """Train once on ``comm`` with one backend; the result row (rank 0's clock).

    Each phase of the run is timed: backend set-up, data and model, optimizer
    the epochs, evaluation, closing the backend.
    """
    from pcourse.backends import make_backend
    from pcourse.loop import train
    from pcourse.partition import samples_per_rank
    from pcourse.workloads import make_workload

    phases: dict[str, float] = {}
    start = lap = time.perf_counter()

    def tick(name: str) -> None:
        nonlocal lap
        now = time.perf_counter()
        phases[name] = phases.get(name, 0.0) + now - lap
        lap = now

    backend = make_backend(backend_name, comm=comm)
    tick("backend_time")
    try:
        wl = make_workload(spec.workload, spec.config, backend.device)
        tick("data_time")
        wl = dataclasses.replace(wl, make_optimizer=_timed(wl.make_optimizer, phases,
                                                           "optimizer_time"),
                                 evaluate=_timed(wl.evaluate, phases, "eval_time"))
        result = train(wl, backend, spec.config, progress=False)
        lap = time.perf_counter()
        if spec.save_model and comm.rank == 0:
            _save_model(result.model, spec.save_model)
    finally:
        backend.close()
    tick("close_time")
    row = {**result.summary(), "repeat": repeat, **phases}
    steps = row["epochs"] * row["steps_per_epoch"]
    row["samples_per_epoch"] = samples_per_rank(wl.n_train, comm.size) * comm.size
    row["time_per_step"] = row["train_time"] / steps
    row["samples_per_s"] = row["epochs"] * row["samples_per_epoch"] / row["train_time"]
    row["wall_time"] = time.perf_counter() - start
    row["threads"] = _threads(spec)
    if repeat == 0:  # once per configuration, after the clocks stopped
        row.update(compute_limit(comm, wl, result.model, row["threads"]))
    return row


def _threads(spec: ScalingSpec) -> int:
    """Torch threads per rank in training: the config's, else the rank's (init_rank's share)."""
    import torch

    return spec.config.threads or torch.get_num_threads()


def compute_limit(comm: Any, wl: Any, model: Any, threads: int) -> dict:
    """FLOPs per training sample, and every rank's matmul rate at ``threads``, summed."""
    from pcourse.runtime.ranks import threads as using
    from pcourse.tools.bench.flops import flops_per_sample, matmul_rate

    per_sample = flops_per_sample(wl, model)
    comm.Barrier()  # all ranks multiply at once: they share the cores as in training
    with using(threads):
        rate = matmul_rate(device=wl.device)
    return {"flops_per_sample": per_sample, "matmul_flops": comm.allreduce(rate)}


def _timed(fn: Any, phases: dict[str, float], name: str) -> Any:
    if fn is None:
        return None

    def timed(*args: Any) -> Any:
        start = time.perf_counter()
        try:
            return fn(*args)
        finally:
            phases[name] = phases.get(name, 0.0) + time.perf_counter() - start

    return timed


def _save_model(model: Any, path: str) -> None:
    import torch

    from pcourse.utils.io import atomic_write

    with atomic_write(path, "wb") as f:
        torch.save(model.state_dict(), f)


# ---- front door 1: the lesson's engines ------------------------------------------------


def run_on(view: Any, workload: str, config: WorkloadConfig | None = None, *,
           backends: tuple[str, ...] | list[str] = CPU_BACKENDS,
           ranks: tuple[int, ...] | list[int] | None = None, repeats: int = 1,
           save_model: str | None = None, progress: bool = True,
           timeout: float = 600.0) -> list[dict]:
    """The benchmark on a running cluster's engines (``mc.view``); the rows, one per run.

    ``config`` defaults to the workload's full configuration; ``ranks`` to every
    power of two up to the engine count (a run on fewer ranks uses the first
    engines while the others wait). ``timeout`` is per run. Skipped configurations
    are printed with the reason.
    """
    world = jobs.cluster_size(view)
    ranks = tuple(ranks or [p for p in (1, 2, 4, 8, 16, 32, 64) if p <= world])
    spec = ScalingSpec(workload, config or CONFIGS[workload](), tuple(backends), ranks,
                       repeats, save_model)
    _check(spec, world)
    outcome = jobs.on_cluster(view, measure, spec, desc=f"{workload} scaling",
                              timeout=timeout * len(spec.plan()) + 60, progress=progress)
    return outcome.rows


# ---- reading the rows ---------------------------------------------------------------------


def aggregate(rows: list[dict]) -> list[dict]:
    """Per (backend, ranks): mean and std of the training time and wall time, time per
    update, samples per second, and the speed-up and efficiency over one rank.

    Speed-up is T1/Tp in strong scaling (every rank count makes the same updates)
    and the ratio of samples per second in weak scaling (more ranks, a larger global
    batch, fewer updates: total time would flatter it). Efficiency is speed-up / p.
    """
    groups: dict[tuple[str, int], list[dict]] = {}
    for row in rows:
        groups.setdefault((row["backend"], row["ranks"]), []).append(row)
    table = []
    for (backend, ranks), runs in sorted(groups.items()):
        times = [r["train_time"] for r in runs]
        walls = [r["wall_time"] for r in runs]
        table.append({"backend": backend, "ranks": ranks, "runs": len(runs),
                      "device": _device(runs),
                      "scaling": runs[-1]["scaling"],
                      "mean": statistics.fmean(times), "std": _std(times),
                      "wall": statistics.fmean(walls), "wall_std": _std(walls),
                      "per_step": statistics.fmean(float(r["time_per_step"]) for r in runs),
                      "throughput": statistics.fmean(float(r["samples_per_s"]) for r in runs),
                      "loss": runs[-1]["final_loss"],
                      "threads": runs[-1].get("threads", ""),
                      **_first(runs, "flops_per_sample", "matmul_flops")})
    base = {t["backend"]: t for t in table if t["ranks"] == 1}
    for t in table:
        one = base.get(t["backend"])
        if one is None:
            t["speedup"] = float("nan")
        elif t["scaling"] == "weak":
            t["speedup"] = t["throughput"] / one["throughput"]
        else:
            t["speedup"] = one["mean"] / t["mean"]
        t["efficiency"] = t["speedup"] / t["ranks"]
    return table


def _device(runs: list[dict]) -> str:
    """The device type a configuration's runs trained on ("cpu", "cuda"; "?" for rows
    that do not say); a comma-separated list if its runs disagree."""
    kinds = dict.fromkeys(str(r.get("device") or "?").split(":")[0] for r in runs)
    return ",".join(kinds)


def mixed_devices(table: list[dict]) -> str:
    """A sentence naming each backend's device when the table's backends ran on more
    than one kind of device; "" when they all ran on one."""
    by_backend = {t["backend"]: t["device"] for t in table}
    if len(set(by_backend.values())) < 2:
        return ""
    where = ", ".join(f"{b} on {d}" for b, d in by_backend.items())
    return (f"the backends ran on different devices ({where}): their times compare the "
            "devices as well as the backends")


def _first(runs: list[dict], *keys: str) -> dict:
    """Each key's first value among the runs (measured once per configuration), as float."""
    return {k: next((float(r[k]) for r in runs if r.get(k) not in (None, "")), None)
            for k in keys}


def _std(values: list[float]) -> float:
    return statistics.stdev(values) if len(values) > 1 else 0.0


def print_table(table: list[dict]) -> None:
    """The summary, one line per (backend, ranks), and a note if devices are mixed."""
    print(f"{'backend':>10} {'device':>6} {'ranks':>5} {'train s (mean ± std)':>22} "
          f"{'ms/update':>9} {'samples/s':>10} {'speed-up':>8} {'effic.':>6} "
          f"{'wall s (mean ± std)':>21} {'final loss':>11}")
    for t in table:
        print(f"{t['backend']:>10} {t['device']:>6} {t['ranks']:>5} "
              f"{t['mean']:>12.3f} ± {t['std']:<7.3f} "
              f"{t['per_step'] * 1e3:>9.3f} {t['throughput']:>10.0f} {t['speedup']:>8.2f} "
              f"{t['efficiency']:>6.2f} {t['wall']:>11.2f} ± {t['wall_std']:<7.2f} "
              f"{t['loss']:>11.4g}")
    mixed = mixed_devices(table)
    if mixed:
        print(f"note: {mixed}")


def plot(table: list[dict], title: str, path: str | Path | None = None) -> Any:
    """Strong scaling: training time against ranks; weak: samples per second. Each
    backend's ideal (from its one-rank run) is the dashed line of its colour."""
    from pcourse.utils.io import savefig_atomic
    from pcourse.utils.show import new_figure  # shows once in a notebook, leaks none

    weak = any(t["scaling"] == "weak" for t in table)
    fig = new_figure(figsize=(6, 4))
    ax = fig.subplots()
    mixed = bool(mixed_devices(table))
    for i, backend in enumerate(dict.fromkeys(t["backend"] for t in table)):
        pts = [t for t in table if t["backend"] == backend]
        ranks = [t["ranks"] for t in pts]
        label = f"{backend} ({pts[0]['device']})" if mixed else backend
        if weak:
            ax.plot(ranks, [t["throughput"] for t in pts], "o-", color=f"C{i}", label=label)
        else:
            ax.errorbar(ranks, [t["mean"] for t in pts], yerr=[t["std"] for t in pts],
                        marker="o", capsize=3, color=f"C{i}", label=label)
        one = next((t for t in pts if t["ranks"] == 1), None)
        if one is not None:
            ideal = [one["throughput"] * p if weak else one["mean"] / p for p in ranks]
            ax.plot(ranks, ideal, "--", lw=1, color=f"C{i}", alpha=0.7)
    ax.set_xlabel("ranks")
    ax.set_ylabel("samples per second (dashed: ideal)" if weak
                  else "training time (s), mean ± std (dashed: ideal)")
    ax.set_xticks(sorted({t["ranks"] for t in table}))
    ax.set_title(title)
    ax.legend()
    fig.tight_layout()
    if path is not None:
        savefig_atomic(fig, path, dpi=120)
    return fig


# ---- front door 2: the command line ------------------------------------------------------


_positive = jobs.whole(1)
MAX_POINTS = 10_000_000  # training points: a thousand times the source's, far past a laptop
MAX_RANKS = 1024


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m pcourse.tools.bench",
                                description=__doc__.split("\n")[0])
    p.add_argument("workload", choices=["franke", "mnist"],
                   help="(python -m pcourse.tools.bench steps|comm: the other benchmarks)")
    p.add_argument("--backends", nargs="+", choices=BACKENDS, default=list(CPU_BACKENDS))
    p.add_argument("--ranks", nargs="+", type=jobs.whole(1, MAX_RANKS), default=[1, 2, 4])
    p.add_argument("--repeats", type=_positive, default=3)
    p.add_argument("--epochs", type=_positive, help="default: the configuration's")
    p.add_argument("--scaling", choices=["strong", "weak"], help="franke: strong, mnist: weak")
    p.add_argument("--batch-size", type=_positive, help="global (strong) or per rank (weak)")
    p.add_argument("--points", type=jobs.whole(1, MAX_POINTS, " (the source uses 10,000)"),
                   help="training samples (points, images)")
    p.add_argument("--quick", action="store_true", help="small data, few epochs (tests, notebooks)")
    p.add_argument("--out", default="results", help="folder for the CSV and pictures")
    p.add_argument("--timeout", type=jobs.seconds, default=600.0,
                   help="seconds per run; the MPI job gets this times the number of runs")
    p.add_argument("--oversubscribe", action="store_true",
                   help="run even with far more ranks than this machine has cores")
    p.add_argument("--save-model", help=argparse.SUPPRESS)
    return p


def build_config(args: argparse.Namespace) -> WorkloadConfig:
    """The workload's configuration with the command line's overrides applied."""
    config_class = CONFIGS[args.workload]
    config = config_class.quick() if args.quick else config_class()
    changes = {"epochs": args.epochs, "scaling": args.scaling, "batch_size": args.batch_size}
    if args.points is not None:
        changes["n_points" if args.workload == "franke" else "limit"] = args.points
    return dataclasses.replace(config, **{k: v for k, v in changes.items() if v is not None})


def spec_from(args: argparse.Namespace) -> ScalingSpec:
    return ScalingSpec(args.workload, build_config(args), tuple(args.backends),
                       tuple(args.ranks), args.repeats, args.save_model)


def n_samples(spec: ScalingSpec) -> int:
    """Training samples; for MNIST the files are read and checked (without torch)."""
    if spec.workload == "franke":
        assert isinstance(spec.config, FrankeConfig)  # build_config made the workload's own
        return spec.config.n_points
    from pcourse.workloads.mnist import read_mnist

    assert isinstance(spec.config, MNISTConfig)

    images, _ = read_mnist(spec.config.split, spec.config.data_dir, limit=spec.config.limit)
    return len(images)


def _check(spec: ScalingSpec, world: int | None = None) -> None:
    """The configuration can run at every rank count (before anything starts)."""
    if world is not None and max(spec.ranks) > world:
        raise BenchError(f"ranks {max(spec.ranks)} asked for, but the cluster has {world} "
                         "engine(s): start it with more, or ask for fewer ranks")
    try:
        n = n_samples(spec)
        for ranks in spec.ranks:
            local, global_ = batch_sizes(spec.config.scaling, spec.config.batch_size, ranks, n)
            if global_ > n:
                raise ValueError(
                    f"--batch-size {spec.config.batch_size}: a step at {ranks} rank(s) would "
                    f"take {global_} samples, more than the {n} there are; use a batch of at "
                    f"most {n if spec.config.scaling == 'strong' else n // ranks}")
    except (ValueError, RuntimeError, OSError) as exc:  # and MNISTError
        raise BenchError(str(exc)) from None


def main(argv: list[str] | None = None) -> int:
    entered = time.perf_counter()
    argv = list(sys.argv[1:] if argv is None else argv)
    p = parser()
    args = p.parse_args(argv)
    spec = spec_from(args)
    inner, made, before = list(argv), [], {}  # the ranks' arguments, a folder, the launcher's time

    def prepare() -> str:
        nonlocal spec
        note = jobs.check_ranks(args.ranks, args.oversubscribe)
        _check(spec)
        check_writable(args.out)
        if args.workload == "mnist":  # the last run's weights, for the pictures
            made.append(tempfile.mkdtemp(prefix="pcourse-bench-"))
            inner.extend(["--save-model", str(Path(made[0]) / "model.pt")])
            spec = dataclasses.replace(spec, save_model=inner[-1])
        before["launcher: before the job"] = time.perf_counter() - entered
        return note

    def reported(outcome: Outcome) -> None:
        outcome.phases.update(before)  # the launcher's; a rank reports without it
        report(args, spec, outcome)

    try:
        return jobs.run_command(
            "pcourse.tools.bench.scaling", inner, measure, spec, reported, ranks=max(args.ranks),
            timeout=args.timeout * len(spec.plan()) + 120, prepare=prepare, error=p.error,
            partial=Path(args.out) / f"{args.workload}_{spec.config.scaling}.partial.csv",
            write=lambda path, rows: write_csv(path, rows, FIELDS))
    finally:
        for folder in made:
            shutil.rmtree(folder, ignore_errors=True)


def report(args: argparse.Namespace, spec: ScalingSpec, outcome: Outcome) -> None:
    """Write the CSV (first: nothing measured is lost), the plot (with two rank counts
    or more) and pictures; print the summary table and where the time went."""
    started = time.perf_counter()
    rows, scaling = outcome.rows, spec.config.scaling
    stem = Path(args.out) / f"{args.workload}_{scaling}"
    written = [save(stem.with_suffix(".csv"), lambda path: write_csv(path, rows, FIELDS))]
    table = aggregate(rows)
    print_table(table)
    print_limits(table)
    title = f"{args.workload}, {scaling} scaling, {spec.config.epochs} epochs"
    try:
        if len({t["ranks"] for t in table}) > 1:
            plot(table, title, stem.with_suffix(".png"))
            written.append(stem.with_suffix(".png"))
        else:  # a plot against ranks with one rank count has nothing to show
            print("one rank count: no plot against ranks")
        if args.workload == "mnist" and spec.save_model:
            assert isinstance(spec.config, MNISTConfig)  # build_config made the workload's own
            written += mnist_pictures(args.out, spec.config, spec.save_model)
    except (OSError, ValueError, RuntimeError) as exc:  # the CSV is safe; say what failed
        print(f"the pictures could not be drawn or written: {exc}", file=sys.stderr)
    if outcome.phases:
        outcome.phases["launcher: CSV, plot, pictures"] = time.perf_counter() - started
        print_phases(outcome.phases, rows)
        written.append(save(stem.parent / f"{stem.name}_phases.csv",
                                 lambda path: write_phases(path, outcome.phases, rows)))
    print("wrote " + ", ".join(str(w) for w in written))


RUN_PHASES = {"backend_time": "backend set-up", "data_time": "data and model",
              "optimizer_time": "optimizer",
              "train_time": "training: the epochs",
              "sync_time": "broadcast, consistency check",
              "eval_time": "evaluation", "close_time": "backend close"}


def phase_table(phases: dict[str, float], rows: list[dict]) -> list[tuple[str, float]]:
    """(phase, seconds) in time order: the job's start-up, each run's phases summed over
    the runs, the exit; then the totals a reader compares."""
    sums = dict.fromkeys(RUN_PHASES, 0.0)
    for r in rows:
        for key in RUN_PHASES:
            sums[key] += r["total_time"] - r["train_time"] if key == "sync_time" else r[key]
    table = [(k, v) for k, v in phases.items() if k.startswith(("start", "import", "MPI"))]
    table += [(f"runs: {label}", sums[key]) for key, label in RUN_PHASES.items()]
    if "measuring" in phases:
        table.append(("between runs: planning, waiting for the other ranks",
                      phases["measuring"] - sum(r["wall_time"] for r in rows)))
    table += [(k, v) for k, v in phases.items() if k.startswith("exit")]
    if "rank job" in phases:
        job = phases["rank job"]
        table += [("rank job, mpiexec start to exit", job),
                  ("rank job: training", sums["train_time"]),
                  ("rank job: everything but training", job - sums["train_time"])]
    return table + [(k, v) for k, v in phases.items() if k.startswith("launcher")]


def print_phases(phases: dict[str, float], rows: list[dict]) -> None:
    print(f"\nwhere the time went (rank 0, seconds; run phases summed over {len(rows)} run(s))")
    for name, seconds in phase_table(phases, rows):
        print(f"  {name:<58} {seconds:>8.3f}")


def write_phases(path: Path, phases: dict[str, float], rows: list[dict]) -> Path:
    return write_csv(path, [{"phase": k, "seconds": v} for k, v in phase_table(phases, rows)],
                     ["phase", "seconds"])


def mnist_pictures(out: str, config: MNISTConfig, model_file: str) -> list[Path]:
    import torch

    from pcourse.utils.io import savefig_atomic
    from pcourse.workloads.mnist import load_mnist
    from pcourse.workloads.vae import latent_walk_figure, make_model, reconstruction_figure

    model = make_model(config.latent, config.seed).to(getattr(torch, config.dtype))
    model.load_state_dict(torch.load(model_file, map_location="cpu"))
    images, _ = load_mnist("test", config.data_dir, limit=10)
    images = images.to(getattr(torch, config.dtype))
    return [savefig_atomic(reconstruction_figure(model, images),
                           Path(out) / "mnist_reconstructions.png", dpi=120),
            savefig_atomic(latent_walk_figure(model), Path(out) / "mnist_latent_walk.png",
                           dpi=120)]


if __name__ == "__main__":
    sys.exit(main())
