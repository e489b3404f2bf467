"""The scaling benchmark: ``python -m pcourse.bench franke|mnist [options]``.

Reproduces the source's results section in one command: every backend at every
rank count, several repeats, each configuration launched as its own MPI job (so a
run starts cold, as the source's scripts did). It writes one CSV row per run, a
plot of training time against ranks (one line per backend, mean ± std) and a
summary table with the speed-up over one rank. The MNIST run also saves pictures
of reconstructions and of a walk through the latent space.


Nothing is written until every run has finished: an error part-way leaves no
partial CSV behind.
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from pcourse.backends import BACKENDS, unavailable_reason
from pcourse.cluster.rankinfo import launcher
from pcourse.utils.io import savefig_atomic, write_csv

CPU_BACKENDS = ["mpi", "mpi-pickle", "gloo"]
FIELDS = ["workload", "backend", "ranks", "repeat", "scaling", "epochs", "global_batch",
          "local_batch", "steps_per_epoch", "train_time", "total_time", "wall_time",
          "final_loss", "test_loss", "max_deviation"]


class BenchError(RuntimeError):
    """A configuration cannot run, or a run failed; the message says which and why."""


def _positive(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m pcourse.bench", description=__doc__.split("\n")[0])
    p.add_argument("workload", choices=["franke", "mnist"],
                   help="(python -m pcourse.bench steps|comm: the other benchmarks)")
    p.add_argument("--backends", nargs="+", choices=BACKENDS, default=CPU_BACKENDS)
    p.add_argument("--ranks", nargs="+", type=_positive, default=[1, 2, 4])
    p.add_argument("--repeats", type=_positive, default=3)
    p.add_argument("--epochs", type=_positive, help="default: the configuration's")
    p.add_argument("--scaling", choices=["strong", "weak"], help="franke: strong, mnist: weak")
    p.add_argument("--batch-size", type=_positive, help="global (strong) or per rank (weak)")
    p.add_argument("--points", type=_positive, help="training samples (points, images)")
    p.add_argument("--quick", action="store_true", help="small data, few epochs (tests, notebooks)")
    p.add_argument("--out", default="results", help="folder for the CSV and pictures")
    p.add_argument("--timeout", type=float, default=600.0, help="seconds per MPI launch")
    p.add_argument("--inner", action="store_true", help=argparse.SUPPRESS)  # one MPI run
    p.add_argument("--backend", help=argparse.SUPPRESS)
    p.add_argument("--save-model", help=argparse.SUPPRESS)
    return p


def build_config(args: argparse.Namespace) -> Any:
    """The workload's configuration with the command line's overrides applied."""
    if args.workload == "franke":
        from pcourse.workloads.franke import FrankeConfig as config_class
    else:
        from pcourse.workloads.vae import MNISTConfig as config_class
    config = config_class.quick() if args.quick else config_class()
    changes = {"epochs": args.epochs, "scaling": args.scaling, "batch_size": args.batch_size}
    if args.points is not None:
        changes["n_points" if args.workload == "franke" else "limit"] = args.points
    return dataclasses.replace(config, **{k: v for k, v in changes.items() if v is not None})


def n_samples(args: argparse.Namespace, config: Any) -> int:
    """Training samples, checking the MNIST files here (once) before any rank starts."""
    if args.workload == "franke":
        return config.n_points
    from pcourse.workloads.mnist import load_mnist

    images, _ = load_mnist(config.split, config.data_dir, limit=config.limit)
    return len(images)


def validate(args: argparse.Namespace, config: Any) -> None:
    from pcourse.loop import batch_sizes

    n = n_samples(args, config)
    for ranks in args.ranks:
        batch_sizes(config.scaling, config.batch_size, ranks, n)  # raises with the reason


def skip_reason(backend: str, ranks: int) -> str:
    reason = unavailable_reason(backend)
    if not reason and backend.startswith("nccl"):
        from pcourse.cluster.rankinfo import gpu_count

        if ranks > gpu_count():
            reason = f"NCCL needs one GPU per rank: {ranks} ranks, {gpu_count()} GPU(s)"
    return reason


def inner(args: argparse.Namespace) -> None:
    """One MPI job: train once with ``args.backend``; rank 0 reports the result row."""
    from pcourse.backends import make_backend
    from pcourse.cluster.launch import report_rows
    from pcourse.cluster.rankinfo import init_rank
    from pcourse.loop import train

    init_rank()
    with make_backend(args.backend) as backend:
        result = train(args.workload, backend, build_config(args), progress=False)
        if backend.rank == 0:
            if args.save_model:
                import torch

                torch.save(result.model.state_dict(), args.save_model)
            report_rows([result.summary()])


def launch(args: argparse.Namespace, backend: str, ranks: int, save_model: Path | None) -> dict:
    """Run one configuration as its own MPI job; return its result row."""
    from pcourse.cluster.launch import MPIJobError, mpirun_rows

    inner_args = ["-m", "pcourse.bench.scaling", *args.argv, "--inner", "--backend", backend]
    if save_model is not None:
        inner_args += ["--save-model", str(save_model)]
    start = time.perf_counter()
    try:
        rows, _ = mpirun_rows(ranks, inner_args, timeout=args.timeout)
    except MPIJobError as exc:
        raise BenchError(f"{backend} at {ranks} rank(s) failed: {exc}") from exc
    return {**rows[0], "wall_time": time.perf_counter() - start}


def run_all(args: argparse.Namespace, model_file: Path) -> list[dict]:
    """Every runnable configuration, ``args.repeats`` times.

    Repeats are rounds over all configurations, not back-to-back runs of one: a
    machine that slows down part-way then slows every configuration alike, and
    the ratios between them stay honest.
    """
    plan = []
    for backend, ranks in [(b, n) for b in args.backends for n in args.ranks]:
        reason = skip_reason(backend, ranks)
        if reason:
            print(f"skip {backend} at {ranks} rank(s): {reason}", flush=True)
        else:
            plan.append((backend, ranks))
    if not plan:
        raise BenchError("no configuration can run on this machine (see the skip reasons)")
    rows = []
    for repeat in range(args.repeats):
        for backend, ranks in plan:
            save = model_file if args.workload == "mnist" else None
            row = launch(args, backend, ranks, save)
            rows.append({**row, "repeat": repeat})
            print(f"{backend:>10} ×{ranks} run {repeat + 1}/{args.repeats}: "
                  f"train {row['train_time']:.2f} s, wall {row['wall_time']:.2f} s, "
                  f"loss {row['final_loss']:.4g}", flush=True)
    return rows


def aggregate(rows: list[dict]) -> list[dict]:
    """Mean and std per (backend, ranks), and the speed-up over the same backend at 1 rank."""
    groups: dict[tuple[str, int], list[dict]] = {}
    for row in rows:
        groups.setdefault((row["backend"], row["ranks"]), []).append(row)
    table = []
    for (backend, ranks), runs in sorted(groups.items()):
        times = [r["train_time"] for r in runs]
        walls = [r["wall_time"] for r in runs]
        table.append({"backend": backend, "ranks": ranks, "runs": len(runs),
                      "mean": statistics.fmean(times), "std": _std(times),
                      "wall": statistics.fmean(walls), "wall_std": _std(walls),
                      "loss": runs[-1]["final_loss"]})
    base = {t["backend"]: t["mean"] for t in table if t["ranks"] == 1}
    for t in table:
        t["speedup"] = base[t["backend"]] / t["mean"] if t["backend"] in base else float("nan")
    return table


def _std(values: list[float]) -> float:
    return statistics.stdev(values) if len(values) > 1 else 0.0


def print_table(table: list[dict]) -> None:
    print(f"{'backend':>10} {'ranks':>5} {'train s (mean ± std)':>22} {'speed-up':>8} "
          f"{'wall s (mean ± std)':>21} {'final loss':>11}")
    for t in table:
        print(f"{t['backend']:>10} {t['ranks']:>5} {t['mean']:>12.3f} ± {t['std']:<7.3f} "
              f"{t['speedup']:>8.2f} {t['wall']:>11.2f} ± {t['wall_std']:<7.2f} {t['loss']:>11.4g}")


def plot(table: list[dict], title: str, path: Path) -> Path:
    from matplotlib.figure import Figure

    fig = Figure(figsize=(6, 4))
    ax = fig.subplots()
    for backend in dict.fromkeys(t["backend"] for t in table):
        pts = [t for t in table if t["backend"] == backend]
        ax.errorbar([t["ranks"] for t in pts], [t["mean"] for t in pts],
                    yerr=[t["std"] for t in pts], marker="o", capsize=3, label=backend)
    ax.set_xlabel("ranks")
    ax.set_ylabel("training time (s), mean ± std")
    ax.set_xticks(sorted({t["ranks"] for t in table}))
    ax.set_title(title)
    ax.legend()
    fig.tight_layout()
    return savefig_atomic(fig, path, dpi=120)


def mnist_pictures(args: argparse.Namespace, config: Any, model_file: Path) -> list[Path]:
    import torch

    from pcourse.workloads.mnist import load_mnist
    from pcourse.workloads.vae import latent_walk_figure, make_model, reconstruction_figure

    model = make_model(config.latent, config.seed).to(getattr(torch, config.dtype))
    model.load_state_dict(torch.load(model_file, map_location="cpu"))
    images, _ = load_mnist("test", config.data_dir, limit=10)
    out = Path(args.out)
    paths = [savefig_atomic(reconstruction_figure(model, images.to(getattr(torch, config.dtype))),
                            out / "mnist_reconstructions.png", dpi=120),
             savefig_atomic(latent_walk_figure(model), out / "mnist_latent_walk.png", dpi=120)]
    return paths


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    p = parser()
    args = p.parse_args(argv)
    args.argv = argv  # what the inner runs repeat
    config = build_config(args)
    if launcher() == "mpi":  # a rank of the job that launch() started
        inner(args)
        return 0
    with tempfile.TemporaryDirectory(prefix="pcourse-bench-") as tmp:
        model_file = Path(tmp) / "model.pt"  # the last MNIST run's weights, for the pictures
        try:
            validate(args, config)
            rows = run_all(args, model_file)
        except (ValueError, RuntimeError, OSError) as exc:  # BenchError, MNISTError, MPIJobError
            p.exit(2, f"error: {exc}\nNo results were written.\n")
        return report(args, config, rows, model_file)


def report(args: argparse.Namespace, config: Any, rows: list[dict], model_file: Path) -> int:
    """Write the CSV and the pictures, print the summary table."""
    stem = Path(args.out) / f"{args.workload}_{config.scaling}"
    write_csv(stem.with_suffix(".csv"), rows, FIELDS)
    table = aggregate(rows)
    title = f"{args.workload}, {config.scaling} scaling, {config.epochs} epochs"
    plot(table, title, stem.with_suffix(".png"))
    print_table(table)
    written = [stem.with_suffix(".csv"), stem.with_suffix(".png")]
    if args.workload == "mnist":
        written += mnist_pictures(args, config, model_file)
    print("wrote " + ", ".join(str(p) for p in written))
    return 0


if __name__ == "__main__":
    sys.exit(main())
