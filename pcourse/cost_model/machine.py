"""The constants a prediction needs, measured on the machine it predicts (lesson 13).

A :class:`Machine` holds what one calibration measured (``python -m pcourse.tools.bench
calibrate``): how fast one core multiplies matrices and computes attention of each size,
how fast it streams memory, what the few operators that compute more than they move cost
per byte, what every operator costs before it does any work, and per backend, collective
and rank count the two numbers of lesson 03's α-β model. Nothing here is looked up: a
constant the calibration did not measure is :class:`NotCalibrated`, never a default.

On a CPU the fixed costs rule small work: an operator's dispatch and autograd's
bookkeeping cost microseconds whatever its size, and a collective's call costs its
latency plus the course's agreement check (one tiny allreduce) before any byte moves.
Both are measured, and both are part of the model, as is the sharing of cores: p ranks
on c cores compute, when p > c, at c/p of their speed each, and slower still when other
work shares the machine: the calibration measures the slowdown of p ranks computing at
once against one alone (:meth:`Machine.share`).
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

from pcourse.collectives import cost_terms, half_cost_terms
from pcourse.utils.io import atomic_write

KINDS = ("allreduce", "reduce_scatter", "all_gather", "send")
BACKENDS = ("mpi", "gloo")
DEFAULT_PATH = Path("results") / "calibration.json"


class CostModelError(ValueError):
    """A prediction was asked for something that cannot run; the message names the value."""


class NotCalibrated(LookupError):
    """A constant the prediction needs was not measured on this machine (yet)."""


@dataclass(frozen=True)
class Link:
    """One collective's time on one backend at one rank count: ``a + b·n`` for n bytes.

    ``a`` (s) is the call's fixed cost: its α on the critical path plus the software
    around it; ``b`` (s/byte) its β times the bytes the critical path carries per byte.
    ``check`` (s): what the course's agreement check adds to a call that asks for it.
    """

    a: float
    b: float
    check: float = 0.0

    def time(self, nbytes: float, checked: bool = False) -> float:
        """Seconds of one call moving ``nbytes`` (with the agreement check if ``checked``)."""
        if nbytes < 0:
            raise CostModelError(f"a message of {nbytes} bytes: sizes are at least 0")
        return self.a + self.b * nbytes + (self.check if checked else 0.0)


def alpha_beta(kind: str, p: int, link: Link) -> tuple[float, float]:
    """The link's α (s per message) and β (s per byte) behind a fitted ``a + b·n``:
    lesson 03's terms (:func:`pcourse.collectives.cost_terms` for the ring allreduce,
    :func:`pcourse.collectives.half_cost_terms` for each half, one step for a send)."""
    steps, volume = (cost_terms("ring", p) if kind == "allreduce" else
                     half_cost_terms(p) if kind in ("reduce_scatter", "all_gather") else (1, 1))
    if steps == 0:
        return 0.0, 0.0
    return link.a / steps, link.b / volume


@dataclass(frozen=True)
class Machine:
    """What one calibration measured (see the module's docstring); every value positive.

    ``matmul``: (FLOPs of one product, FLOP/s it reached) for square products of a few
    sizes, one thread; ``attention``: the same for attention's forward and backward;
    ``bandwidth``: bytes/s a simple elementwise operator streams; ``per_byte``: s per
    byte read and written for the operators that compute more per element than they
    move (GELU's error function, a norm's statistics), by name; ``op_overhead``: s per
    operator dispatched in a forward and backward pass (autograd included);
    ``view_overhead``: s per view (a reshape: dispatch, no data); ``first_touch``: s per
    byte of new memory a result is written to; ``mode_overhead``: s per operator per
    Python dispatch mode it passes through (torch's selective checkpointing runs Python
    for every operator it watches); ``step_overhead``: s per operator of an optimizer's
    step (a loop in Python over the parameters, nothing recorded for autograd: less
    than a forward's and backward's operator costs); ``cores``;
    ``slowdown``: p -> how much longer the same computation took on each of p ranks
    computing at once than on one alone; ``meeting``: p -> what a collective between
    steps costs beyond its latency, the ranks waiting to meet (one may be off its core);
    ``links``:
    ``"backend kind p"`` -> :class:`Link`; ``about``: where and when.
    """

    matmul: tuple[tuple[float, float], ...]
    bandwidth: float
    op_overhead: float
    cores: int
    links: Mapping[str, Link] = field(default_factory=dict)
    about: str = ""
    attention: tuple[tuple[float, float], ...] = ()
    per_byte: Mapping[str, float] = field(default_factory=dict)
    slowdown: Mapping[int, float] = field(default_factory=dict)
    meeting: Mapping[int, float] = field(default_factory=dict)
    view_overhead: float = 0.0
    first_touch: float = 0.0
    mode_overhead: float = 0.0
    step_overhead: float = 0.0

    def __post_init__(self) -> None:
        values = {"bandwidth": self.bandwidth, "op_overhead": self.op_overhead,
                  "cores": self.cores}
        values |= {f"matmul rate at {f:.3g} FLOPs": r for f, r in self.matmul}
        values |= {f"attention rate at {f:.3g} FLOPs": r for f, r in self.attention}
        values |= {f"{name} per byte": v for name, v in self.per_byte.items()}
        values |= {f"slowdown at {p} ranks": v for p, v in self.slowdown.items()}
        for name, value in values.items():
            if not (isinstance(value, int | float) and math.isfinite(value) and value > 0):
                raise CostModelError(f"the constant {name} = {value!r} is not a positive "
                                     "number: calibrate again")
        if not self.matmul:
            raise NotCalibrated("no matmul rate was measured: run python -m "
                                "pcourse.tools.bench.calibrate")

    def rate(self, flops: float, kind: str = "matmul") -> float:
        """FLOP/s of one product (or ``kind="attention"``) of ``flops`` FLOPs: the measured
        rates, interpolated in log(FLOPs) between the sizes measured, the nearest one
        outside them."""
        points = sorted(self.attention if kind == "attention" and self.attention
                        else self.matmul)
        if flops <= points[0][0]:
            return points[0][1]
        for (f0, r0), (f1, r1) in zip(points, points[1:], strict=False):
            if flops <= f1:
                w = math.log(flops / f0) / math.log(f1 / f0)
                return r0 + w * (r1 - r0)
        return points[-1][1]

    def stepping(self) -> Machine:
        """The machine as an optimizer's step meets it: each operator costs
        ``step_overhead`` (where measured) in place of ``op_overhead``."""
        return replace(self, op_overhead=self.step_overhead) if self.step_overhead else self

    def share(self, ranks: int) -> float:
        """The part of a core each of ``ranks`` ranks computing at once gets: 1/slowdown
        as measured at that rank count; else 1 up to one rank per core, c/p beyond."""
        if ranks < 1:
            raise CostModelError(f"ranks = {ranks}: at least 1")
        if ranks in self.slowdown:
            return 1.0 / self.slowdown[ranks]
        return min(1.0, self.cores / ranks)

    def link(self, backend: str, kind: str, p: int) -> Link:
        """The fitted :class:`Link` of ``kind`` on ``backend`` at p ranks; NotCalibrated
        if that was not measured, CostModelError for a backend or kind that does not exist."""
        if backend not in BACKENDS:
            raise CostModelError(f"unknown backend {backend!r}; the model knows "
                                 f"{', '.join(BACKENDS)}")
        if kind not in KINDS:
            raise CostModelError(f"unknown collective {kind!r}; the model knows "
                                 f"{', '.join(KINDS)}")
        key = f"{backend} {kind} {p}"
        if key not in self.links:
            measured = sorted({k.rsplit(' ', 1)[1] for k in self.links
                               if k.startswith(f'{backend} {kind} ')})
            raise NotCalibrated(f"{kind} on {backend} at {p} ranks was not measured here "
                                f"(measured at: {', '.join(measured) or 'no rank count'}); run "
                                f"python -m pcourse.tools.bench.calibrate --ranks {p}")
        return self.links[key]

    def meet(self, ranks: int) -> float:
        """Seconds p ranks wait to meet at a collective after computing (0 if unmeasured)."""
        return self.meeting.get(ranks, 0.0)

    def to_json(self) -> dict[str, Any]:
        return {**asdict(self), "links": {k: asdict(v) for k, v in self.links.items()},
                "per_byte": dict(self.per_byte),
                "slowdown": {str(p): v for p, v in self.slowdown.items()},
                "meeting": {str(p): v for p, v in self.meeting.items()}}

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> Machine:
        try:
            return cls(matmul=tuple(tuple(x) for x in data["matmul"]),
                       bandwidth=data["bandwidth"], op_overhead=data["op_overhead"],
                       cores=data["cores"],
                       links={k: Link(**v) for k, v in data["links"].items()},
                       about=data.get("about", ""),
                       attention=tuple(tuple(x) for x in data.get("attention", ())),
                       per_byte=dict(data.get("per_byte", {})),
                       slowdown={int(p): v for p, v in data.get("slowdown", {}).items()},
                       meeting={int(p): v for p, v in data.get("meeting", {}).items()},
                       view_overhead=data.get("view_overhead", 0.0),
                       first_touch=data.get("first_touch", 0.0),
                       mode_overhead=data.get("mode_overhead", 0.0),
                       step_overhead=data.get("step_overhead", 0.0))
        except (KeyError, TypeError) as exc:
            raise NotCalibrated(f"the calibration lacks {exc}: calibrate again") from None


def save(machine: Machine, path: str | os.PathLike[str] = DEFAULT_PATH) -> Path:
    """Write ``machine`` as JSON, atomically (a crash leaves the previous file whole)."""
    with atomic_write(path) as f:
        json.dump(machine.to_json(), f, indent=1)
    return Path(path)


def load(path: str | os.PathLike[str] = DEFAULT_PATH) -> Machine:
    """The calibration written by :func:`save`; NotCalibrated if there is none."""
    path = Path(path)
    if not path.is_file():
        raise NotCalibrated(f"no calibration at {path}: run python -m pcourse.tools.bench "
                            "calibrate (a minute) on this machine first")
    try:
        data = json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise NotCalibrated(f"{path} is not a calibration ({exc}): calibrate again") from None
    return Machine.from_json(data)

