"""Per-step time of every gradient-averaging strategy, side by side with torch DDP.

``python -m pcourse.bench.steps --ranks 2 4`` (or ``python -m pcourse.bench steps ...``)
times one training step (forward, backward, gradient averaging, optimizer step) of
the same model on the same data, for:

===================  ==========  ==============================================
path                 backend     what averages the gradients
===================  ==========  ==============================================
no averaging         (none)      nothing: the compute-only floor
per-param pickle     mpi-pickle  the source: one pickled allreduce per parameter
per-param buffer     mpi         one in-place ``Allreduce`` per parameter
bucketed             gloo/nccl   BucketedAllreduce(overlap=False)
bucketed+overlap     gloo/nccl   BucketedAllreduce(overlap=True)
bucketed+overlap     mpi         the same over MPI ``Iallreduce``
DDP                  gloo/nccl   torch DistributedDataParallel
===================  ==========  ==============================================

Both bucketed paths and DDP use 25 MB buckets and keep gradients as views into
the buckets (DDP: ``gradient_as_bucket_view=True``), and every path zeroes with
``zero_grad(set_to_none=False)`` as the course's training loop does. The per-param
paths call ``average_gradients(..., check=False)``: the strategy, without the
course's shape check (two more small allreduces a step). DDP also puts
its first 1 MB in a bucket of its own (to start communicating early); ours does not.

Each step is timed on every rank; a step's time is the slowest rank's, and the
table shows the median over the steps after a warm-up. The paths take turns in
rounds, so a noisy neighbour slows all of them alike. Compare ratios within one
run: absolute times vary from run to run.
"""

from __future__ import annotations

import argparse
import copy
import sys
import time
from collections.abc import Callable
from typing import Any

import torch

from pcourse.cluster.launch import report_rows
from pcourse.cluster.rankinfo import launcher
from pcourse.utils.io import write_csv
from pcourse.workloads.base import Workload

FIELDS = ["workload", "ranks", "path", "backend", "local_batch", "params",
          "median_ms", "p25_ms", "p75_ms", "steps", "ratio_to_ddp"]
Step = Callable[[int], None]  # runs training step number i


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m pcourse.bench.steps",
                                description=__doc__.split("\n")[0])
    p.add_argument("--ranks", nargs="+", type=int, default=[2, 4])
    p.add_argument("--workloads", nargs="+", choices=["franke", "mnist"],
                   default=["franke", "mnist"])
    p.add_argument("--steps", type=int, default=20, help="timed steps per path and round")
    p.add_argument("--rounds", type=int, default=6, help="turns each path takes")
    p.add_argument("--warmup", type=int, default=5, help="untimed steps per path first")
    p.add_argument("--quick", action="store_true", help="2 ranks, few steps: a smoke test")
    p.add_argument("--out", default="results/steps.csv", help="the CSV to write")
    p.add_argument("--timeout", type=float, default=900.0, help="seconds per MPI launch")
    p.add_argument("--inner", action="store_true", help=argparse.SUPPRESS)
    return p


# -- the workloads: the course's own, so the step is the training loop's step ----------

def workload_config(name: str) -> Any:
    """Franke: the source's global batch of 256, split over the ranks (strong).
    MNIST: the 10,000-image test split, 128 images per rank (weak, as the source)."""
    from pcourse.workloads.franke import FrankeConfig
    from pcourse.workloads.vae import MNISTConfig

    return FrankeConfig() if name == "franke" else MNISTConfig(split="test")


def mnist_missing() -> str:
    """Why the MNIST workload cannot run here ("" if it can); checked before launching."""
    from pcourse.workloads.mnist import MNISTError, load_mnist

    try:
        load_mnist("test")
    except (MNISTError, OSError) as exc:
        return str(exc)
    return ""


# -- the paths: each returns its own model copy wrapped for one strategy ------------------

def make_step(path: str, wl: Workload, batches: list[torch.Tensor], backends: dict) -> Step:
    """One training step of a private copy of ``wl.model``, averaged the way ``path`` says."""
    from pcourse.buckets import BucketedAllreduce
    from pcourse.data_parallel import average_gradients

    model = copy.deepcopy(wl.model)
    net, after = model, (lambda: None)
    kind, _, backend_name = path.partition("@")
    backend = backends.get(backend_name)
    if kind == "per-param pickle" or kind == "per-param buffer":
        def after() -> None:
            average_gradients(model, backend, check=False)  # the strategy, not the safety net
    elif kind.startswith("bucketed"):
        reducer = BucketedAllreduce(model, backend, 25, overlap=kind.endswith("overlap"))
        after = reducer.finish
    elif kind == "DDP":
        from torch.nn.parallel import DistributedDataParallel as DDP

        ids = [backend.device.index] if backend.device.type == "cuda" else None
        net = DDP(model, device_ids=ids, bucket_cap_mb=25, gradient_as_bucket_view=True)
    opt, _ = wl.make_optimizer(model)

    def step(i: int) -> None:  # as pcourse.loop's loop: mean over my share, averaged
        idx = batches[i % len(batches)]
        opt.zero_grad(set_to_none=False)
        (wl.loss_sum(net, idx, 0) / len(idx)).backward()
        after()
        opt.step()

    return step


def paths(main_backend: str) -> list[str]:
    """Every strategy, as "kind@backend"; "no averaging" is the compute-only floor."""
    return ["no averaging@-", "per-param pickle@mpi-pickle", "per-param buffer@mpi",
            f"bucketed@{main_backend}", f"bucketed+overlap@{main_backend}",
            "bucketed+overlap@mpi", f"DDP@{main_backend}"]


def time_paths(steps: dict[str, Step], args: argparse.Namespace, device: torch.device) -> dict:
    """Per-step seconds (the slowest rank's) of every path; paths take turns in rounds."""
    import numpy as np
    from mpi4py import MPI

    def timed(step: Step, i: int) -> float:
        t0 = time.perf_counter()
        step(i)
        if device.type == "cuda":
            torch.cuda.synchronize()
        return time.perf_counter() - t0

    for step in steps.values():
        for i in range(args.warmup):
            step(i)
    times: dict[str, list[float]] = {p: [] for p in steps}
    for _ in range(args.rounds):
        for path, step in steps.items():
            MPI.COMM_WORLD.Barrier()
            times[path] += [timed(step, i) for i in range(args.steps)]
    slowest = {}
    for path, mine in times.items():
        arr = np.asarray(mine)
        MPI.COMM_WORLD.Allreduce(MPI.IN_PLACE, arr, op=MPI.MAX)
        slowest[path] = arr
    return slowest


def inner(args: argparse.Namespace) -> list[dict]:
    """One MPI job: time every path on every workload; rank 0 returns the rows."""
    import numpy as np

    from pcourse.backends import make_backend
    from pcourse.cluster.rankinfo import init_rank
    from pcourse.loop import batch_sizes
    from pcourse.workloads import make_workload

    info = init_rank()
    device = torch.device(info.device)
    main_backend = "nccl" if device.type == "cuda" else "gloo"
    names = {p.partition("@")[2] for p in paths(main_backend)} - {"-"}
    backends = {name: make_backend(name) for name in sorted(names)}
    rows = []
    try:
        for workload in args.workloads:
            config = workload_config(workload)
            wl = make_workload(workload, config, device)
            local, _ = batch_sizes(config.scaling, config.batch_size, info.size, wl.n_train)
            gen = torch.Generator().manual_seed(100 + info.rank)
            batches = [torch.randint(0, wl.n_train, (local,), generator=gen).to(device)
                       for _ in range(16)]
            steps = {p: make_step(p, wl, batches, backends) for p in paths(main_backend)}
            params = sum(p.numel() for p in wl.model.parameters())
            for path, secs in time_paths(steps, args, device).items():
                kind, _, backend = path.partition("@")
                ms = np.percentile(secs * 1e3, [25, 50, 75])
                rows.append({"workload": workload, "ranks": info.size, "path": kind,
                             "backend": backend, "local_batch": local, "steps": len(secs),
                             "params": params,
                             "p25_ms": ms[0], "median_ms": ms[1], "p75_ms": ms[2]})
            del steps  # DDP and the reducers hold hooks and buffers: free before the next
    finally:
        close_together(backends)
    return rows if info.rank == 0 else []


def close_together(backends: dict) -> None:
    """Barrier, close, barrier: a rank that exits while a peer still tears down its
    Gloo connections can make that peer abort after all the work is done."""
    import gc

    from mpi4py import MPI

    gc.collect()  # DDP wrappers and reducers still hold the process group
    MPI.COMM_WORLD.Barrier()
    for backend in backends.values():
        backend.close()
    MPI.COMM_WORLD.Barrier()


def with_ratios(rows: list[dict]) -> list[dict]:
    """Add each row's per-step time divided by DDP's for the same workload and ranks."""
    ddp = {(r["workload"], r["ranks"]): r["median_ms"] for r in rows if r["path"] == "DDP"}
    for r in rows:
        base = ddp.get((r["workload"], r["ranks"]))
        r["ratio_to_ddp"] = round(r["median_ms"] / base, 3) if base else ""
    return rows


def print_table(rows: list[dict]) -> None:
    print(f"{'workload':<8} {'ranks':>5}  {'path':<18} {'backend':<10} "
          f"{'median ms':>9} {'p25-p75 ms':>15} {'÷ DDP':>6}")
    for r in rows:
        spread = f"{r['p25_ms']:.2f}-{r['p75_ms']:.2f}"
        ratio = f"{r['ratio_to_ddp']:.2f}" if r["ratio_to_ddp"] != "" else "-"
        print(f"{r['workload']:<8} {r['ranks']:>5}  {r['path']:<18} {r['backend']:<10} "
              f"{r['median_ms']:>9.2f} {spread:>15} {ratio:>6}")


def report(rows: list[dict], out: str) -> None:
    rows = with_ratios(rows)
    print_table(rows)
    print(f"wrote {write_csv(out, rows, FIELDS)}")


def outer(args: argparse.Namespace, argv: list[str]) -> int:
    """Launch one MPI job per rank count, then print and write the table."""
    from pcourse.cluster.launch import MPIJobError, mpirun_rows

    if "mnist" in args.workloads and (reason := mnist_missing()):
        print(f"skip mnist: {reason}", flush=True)
        args.workloads = [w for w in args.workloads if w != "mnist"]
        if not args.workloads:
            print("error: no workload can run here; no results written", file=sys.stderr)
            return 1
        argv = [*argv, "--workloads", *args.workloads]
    rows: list[dict] = []
    for ranks in args.ranks:
        try:
            found, _ = mpirun_rows(ranks, ["-m", "pcourse.bench.steps", *argv, "--inner"],
                                   timeout=args.timeout, env={"OMP_NUM_THREADS": "1"})
        except MPIJobError as exc:
            print(f"error: the step benchmark at {ranks} ranks failed: {exc}", file=sys.stderr)
            return 1
        rows += found
    report(rows, args.out)
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parser().parse_args(argv)
    if args.quick:
        args.ranks, args.steps, args.rounds, args.warmup = [2], 3, 1, 1
    if min(args.ranks) < 1 or min(args.steps, args.rounds) < 1 or args.warmup < 0:
        parser().error("--ranks, --steps and --rounds must be at least 1, --warmup at least 0")
    batch = workload_config("franke").batch_size
    if "franke" in args.workloads and any(batch % r for r in args.ranks):
        parser().error(f"--ranks: Franke's global batch of {batch} must split evenly over the "
                       f"ranks; use rank counts that divide {batch} (1, 2, 4, 8, ...)")
    if launcher() == "mpi":
        rows = inner(args)  # launched by outer, or by the user's own mpiexec
        if rows and not report_rows(rows):
            report(rows, args.out)
        return 0
    return outer(args, argv)


if __name__ == "__main__":
    sys.exit(main())
