"""OSU-style allreduce benchmark: why the algorithm, and the path to the wire, matter.

``python -m pcourse.bench.comm`` times an in-place float32 allreduce from 4 bytes to
64 MiB with every method the course builds: MPI's native ``Allreduce`` on a buffer,
the source's pickle-based ``allreduce``, the from-scratch tree, ring and recursive
doubling (:mod:`pcourse.collectives`), Gloo, and NCCL where a GPU exists. For each
it reports latency, algorithm bandwidth (bytes / time) and bus bandwidth
(algbw · 2(p-1)/p, as nccl-tests defines it: what each link carries, so it is
comparable across rank counts), the speed relative to MPI native, and the fitted
alpha-beta model. Run plainly, it launches itself under ``mpiexec`` once per
``--ranks`` value; run under ``mpiexec`` it measures that job alone.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from pcourse import collectives
from pcourse.bench.commreport import report

METHODS = ("mpi", "mpi-pickle", "tree", "ring", "recursive-doubling", "gloo", "nccl",
           "nccl-cupy")
MiB = 1 << 20


def _size(text: str) -> int:
    """'64M', '4K', '1024' -> bytes."""
    units = {"K": 1 << 10, "M": MiB, "G": 1 << 30}
    scale = units.get(text[-1:].upper(), 1)
    try:
        return int(float(text[:-1] if scale > 1 else text) * scale)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"not a size in bytes: {text!r} (e.g. 4096, 64M)") from None


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="python -m pcourse.bench.comm", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--ranks", type=int, nargs="+", default=None,
                    help="rank counts to launch, one mpiexec each (default: 2 4; quick: 2)")
    ap.add_argument("--min-bytes", type=_size, default=4)
    ap.add_argument("--max-bytes", type=_size, default=None, help="default 64M (quick: 64K)")
    ap.add_argument("--factor", type=int, default=None, help="size step (default 2; quick: 4)")
    ap.add_argument("--methods", nargs="+", default=list(METHODS), choices=METHODS)
    ap.add_argument("--warmup", type=int, default=None, help="untimed calls per point")
    ap.add_argument("--target-time", type=float, default=0.2,
                    help="seconds of timed calls per (method, size); sets the iterations")
    ap.add_argument("--min-iters", type=int, default=None)
    ap.add_argument("--max-iters", type=int, default=1000)
    ap.add_argument("--quick", action="store_true", help="smoke test: seconds, not minutes")
    ap.add_argument("--timeout", type=float, default=900.0, help="seconds per mpiexec launch")
    ap.add_argument("--out", type=Path, default=Path("results/commbench.csv"))
    ap.add_argument("--plot", type=Path, default=None, help="default: --out with .png")
    ap.add_argument("--inner", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    quick = args.quick
    for name, normal, smoke in [("ranks", [2, 4], [2]), ("max_bytes", 64 * MiB, 64 << 10),
                                ("factor", 2, 4), ("warmup", 1, 1), ("min_iters", 2, 1)]:
        if getattr(args, name) is None:
            setattr(args, name, smoke if quick else normal)
    if quick:
        args.max_iters = min(args.max_iters, 2)
    _validate(ap, args)
    args.plot = args.plot or args.out.with_suffix(".png")
    return args


def _validate(ap: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Refuse bad input before anything runs or is written."""
    bad = [n for n in args.ranks if n < 2]
    if bad:
        ap.error(f"--ranks: an allreduce needs at least 2 ranks to communicate, got {bad}")
    if not args.inner:  # only the launcher cares; ranks need not import the cluster code
        from pcourse.cluster.launch import max_engines

        if max(args.ranks) > max_engines():
            ap.error(f"--ranks: {max(args.ranks)} ranks is far beyond this machine "
                     f"({os.cpu_count()} cores; at most {max_engines()} here)")
    if not 4 <= args.min_bytes <= args.max_bytes:
        ap.error(f"need 4 <= --min-bytes <= --max-bytes, got {args.min_bytes}, "
                 f"{args.max_bytes} (sizes are in bytes of float32 data)")
    if args.factor < 2 or args.warmup < 0 or not 1 <= args.min_iters <= args.max_iters:
        ap.error("need --factor >= 2, --warmup >= 0 and 1 <= --min-iters <= --max-iters")
    if args.out.suffix != ".csv":
        ap.error(f"--out must name a .csv file, got {args.out}")


def sizes(min_bytes: int, max_bytes: int, factor: int) -> list[int]:
    """Message sizes in bytes, whole float32 elements, growing geometrically."""
    out, n = [], min_bytes - min_bytes % 4 or 4
    while n <= max_bytes:
        out.append(n)
        n *= factor
    return out


# ---- measuring: runs on every rank -------------------------------------------------


def _open_backends(comm: Any, methods: Sequence[str], say: Callable[[str], None]) -> dict:
    """Create the torch-level backends that can run here; skip the others, saying why."""
    from pcourse.backends import BackendUnavailable, make_backend, unavailable_reason

    backends = {}
    for name in methods:
        if name in ("gloo", "nccl", "nccl-cupy"):
            reason = unavailable_reason(name)
            try:
                backends[name] = None if reason else make_backend(name)
            except BackendUnavailable as exc:
                reason = str(exc)
            if reason:
                say(f"skip {name}: {reason}")
    return backends


def _call(name: str, comm: Any, x: np.ndarray, backend: Any) -> Callable[[], Any]:
    """One in-place sum-allreduce of ``x`` by method ``name``, as a callable to time."""
    from mpi4py import MPI

    if name == "mpi":
        return lambda: comm.Allreduce(MPI.IN_PLACE, x, op=MPI.SUM)
    if name == "mpi-pickle":  # the source's way: pickle, reduce in Python, copy back
        return lambda: np.copyto(x, comm.allreduce(x, op=MPI.SUM))
    if name in collectives.ALGORITHMS:  # same size everywhere: skip the length check
        fn = getattr(collectives, name.replace("-", "_") + "_allreduce")
        return lambda: fn(x, "sum", comm=comm, check=False)
    import torch

    tensor = torch.from_numpy(x).to(backend.device)
    if backend.device.type == "cuda":  # time the work, not the launch
        return lambda: (backend.allreduce(tensor, check=False), torch.cuda.synchronize())
    return lambda: backend.allreduce(tensor, check=False)


def time_call(comm: Any, fn: Callable[[], Any], warmup: int, iters: int) -> np.ndarray:
    """Seconds of each timed call on the slowest rank, barriers around the loop.

    The mean of these is the latency OSU and nccl-tests report; their median shows
    how much of it was the machine being busy with something else.
    """
    from mpi4py import MPI

    for _ in range(warmup):
        fn()
    times = np.empty(iters)
    comm.Barrier()
    for i in range(iters):
        start = time.perf_counter()
        fn()
        times[i] = time.perf_counter() - start
    comm.Barrier()
    comm.Allreduce(MPI.IN_PLACE, times, op=MPI.MAX)
    return times


def _iterations(comm: Any, fn: Callable[[], Any], args: argparse.Namespace) -> int:
    """Enough calls for ~target-time seconds; every rank must agree on the count.

    So a 4-byte point gets hundreds of calls and a 64 MiB pickle a couple: the run
    stays within minutes and every point gets about the same share of it.
    """
    once = time_call(comm, fn, args.warmup, 1)[0]
    return int(np.clip(args.target_time / max(once, 1e-9), args.min_iters, args.max_iters))


def measure(comm: Any, args: argparse.Namespace, say: Callable[[str], None]) -> list[dict]:
    """All (size, method) points on this job; every rank returns the same rows.

    Methods take turns at each size, so background noise falls on all of them alike.
    """
    backends = _open_backends(comm, args.methods, say)
    methods = [m for m in args.methods if backends.get(m, True) is not None]
    p, rows = comm.size, []
    try:
        for nbytes in sizes(args.min_bytes, args.max_bytes, args.factor):
            x = np.zeros(nbytes // 4, dtype=np.float32)  # zeros never overflow
            for name in methods:
                fn = _call(name, comm, x, backends.get(name))
                iters = _iterations(comm, fn, args)
                t = time_call(comm, fn, 0, iters)
                rows.append({"ranks": p, "method": name, "bytes": nbytes, "iterations": iters,
                             "seconds": t.mean(), "median_us": np.median(t) * 1e6})
    finally:
        for backend in backends.values():
            if backend is not None:
                backend.close()
    return rows


def run_inner(args: argparse.Namespace) -> list[dict]:
    """Measure on this MPI job; rank 0 returns the rows, the others an empty list."""
    from mpi4py import MPI

    comm = MPI.COMM_WORLD
    say = print if comm.rank == 0 else (lambda _msg: None)
    start = time.perf_counter()
    rows = measure(comm, args, say)
    say(f"{comm.size} ranks: {len(rows)} points in {time.perf_counter() - start:.0f} s")
    return rows if comm.rank == 0 else []


# ---- launching and reporting: one process -------------------------------------------


def _inner_argv(args: argparse.Namespace) -> list[str]:
    argv = ["-m", "pcourse.bench.comm", "--inner", "--out", str(args.out)]
    for opt in ("min_bytes", "max_bytes", "factor", "warmup", "target_time", "min_iters",
                "max_iters"):
        argv += [f"--{opt.replace('_', '-')}", str(getattr(args, opt))]
    return argv + ["--methods", *args.methods]


def launch(args: argparse.Namespace) -> list[dict]:
    """One mpiexec per rank count, each with a deadline; collect rank 0's rows."""
    from pcourse.cluster.launch import mpirun_rows

    rows: list[dict] = []
    for p in args.ranks:
        print(f"launching {p} ranks ...", flush=True)
        found, output = mpirun_rows(p, _inner_argv(args), timeout=args.timeout)
        print(output.strip())
        rows += found
    return rows


def main(argv: Sequence[str] | None = None) -> int:
    from pcourse.cluster.launch import MPIJobError, report_rows
    from pcourse.cluster.rankinfo import launcher

    args = parse_args(argv)
    if launcher() == "mpi":
        rows = run_inner(args)  # a rank of a job that `launch` or the user's mpiexec started
        if rows and not report_rows(rows):
            report(rows, args.out, args.plot)
        return 0
    try:
        rows = launch(args)
    except MPIJobError as exc:  # nothing is written: no half-finished results
        print(f"commbench: a benchmark job failed, no results written.\n{exc}", file=sys.stderr)
        return 1
    report(rows, args.out, args.plot)
    return 0


if __name__ == "__main__":
    sys.exit(main())
