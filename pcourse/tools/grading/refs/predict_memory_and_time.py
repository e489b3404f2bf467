"""Exercise 11, predict memory and time: the learner's cost model of four strategies.

The learner writes plain Python: ``collective_time`` (lesson 03's α-β terms plus the
per-call overhead) and, for DP with buckets, ZeRO-1, tensor parallelism and 1F1B, one
function each that returns a rank's bytes (parameters, gradients kept between steps,
optimizer state, saved activations, the peak) and the step's seconds, from a model's
sizes (:func:`model_of`) and given :class:`Constants`. The trials run those functions
where the learner's code runs and send back numbers only. The references are computed
here, by lesson 13's cost model (:mod:`pcourse.cost_model`), never by a second copy of
its formulas, and the peaks of the float32 configurations also by the allocator, each
strategy built on a stand-in group (:class:`~pcourse.tools.bench.strategies.Absent`) in
this process. The configurations are held out: drawn from :data:`SEED`, which the
exercise never shows, at p = 2, 3 and 4, in float32 and bfloat16, at shapes it never
names. Nothing here reads a clock: every verdict is the same on every machine.
"""

from __future__ import annotations

import functools
import numbers
import random
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from pcourse.tools.bench.predict import MEDIAN_BAR, TAU_BAR, WORST_BAR
from pcourse.tools.bench.predict import MEMORY_BAR as PEAK_BAR  # lesson 13's bars
from pcourse.tools.grading.checks import Check, Contract, ExerciseError, Learner, checker, run

COLLECTIVE = Learner("collective_time")
LEARNERS = {"dp": Learner("predict_dp"), "zero1": Learner("predict_zero1"),
            "tp": Learner("predict_tp"), "1f1b": Learner("predict_1f1b")}
NAMES = {"dp": "DP with buckets", "zero1": "ZeRO-1", "tp": "tensor parallelism",
         "1f1b": "1F1B"}
BYTES = ("parameters", "gradients", "optimizer", "activations")
KEYS = (*BYTES, "peak", "time")
SEED, CONFIGS, MEASURED = 20261206, 15, 4  # MEASURED: float32 configurations measured
KINDS = ("allreduce", "reduce_scatter", "all_gather", "send")
CONTRACT = Contract(why_not={
    "dtypes": "numbers in, numbers out: a dtype enters as its itemsize, and the "
              "configurations draw float32 and bfloat16",
    "shapes": "the configurations are drawn from a seed the notebook never shows: "
              "p = 2, 3 and 4, and shapes it never names",
    "aliasing": "no tensors: the functions take numbers and return a new dict",
    "groups": "no group: plain Python, called once per configuration",
    "orders": "no order is taken: 1F1B's is fixed by the formula being predicted",
    "accumulation": "nothing trains: the functions predict a step, they do not take one"})


@dataclass(frozen=True)
class Constants:
    """What the machine costs: ``flops`` FLOP/s one rank computes; ``adam`` s per
    parameter one AdamW step updates; ``alpha`` s per message on a collective's critical
    path; ``beta`` s per byte on it; ``overhead`` s every call (collective or send) costs
    before it moves a byte."""

    flops: float
    adam: float
    alpha: float
    beta: float
    overhead: float


# ------------------------------------------------------------------ configurations
def configurations(n: int = CONFIGS, seed: int = SEED) -> list[dict]:
    """n held-out configurations: p, m (micro-batches), a stack's sizes, the bucket cap,
    and the constants; each p in turn, m from 1 to p (where the bubble is a third or more)."""
    rng = random.Random(seed)
    out = []
    for k in range(n):
        p = (2, 3, 4)[k % 3]
        d = rng.choice((48, 72, 96))
        shape = {"layers": rng.randint(p, 5), "d": d, "heads": 12,
                 "hidden": d * rng.choice((2, 3, 4)), "seq": rng.choice((8, 12, 16)),
                 "batch": rng.choice((12, 24)), "itemsize": (4, 2)[k // 3 % 2]}
        c = {"flops": 1e9 * rng.uniform(5, 50), "adam": 1e-9 * rng.uniform(2, 20),
             "alpha": 1e-6 * rng.uniform(2, 20), "beta": 1e-10 * rng.uniform(2, 20),
             "overhead": 1e-6 * rng.uniform(20, 200)}
        out.append({"p": p, "m": rng.randint(1, p), "shape": shape, "parts": rng.choice((2, 3)),
                    "c": {key: float(f"{v:.3g}") for key, v in c.items()}})
    return out


def stack(cfg: dict) -> Any:
    from pcourse.cost_model.shapes import Stack

    return Stack(**cfg["shape"])


def cap(cfg: dict) -> int:
    """The bucket cap: the model's bytes in ``parts`` buckets, about."""
    shape = stack(cfg)
    return -(-shape.params() * shape.itemsize // cfg["parts"])


def model_of(cfg: dict) -> dict:
    """The numbers the learner's functions get, read off lesson 13's :class:`Stack`: the
    block's parameters (and those tensor parallelism leaves whole), the buckets, the
    training FLOPs of one sample, and per sample the bytes a block saves (the part
    tensor parallelism splits t ways and the part it does not), of one ``[seq, d]``
    activation, one ``[seq, hidden]`` one, and the MLP's second weight."""
    from pcourse.cost_model import memory

    shape, s = stack(cfg), cfg["shape"]["itemsize"]
    one, half = shape.block_saved(batch=1), shape.block_saved(t=2, batch=1)
    split = 2 * (one - half)  # saved = whole + split / t: two degrees say both
    return {"layers": shape.layers, "batch": shape.batch, "itemsize": s,
            "block_params": shape.block_params(), "block_whole": shape.block_params_whole(),
            "buckets": memory.buckets(shape, cap(cfg)), "flops": shape.flops_per_token()
            * shape.seq, "act_whole": one - split, "act_split": split, "out": shape.unit(1),
            "wide": shape.seq * shape.hidden * s, "fc2": shape.d * shape.hidden * s}


def example() -> tuple[dict, Constants]:
    """A configuration to try functions on (never one the checks use)."""
    cfg = {"shape": {"layers": 4, "d": 64, "heads": 4, "hidden": 256, "seq": 16, "batch": 8,
                     "itemsize": 4}, "parts": 3}
    return model_of(cfg), Constants(flops=2e10, adam=5e-9, alpha=1e-5, beta=1e-9,
                                    overhead=5e-5)


# ------------------------------------------------------------------ trials (the learner's side)
def _number(value: Any, what: str) -> float:
    if isinstance(value, bool) or not isinstance(value, numbers.Real):  # numpy's too
        raise TypeError(f"{what} is {type(value).__name__} {value!r}, not a number")
    return float(value)


def collective_trial(fn: Callable, cases: list[dict]) -> list[list[float]]:
    """The learner's seconds for each case at its constants, then at three probes that
    cost only the overhead, only α, only β (1 s each): what each term counts."""
    probes = [dict.fromkeys(("flops", "adam", "alpha", "beta", "overhead"), 0.0) | {k: 1.0}
              for k in ("overhead", "alpha", "beta")]
    return [[_number(fn(case["kind"], case["n"], case["p"], Constants(**c)), "collective_time's "
                     "result") for c in (case["c"], *probes)] for case in cases]


def strategy_trial(fn: Callable, strategy: str, cases: list[dict]) -> list[dict]:
    """The learner's prediction for each case (on every stage for 1F1B), numbers only."""
    out, name = [], getattr(fn, "__name__", "your function")
    for case in cases:
        c = Constants(**case["c"])
        ranks = range(case["p"]) if strategy == "1f1b" else [None]
        for r in ranks:
            args = (case["p"], r, case["m"]) if strategy == "1f1b" else (case["p"],)
            got = fn(dict(case["model"]), *args, c)
            if not isinstance(got, dict) or set(KEYS) - set(got):
                missing = sorted(set(KEYS) - set(got)) if isinstance(got, dict) else KEYS
                raise TypeError(f"{name} returned {type(got).__name__} without "
                                f"{', '.join(missing)}: return a dict of {', '.join(KEYS)}")
            out.append({k: _number(got[k], f"{name}'s {k!r}") for k in KEYS})
    return out


# ------------------------------------------------------------------ references (here)
def _terms(kind: str, p: int) -> tuple[float, float]:
    """(messages one after another, bytes on the critical path per byte): lesson 03's."""
    from pcourse.collectives import cost_terms, half_cost_terms

    return cost_terms("ring", p) if kind == "allreduce" else half_cost_terms(p) \
        if kind in ("reduce_scatter", "all_gather") else (1.0, 1.0)


def link(kind: str, p: int, c: Constants) -> Any:
    """The cost model's :class:`~pcourse.cost_model.machine.Link` of one call."""
    from pcourse.cost_model.machine import Link

    steps, volume = _terms(kind, p)
    return Link(c.overhead + steps * c.alpha, volume * c.beta)


def reference(strategy: str, cfg: dict) -> list[dict]:
    """Lesson 13's prediction of one configuration (one dict per stage for 1F1B)."""
    from pcourse.cost_model import memory, step_time
    from pcourse.cost_model.step_time import Work

    shape, p, m, c = stack(cfg), cfg["p"], cfg["m"], Constants(**cfg["c"])
    s, flops = shape.itemsize, shape.flops_per_token() * shape.seq / c.flops  # s per sample

    def work(samples: float, params: int) -> Work:
        return Work(flops * samples / 3, 2 * flops * samples / 3, params * c.adam)

    if strategy == "1f1b":
        mems = [memory.pipeline_memory(shape, p, r, m, "1f1b") for r in range(p)]
        share = [mm.parameters / s / shape.block_params() / shape.layers for mm in mems]
        b = shape.batch // m
        t = step_time.pipeline_step_time(
            [flops * b * x / 3 for x in share], [2 * flops * b * x / 3 for x in share], m,
            link("send", p, c), shape.unit(b), max(mm.parameters // s for mm in mems) * c.adam)
        return [{**_bytes(mm), "time": t} for mm in mems]
    if strategy == "dp":
        mm = memory.dp_memory(shape, p)
        t = step_time.dp_step_time(work(shape.batch / p, shape.params()),
                                   [n * s for n in memory.buckets(shape, cap(cfg))],
                                   link("allreduce", p, c), overlap=True)
    elif strategy == "zero1":
        mm = memory.zero_memory(shape, p, 1, cap(cfg))
        sizes = [memory.padded(n, p) * s for n in memory.buckets(shape, cap(cfg))]
        t = step_time.zero_step_time(work(shape.batch / p, sum(sizes) // s // p), sizes,
                                     link("reduce_scatter", p, c), link("all_gather", p, c))
    else:
        mm = memory.tp_memory(shape, p)
        t = step_time.tp_step_time(work(shape.batch / p, shape.params(p)), shape.layers,  # B/t
                                   shape.unit(), link("allreduce", p, c))
    return [{**_bytes(mm), "time": t}]


def _bytes(mm: Any) -> dict:
    return {**{k: getattr(mm, k) for k in BYTES}, "peak": mm.peak}


@functools.lru_cache(maxsize=64)
def measured_peak(strategy: str, key: str, rank: int) -> int:
    """The allocator's peak of one rank's step (float32), above what was there before,
    the strategy built on a stand-in group in this process (no clock is read)."""
    import ast

    import torch

    from pcourse.runtime.ranks import threads
    from pcourse.tools.bench import measured, strategies

    cfg = ast.literal_eval(key)
    shape, p = stack(cfg), cfg["p"]
    name = {"dp": "ddp-buckets"}.get(strategy, strategy)
    torch.manual_seed(0)
    x = torch.randn(shape.seq, shape.batch, shape.d)
    group = strategies.Absent(rank, p)
    mine = strategies.local_input(name, group, x)
    with threads(1):
        return measured.profiled(lambda: strategies.build(
            name, group, shape, mine, micro=cfg["m"], bucket_cap=cap(cfg)), lambda: None)[2]


# ------------------------------------------------------------------ the checks
_NONE_KEPT = "zero_grad() sets them to None: none are kept between steps"
_ADAM = "AdamW keeps two numbers per parameter it steps (exp_avg and exp_avg_sq)"
_DATA = "each block saves its share for batch/p samples, and the loss the output"
HINTS = {  # what each count is, said where it is wrong
    "parameters": {"dp": "every rank holds every parameter",
                   "zero1": "every rank holds every parameter, each bucket padded to p's multiple",
                   "tp": "tensor parallelism divides each block's weights by t; the norms and "
                         "the row-parallel biases stay whole",
                   "1f1b": "a stage holds its own blocks only (the first layers % p one more)"},
    "gradients": {"dp": "DDP's buckets keep every gradient between steps", "tp": _NONE_KEPT,
                  "zero1": "ZeRO-1 shards the optimizer's state only: every rank keeps the "
                           "whole (padded) gradient buffer; sharding the gradients is ZeRO-2",
                  "1f1b": _NONE_KEPT},
    "optimizer": {"dp": _ADAM, "tp": _ADAM, "1f1b": _ADAM,
                  "zero1": _ADAM + ", for this rank's 1/p of the padded buckets"},
    "activations": {"dp": _DATA, "zero1": _DATA,
                    "tp": "the whole batch on every rank; only the split part of each block's "
                          "saved bytes divides by t",
                    "1f1b": "1F1B keeps min(p - rank, m) micro-batches in flight, not m, and "
                            "every message sent stays until the step ends"},
}
TIME_HINTS = {"dp": "each bucket's allreduce starts once the backward has filled it and the "
                    "one before has ended; only what runs past the backward's end adds",
              "zero1": "a reduce-scatter and an all-gather per padded bucket, and the "
                       "optimizer steps this rank's 1/p",
              "tp": "four allreduces of the whole [seq, batch, d] activation per block",
              "1f1b": "the bubble: (m - 1)·max_r(F_r + B_r) + Σ_r(F_r + B_r), plus 2(p - 1) "
                      "sends and the slowest stage's optimizer"}


def describe(cfg: dict, rank: int | None = None) -> str:
    sh = cfg["shape"]
    return (f"p={cfg['p']}" + (f", stage {rank}, m={cfg['m']}" if rank is not None else "")
            + f" ({sh['layers']} blocks, d={sh['d']}, hidden={sh['hidden']}, seq={sh['seq']}, "
            f"batch={sh['batch']}, {'float32' if sh['itemsize'] == 4 else 'bfloat16'})")


def collective_problem(cases: list[dict], got: list[list[float]]) -> str | None:
    if len(got) != len(cases):
        return f"{len(got)} results where {len(cases)} were asked for"
    for case, (t, over, alpha, beta) in zip(cases, got, strict=True):
        kind, n, p = case["kind"], case["n"], case["p"]
        steps, volume = _terms(kind, p)
        where = f"{kind} of {n} bytes at p={p}: "
        if not _close(over, 1.0):
            return where + (f"the per-call overhead counted {over:g} times: every call costs "
                            "c.overhead once, before it moves a byte")
        if not _close(alpha, steps):
            return where + (f"{alpha:g} latencies α where a ring has {steps:g} messages one "
                            "after another")
        if not _close(beta, volume * n):
            return where + (f"{beta / n:.4g}·n bytes on the critical path where the ring's "
                            f"carries {volume:.4g}·n: "
                            + {"allreduce": "2(p - 1)/p", "send": "1"}.get(kind, "(p - 1)/p")
                            + " per byte")
        want = link(kind, p, Constants(**case["c"])).time(n)
        if not _close(t, want):
            return where + f"{t:.6g} s where overhead + steps·α + volume·n·β is {want:.6g} s"
    return None


def _close(a: float, b: float) -> bool:
    return abs(a - b) <= 1e-9 * max(abs(a), abs(b)) + 1e-15


def strategy_problem(strategy: str, cfgs: list[dict], got: list[dict],
                     peak_of: Callable[[dict, int], int | None]) -> str | None:
    """Bytes exactly, each peak within 10% of the model and of the allocator
    (``peak_of(cfg, rank)``, None where not measured), the step's times within the bars."""
    from pcourse.cost_model.compare import error, summary

    rows = [(cfg, r if strategy == "1f1b" else None, want) for cfg in cfgs
            for r, want in enumerate(reference(strategy, cfg))]
    if len(got) != len(rows):
        return f"{len(got)} results where {len(rows)} were asked for"
    name = NAMES[strategy]
    for (cfg, r, want), mine in zip(rows, got, strict=True):
        for k in BYTES:
            if mine[k] != want[k]:  # exact: whole bytes, counted
                return (f"{name} at {describe(cfg, r)}: {k} {mine[k]:,.0f} bytes where the "
                        f"model counts {want[k]:,}: {HINTS[k][strategy]}")
    for (cfg, r, want), mine in zip(rows, got, strict=True):
        for what, ref in (("the model says", want["peak"]), ("the allocator measured",
                                                              peak_of(cfg, r or 0))):
            if ref is not None and abs(error(mine["peak"], ref)) > PEAK_BAR:
                return (f"{name} at {describe(cfg, r)}: peak {mine['peak']:,.0f} bytes where "
                        f"{what} {ref:,} ({error(mine['peak'], ref):+.0%}; within "
                        f"{PEAK_BAR:.0%}): the state at rest, the activations in flight, the "
                        "backward's first temporaries (and gradients once they exist)")
    steps = [(cfg, mine["time"], want["time"]) for (cfg, r, want), mine in zip(rows, got,
                                                                               strict=True)
             if not r]
    if any(t <= 0 for _, t, _ in steps):
        return f"{name}: a step time of 0 s or less"
    # the references are computed, not timed: every pair is decided, τ is over all of them
    b = summary([t for _, t, _ in steps], [w for _, _, w in steps])
    cfg, t, w = max(steps, key=lambda x: abs(error(x[1], x[2])))
    if b["median"] > MEDIAN_BAR or b["worst"] > WORST_BAR or b["tau"] < TAU_BAR:
        return (f"{name}'s step time over {b['n']} configurations: median |error| "
                f"{b['median']:.0%} (at most {MEDIAN_BAR:.0%}), worst {b['worst']:.0%} (at most "
                f"{WORST_BAR:.0%}; {t * 1e3:.3g} ms where the model says {w * 1e3:.3g} ms at "
                f"{describe(cfg)}), Kendall's τ {b['tau']:.2f} (at least {TAU_BAR}): "
                f"{TIME_HINTS[strategy]}")
    return None


def collective_cases() -> list[dict]:
    c = configurations()
    return [{"kind": kind, "n": n, "p": p, "c": c[(i + j) % len(c)]["c"]}
            for i, kind in enumerate(KINDS) for j, p in enumerate((2, 3, 4))
            for n in (4096, 3_000_000)]


def _peak(strategy: str) -> Callable[[dict, int], int | None]:
    measured = [cfg for cfg in configurations() if cfg["shape"]["itemsize"] == 4][:MEASURED]

    def peak_of(cfg: dict, rank: int) -> int | None:
        return measured_peak(strategy, repr(cfg), rank) if cfg in measured else None

    return peak_of


def _collectives(mc: Any) -> str | None:
    cases = collective_cases()
    return collective_problem(cases, run(mc, collective_trial, COLLECTIVE, cases, ranks=1)[0])


def _strategy(mc: Any, strategy: str) -> str | None:
    cfgs = configurations()
    cases = [{"p": cfg["p"], "m": cfg["m"], "c": cfg["c"], "model": model_of(cfg)}
             for cfg in cfgs]
    try:
        got = run(mc, strategy_trial, LEARNERS[strategy], strategy, cases, ranks=1)[0]
    except ExerciseError as exc:
        return str(exc)
    return strategy_problem(strategy, cfgs, got, _peak(strategy))


CHECKS = (
    Check("collective_time: overhead + steps·α + volume·n·β, lesson 03's ring terms",
          _collectives),
    *(Check(f"{NAMES[s]}: bytes exact, peaks within 10% of the model and the allocator, step "
            f"times within the bars, over {CONFIGS} held-out configurations",
            functools.partial(_strategy, strategy=s)) for s in LEARNERS),
)
check = checker(CHECKS)
