"""Per-step time of every gradient-averaging strategy, on the same backends, beside DDP.

It times one training step (forward, backward, gradient averaging, optimizer
step) of the same model on the same data. Each strategy runs on MPI *and* on the
torch backend (NCCL where every rank has a GPU of its own, else Gloo on the CPU:
:func:`torch_backend_for`), so that comparing two rows with the same backend shows
the strategy alone, and two with the same strategy the backend:

=================  ========================  =========================================
path               backends                  what averages the gradients
=================  ========================  =========================================
no averaging       (none)                    nothing: the compute-only floor
per-param          mpi-pickle                the source: one pickled allreduce a tensor
per-param          mpi, gloo/nccl            one in-place allreduce per parameter
bucketed           mpi, gloo/nccl            BucketedAllreduce(overlap=False)
bucketed+overlap   mpi, gloo/nccl            BucketedAllreduce(overlap=True)
DDP                gloo/nccl                 torch DistributedDataParallel
=================  ========================  =========================================

The bucketed paths and DDP run at every bucket cap of the sweep (``caps``, in
bytes; 1 byte puts every parameter in a bucket of its own), and the CSV says the
cap (``bucket_cap``) and how many buckets it gave (``buckets``). ``ratio_to_ddp``
divides by DDP at the same cap (the paths without buckets: by DDP at 25 MiB, its
default), so the cap is held fixed and only the implementation differs. DDP is
given its cap explicitly, and an explicit cap is also its first bucket's (only
its default, ``bucket_cap_mb=None``, makes the first bucket 1 MiB). Gradients are
views into the buckets on every bucketed path (DDP: the non-default
``gradient_as_bucket_view=True``), and every path zeroes with
``zero_grad(set_to_none=False)`` as the course's training loop does whenever it
averages, which keeps those views. The per-param paths call
``average_gradients(..., check=False)``: the strategy, without the course's shape
check (two more small allreduces a step).
The target of issue 24 (:func:`targets`): at its best cap, bucketed+overlap at
most 0.9x DDP's step at that cap, on the same backend.

Each step is timed on every rank; a step's time is the slowest rank's, and the
table shows the median over the steps after a warm-up, with the quartiles. The
paths take turns in rounds, so a noisy neighbour slows all of them alike.
Compare ratios within one run: absolute times vary from run to run.

Two front doors, one measurement (:func:`measure`): on the lesson's running
cluster, ``run_on(mc.view, StepSpec.quick())``; from a terminal,
``python -m pcourse.tools.bench steps --ranks 2 4``.
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from typing import Any, Literal

from pcourse.tools.bench import jobs
from pcourse.utils.io import check_writable, save, write_csv
from pcourse.workloads.config import FrankeConfig, MNISTConfig, WorkloadConfig, batch_sizes

FIELDS = ["workload", "ranks", "path", "backend", "bucket_cap", "buckets", "local_batch",
          "params", "median_ms", "p25_ms", "p75_ms", "steps", "ratio_to_ddp",
          "ratio_to_per_param"]
KiB, MiB = 1 << 10, 1 << 20
DEFAULT_CAP = 25 * MiB  # bytes: DDP's default bucket_cap_mb=25 (MiB), and BucketedAllreduce's
FULL_CAPS = (1, 4 * KiB, 16 * KiB, 64 * KiB, 256 * KiB, MiB, 4 * MiB, DEFAULT_CAP)
QUICK_CAPS = (1, 16 * KiB, MiB, DEFAULT_CAP)
TARGET = 0.9  # issue 24: ours, at its best cap, at most this times DDP at that cap
Step = Callable[[int], None]  # runs training step number i


@dataclass(frozen=True)
class StepSpec:
    """What to time. ``StepSpec()``: the full run; ``quick()`` a lesson's quick mode;
    ``smoke()`` the tests' (every path, a few steps)."""

    ranks: tuple[int, ...] = (2, 4)
    workloads: tuple[str, ...] = ("franke", "mnist")
    steps: int = 20  # timed steps per path and round
    rounds: int = 6  # turns each path takes
    warmup: int = 5  # untimed steps per path first
    caps: tuple[int, ...] = FULL_CAPS  # bucket caps in bytes, for the bucketed paths and DDP

    @classmethod
    def quick(cls, **changes: Any) -> StepSpec:
        return dataclasses.replace(cls(ranks=(2,), steps=10, rounds=3, warmup=2,
                                       caps=QUICK_CAPS), **changes)

    @classmethod
    def smoke(cls, **changes: Any) -> StepSpec:
        return dataclasses.replace(cls(ranks=(2,), steps=3, rounds=1, warmup=1,
                                       caps=(1, DEFAULT_CAP)), **changes)

    def check(self, world: int | None = None) -> None:
        if min(self.ranks) < 1 or min(self.steps, self.rounds) < 1 or self.warmup < 0:
            raise jobs.BenchError("--ranks, --steps and --rounds must be at least 1, "
                                  "--warmup at least 0")
        if not self.caps or min(self.caps) < 1:
            raise jobs.BenchError(f"--caps: bucket caps are positive numbers of bytes "
                                  f"(1 puts every parameter in a bucket of its own), got "
                                  f"{list(self.caps)}")
        if world is not None and max(self.ranks) > world:
            raise jobs.BenchError(f"ranks {max(self.ranks)} asked for, but the cluster has "
                                  f"{world} engine(s)")
        batch = FrankeConfig().batch_size
        if "franke" in self.workloads and any(batch % r for r in self.ranks):
            raise jobs.BenchError(
                f"--ranks: Franke's global batch of {batch} must split evenly over the "
                f"ranks; use rank counts that divide {batch} (1, 2, 4, 8, ...)")


# -- the workloads: the course's own, so the step is the training loop's step ----------

def workload_config(name: str) -> WorkloadConfig:
    """Franke: the source's global batch of 256, split over the ranks (strong).
    MNIST: the 10,000-image test split, 64 images per rank (weak, as the source's runs)."""
    return FrankeConfig() if name == "franke" else MNISTConfig(split="test")


def mnist_missing() -> str:
    """Why the MNIST workload cannot run here ("" if it can); checked before starting."""
    from pcourse.workloads.mnist import MNISTError, read_mnist

    try:
        read_mnist("test")
    except (MNISTError, OSError) as exc:
        return str(exc)
    return ""


def torch_backend_for(device: str, ranks: int) -> tuple[str, str]:
    """(torch backend, why not NCCL) for ``ranks`` ranks whose own device is ``device``.

    NCCL, on each rank's GPU, when every rank has a GPU of its own; otherwise Gloo,
    and every path runs on the CPU (Gloo reduces CPU tensors, and the MPI rows must
    run on the same device to be compared), with the reason NCCL cannot run here.
    """
    from pcourse.tools.bench.scaling import skip_reason

    if not device.startswith("cuda"):
        return "gloo", ""
    reason = skip_reason("nccl", ranks)
    return ("gloo", reason) if reason else ("nccl", "")


# -- the paths: each returns its own model copy wrapped for one strategy ------------------

def paths(torch_backend: str, caps: tuple[int, ...] = (DEFAULT_CAP,)) -> list[str]:
    """Every strategy, as "kind@backend", or "kind@backend@cap" for the bucketed paths
    and DDP, one per cap in bytes; "no averaging" is the compute-only floor."""
    fixed = [f"per-param@{backend}" for backend in ("mpi-pickle", "mpi", torch_backend)]
    swept = [f"{kind}@{backend}@{cap}" for cap in caps
             for backend in ("mpi", torch_backend) for kind in ("bucketed", "bucketed+overlap")]
    swept += [f"DDP@{torch_backend}@{cap}" for cap in caps]
    return ["no averaging@-", *fixed, *swept]


def split_path(path: str) -> tuple[str, str, int | None]:
    """(kind, backend, cap in bytes or None) of a path from :func:`paths`."""
    kind, backend, *cap = path.split("@")
    return kind, backend, int(cap[0]) if cap else None


def ddp_bucket_count(net: Any) -> int:
    """How many buckets DDP reduces now: its first step reduces one bucket of everything
    and records the order gradients became ready; then it rebuilds them in that order,
    closing a bucket once it *reaches* the cap (ours close before exceeding it)."""
    logged = net._get_ddp_logging_data()
    return len(logged.get("rebuilt_bucket_sizes", logged["bucket_sizes"]).split(","))


def make_step(path: str, wl: Any, batches: list, backends: dict) -> tuple[Step, Callable]:
    """One training step of a private copy of ``wl.model``, averaged the way ``path``
    says, and a function that says how many buckets it reduces ("" if no buckets)."""
    from pcourse.buckets import BucketedAllreduce
    from pcourse.data_parallel import average_gradients

    model = copy.deepcopy(wl.model)
    buckets: Callable[[], int | str]  # a count, or "" where nothing is bucketed
    net, after, buckets = model, (lambda: None), (lambda: "")
    kind, backend_name, cap = split_path(path)
    backend = backends.get(backend_name)  # None for "no averaging@-" alone
    if kind == "per-param":
        assert backend is not None  # every averaging path names a backend made for it

        def after() -> None:
            average_gradients(model, backend, check=False)  # the strategy, not the safety net
    elif kind.startswith("bucketed"):
        assert backend is not None and cap is not None  # paths() gives these paths a cap
        reducer = BucketedAllreduce(model, backend, cap, overlap=kind.endswith("overlap"))
        after, buckets = reducer.finish, (lambda: len(reducer.buckets))
    elif kind == "DDP":
        from torch.nn.parallel import DistributedDataParallel as DDP

        assert backend is not None and cap is not None  # paths() gives these paths a cap
        ids = [backend.device.index] if backend.device.type == "cuda" else None
        net = DDP(model, device_ids=ids, bucket_cap_mb=cap / MiB,  # torch's "mb" is MiB
                  gradient_as_bucket_view=True, process_group=backend.group)
        buckets = partial(ddp_bucket_count, net)
    opt, _ = wl.make_optimizer(model)

    def step(i: int) -> None:  # as pcourse.loop's loop: mean over my share, averaged
        idx = batches[i % len(batches)]
        opt.zero_grad(set_to_none=False)
        (wl.loss_sum(net, idx, 0) / len(idx)).backward()
        after()
        opt.step()

    return step, buckets


def time_paths(comm: Any, steps: dict[str, Step], spec: StepSpec, device: Any,
               tick: Callable[[int], None]) -> dict:
    """Per-step seconds (the slowest rank's) of every path; paths take turns in rounds."""
    import numpy as np
    import torch
    from mpi4py import MPI

    def timed(step: Step, i: int) -> float:
        t0 = time.perf_counter()
        step(i)
        if device.type == "cuda":
            torch.cuda.synchronize()
        return time.perf_counter() - t0

    for step in steps.values():
        for i in range(spec.warmup):
            step(i)
    times: dict[str, list[float]] = {p: [] for p in steps}
    for round_ in range(spec.rounds):
        for path, step in steps.items():
            comm.Barrier()
            times[path] += [timed(step, i) for i in range(spec.steps)]
        tick(round_)
    slowest = {}
    for path, mine in times.items():
        arr = np.asarray(mine)
        comm.Allreduce(MPI.IN_PLACE, arr, op=MPI.MAX)
        slowest[path] = arr
    return slowest


def measure_ranks(comm: Any, spec: StepSpec, progress: jobs.Progress) -> None:
    """Every path on every workload on this communicator; rows to ``progress``."""
    import numpy as np
    import torch

    from pcourse.backends import make_backend
    from pcourse.runtime.ranks import init_rank
    from pcourse.workloads import make_workload

    mine = init_rank().device
    # rank 0 decides, so that every rank builds the same paths
    torch_backend, why = comm.bcast(
        torch_backend_for(mine, comm.size) if comm.rank == 0 else None, root=0)
    device = torch.device(mine if torch_backend == "nccl" else "cpu")
    if why:
        progress.note(f"no nccl at {comm.size} ranks ({why}): gloo instead, every path "
                      "on the CPU")
    names = {split_path(p)[1] for p in paths(torch_backend)} - {"-"}
    backends = {name: make_backend(name, comm=comm) for name in sorted(names)}
    try:
        for workload in spec.workloads:
            config = workload_config(workload)
            wl = make_workload(workload, config, device)
            local, _ = batch_sizes(config.scaling, config.batch_size, comm.size, wl.n_train)
            gen = torch.Generator().manual_seed(100 + comm.rank)
            batches = [torch.randint(0, wl.n_train, (local,), generator=gen).to(device)
                       for _ in range(16)]
            made = {p: make_step(p, wl, batches, backends)
                    for p in paths(torch_backend, spec.caps)}
            steps = {p: step for p, (step, _) in made.items()}
            params = sum(p.numel() for p in wl.model.parameters())

            def tick(round_: int, w: str = workload) -> None:
                progress.done(f"{w} ×{comm.size}: round {round_ + 1}/{spec.rounds}", [])

            rows = []
            for path, secs in time_paths(comm, steps, spec, device, tick).items():
                kind, backend, cap = split_path(path)
                ms = np.percentile(secs * 1e3, [25, 50, 75])
                rows.append({"workload": workload, "ranks": comm.size, "path": kind,
                             "backend": backend, "bucket_cap": "" if cap is None else cap,
                             "buckets": made[path][1](),
                             "local_batch": local, "steps": len(secs),
                             "params": params,
                             "p25_ms": ms[0], "median_ms": ms[1], "p75_ms": ms[2]})
            progress.done(f"{workload} ×{comm.size}: done", rows)
            del steps, made  # DDP and the reducers hold hooks and buffers: free them first
    finally:
        close_together(comm, backends)


def measure(comm: Any, spec: StepSpec, progress: jobs.Progress) -> None:
    """The step benchmark at every rank count of ``spec``, each on the first ranks."""
    progress.total = len(spec.ranks) * len(spec.workloads) * (spec.rounds + 1)
    with jobs.RankGroups(comm, spec.ranks) as groups:
        for p in spec.ranks:
            groups.run(p, lambda sub: measure_ranks(sub, spec, progress))


def close_together(comm: Any, backends: dict) -> None:
    """Barrier, close, barrier: a rank that exits while a peer still tears down its
    Gloo connections can make that peer abort after all the work is done."""
    import gc

    gc.collect()  # DDP wrappers and reducers still hold the process group
    comm.Barrier()
    for backend in backends.values():
        backend.close()
    comm.Barrier()


# -- reading the rows ---------------------------------------------------------------------

def with_ratios(rows: list[dict]) -> list[dict]:
    """Each row's median per-step time divided by DDP's at the same cap (same workload and
    ranks; rows without buckets: DDP at its default cap, else the largest swept) and by
    per-param's on the same backend: the strategy's effect, the backend held fixed."""
    ddp = {(r["workload"], r["ranks"], r["bucket_cap"]): r["median_ms"]
           for r in rows if r["path"] == "DDP"}
    per_param = {(r["workload"], r["ranks"], r["backend"]): r["median_ms"]
                 for r in rows if r["path"] == "per-param"}
    for r in rows:
        cap = r["bucket_cap"]
        if cap == "":
            swept = [c for (w, n, c) in ddp if (w, n) == (r["workload"], r["ranks"])]
            cap = DEFAULT_CAP if DEFAULT_CAP in swept else max(swept, default="")
        base = ddp.get((r["workload"], r["ranks"], cap))
        r["ratio_to_ddp"] = round(r["median_ms"] / base, 3) if base else ""
        base = per_param.get((r["workload"], r["ranks"], r["backend"]))
        r["ratio_to_per_param"] = round(r["median_ms"] / base, 3) if base else ""
    return rows


def human(nbytes: int | Literal[""]) -> str:
    """A cap for people: 1 B, 16 KiB, 25 MiB ("-" for no cap)."""
    if nbytes == "":
        return "-"
    for unit, size in (("MiB", MiB), ("KiB", KiB)):
        if nbytes >= size:
            return f"{nbytes / size:g} {unit}"
    return f"{nbytes} B"


def print_table(rows: list[dict]) -> None:
    print(f"{'workload':<8} {'ranks':>5}  {'path':<18} {'backend':<10} {'cap':>8} "
          f"{'buckets':>7} {'median ms':>9} {'p25-p75 ms':>15} {'÷ per-param':>11} "
          f"{'÷ DDP':>6}")
    for r in rows:
        spread = f"{r['p25_ms']:.2f}-{r['p75_ms']:.2f}"
        ratios = [f"{r[k]:.2f}" if r[k] != "" else "-" for k in ("ratio_to_per_param",
                                                                  "ratio_to_ddp")]
        print(f"{r['workload']:<8} {r['ranks']:>5}  {r['path']:<18} {r['backend']:<10} "
              f"{human(r['bucket_cap']):>8} {r['buckets']!s:>7} "
              f"{r['median_ms']:>9.2f} {spread:>15} {ratios[0]:>11} {ratios[1]:>6}")


def targets(rows: list[dict]) -> list[dict]:
    """Issue 24's target, per workload and rank count: bucketed+overlap on the torch
    backend at its best cap (its fastest median) against DDP at that same cap.

    ``met``: the ratio is at most :data:`TARGET`. ``overlap_paid``: at that cap the
    overlapped path beat the same buckets reduced after backward, so the reducer
    hid some communication; where it did not, the timeline of lesson 07 shows why.
    """
    out = []
    for key in dict.fromkeys((r["workload"], r["ranks"]) for r in rows):
        ddp = {r["bucket_cap"]: r for r in rows
               if (r["workload"], r["ranks"]) == key and r["path"] == "DDP"}
        if not ddp:
            continue
        backend = next(iter(ddp.values()))["backend"]

        def mine(kind: str, key: tuple = key, backend: str = backend, caps: dict = ddp) -> dict:
            return {r["bucket_cap"]: r for r in rows if (r["workload"], r["ranks"]) == key
                    and r["path"] == kind and r["backend"] == backend and r["bucket_cap"] in caps}

        ours, plain = mine("bucketed+overlap"), mine("bucketed")
        if not ours:
            continue
        cap = min(ours, key=lambda c: ours[c]["median_ms"])
        ratio = ours[cap]["median_ms"] / ddp[cap]["median_ms"]
        out.append({"workload": key[0], "ranks": key[1], "backend": backend, "cap": cap,
                    "buckets": ours[cap]["buckets"], "ours_ms": ours[cap]["median_ms"],
                    "ddp_ms": ddp[cap]["median_ms"], "ratio": ratio, "met": ratio <= TARGET,
                    "overlap_paid": cap in plain
                    and ours[cap]["median_ms"] < plain[cap]["median_ms"]})
    return out


def print_targets(rows: list[dict]) -> None:
    """One line per workload and rank count: the target of issue 24, met or not.

    A development target, for the command line's report; lesson 07 prints
    :func:`print_against_ddp` instead, a comparison with its margin."""
    for t in targets(rows):
        verdict = "met" if t["met"] else "NOT met"
        print(f"target {t['workload']} x{t['ranks']} on {t['backend']}: bucketed+overlap at "
              f"its best cap ({human(t['cap'])}, {t['buckets']} buckets) / DDP at that cap = "
              f"{t['ratio']:.2f} (target <= {TARGET}: {verdict})")
        if not t["met"]:
            said = ("there is one bucket: it can only start when backward has ended, "
                    "nothing to overlap" if t["buckets"] == 1 else
                    "overlap beat the same buckets reduced after backward"
                    if t["overlap_paid"] else
                    "overlap did not beat the same buckets reduced after backward: the "
                    "communication was not hidden")
            print(f"  at that cap {said}; lesson 07's trace of one step shows where the "
                  "time goes")


def print_against_ddp(rows: list[dict]) -> None:
    """Lesson 07's comparison: per workload and rank count, bucketed+overlap at its best
    cap against DDP at that same cap, on the same backend, decided only beyond the
    interquartile ranges (:func:`pcourse.utils.verdict.faster_quartiles`), and what
    overlap could do at that cap."""
    from pcourse.utils.verdict import faster_quartiles

    def quartiles(r: dict) -> tuple[float, float, float]:
        return r["p25_ms"], r["median_ms"], r["p75_ms"]

    for t in targets(rows):
        pick = {r["path"]: r for r in rows if (r["workload"], r["ranks"], r["bucket_cap"])
                == (t["workload"], t["ranks"], t["cap"]) and r["backend"] == t["backend"]}
        said = faster_quartiles(quartiles(pick["bucketed+overlap"]), quartiles(pick["DDP"]),
                                ("bucketed+overlap", "DDP"))
        print(f"{t['workload']} x{t['ranks']} on {t['backend']}, at the reducer's best cap "
              f"({human(t['cap'])}, {t['buckets']} bucket{'s' * (t['buckets'] != 1)}): {said}")
        if t["buckets"] == 1:
            print("  at that cap there is one bucket: it can only start when backward has "
                  "ended, nothing to overlap")
        elif "bucketed" in pick:
            print("  overlap against the same buckets reduced after backward: "
                  + faster_quartiles(quartiles(pick["bucketed+overlap"]),
                                     quartiles(pick["bucketed"]),
                                     ("bucketed+overlap", "bucketed")))


def report(rows: list[dict], out: str, with_targets: bool = False) -> None:
    """The table and lesson 07's comparison with DDP; ``with_targets`` (``--targets``):
    the course's development target too, for its developers, never a learner's output."""
    rows = with_ratios(rows)
    print_table(rows)
    print_against_ddp(rows)
    if with_targets:
        print_targets(rows)
    print(f"wrote {save(out, lambda path: write_csv(path, rows, FIELDS))}")


# ---- front door 1: the lesson's engines ------------------------------------------------


def run_on(view: Any, spec: StepSpec | None = None, *, progress: bool = True,
           timeout: float = 3600.0) -> list[dict]:
    """The benchmark on a running cluster's engines (``mc.view``); rows with ratios.

    ``spec`` defaults to the full run at the cluster's engine count. Without the
    MNIST files, MNIST is skipped with the reason.
    """
    world = jobs.cluster_size(view)
    spec = spec or StepSpec(ranks=(world,))
    spec = _without_missing_mnist(spec)
    spec.check(world)
    outcome = jobs.on_cluster(view, measure, spec, desc="step benchmark", timeout=timeout,
                              progress=progress)
    return with_ratios(outcome.rows)


def _without_missing_mnist(spec: StepSpec) -> StepSpec:
    if "mnist" in spec.workloads and (reason := mnist_missing()):
        print(f"skip mnist: {reason}", flush=True)
        spec = dataclasses.replace(spec, workloads=tuple(w for w in spec.workloads
                                                         if w != "mnist"))
        if not spec.workloads:
            raise jobs.BenchError("no workload can run here")
    return spec


# ---- front door 2: the command line ------------------------------------------------------


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m pcourse.tools.bench steps",
                                description=__doc__.split("\n")[0])
    p.add_argument("--ranks", nargs="+", type=jobs.whole(1, 1024), default=None,
                   help="default: 2 4")
    p.add_argument("--workloads", nargs="+", choices=["franke", "mnist"], default=None)
    p.add_argument("--steps", type=jobs.whole(1), default=None,
                   help="timed steps per path and round")
    p.add_argument("--rounds", type=jobs.whole(1), default=None, help="turns each path takes")
    p.add_argument("--warmup", type=jobs.whole(0), default=None,
                   help="untimed steps per path first")
    p.add_argument("--caps", nargs="+", type=_cap, default=None,
                   help="bucket caps to sweep, in bytes or with a unit (1, 64KiB, 25MiB); "
                        "1 puts every parameter in a bucket of its own; default: "
                        + " ".join(human(c).replace(" ", "") for c in FULL_CAPS))
    preset = p.add_mutually_exclusive_group()
    preset.add_argument("--quick", action="store_true",
                        help="the lesson's quick mode (StepSpec.quick()): 2 ranks, 4 caps")
    preset.add_argument("--smoke", action="store_true",
                        help="the tests' run: 2 ranks, few steps, 2 caps (StepSpec.smoke())")
    p.add_argument("--out", default="results/steps.csv", help="the CSV to write")
    p.add_argument("--targets", action="store_true",
                   help="also the course's development target, met or not (for its developers)")
    p.add_argument("--timeout", type=jobs.seconds, default=900.0, help="seconds for the MPI job")
    p.add_argument("--oversubscribe", action="store_true",
                   help="run even with far more ranks than this machine has cores")
    return p


def _cap(text: str) -> int:
    """A bucket cap from the command line: bytes, or a number with B, KiB or MiB."""
    units = {"kib": KiB, "mib": MiB, "b": 1}
    low = text.strip().lower()
    for unit, size in units.items():
        if low.endswith(unit):
            number, scale = low.removesuffix(unit), size
            break
    else:
        number, scale = low, 1
    try:
        value = float(number) * scale
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"{text!r} is not a bucket cap: give bytes or a number with B, KiB or MiB, "
            "e.g. 1, 64KiB, 25MiB") from None
    if not value >= 1:
        raise argparse.ArgumentTypeError(f"bucket cap {text!r} is under one byte: give at "
                                         "least 1 (a bucket per parameter)")
    return int(value)


def spec_from(args: argparse.Namespace) -> StepSpec:
    base = (StepSpec.smoke() if args.smoke else StepSpec.quick() if args.quick
            else StepSpec())
    given = {f.name: getattr(args, f.name) for f in dataclasses.fields(StepSpec)
             if getattr(args, f.name) is not None}
    chosen: dict[str, Any] = {k: tuple(v) if isinstance(v, list) else v
                              for k, v in given.items()}
    return dataclasses.replace(base, **chosen)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    p = parser()
    args = p.parse_args(argv)
    spec = spec_from(args)
    try:
        spec.check()
    except jobs.BenchError as exc:
        p.error(str(exc))
    inner = list(argv)  # the ranks' arguments: prepare() adds the workloads that can run

    def prepare() -> str:
        note = jobs.check_ranks(spec.ranks, args.oversubscribe)
        check_writable(args.out, "file")
        inner.extend(["--workloads", *_without_missing_mnist(spec).workloads])
        return note

    return jobs.run_command(
        "pcourse.tools.bench.steps", inner, measure, spec,
        lambda outcome: report(outcome.rows, args.out, args.targets), ranks=max(spec.ranks),
        timeout=args.timeout, prepare=prepare, error=p.error,
        partial=args.out.removesuffix(".csv") + ".partial.csv",
        write=lambda path, rows: write_csv(path, with_ratios(rows), FIELDS),
        what="step benchmark", env={"OMP_NUM_THREADS": "1"})


if __name__ == "__main__":
    sys.exit(main())
