"""Tensor parallelism beside torch's own: ``python -m pcourse.tools.bench tp [options]``.

Lesson 11's transformer block (:class:`pcourse.workloads.transformer.Block`, activations
sequence-first ``[T, B, d]``) split over the t ranks of one group, at each rank count t,
in one run:

- **ours**: :class:`pcourse.tensor_parallel.ParallelBlock` on the group's backend (Gloo
  and MPI), without (``tp``) and with (``sp``) sequence parallelism;
- **torch's**: the same block under ``torch.distributed.tensor.parallel``
  (``ColwiseParallel``, ``RowwiseParallel``, ``SequenceParallel`` for the norms: the
  lesson's plan) on a ``DeviceMesh`` of the same Gloo group. DTensor runs on
  torch.distributed's backends only: on Gloo here, so ours on MPI is set beside torch's
  on Gloo;
- **data parallelism** (``dp``) on the same ranks: the whole block on every rank, the
  batch split, one allreduce of the gradients.

Every step is one forward and backward of the block. Per configuration the step time
(median, fastest and slowest repeat: the slowest rank's, the configurations taking
turns each round), its ratio to torch's (``tp``, ``sp``) or to ours without sequence
parallelism (``dp``) with :func:`pcourse.utils.verdict.faster`'s verdict; for ours,
the bytes this rank sent, counted at the backend
(:class:`pcourse.backends.counting.CountingBackend`), and the activation memory saved
for backward (:func:`pcourse.activations.count_saved`), each beside lesson 11's theory
(:func:`theory_bytes`, :func:`theory_activations`). A benchmark's figures, never a
test's verdict; the bytes and activations are exact and the tests hold them to the theory.
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import os
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from pcourse.tools.bench import jobs
from pcourse.utils.io import check_writable, save, write_csv

BACKENDS = ("gloo", "mpi")
MODES = ("tp", "sp", "dp")  # tensor-parallel, sequence-parallel, data-parallel
ITEMSIZE = 4  # float32
FIELDS = ["ranks", "backend", "mode", "impl", "repeats", "median_ms", "min_ms", "max_ms",
          "compared_with", "ratio", "verdict", "bytes_sent", "bytes_theory",
          "activation_bytes", "activation_rest", "activation_theory", "max_diff_vs_ours",
          "calls_seen"]


@dataclasses.dataclass(frozen=True)
class Spec:
    """What to run. Every size divides by 2, 3 and 4 (:func:`check_sizes` says why)."""

    ranks: tuple[int, ...] = (2, 4)
    backends: tuple[str, ...] = BACKENDS
    d: int = 192
    heads: int = 12
    hidden: int = 768
    seq: int = 96  # T
    batch: int = 12  # B
    repeats: int = 10  # timed steps per configuration, taking turns

    @classmethod
    def quick(cls) -> Spec:
        """Seconds long: the lesson's quick block, at 2 ranks."""
        return cls(ranks=(2,), d=48, heads=12, hidden=96, seq=12, batch=12, repeats=5)

    def block_params(self) -> int:
        """Ψ of one block: four d×d projections, two MLP layers, two norms (biases too)."""
        d, h = self.d, self.hidden
        return 4 * (d * d + d) + (d * h + h) + (h * d + d) + 4 * d


def default_ranks() -> tuple[int, ...]:
    """2, and 4 where the machine has the cores for it (``--ranks 2 4`` asks anyway)."""
    return (2, 4) if (os.cpu_count() or 1) >= 4 else (2,)


def check_sizes(spec: Spec) -> None:
    """Refuse a rank count the block cannot be split over (before any rank starts).

    Tensor parallelism needs whole heads and hidden features on each rank, sequence
    parallelism whole positions, data parallelism whole samples.
    """
    for t in spec.ranks:
        for what, n in (("heads", spec.heads), ("hidden features", spec.hidden),
                        ("sequence positions", spec.seq), ("samples per batch", spec.batch)):
            if n % t:
                raise jobs.BenchError(f"--ranks {t}: the block's {n} {what} do not divide by "
                                      f"{t}; use rank counts that divide {n} (2, 3, 4, 6)")


# ---------------------------------------------------------------- the theory (lesson 11)
def theory_bytes(mode: str, t: int, spec: Spec) -> float:
    """Bytes one rank sends in one block step, by a ring (lesson 03: 2(t-1)/t per value).

    ``tp``: four allreduces of the activations (N = T·B·d values): g forward and f
    backward, for attention and for the MLP. ``sp``: four reduce-scatters and four
    all-gathers of the same N (the same bytes), plus the allreduce of the 6d values
    used on a slice of the sequence (two norms, two row-parallel biases). ``dp``: one
    allreduce of every gradient, Ψ values.
    """
    ring = 2 * (t - 1) / t * ITEMSIZE
    if mode == "dp":
        return ring * spec.block_params()
    n = spec.seq * spec.batch * spec.d
    return ring * (4 * n + (6 * spec.d if mode == "sp" else 0))


def theory_activations(mode: str, t: int, spec: Spec) -> float:
    """Bytes of ``[T, B, ·]`` activations one rank saves for backward (lesson 11's table).

    In units of U = T·B·d values: the norms' inputs 2U (2U/t with the sequence split),
    their outputs 2U (gathered with it), q, k, v and the heads 4U/t, the MLP's hidden
    2U·h/d/t. ``dp``: the whole block on 1/t of the batch.
    """
    u = spec.seq * spec.batch * spec.d * ITEMSIZE
    split = (4 * u + 2 * u * spec.hidden / spec.d) / t
    if mode == "dp":
        return 4 * u / t + split
    return (2 * u / t + 2 * u if mode == "sp" else 4 * u) + split


# ------------------------------------------------------------------- the configurations
@dataclasses.dataclass
class Run:
    """One configuration on this rank: its model, its part of the input and of the loss's
    weights (contiguous copies: a view would count its whole storage as saved), and what
    follows backward."""

    model: Any
    x: Any
    w: Any
    after: Callable[[], None] = lambda: None
    group: Any = None  # ours: the counting backend

    def forward(self) -> Any:
        self.model.zero_grad(set_to_none=True)
        return self.model(self.x)

    def finish(self, y: Any) -> None:
        """Backward of a loss that weights every output, so that nothing cancels."""
        (y * self.w).sum().backward()
        self.after()

    def step(self) -> Any:
        """One forward and backward; the output (detached)."""
        y = self.forward()
        self.finish(y)
        return y.detach()


def torch_plan(sp: bool) -> dict[str, Any]:
    """torch's plan for the block, the same as ours: q, k and v share one entry into the
    group (``PrepareModuleInput`` on the attention, as torch's tutorial does; a
    ``ColwiseParallel`` on each would redistribute the shared input three times), and
    with sequence parallelism the sequence is gathered once per sub-block. Lesson 11
    and this benchmark use it."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        PrepareModuleInput,
        RowwiseParallel,
        SequenceParallel,
    )

    seq = Shard(0) if sp else Replicate()  # how a sub-block's input arrives
    enter = PrepareModuleInput(input_layouts=(seq,), desired_input_layouts=(Replicate(),),
                               use_local_output=False)
    rows = RowwiseParallel(output_layouts=Shard(0)) if sp else RowwiseParallel()
    plan = {"attn": enter, "attn.q": ColwiseParallel(), "attn.k": ColwiseParallel(),
            "attn.v": ColwiseParallel(), "attn.o": rows,
            "mlp": enter, "mlp.fc1": ColwiseParallel(), "mlp.fc2": rows}
    if sp:
        plan |= {"ln1": SequenceParallel(sequence_dim=0), "ln2": SequenceParallel(sequence_dim=0)}
    return plan


def reduce_partial_grads(model: Any) -> None:
    """torch's side of ``sync_sequence_parallel_grads``: the gradients DTensor leaves as
    partial sums (the parameters that see a slice of the sequence), summed in place, so
    that a step of torch's does what a step of ours does."""
    from torch.distributed.tensor import Replicate

    for p in model.parameters():
        placements = getattr(p.grad, "placements", ())
        if any(pl.is_partial() for pl in placements):
            p.grad = p.grad.redistribute(placements=[Replicate()] * len(placements))


def build(mode: str, impl: str, block: Any, group: Any, spec: Spec, x: Any, w: Any) -> Run:
    """One configuration: ours (``group``: a counting backend) or torch's (on its Gloo group)."""
    import torch

    from pcourse.tensor_parallel import ParallelBlock, sync_sequence_parallel_grads

    t, r = group.size, group.rank
    if mode == "dp":
        model = copy.deepcopy(block)
        part = spec.batch // t

        def allreduce() -> None:
            group.allreduce(torch.cat([p.grad.reshape(-1) for p in model.parameters()]), "avg")

        mine: tuple[slice, slice] | slice = (slice(None), slice(r * part, (r + 1) * part))
        return Run(model, x[mine].clone(), w[mine].clone(), allreduce, group)
    sp = mode == "sp"
    mine = slice(r * spec.seq // t, (r + 1) * spec.seq // t) if sp else slice(None)
    if impl == "ours":
        model = ParallelBlock(block, group, sp)
        after = (lambda: sync_sequence_parallel_grads(model, group)) if sp else (lambda: None)
        return Run(model, x[mine].clone(), w[mine].clone(), after, group)
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor.parallel import parallelize_module

    theirs = copy.deepcopy(block)
    theirs.attn.n_heads //= t  # each rank runs its own heads
    parallelize_module(theirs, DeviceMesh.from_group(group.inner.group, "cpu"), torch_plan(sp))
    return Run(theirs, x[mine].clone(), w[mine].clone(), lambda: reduce_partial_grads(theirs))


def counted_step(run: Run, spec: Spec) -> dict[str, Any]:
    """One step of ours, counted: bytes sent, and the activations saved (the ``[T, B, ·]``
    tensors, and the rest: the norms' and attention's small statistics); its output."""
    from pcourse.activations import count_saved

    t = run.group.size
    run.group.reset()
    with count_saved(run.model.parameters()) as saved:
        y = run.forward()
    run.finish(y)
    # the smallest [T, B, .] tensor a rank saves: U/t bytes (its slice of the sequence or batch)
    big = sum(s for s in saved.storages.values()
              if s >= spec.seq * spec.batch * spec.d * ITEMSIZE / t)
    return {"bytes_sent": round(run.group.total()), "activation_bytes": big,
            "activation_rest": saved.bytes - big, "output": y.detach()}


def measure_ranks(comm: Any, spec: Spec, progress: jobs.Progress) -> None:
    """Every configuration on this communicator (t = its size); rows to ``progress``."""
    import contextlib
    import gc

    import torch

    from pcourse.backends import make_backend
    from pcourse.backends.counting import CountingBackend, calls_seen
    from pcourse.workloads.transformer import Block

    t = comm.size
    torch.manual_seed(0)  # the same block and data on every rank
    block = Block(spec.d, spec.heads, spec.hidden)
    x, w = torch.randn(spec.seq, spec.batch, spec.d), torch.randn(spec.seq, spec.batch, spec.d)
    with contextlib.ExitStack() as stack:
        runs: dict[tuple[str, str, str], Run] = {}
        for name in spec.backends:
            group = CountingBackend(stack.enter_context(make_backend(name, comm=comm)))
            for mode in MODES:
                runs[name, mode, "ours"] = build(mode, "ours", block, group, spec, x, w)
                if name == "gloo" and mode != "dp":
                    runs[name, mode, "torch's"] = build(mode, "torch's", block, group, spec,
                                                        x, w)
        counted = {key: counted_step(run, spec)  # also every run's warm-up step
                   for key, run in runs.items() if key[2] == "ours"}
        for (name, mode, impl), run in runs.items():  # torch's computes what ours does
            if impl != "ours":
                diff = (run.step() - counted[name, mode, "ours"].pop("output")).abs().max()
                diff = comm.allreduce(diff.item(), op=_max())  # every rank's part of the output
                counted[name, mode, impl] = {"max_diff_vs_ours": f"{diff:.1e}"}
        for (name, mode, impl), run in runs.items():  # what the process group ran: both alike
            if name == "gloo":
                counted.setdefault((name, mode, impl), {})["calls_seen"] = " ".join(
                    f"{n} {k}" for k, n in calls_seen(run.step)[1].items())
        times: dict[tuple[str, str, str], list[float]] = {key: [] for key in runs}
        for round_ in range(spec.repeats):
            for key, run in runs.items():
                comm.Barrier()
                t0 = time.perf_counter()
                run.step()
                secs = time.perf_counter() - t0
                times[key].append(float(comm.allreduce(secs, op=_max())))  # the slowest rank's
            progress.done(f"tp={t}: round {round_ + 1}/{spec.repeats}", [])
        rows = [row(key, times, counted.get(key, {}), t, spec) for key in runs]
        progress.done(f"tp={t}: done", rows)
        del runs
        gc.collect()  # DTensor's modules hold the Gloo group
        comm.Barrier()


def row(key: tuple[str, str, str], times: dict, counted: dict, t: int, spec: Spec) -> dict:
    """One CSV row: the step's times, the comparison and verdict, and the counts beside theory."""
    from pcourse.utils.verdict import faster

    backend, mode, impl = key
    mine = times[key]
    out = {"ranks": t, "backend": backend, "mode": mode, "impl": impl, "repeats": len(mine),
           "median_ms": round(statistics.median(mine) * 1e3, 3),
           "min_ms": round(min(mine) * 1e3, 3), "max_ms": round(max(mine) * 1e3, 3)}
    other = None
    if impl == "ours" and mode == "dp":
        other, names = (backend, "tp", "ours"), ("data parallelism", "tensor parallelism")
    elif impl == "ours" and backend == "gloo" and ("gloo", mode, "torch's") in times:
        # like for like: torch's runs on Gloo, so only ours on Gloo is set beside it
        other, names = ("gloo", mode, "torch's"), ("ours", "torch's")
    if other is not None:
        theirs = times[other]
        out |= {"compared_with": f"{other[2]} {other[1]} ({other[0]})",
                "ratio": round(statistics.median(mine) / statistics.median(theirs), 3),
                "verdict": faster(mine, theirs, names)}
    out |= {k: v for k, v in counted.items() if k != "output"}
    if "bytes_sent" in counted:
        out |= {"bytes_theory": round(theory_bytes(mode, t, spec)),
                "activation_theory": round(theory_activations(mode, t, spec))}
    return out


def _max() -> Any:
    from mpi4py import MPI

    return MPI.MAX


def measure(comm: Any, spec: Spec, progress: jobs.Progress) -> None:
    progress.total = len(spec.ranks) * (spec.repeats + 1)
    with jobs.RankGroups(comm, spec.ranks) as groups:
        for p in spec.ranks:
            groups.run(p, lambda sub: measure_ranks(sub, spec, progress))


# ---------------------------------------------------------------------------- the report
def report(rows: list[dict], out: str) -> None:
    print(f"{'t':>2} {'backend':7} {'mode':4} {'impl':7} {'median ms':>9} {'[min, max]':>17} "
          f"{'ratio':>6} {'compared with':22} {'bytes sent':>10} {'theory':>10} "
          f"{'activations':>11} {'theory':>10} {'rest':>6} {'|Δ| vs ours':>11}")
    for r in rows:
        spread = f"[{r['min_ms']}, {r['max_ms']}]"
        print(f"{r['ranks']:>2} {r['backend']:7} {r['mode']:4} {r['impl']:7} "
              f"{r['median_ms']:>9} {spread:>17} {r.get('ratio', ''):>6} "
              f"{r.get('compared_with', ''):22} {r.get('bytes_sent', ''):>10} "
              f"{r.get('bytes_theory', ''):>10} {r.get('activation_bytes', ''):>11} "
              f"{r.get('activation_theory', ''):>10} {r.get('activation_rest', ''):>6} "
              f"{r.get('max_diff_vs_ours', ''):>11}")
    for r in rows:
        if r.get("verdict"):
            print(f"t={r['ranks']} {r['backend']} {r['mode']}: {r['verdict']}")
    for r in rows:
        if r.get("calls_seen"):
            print(f"t={r['ranks']} {r['mode']} {r['impl']}: a step's collectives, as the process "
                  f"group recorded them: {r['calls_seen']}")
    ours = [r for r in rows if "bytes_sent" in r]
    print("bytes sent = theory on every row of ours:",
          all(r["bytes_sent"] == r["bytes_theory"] for r in ours))
    print("activations of shape [T, B, .] = theory on every row of ours:",
          all(r["activation_bytes"] == r["activation_theory"] for r in ours))
    print(f"wrote {save(out, lambda path: write_csv(path, rows, FIELDS))}")


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m pcourse.tools.bench tp",
                                description=__doc__.split("\n")[0])
    p.add_argument("--ranks", nargs="+", type=jobs.whole(2), default=None,
                   help="tensor-parallel sizes (default: 2, and 4 where there are 4 cores)")
    p.add_argument("--backends", nargs="+", choices=BACKENDS, default=None,
                   help="ours on these; torch's runs on Gloo (default: gloo mpi)")
    p.add_argument("--repeats", type=jobs.whole(2), default=None,
                   help="timed steps per configuration (at least 2: a spread)")
    p.add_argument("--quick", "--smoke", action="store_true",
                   help="seconds long: a small block, 2 ranks, 3 repeats")
    p.add_argument("--out", default="results/tp.csv", help="the CSV")
    p.add_argument("--timeout", type=jobs.seconds, default=900.0,
                   help="seconds for the MPI job")
    p.add_argument("--oversubscribe", action="store_true")
    return p


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parser().parse_args(argv)
    base = Spec.quick() if args.quick else Spec(ranks=default_ranks())
    given: dict[str, Any] = {k: (tuple(sorted(set(v))) if isinstance(v, list) else v)
                             for k in ("ranks", "backends", "repeats")
                             if (v := getattr(args, k)) is not None}
    spec = dataclasses.replace(base, **given)

    def prepare() -> str:
        check_sizes(spec)
        note = jobs.check_ranks(spec.ranks, args.oversubscribe)
        check_writable(args.out, "file")
        return note

    return jobs.run_command(
        "pcourse.tools.bench.tp", argv, measure, spec,
        lambda outcome: report(outcome.rows, args.out), ranks=max(spec.ranks),
        timeout=args.timeout, prepare=prepare, error=parser().error,
        partial=Path(args.out).with_suffix(".partial.csv"),
        write=lambda path, rows: write_csv(path, rows, FIELDS), what="tensor-parallel benchmark",
        env={"OMP_NUM_THREADS": "1"})


if __name__ == "__main__":
    sys.exit(main())


def owners(whole: Any, parts: list[Any], dim: int) -> list[int]:
    """For each row (``dim`` 0) or column (1) of ``whole``, the rank whose block of it
    ``parts[rank]`` holds, found by the values (-1: nobody's, which would be a bug)."""
    import torch

    lines = whole.unbind(dim)
    found = [-1] * len(lines)
    for rank, part in enumerate(parts):
        for mine in part.unbind(dim):
            for i, line in enumerate(lines):
                if found[i] < 0 and torch.equal(mine, line):
                    found[i] = rank
                    break
    return found


def plot_split(ax: Any, column: list[int], row: list[int]) -> None:
    """A column-parallel layer then a row-parallel one, as the ranks hold them: the first
    weight A (in x hidden) by its columns, the second B (hidden x out) by its rows, each
    line coloured by the rank that holds it (``column``, ``row``: :func:`owners` of each),
    and where f and g sit on the way."""
    import matplotlib
    import numpy as np

    hidden = len(column)
    a = np.array(column, dtype=float)[None, :].repeat(6, axis=0)  # A: every row has all columns
    b = np.array(row, dtype=float)[:, None].repeat(6, axis=1)  # B: every column has all rows
    t = max(max(column), max(row)) + 1
    cmap = matplotlib.colormaps["tab10"]
    ax.imshow(a, extent=(3, 3 + hidden, 0, 6), cmap=cmap, vmin=0, vmax=9, aspect="auto")
    ax.imshow(b, extent=(6 + hidden, 12 + hidden, -hidden / 2 + 3, hidden / 2 + 3), cmap=cmap,
              vmin=0, vmax=9, aspect="auto")
    ax.text(3 + hidden / 2, 6.6, "A: column-parallel (its columns split)", ha="center", fontsize=8)
    ax.text(9 + hidden, hidden / 2 + 3.6, "B: row-parallel (its rows split)", ha="center",
            fontsize=8)
    for x, label in ((1.2, "X, whole\non every rank\n→ f"), (4.5 + hidden, "XA_r\n(GELU)"),
                     (13.8 + hidden, "partial sums\n→ g → Z")):
        ax.text(x, 3, label, ha="center", va="center", fontsize=8)
    for r in range(t):
        ax.plot([], [], "s", color=cmap(r), label=f"rank {r}")
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0), borderaxespad=0.0)
    ax.set(xlim=(-0.5, 16 + hidden), ylim=(min(0, 3 - hidden / 2) - 0.5, max(7, hidden / 2 + 4.2)))
    ax.axis("off")


def draw_mesh(ax: Any, coords: list[dict[str, int]], title: str = "") -> None:
    """The ranks of a mesh (``coords[r]``: rank r's coordinate on each named dimension,
    outermost first, as :class:`pcourse.mesh.Mesh` gives them), one box each: the
    outermost dimension side by side, the next down the page (if there are three), the
    innermost across; a shaded band joins each innermost group, lines the groups of the
    other dimensions (solid: the middle one, dashed: the outermost)."""
    from matplotlib.patches import FancyArrowPatch, FancyBboxPatch

    dims = list(coords[0])
    if not 2 <= len(dims) <= 3:
        raise ValueError(f"a mesh of 2 or 3 dimensions is drawn, got {dims}")
    outer, inner = dims[0], dims[-1]
    middle = dims[1] if len(dims) == 3 else None
    n_inner = 1 + max(c[inner] for c in coords)
    where = {}
    for r, c in enumerate(coords):
        x = c[outer] * (n_inner + 0.8) + c[inner]
        y = -c[middle] * 1.4 if middle else 0.0
        where[r] = (x, y)
        ax.add_patch(FancyBboxPatch((x - 0.38, y - 0.3), 0.76, 0.6, boxstyle="round,pad=0.02",
                                    fc=f"C{c[middle] if middle else 0}", alpha=0.35, ec="k"))
        ax.text(x, y + 0.08, f"rank {r}", ha="center", va="center", fontsize=8)
        ax.text(x, y - 0.13, " ".join(f"{d}{c[d]}" for d in dims), ha="center", va="center",
                fontsize=6)
    for a in where:
        for b in where:
            if a >= b:
                continue
            differ = [d for d in dims if coords[a][d] != coords[b][d]]
            if len(differ) != 1:
                continue
            (xa, ya), (xb, yb) = where[a], where[b]
            if differ[0] == inner:  # the innermost group: a band under its boxes
                ax.add_patch(FancyBboxPatch((min(xa, xb) - 0.45, ya - 0.37), abs(xb - xa) + 0.9,
                                            0.74, boxstyle="round,pad=0.02", fc="0.85",
                                            ec="none", zorder=0))
            elif differ[0] == middle:  # straight down, box edge to box edge
                top, low = sorted([(ya, xa), (yb, xb)], reverse=True)
                ax.plot([top[1], low[1]], [top[0] - 0.3, low[0] + 0.3], "-", color="0.3", lw=0.8)
            else:  # the outermost: an arc over the boxes between
                ax.add_patch(FancyArrowPatch((xa, ya + 0.3), (xb, yb + 0.3), arrowstyle="-",
                                             connectionstyle="arc3,rad=-0.3", ls="--",
                                             color="0.3", lw=0.8))
    xs, ys = zip(*where.values(), strict=True)
    ax.set(xlim=(min(xs) - 0.7, max(xs) + 0.7), ylim=(min(ys) - 0.6, max(ys) + 1.3),
           aspect="equal")
    ax.axis("off")
    key = f"grey band: a {inner} group"
    if middle:
        key += f"; solid: a {middle} group"
    ax.set_title((title + "\n" if title else "") + key + f"; dashed: a {outer} group", fontsize=8)
