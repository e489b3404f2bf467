"""``python -m pcourse.tools.bench.calibrate``: measure the cost model's constants here.

Lesson 13's cost model (:mod:`pcourse.cost_model`) predicts from constants measured on
the machine it predicts, in well under a minute:

- on rank 0, the others asleep: the FLOP/s of square float32 products of a few sizes
  and of attention's forward and backward (one thread, as every rank of a job on this
  machine has), the bytes per second an elementwise operator streams and what GELU and
  a norm cost per byte, and the overhead of one operator (a tiny model's forward
  and backward over the operators it dispatched: :func:`pcourse.cost_model.counting.count_ops`),
  of one in an optimizer's step, and of one passing a Python dispatch mode;
- at each rank count asked for: how much longer a small model's forward and backward
  takes on every rank at once than on one alone (the cores shared, with each other and
  with whatever else runs here); and per backend: an allreduce, a reduce-scatter and an
  all-gather as the course's strategies call them (no agreement check), and a send from
  one rank to the next, each timed at a few sizes as lesson 04 times a collective (the
  median call of the slowest rank, :func:`pcourse.timing.time_call`) and fitted to
  ``a + b·n`` (:func:`pcourse.collectives.fit_alpha_beta`); and what the agreement check
  adds to a call that asks for it.

The constants are printed and written atomically as JSON (``--out``; default
``results/calibration.json``), which :func:`pcourse.cost_model.machine.load` reads back.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import os
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from pcourse.tools.bench import jobs

KINDS = ("allreduce", "reduce_scatter", "all_gather", "send")
SQUARES = (32, 64, 128, 256, 512)


@dataclasses.dataclass(frozen=True)
class Spec:
    """What to measure: rank counts, backends, message sizes (bytes), repeats per point."""

    ranks: tuple[int, ...] = (2, 3)
    backends: tuple[str, ...] = ("mpi",)
    sizes: tuple[int, ...] = (1 << 10, 1 << 14, 1 << 17, 1 << 20, 1 << 22, 1 << 24)
    iters: int = 15
    seconds: float = 0.05  # per matmul size, and per other single-rank constant

    @classmethod
    def quick(cls, **changes: Any) -> Spec:
        """A lesson's quick mode: fewer sizes and repeats (seconds)."""
        base = cls(sizes=(1 << 10, 1 << 16, 1 << 20, 1 << 22), iters=5, seconds=0.02)
        return dataclasses.replace(base, **changes)

    def check(self, world: int | None = None) -> None:
        """Refuse what cannot be measured, before anything runs: naming the value."""
        from pcourse.cost_model.machine import BACKENDS, CostModelError

        for b in self.backends:
            if b not in BACKENDS:
                raise CostModelError(f"unknown backend {b!r}; calibrate one of "
                                     f"{', '.join(BACKENDS)}")
        for p in self.ranks:
            if p < 2 or (world is not None and p > world):
                raise CostModelError(f"rank count {p}: at least 2"
                                     + (f" and at most the {world} engines" if world else ""))
        if self.iters < 3 or len(set(self.sizes)) < 2:
            raise CostModelError("need at least 3 repeats and 2 different sizes to fit a + b·n")


# ------------------------------------------------------------------ one rank's constants
def _best(fn: Callable[[], Any], seconds: float) -> float:
    """The median of repeated calls of ``fn`` for about ``seconds`` (after one warm-up,
    at least 5): the median, as the step times it predicts are medians."""
    fn()
    times: list[float] = []
    while sum(times) < seconds or len(times) < 5:
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def matmul_rates(seconds: float) -> list[tuple[float, float]]:
    """(FLOPs, FLOP/s) of square float32 products of :data:`SQUARES` sizes, each result
    new memory kept a while, as a forward keeps what it computes (a product that writes
    into memory it used a moment ago runs faster than any step does)."""
    import torch

    out = []
    for n in SQUARES:
        a, b = torch.randn(n, n), torch.randn(n, n)
        out.append((2.0 * n**3, 2.0 * n**3 / _best(_kept(functools.partial(torch.mm, a, b)),
                                                   seconds)))
    return out


def _kept(fn: Callable[[], Any], pool: int = 32) -> Callable[[], None]:
    """``fn`` whose results are kept alive, the oldest let go past ``pool`` of them."""
    kept: list[Any] = []

    def call() -> None:
        kept.append(fn())
        if len(kept) > pool:
            kept.pop(0)

    return call


def bandwidth(seconds: float) -> float:
    """Bytes/s of ``add(a, b, out=c)`` on 4 Mi floats: 48 MiB read and written, more than
    a cache holds, as a step's activations are."""
    import torch

    a, b, c = (torch.randn(1 << 22) for _ in range(3))
    return 48.0 * (1 << 20) / _best(lambda: torch.add(a, b, out=c), seconds)


def per_byte(seconds: float) -> dict[str, float]:
    """Seconds per counted byte of the operators that compute more than they move:
    GELU and a norm, forward and backward, on ``[8192, 192]`` floats; and AdamW's own
    (a running average, a fused multiply-add, a square root, a division) on as many."""
    import torch

    from pcourse.cost_model.counting import count_ops

    aten = torch.ops.aten
    x, g = torch.randn(8192, 192), torch.randn(8192, 192)
    w, b = torch.ones(192), torch.zeros(192)
    _, mean, rstd = aten.native_layer_norm(x, [192], w, b, 1e-5)
    positive = g.abs() + 1
    calls = {"gelu": lambda: aten.gelu(x),
             "gelu_backward": lambda: aten.gelu_backward(g, x),
             "native_layer_norm": lambda: aten.native_layer_norm(x, [192], w, b, 1e-5),
             "native_layer_norm_backward": lambda: aten.native_layer_norm_backward(
                 g, x, [192], mean, rstd, w, b, [True, True, True]),
             "lerp_": lambda: x.lerp_(g, 0.1), "addcmul_": lambda: x.addcmul_(g, g, value=0.1),
             "addcdiv_": lambda: x.addcdiv_(g, positive, value=0.1),
             "sqrt": lambda: positive.sqrt(), "div": lambda: g / 1.5}
    out = {}
    for name, call in calls.items():
        counts, _ = count_ops(call)
        out[name] = _best(call, seconds) / counts.bytes
    return out


def attention_rates(seconds: float) -> list[tuple[float, float]]:
    """(FLOPs, FLOP/s) of causal attention's forward and of its backward, at a few sizes
    (sequence, batch, heads, head width), laid out as the course's blocks lay it out
    (sequence first, heads split from the width:
    :func:`~pcourse.workloads.transformer.causal_attention`), FLOPs as torch's table
    counts them."""
    import torch

    from pcourse.cost_model.counting import count_ops
    from pcourse.workloads.transformer import causal_attention

    out = []
    for seq, batch, heads, width in ((16, 2, 4, 16), (48, 4, 12, 16), (128, 8, 8, 32)):
        qkv = tuple(torch.randn(seq, batch, heads * width, requires_grad=True)
                    for _ in range(3))

        def forward(qkv: tuple[torch.Tensor, ...] = qkv, heads: int = heads) -> torch.Tensor:
            q, k, v = qkv
            return causal_attention(q, k, v, heads)

        y = forward()

        def backward(y: torch.Tensor = y, qkv: tuple = qkv) -> None:
            torch.autograd.grad(y, qkv, torch.ones_like(y), retain_graph=True)

        for fn in (forward, backward):
            counts, _ = count_ops(fn)
            out.append((float(counts.flops), counts.flops / _best(fn, seconds)))
    return sorted(out)


REFERENCE = (96, 8, 384, 32, 8, 96)  # a block's width, heads, MLP; its input's shape


def _reference() -> Callable[[], None]:
    """A small model's forward and backward: the same computation alone and at p ranks."""
    import torch

    from pcourse.workloads.transformer import Block

    block, x = Block(*REFERENCE[:3]), torch.randn(*REFERENCE[3:])
    return lambda: block(x).square().mean().backward()


def _stretch(step: Callable[[], object], repeats: int) -> float:
    """Seconds per ``step()`` over ``repeats`` in a row: the mean, which counts the time
    slices a rank waits for a core (a median of short steps would skip them)."""
    step()
    start = time.perf_counter()
    for _ in range(repeats):
        step()
    return (time.perf_counter() - start) / repeats


def slowdown(comm: Any, alone: float, spec: Spec) -> tuple[float, float]:
    """How much longer :func:`_reference` takes on every rank of ``comm`` at once than on
    one rank alone (``alone``, :func:`_stretch`'s too), as the slowest rank saw it; and
    what a collective between such steps costs beyond its own latency: waiting for the
    ranks to meet, one of them perhaps off its core (the same steps, each followed by a
    one-number allreduce, against the steps alone and the allreduce alone)."""
    import torch

    from pcourse.backends import make_backend
    from pcourse.timing import time_call

    step = _reference()
    repeats = max(5, int(spec.seconds * 8 / alone))
    jobs.wait_politely(comm)
    mine = _stretch(step, repeats)
    jobs.wait_politely(comm)  # a rank done early sleeps: it must not spin on a busy core
    with make_backend("mpi", comm=comm) as group:
        x = torch.zeros(1)
        call = float(statistics.median(time_call(comm, lambda: group.allreduce(
            x, "sum", check=False), 2, spec.iters)))
        jobs.wait_politely(comm)
        met = _stretch(lambda: (step(), group.allreduce(x, "sum", check=False)), repeats)
    factor = max(comm.allgather(mine)) / alone
    return factor, max(0.0, max(comm.allgather(met)) - max(comm.allgather(mine)) - call)


def view_overhead(seconds: float) -> float:
    """Seconds per view: 100 transposes of a small tensor, timed, over 100."""
    import torch

    x = torch.randn(4, 8)

    def views() -> None:
        for _ in range(100):
            x.t()

    return _best(views, seconds) / 100


def op_overhead(seconds: float, view: float) -> float:
    """Seconds per operator of a tiny transformer block's forward and backward (its
    modules' calls and autograd included): its time, less its views', over the other
    operators :func:`~pcourse.cost_model.counting.count_ops` counts."""
    import torch

    from pcourse.cost_model.counting import count_ops
    from pcourse.workloads.transformer import Block

    block, x = Block(8, 2, 16), torch.randn(4, 2, 8)

    def step() -> None:
        block(x).square().mean().backward()

    counts, _ = count_ops(step)
    views = len(counts) - counts.operators
    return max(_best(step, seconds) - views * view, 0.0) / counts.operators


def step_overhead(seconds: float) -> float:
    """Seconds per operator of an optimizer's step (a loop in Python, nothing recorded for
    autograd): AdamW's step and ``zero_grad`` over a tiny block's parameters, over the
    operators :func:`~pcourse.cost_model.counting.count_ops` counts."""
    import torch

    from pcourse.cost_model.counting import count_ops
    from pcourse.workloads.transformer import Block

    opt = torch.optim.AdamW(Block(8, 2, 16).parameters())
    for q in opt.param_groups[0]["params"]:
        q.grad = torch.zeros_like(q)
    counts, _ = count_ops(step := lambda: (opt.step(), opt.zero_grad(set_to_none=False)))
    return _best(step, seconds) / counts.operators


def mode_overhead(seconds: float, machine: Any) -> float:
    """Seconds an operator costs per Python dispatch mode it passes: :func:`_reference`'s
    block under torch's selective checkpointing (lesson 13's policy: a mode in front of
    every operator, in the forward and the recomputation) against the same without,
    beyond what ``machine`` (the other constants, this one 0) prices for the operators
    it adds, over the operators the modes handled (``count_ops``' ``modes``)."""
    import torch

    from pcourse.checkpointing import run_segments
    from pcourse.cost_model.counting import compute_time, count_ops
    from pcourse.workloads.transformer import Block

    block, x = Block(*REFERENCE[:3]), torch.randn(*REFERENCE[3:])
    took, priced, handled = [], [], 0
    for how in ("none", "selective"):
        counts, _ = count_ops(step := lambda how=how: run_segments(
            [block], x, 1, how).square().mean().backward())
        took.append(_best(step, seconds))
        priced.append(compute_time(counts, machine))
        handled += sum(o.modes for o in counts.ops)
    return max((took[1] - took[0]) - (priced[1] - priced[0]), 0.0) / handled


def first_touch(seconds: float) -> float:
    """Seconds per byte a result written to new memory costs beyond the operator itself:
    an addition of 1 MiB vectors into a fresh result kept alive (as a forward keeps its
    activations), against the same addition into a result that exists."""
    import torch

    n = 1 << 18
    a, b, c = torch.randn(n), torch.randn(n), torch.empty(n)
    kept: list[torch.Tensor] = []

    def fresh() -> None:
        kept.append(torch.add(a, b))
        if len(kept) > 32:
            kept.clear()

    return max(_best(fresh, seconds) - _best(lambda: torch.add(a, b, out=c), seconds),
               0.0) / (4 * n)


# ------------------------------------------------------------------ the links
def _kind_call(kind: str, group: Any, nbytes: int) -> Callable[[], Any]:
    """One call of ``kind`` moving ``nbytes`` as the strategies make it (unchecked)."""
    import torch

    p, n = group.size, max(1, nbytes // 4 // group.size) * group.size
    whole, part = torch.zeros(n), torch.zeros(n // p)
    if kind == "allreduce":
        return lambda: group.allreduce(whole, "sum", check=False)
    if kind == "reduce_scatter":
        return lambda: group.reduce_scatter(part, whole, "sum", check=False)
    if kind == "all_gather":
        return lambda: group.all_gather(whole, part, check=False)
    nxt, prev = (group.rank + 1) % p, (group.rank - 1) % p

    def send() -> None:  # every rank sends to the next and receives from the previous
        work = group.send(whole, nxt)
        group.recv(torch.empty_like(whole), prev)
        work.wait()
    return send


def fit_link(comm: Any, group: Any, kind: str, spec: Spec) -> tuple[float, float]:
    """(a, b) of ``kind``'s time over the sizes (lesson 03's fit)."""
    from pcourse.collectives import fit_alpha_beta
    from pcourse.timing import time_call

    medians = [float(statistics.median(time_call(comm, _kind_call(kind, group, n), 2,
                                                 spec.iters))) for n in spec.sizes]
    sizes = [max(1, n // 4 // group.size) * group.size * 4 for n in spec.sizes]
    return fit_alpha_beta(sizes, medians)


def check_cost(comm: Any, group: Any, spec: Spec) -> float:
    """Seconds the agreement check adds to a small allreduce."""
    import torch

    from pcourse.timing import time_call

    x = torch.zeros(64)
    with_check = statistics.median(time_call(comm, lambda: group.allreduce(x, "sum"), 2,
                                             spec.iters))
    without = statistics.median(time_call(comm, lambda: group.allreduce(x, "sum", check=False),
                                          2, spec.iters))
    return max(float(with_check - without), 0.0)


def measure_links(comm: Any, spec: Spec, progress: jobs.Progress, alone: float) -> None:
    """On a group of p ranks: their slowdown computing at once; every kind's (a, b) and
    the check's cost, per backend."""
    from pcourse.backends import make_backend

    factor, meeting = slowdown(comm, alone, spec)
    progress.done(f"{comm.size} ranks computing at once",
                  [{"slowdown": [comm.size, factor], "meeting": [comm.size, meeting]}])
    for backend in spec.backends:
        with make_backend(backend, comm=comm) as group:
            check = check_cost(comm, group, spec)
            rows = [{"key": f"{backend} {kind} {comm.size}",
                     "link": (*fit_link(comm, group, kind, spec), check)} for kind in KINDS]
            progress.done(f"{backend} at {comm.size} ranks", rows)


def measure(comm: Any, spec: Spec, progress: jobs.Progress) -> None:
    """Every rank: rank 0's own constants (the others asleep), then the links."""
    spec.check(comm.size)
    progress.total = 1 + len(spec.ranks) * (1 + len(spec.backends))
    alone = 0.0
    if comm.rank == 0:
        import torch

        step = _reference()
        alone = _stretch(step, max(5, int(spec.seconds * 8 / _best(step, spec.seconds))))
        row = {"matmul": matmul_rates(spec.seconds), "bandwidth": bandwidth(spec.seconds),
               "attention": attention_rates(spec.seconds), "per_byte": per_byte(spec.seconds),
               "view_overhead": (view := view_overhead(spec.seconds)),
               "op_overhead": op_overhead(spec.seconds, view),
               "first_touch": first_touch(spec.seconds), "mode_overhead": 0.0,
               "step_overhead": step_overhead(spec.seconds),
               "cores": os.cpu_count() or 1, "threads": torch.get_num_threads()}
        row["mode_overhead"] = mode_overhead(spec.seconds, machine_from([row]))
        progress.done("one rank's compute", [row])
    jobs.wait_politely(comm)
    alone = comm.bcast(alone)
    with jobs.RankGroups(comm, spec.ranks) as groups:
        for p in spec.ranks:
            groups.run(p, lambda sub: measure_links(sub, spec, progress, alone))


def machine_from(rows: Sequence[dict], about: str = "") -> Any:
    """The :class:`~pcourse.cost_model.machine.Machine` the rows measured."""
    from pcourse.cost_model.machine import Machine

    one = next(r for r in rows if "matmul" in r)
    return Machine.from_json({
        **one, "about": about, "links": {r["key"]: dict(zip(("a", "b", "check"), r["link"],
                                                          strict=True))
                                         for r in rows if "key" in r},
        "slowdown": dict(r["slowdown"] for r in rows if "slowdown" in r),
        "meeting": dict(r["meeting"] for r in rows if "meeting" in r)})


def run_on(view: Any, spec: Spec | None = None, *, progress: bool = True,
           timeout: float = 300.0) -> Any:
    """Calibrate on a running cluster's engines (``mc.view``); the Machine."""
    world = jobs.cluster_size(view)
    spec = spec or Spec(ranks=tuple(p for p in (2, 3) if p <= world))
    outcome = jobs.on_cluster(view, measure, spec, desc="calibrate", timeout=timeout,
                              progress=progress)
    return machine_from(outcome.rows, about=describe())


def describe() -> str:
    """Where and when: host, cores, torch, the date."""
    import platform

    import torch

    return (f"{platform.node()}, {os.cpu_count()} cores, torch {torch.__version__}, "
            f"{time.strftime('%Y-%m-%d %H:%M')}")


# ------------------------------------------------------------------ the command line
def report(machine: Any, out: str) -> None:
    """Print the constants, and write them (atomically)."""
    from pcourse.cost_model.machine import save

    print_constants(machine)
    path = save(machine, out)
    print(f"wrote {path}")


def print_constants(machine: Any) -> None:
    """Every constant of ``machine``, in the units a reader compares."""
    from pcourse.cost_model.machine import alpha_beta

    print(f"calibrated on {machine.about}")
    for kind, table in (("matmul", machine.matmul), ("attention", machine.attention)):
        for flops, rate in table:
            print(f"  {kind:9} of {flops:>12,.0f} FLOPs: {rate / 1e9:8.1f} GFLOP/s")
    for name, cost in machine.per_byte.items():
        print(f"  {name:28} {1 / cost / 1e9:6.2f} GB/s")
    for p, factor in sorted(machine.slowdown.items()):
        print(f"  {p} ranks computing at once: each {factor:.2f}× as long as one alone; a "
              f"collective between steps waits {machine.meeting.get(p, 0) * 1e6:.0f} µs more "
              "for them to meet")
    print(f"  elementwise bandwidth {machine.bandwidth / 1e9:.2f} GB/s; operator overhead "
          f"{machine.op_overhead * 1e6:.2f} µs, per view {machine.view_overhead * 1e6:.2f} "
          f"µs; first touch of new memory {machine.first_touch * 1e9:.3f} ns/B")
    print(f"  per operator of an optimizer's step {machine.step_overhead * 1e6:.2f} µs; per "
          f"operator and Python dispatch mode it passes {machine.mode_overhead * 1e6:.2f} µs")
    for key, link in sorted(machine.links.items()):
        backend, kind, p = key.split()
        alpha, beta = alpha_beta(kind, int(p), link)
        print(f"  {key:28} a = {link.a * 1e6:8.1f} µs  b = {link.b * 1e9:7.3f} ns/B  "
              f"(α {alpha * 1e6:7.1f} µs, β {beta * 1e9:6.3f} ns/B)  check +"
              f"{link.check * 1e6:.1f} µs")


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m pcourse.tools.bench.calibrate",
                                description=__doc__.split("\n")[0])
    p.add_argument("--ranks", nargs="+", type=jobs.whole(2), default=[2, 3],
                   help="rank counts to fit the collectives at (default: 2 3)")
    p.add_argument("--backends", nargs="+", default=["mpi"], help="mpi, gloo")
    p.add_argument("--quick", action="store_true", help="fewer sizes and repeats")
    p.add_argument("--out", default=str(Path("results") / "calibration.json"))
    p.add_argument("--timeout", type=jobs.seconds, default=300.0)
    p.add_argument("--oversubscribe", action="store_true")
    return p


def main(argv: list[str] | None = None) -> int:
    from pcourse.cost_model.machine import CostModelError
    from pcourse.utils.io import check_writable

    argv = list(sys.argv[1:] if argv is None else argv)
    args = parser().parse_args(argv)
    base = Spec.quick() if args.quick else Spec()
    spec = dataclasses.replace(base, ranks=tuple(sorted(set(args.ranks))),
                               backends=tuple(args.backends))

    def prepare() -> str:
        spec.check()
        note = jobs.check_ranks(spec.ranks, args.oversubscribe)
        check_writable(args.out, "file")
        return note

    return jobs.run_command(
        "pcourse.tools.bench.calibrate", argv, measure, spec,
        lambda o: report(machine_from(o.rows, describe()), args.out), ranks=max(spec.ranks),
        timeout=args.timeout, prepare=prepare, error=parser().error, refused=(CostModelError,),
        what="calibration", env={"OMP_NUM_THREADS": "1"})


if __name__ == "__main__":
    sys.exit(main())
