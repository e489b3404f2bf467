"""OSU-style allreduce benchmark: why the algorithm, and the path to the wire, matter.

It times an in-place float32 sum-allreduce from 4 bytes to 64 MiB with every
method the course builds: MPI's native ``Allreduce`` on a buffer, the source's
pickle-based ``comm.allreduce`` (the ``mpi-pickle`` backend: mpi4py's own call on a
torch tensor, copied back, as the source's code does it), the from-scratch tree,
ring and recursive doubling (:mod:`pcourse.collectives`), Gloo, and NCCL where a
GPU exists. For each it reports latency (the median call, with the spread between the quartiles),
algorithm bandwidth (bytes / time) and bus bandwidth (algbw · 2(p-1)/p, as
nccl-tests defines it: what each link carries, so it is comparable across rank
counts), the speed relative to MPI native, and the fitted alpha-beta model.

Every (method, size) is warmed up before it is timed (the first calls pay for
connections and buffers, not for latency), and gets about the same share of
the run: many calls for a small message, a few for a large one. Methods take
turns at each size, so background noise falls on all of them alike.

Two front doors, one measurement (:func:`measure`): on the lesson's running
cluster, ``run_on(mc.view, CommSpec.quick())``; from a terminal,
``python -m pcourse.tools.bench comm --ranks 2 4`` (one MPI job; each rank count runs on
the job's first ranks).
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from pcourse import collectives
from pcourse.timing import time_call
from pcourse.tools.bench import jobs
from pcourse.tools.bench.commreport import FIELDS, add_rates, human, report
from pcourse.utils.io import check_writable, write_csv

METHODS = ("mpi", "mpi-pickle", "tree", "ring", "recursive-doubling", "gloo", "nccl",
           "nccl-cupy")
MiB = 1 << 20


@dataclass(frozen=True)
class CommSpec:
    """What to measure. ``CommSpec()`` is the full sweep, ``quick()`` a lesson's quick
    mode (seconds), ``smoke()`` the tests' (every method and a few sizes, barely timed)."""

    ranks: tuple[int, ...] = (2, 4)
    min_bytes: int = 4
    max_bytes: int = 64 * MiB
    factor: int = 2
    methods: tuple[str, ...] = METHODS
    warmup: int = 3  # untimed calls per (method, size) before its timed calls
    target_time: float = 0.2  # seconds of timed calls per (method, size)
    min_iters: int = 5
    max_iters: int = 1000

    @classmethod
    def quick(cls, **changes: Any) -> CommSpec:
        """2 ranks, 4 B to 4 MiB in factors of 4, a few hundredths of a second per point."""
        base = cls(ranks=(2,), max_bytes=4 * MiB, factor=4, target_time=0.02, max_iters=200)
        return dataclasses.replace(base, **changes)

    @classmethod
    def smoke(cls, **changes: Any) -> CommSpec:
        """2 ranks, 4 B to 64 KiB, one or two calls a point: checks that everything runs."""
        base = cls(ranks=(2,), max_bytes=64 << 10, factor=4, warmup=1, target_time=0.0,
                   min_iters=1, max_iters=2)
        return dataclasses.replace(base, **changes)

    def sizes(self) -> list[int]:
        return sizes(self.min_bytes, self.max_bytes, self.factor)

    def check(self, world: int | None = None) -> None:
        """Refuse what cannot run, before anything runs or is written."""
        bad = [n for n in self.ranks if n < 2]
        if bad:
            raise jobs.BenchError(
                f"ranks: an allreduce needs at least 2 ranks to communicate, got {bad}: at 1 "
                "rank every method returns its input without a message, so its time would "
                "measure no communication. On a one-GPU machine, `make gpu-check` runs the "
                "NCCL backends at 1 rank, which checks their plumbing, not a reduction")
        if world is not None and max(self.ranks) > world:
            raise jobs.BenchError(f"ranks {max(self.ranks)} asked for, but the cluster has "
                                  f"{world} engine(s)")
        if not 4 <= self.min_bytes <= self.max_bytes:
            raise jobs.BenchError(f"need 4 <= --min-bytes <= --max-bytes, got {self.min_bytes}, "
                                  f"{self.max_bytes} (sizes are in bytes of float32 data)")
        if self.factor < 2 or self.warmup < 0 or not 1 <= self.min_iters <= self.max_iters:
            raise jobs.BenchError("need --factor >= 2, --warmup >= 0 and "
                                  "1 <= --min-iters <= --max-iters")
        unknown = set(self.methods) - set(METHODS)
        if unknown:
            raise jobs.BenchError(f"unknown method(s) {sorted(unknown)}; choose from {METHODS}")


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
        if name in ("mpi-pickle", "gloo", "nccl", "nccl-cupy"):
            reason = unavailable_reason(name)
            try:
                backends[name] = None if reason else make_backend(name, comm=comm)
            except BackendUnavailable as exc:
                reason = str(exc)
            if reason:
                say(f"skip {name} at {comm.size} ranks: {reason}")
    return backends


def _call(name: str, comm: Any, x: np.ndarray, backend: Any) -> Callable[[], Any]:
    """One in-place sum-allreduce of ``x`` by method ``name``, as a callable to time."""
    from mpi4py import MPI

    if name == "mpi":
        return lambda: comm.Allreduce(MPI.IN_PLACE, x, op=MPI.SUM)
    if name in collectives.ALGORITHMS:  # same size everywhere: skip the length check
        fn = getattr(collectives, name.replace("-", "_") + "_allreduce")
        return lambda: fn(x, "sum", comm=comm, check=False)
    import torch

    tensor = torch.from_numpy(x).to(backend.device)
    if backend.device.type == "cuda":  # time the work, not the launch
        def synced() -> None:
            backend.allreduce(tensor, check=False)
            torch.cuda.synchronize()

        return synced
    return lambda: backend.allreduce(tensor, check=False)


def time_point(comm: Any, fn: Callable[[], Any], spec: CommSpec) -> np.ndarray:
    """Warm up, then time enough calls for about ``spec.target_time`` seconds.

    The warm-up calls are timed too, to choose the count: every rank agrees on it
    (the times are the slowest rank's), and a cold first call does not count.
    """
    warm = time_call(comm, fn, 0, max(spec.warmup, 2))
    once = float(np.median(warm[1:]))
    iters = int(np.clip(spec.target_time / max(once, 1e-9), spec.min_iters, spec.max_iters))
    return time_call(comm, fn, 0, iters)


def sweep(comm: Any, spec: CommSpec, progress: jobs.Progress) -> None:
    """All (size, method) points on this communicator; rows to ``progress`` size by size."""
    backends = _open_backends(comm, spec.methods, progress.note)
    methods = [m for m in spec.methods if backends.get(m, True) is not None]
    try:
        for nbytes in spec.sizes():
            x = np.zeros(nbytes // 4, dtype=np.float32)  # zeros never overflow
            rows = []
            for name in methods:
                t = time_point(comm, _call(name, comm, x, backends.get(name)), spec)
                q25, q50, q75 = np.percentile(t, [25, 50, 75]) * 1e6
                rows.append({"ranks": comm.size, "method": name, "bytes": nbytes,
                             "iterations": len(t), "seconds": q50 * 1e-6, "median_us": q50,
                             "p25_us": q25, "p75_us": q75, "mean_us": t.mean() * 1e6})
            progress.done(f"{comm.size} ranks, {human(nbytes)}", rows)
    finally:
        for backend in backends.values():
            if backend is not None:
                backend.close()


def measure(comm: Any, spec: CommSpec, progress: jobs.Progress) -> None:
    """The sweep at every rank count of ``spec``, each on the first ranks of ``comm``."""
    progress.total = len(spec.ranks) * len(spec.sizes())
    with jobs.RankGroups(comm, spec.ranks) as groups:
        for p in spec.ranks:
            groups.run(p, lambda sub: sweep(sub, spec, progress))


# ---- front door 1: the lesson's engines ------------------------------------------------


def run_on(view: Any, spec: CommSpec | None = None, *, progress: bool = True,
           timeout: float = 1800.0) -> list[dict]:
    """The benchmark on a running cluster's engines (``mc.view``); rows with rates.

    ``spec`` defaults to the full sweep at the cluster's engine count. Read the
    rows with :func:`pcourse.tools.bench.commreport.print_report` and ``plot``.
    """
    world = jobs.cluster_size(view)
    spec = spec or CommSpec(ranks=(world,))
    spec.check(world)
    outcome = jobs.on_cluster(view, measure, spec, desc="allreduce", timeout=timeout,
                              progress=progress)
    return add_rates(outcome.rows)


# ---- front door 2: the command line ------------------------------------------------------


MAX_BYTES = 1 << 30  # per message: each rank holds a few buffers of it, so 1 GiB is plenty


def _size(text: str) -> int:
    """'64M', '4K', '1024' -> bytes, between 4 and :data:`MAX_BYTES`."""
    units = {"K": 1 << 10, "M": MiB, "G": 1 << 30}
    scale = units.get(text[-1:].upper(), 1)
    try:
        value = int(float(text[:-1] if scale > 1 else text) * scale)
    except (ValueError, OverflowError):
        raise argparse.ArgumentTypeError(
            f"not a size in bytes: {text!r} (e.g. 4096, 64M)") from None
    if not 4 <= value <= MAX_BYTES:
        raise argparse.ArgumentTypeError(
            f"{text} is {value:,} bytes: a message size must be between 4 bytes (one float32) "
            f"and {MAX_BYTES:,} (1G; each rank holds several buffers of it)")
    return value


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    """The command line, with ``args.spec`` (a checked :class:`CommSpec`) built from it."""
    ap = argparse.ArgumentParser(prog="python -m pcourse.tools.bench comm", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--ranks", type=jobs.whole(1, 1024), nargs="+", default=None,
                    help="rank counts (default: 2 4; quick: 2); one MPI job of the largest")
    ap.add_argument("--min-bytes", type=_size, default=None)
    ap.add_argument("--max-bytes", type=_size, default=None, help="default 64M (quick: 64K)")
    ap.add_argument("--factor", type=jobs.whole(2), default=None,
                    help="size step (default 2; quick: 4)")
    ap.add_argument("--methods", nargs="+", default=None, choices=METHODS)
    ap.add_argument("--warmup", type=jobs.whole(0), default=None, help="untimed calls per point")
    ap.add_argument("--target-time", type=jobs.seconds, default=None,
                    help="seconds of timed calls per (method, size); sets the iterations")
    ap.add_argument("--min-iters", type=jobs.whole(1), default=None)
    ap.add_argument("--max-iters", type=jobs.whole(1), default=None)
    preset = ap.add_mutually_exclusive_group()
    preset.add_argument("--quick", action="store_true",
                        help="the lessons' quick mode (CommSpec.quick())")
    preset.add_argument("--smoke", action="store_true",
                        help="the tests' run: seconds, not minutes (CommSpec.smoke())")
    ap.add_argument("--timeout", type=jobs.seconds, default=900.0, help="seconds for the MPI job")
    ap.add_argument("--oversubscribe", action="store_true",
                    help="run even with far more ranks than this machine has cores")
    ap.add_argument("--out", type=Path, default=Path("results/commbench.csv"))
    ap.add_argument("--plot", type=Path, default=None, help="default: --out with .png")
    args = ap.parse_args(argv)
    base = (CommSpec.smoke() if args.smoke else CommSpec.quick() if args.quick
            else CommSpec())
    given = {f.name: getattr(args, f.name) for f in dataclasses.fields(CommSpec)
             if getattr(args, f.name, None) is not None}
    given = {k: tuple(v) if isinstance(v, list) else v for k, v in given.items()}
    args.spec = dataclasses.replace(base, **given)
    try:
        args.spec.check()
        if args.out.suffix != ".csv":
            raise jobs.BenchError(f"--out must name a .csv file, got {args.out}")
    except jobs.BenchError as exc:
        ap.error(str(exc))
    args.plot = args.plot or args.out.with_suffix(".png")
    args.error = ap.error
    return args


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(argv)

    def prepare() -> str:
        note = jobs.check_ranks(args.spec.ranks, args.oversubscribe)
        check_writable(args.out, "file")
        check_writable(args.plot, "file")
        return note

    return jobs.run_command(
        "pcourse.tools.bench.commbench", argv, measure, args.spec,
        lambda outcome: report(add_rates(outcome.rows), args.out, args.plot),
        ranks=max(args.spec.ranks), timeout=args.timeout, prepare=prepare, error=args.error,
        partial=args.out.with_suffix(".partial.csv"),
        write=lambda path, rows: write_csv(path, add_rates(rows), FIELDS),
        what="communication benchmark")


if __name__ == "__main__":
    sys.exit(main())
