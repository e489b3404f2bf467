"""Sharded training beside torch's own: ``python -m pcourse.tools.bench sharding [options]``.

On Gloo, for Franke's net and the VAE at each rank count, one training step (AdamW)
of: DDP (torch's), our ZeRO-1 and ZeRO-2 (:class:`pcourse.sharding.ShardedOptimizer`),
each with its collectives in the open and overlapped (``-overlap``: buckets of about a
quarter of the model reduce-scattered in backward, all-gathers waited for in the next
forward), and torch's ``ZeroRedundancyOptimizer`` (under DDP, as torch documents it),
our FSDP (:class:`pcourse.sharding.FullyShardedDataParallel`, every ``nn.Linear`` a
unit; ``-prefetch``: one unit gathered ahead, reduce-scatters overlapped) and FSDP2's
``fully_shard`` (the same units). First every strategy trains the same steps from the
same start, and the largest difference of its parameters from DDP's is recorded (the
updates are the same up to float32 rounding); then the strategies take turns in
rounds, timed; then each of ours is traced (:mod:`pcourse.tools.bench.overlap`): its
communication in flight per step, and the part of it exposed (the slowest rank's,
median of a few traced steps), each rank's CPU time per step (all its threads), and
the whole model's reduce-scatter, all-gather and allreduce, each timed alone.
Writes a CSV with the median step time and its ratio to DDP's, and a plot beside it,
and prints what overlapping gained here, decided beyond the spread of the rounds: a
benchmark's figures, never a test's verdict. ``--targets`` adds the course's
development targets (ours against DDP and against torch's), each met or not on one
median ratio (one not met: whether the rank's CPU work leaves any schedule room to
meet it here, or, for ZeRO, what its two collectives cost against DDP's allreduce).

torch's ``ZeroRedundancyOptimizer`` is not the same algorithm as our ZeRO-1: it gives
*whole parameters* to ranks (each parameter belongs to one rank), runs under DDP, which
all-reduces the whole gradient and keeps it on every rank, and then each rank
broadcasts the parameters it updated: DDP's bytes plus the broadcasts, where ours
reduce-scatters and all-gathers slices of one flat vector, DDP's bytes alone. The
updates are the same; the messages and the memory are not.
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import sys
import time
from pathlib import Path
from typing import Any

from pcourse.tools.bench import jobs
from pcourse.tools.bench.sharded import build, model_and_loss
from pcourse.utils.io import check_writable, save, write_csv

STRATEGIES = ("ddp", "zero1", "zero1-overlap", "zero2", "zero2-overlap", "torch-zero", "fsdp",
              "fsdp-prefetch", "torch-fsdp2")
OURS = tuple(s for s in STRATEGIES if s[:4] in ("zero", "fsdp"))  # they go through our backend
OVERLAPPED = {"zero1-overlap": "zero1", "zero2-overlap": "zero2", "fsdp-prefetch": "fsdp"}
FIELDS = ["workload", "ranks", "strategy", "steps", "median_ms", "ratio_to_ddp",
          "max_diff_vs_ddp", "comm_ms", "exposed_ms", "backward_ms", "cpu_ms", "cores",
          "model_rs_ms", "model_ag_ms", "model_ar_ms", "round_ms"]
TRACED = 3  # traced steps per strategy: the median is reported
# (ours, theirs, at most this ratio, only at these rank counts or None, only this workload)
TARGETS = (("zero1", "ddp", 1.1, None, None), ("zero1", "torch-zero", 1.0, None, None),
           ("zero2", "torch-zero", 1.0, None, None), ("fsdp", "torch-fsdp2", 1.0, (2,), None),
           ("zero1-overlap", "ddp", 1.1, None, None), ("zero2-overlap", "ddp", 1.1, None, None),
           ("fsdp-prefetch", "ddp", 1.6, None, "vae"),
           ("fsdp-prefetch", "torch-fsdp2", 0.6, None, None))


@dataclasses.dataclass(frozen=True)
class Spec:
    ranks: tuple[int, ...] = (2, 4)
    workloads: tuple[str, ...] = ("franke", "vae")
    steps: int = 10  # timed steps per strategy and round
    rounds: int = 3
    check_steps: int = 3  # steps trained before the parameters are compared with DDP's

    @classmethod
    def quick(cls) -> Spec:
        return cls(ranks=(2,), workloads=("franke",), steps=3, rounds=2, check_steps=2)


def full_params(strategy: str, module: Any) -> list:
    """Every parameter, whole, in the model's order (collective for the FSDPs)."""
    if strategy.startswith("fsdp"):
        return list(module.full_parameters().values())
    if strategy == "torch-fsdp2":
        return [p.full_tensor().detach().clone() for _, p in sorted(module.named_parameters())]
    inner = getattr(module, "module", module)
    return [p.detach().clone() for _, p in sorted(inner.named_parameters())]


def one_step(module: Any, opt: Any, finish: Any, loss: Any, rank: int, step: int) -> None:
    opt.zero_grad()
    loss(module, rank, step).backward()
    if finish is not None:
        finish()
    opt.step()


def measure_ranks(comm: Any, spec: Spec, progress: jobs.Progress) -> None:
    """Every strategy on every workload on this communicator; rows to ``progress``."""
    import torch

    from pcourse.backends import make_backend

    backend = make_backend("gloo", comm=comm)
    try:
        for workload in spec.workloads:
            make_model, loss = model_and_loss(workload)
            built = {s: build(s, make_model, backend) for s in STRATEGIES}
            for step in range(spec.check_steps):  # the same steps, from the same start
                for s in STRATEGIES:
                    one_step(*built[s], loss, comm.rank, step)
            for s in OURS:
                getattr(built[s][1], "synchronize", lambda: None)()  # the last all-gathers
            ref = full_params("ddp", built["ddp"][0])
            diffs = {s: max((a - b).abs().max().item()
                            for a, b in zip(full_params(s, built[s][0]), ref, strict=True))
                     for s in STRATEGIES}
            times: dict[str, list[float]] = {s: [] for s in STRATEGIES}
            cpu: dict[str, list[float]] = {s: [] for s in STRATEGIES}
            rounds: dict[str, list[float]] = {s: [] for s in STRATEGIES}
            for round_ in range(spec.rounds):
                for s in STRATEGIES:
                    mine = []
                    for k in range(spec.steps):
                        comm.Barrier()
                        t0, c0 = time.perf_counter(), time.process_time()
                        one_step(*built[s], loss, comm.rank, spec.check_steps + k)
                        secs = time.perf_counter() - t0  # the slowest rank's
                        used = time.process_time() - c0  # every thread of the rank: compute,
                        mine.append(float(comm.allreduce(secs, op=_max())))  # Gloo's copies
                        cpu[s].append(float(comm.allreduce(used)) / comm.size)
                    times[s] += mine
                    rounds[s].append(statistics.median(mine) * 1e3)
                progress.done(f"{workload} ×{comm.size}: round {round_ + 1}/{spec.rounds}", [])
            del built
            traced = {s: _traced(s, workload, backend, comm) for s in OURS}
            alone = _collectives(backend, comm, sum(p.numel() for p in make_model().parameters()))
            ms = {s: statistics.median(t) * 1e3 for s, t in times.items()}
            rows = [{"workload": workload, "ranks": comm.size, "strategy": s,
                     "steps": len(times[s]), "median_ms": round(ms[s], 3),
                     "ratio_to_ddp": round(ms[s] / ms["ddp"], 3),
                     "max_diff_vs_ddp": f"{diffs[s]:.2e}",
                     **traced.get(s, {"comm_ms": "", "exposed_ms": "", "backward_ms": ""}),
                     "cpu_ms": round(statistics.median(cpu[s]) * 1e3, 3),
                     "cores": torch.get_num_threads(), **alone,
                     "round_ms": " ".join(f"{r:.3f}" for r in rounds[s])} for s in STRATEGIES]
            progress.done(f"{workload} ×{comm.size}: done", rows)
    finally:
        import gc

        gc.collect()  # DDP and FSDP2 hold the group
        comm.Barrier()
        backend.close()
        comm.Barrier()


def _traced(strategy: str, workload: str, backend: Any, comm: Any) -> dict[str, float]:
    """The slowest rank's communication in flight, exposed, and backward (ms), each the
    median of :data:`TRACED` traced steps."""
    from pcourse.tools.bench.overlap import chrome_trace, exposure, record

    got: dict[str, list[float]] = {"comm_ms": [], "exposed_ms": [], "backward_ms": []}
    for _ in range(TRACED):
        rec = record(strategy, workload, backend)
        (mine,) = exposure(chrome_trace([rec]))
        backward = sum(t1 - t0 for name, t0, t1 in rec["phases"] if name == "backward")
        for key, value in (("comm_ms", mine["in_flight_ms"]), ("exposed_ms", mine["exposed_ms"]),
                           ("backward_ms", backward)):
            got[key].append(float(comm.allreduce(value, op=_max())))
    return {k: round(statistics.median(v), 3) for k, v in got.items()}


def _collectives(backend: Any, comm: Any, numel: int, repeats: int = 15) -> dict[str, float]:
    """Gloo's reduce-scatter, all-gather and allreduce of the whole model's numbers, each
    alone (ms, the slowest rank's): what ZeRO's two halves cost here against DDP's one
    allreduce. The fastest of ``repeats``: a small call's time is mostly how soon the
    scheduler wakes Gloo's threads, and the fastest is the call's own cost."""
    import torch

    n = -(-numel // comm.size)
    full, mine = torch.randn(n * comm.size), torch.randn(n)
    calls = {"model_rs_ms": lambda: backend.reduce_scatter(mine, full, "avg", check=False),
             "model_ag_ms": lambda: backend.all_gather(full, mine, check=False),
             "model_ar_ms": lambda: backend.allreduce(full, "avg", check=False)}
    out = {}
    for key, call in calls.items():
        times = []
        for _ in range(repeats):
            comm.Barrier()
            t0 = time.perf_counter()
            call()
            times.append(float(comm.allreduce(time.perf_counter() - t0, op=_max())))
        out[key] = round(min(times) * 1e3, 3)
    return out


def _max() -> Any:
    from mpi4py import MPI

    return MPI.MAX


def measure(comm: Any, spec: Spec, progress: jobs.Progress) -> None:
    progress.total = len(spec.ranks) * len(spec.workloads) * (spec.rounds + 1)
    with jobs.RankGroups(comm, spec.ranks) as groups:
        for p in spec.ranks:
            groups.run(p, lambda sub: measure_ranks(sub, spec, progress))


def targets(rows: list[dict]) -> list[str]:
    """Each target, as met or not, from the rows (never asserted); one not met says what
    this run's numbers tell about it (:func:`why_not`)."""
    lines = []
    by = {(r["workload"], r["ranks"], r["strategy"]): r for r in rows}
    med = {key: float(r["median_ms"]) for key, r in by.items()}
    for ours, theirs, bound, only, workload in TARGETS:
        for (w, p, s), ms in sorted(med.items()):
            if s != ours or (only and p not in only) or (w, p, theirs) not in med \
                    or workload not in (None, w):
                continue
            ratio = ms / med[w, p, theirs]
            line = (f"target {ours} ≤ {bound:g}× {theirs} ({w}, {p} ranks): "
                    f"{ratio:.2f}× — {'met' if ratio <= bound else 'NOT met'}")
            if theirs == "torch-zero":  # the same updates, not the same messages
                line += "; torch's sends DDP's allreduce and then broadcasts the parameters"
            if ratio > bound:
                line += why_not(by[w, p, s], theirs, med[w, p, theirs], bound)
            lines.append(line)
    return lines


def why_not(row: dict, theirs: str, their_ms: float, bound: float) -> str:
    """What the run's own numbers say of a target not met (empty if nothing).

    Out of reach on this machine, when the CPU floor (:func:`floor_ms`) breaks the
    bound; else, for ZeRO against DDP, what the collectives cost alone here: ZeRO's
    reduce-scatter and all-gather against DDP's one allreduce of the same numbers.
    """
    floor = floor_ms(row)
    if floor is not None and floor / their_ms > bound:
        return (f"; out of reach on this machine: each rank's threads work "
                f"{float(row['cpu_ms']):.1f} ms of CPU per step on {row['cores']} core(s), so "
                f"no schedule brings the step under {floor:.1f} ms "
                f"({floor / their_ms:.2f}× {theirs})")
    if str(row["strategy"]).startswith("zero") and theirs == "ddp" \
            and row.get("model_ar_ms") not in (None, ""):
        halves = float(row["model_rs_ms"]) + float(row["model_ag_ms"])
        whole = float(row["model_ar_ms"])
        return (f"; ZeRO's reduce-scatter and all-gather of the whole model take {halves:.2f} "
                f"ms here, DDP's allreduce of it {whole:.2f} ms ({halves / whole:.2f}×)")
    return ""


def floor_ms(row: dict) -> float | None:
    """The shortest step any schedule of this strategy could reach here, or None if unknown.

    Overlap hides a collective only behind a core that is free for it: the rank's CPU
    work per step (every thread: the compute and the collectives' copies and sums,
    measured) spread over the rank's cores is a floor no schedule goes below.
    """
    if row.get("cpu_ms") in (None, "") or not row.get("cores"):
        return None
    return float(row["cpu_ms"]) / int(row["cores"])


def overlap_notes(rows: list[dict]) -> list[str]:
    """Per overlapped variant: its step against the same strategy in the open, decided
    beyond the spread of the rounds, and what its own trace says about why."""
    from pcourse.utils.verdict import faster

    by = {(r["workload"], r["ranks"], r["strategy"]): r for r in rows}
    lines = []
    for (w, p, s), r in sorted(by.items()):
        plain = by.get((w, p, OVERLAPPED.get(s, "")))
        if plain is None or not r.get("comm_ms") or not r.get("round_ms"):
            continue
        a = [float(x) for x in str(r["round_ms"]).split()]
        b = [float(x) for x in str(plain["round_ms"]).split()]
        verdict = faster(a, b, (s, plain["strategy"])) if min(len(a), len(b)) > 1 else \
            "one round: no spread to decide on"
        comm, exposed, back = (float(r[k]) for k in ("comm_ms", "exposed_ms", "backward_ms"))
        lines.append(f"{w}, {p} ranks: {verdict}; exposed communication {exposed:.2f} of "
                     f"{comm:.2f} ms in flight (in the open: {float(plain['exposed_ms']):.2f} "
                     f"of {float(plain['comm_ms']):.2f})")
        if exposed > 0.8 * comm:
            lines.append(f"  nothing much to hide behind here: backward takes {back:.2f} ms, "
                         f"the communication {comm:.2f} ms in flight, and the rank's cores "
                         f"run both (a collective moves only when a core is free for it)")
    return lines


def plot(rows: list[dict], path: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from pcourse.utils.io import savefig_atomic

    groups = sorted({(r["workload"], r["ranks"]) for r in rows})
    fig, axes = plt.subplots(1, len(groups), figsize=(5 * len(groups), 3.8), squeeze=False,
                             layout="constrained")
    for ax, (w, p) in zip(axes[0], groups, strict=True):
        mine = [r for r in rows if (r["workload"], r["ranks"]) == (w, p)]
        ax.barh([r["strategy"] for r in mine], [float(r["ratio_to_ddp"]) for r in mine],
                color=["C0" if "torch" in r["strategy"] or r["strategy"] == "ddp" else "C1"
                       for r in mine])
        ax.axvline(1.0, color="k", ls="--", lw=0.8)
        ax.invert_yaxis()
        ax.set(title=f"{w}, {p} ranks, Gloo", xlabel="step time / DDP's (median)")
    return savefig_atomic(fig, path)


def report(rows: list[dict], out: str, with_targets: bool = False) -> None:
    """The table, and what overlapping gained, decided beyond the rounds' spread;
    ``with_targets`` (``--targets``): the course's development targets too, for its
    developers, never a learner's output."""
    print(f"{'workload':8} {'p':>2} {'strategy':14} {'median ms':>10} {'× DDP':>7} "
          f"{'max |Δ| vs DDP':>15} {'comm ms':>8} {'exposed':>8}")
    for r in rows:
        print(f"{r['workload']:8} {r['ranks']:>2} {r['strategy']:14} {r['median_ms']:>10} "
              f"{r['ratio_to_ddp']:>7} {r['max_diff_vs_ddp']:>15} {r.get('comm_ms', ''):>8} "
              f"{r.get('exposed_ms', ''):>8}")
    for line in (targets(rows) if with_targets else []) + overlap_notes(rows):
        print(line)
    print(f"wrote {save(out, lambda path: write_csv(path, rows, FIELDS))}")
    print(f"wrote {save(Path(out).with_suffix('.png'), lambda path: plot(rows, path))}")


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m pcourse.tools.bench sharding",
                                description=__doc__.split("\n")[0])
    p.add_argument("--ranks", nargs="+", type=int, default=None, help="default: 2 4")
    p.add_argument("--workloads", nargs="+", choices=["franke", "vae"], default=None)
    p.add_argument("--steps", type=int, default=None, help="timed steps per strategy and round")
    p.add_argument("--rounds", type=int, default=None)
    p.add_argument("--quick", action="store_true", help="2 ranks, Franke, few steps")
    p.add_argument("--out", default="results/sharding.csv", help="the CSV (a .png beside it)")
    p.add_argument("--targets", action="store_true",
                   help="also the course's development targets, met or not (for its developers)")
    p.add_argument("--timeout", type=float, default=900.0, help="seconds for the MPI job")
    p.add_argument("--oversubscribe", action="store_true")
    return p


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parser().parse_args(argv)
    base = Spec.quick() if args.quick else Spec()
    given: dict[str, Any] = {k: (tuple(v) if isinstance(v, list) else v)
                             for k in ("ranks", "workloads", "steps", "rounds")
                             if (v := getattr(args, k)) is not None}
    spec = dataclasses.replace(base, **given)

    def prepare() -> str:
        note = jobs.check_ranks(spec.ranks, args.oversubscribe)
        check_writable(args.out, "file")
        return note

    return jobs.run_command(
        "pcourse.tools.bench.sharding", argv, measure, spec,
        lambda outcome: report(outcome.rows, args.out, args.targets), ranks=max(spec.ranks),
        timeout=args.timeout, prepare=prepare, error=parser().error,
        partial=Path(args.out).with_suffix(".partial.csv"),
        write=lambda path, rows: write_csv(path, rows, FIELDS), what="sharding benchmark",
        env={"OMP_NUM_THREADS": "1"})


if __name__ == "__main__":
    sys.exit(main())
