"""Pipeline parallelism (lesson 12): a model cut into stages, a batch into micro-batches.

A model of consecutive layers is cut into p consecutive **stages**, one per rank of a
pipeline group (any backend with point-to-point messages: ``send``/``recv``, MPI's
``Isend``/``Irecv`` or torch.distributed's ``isend``/``irecv``, every wait with the
backend's deadline). Stage r's forward output is sent to stage r + 1; in the backward,
the gradient of that output comes back, and stage r sends the gradient of its own
input to stage r - 1. The batch is cut into m **micro-batches** so that the stages can
work at once, each on a different micro-batch; their gradients accumulate.

Each micro-batch's loss is scaled by its share of the batch (n_i / n, which is 1/m
when the micro-batches are equal), so that the accumulated gradients are exactly
those of the whole batch's mean loss: :func:`run_step` equals one process.

A **schedule** is, per stage, an order of actions ``("F", i)`` (forward of
micro-batch i) and ``("B", i)`` (its backward), all run by one loop
(:func:`run_step`):

- :func:`gpipe_order`: all forwards, then all backwards (GPipe: Huang et al. 2019,
  arXiv:1811.06965). Every stage holds the activations of all m micro-batches.
- :func:`one_f_one_b_order`: p - 1 - r forwards to fill the pipeline, then one
  forward and one backward in turn, then the remaining backwards (1F1B,
  PipeDream-Flush: Narayanan et al. 2021, arXiv:2006.09503). Stage r holds at most
  min(m, p - r) micro-batches' activations; the same step, the same gradients.

Both leave the stages idle for the same **bubble**: with equal stages, each of
forward and backward time t, a step lasts (m + p - 1) of them per direction while a
stage works m, so the idle fraction is (p - 1)/(m + p - 1) (:func:`bubble_fraction`);
with unequal stages, :func:`simulated_step` plays the orders out with each stage's
own times.

Every action is timed (``Timeline``: start and length in ms from the step's start,
the events lesson 07's trace writer, ``pcourse.tools.bench.trace.chrome_trace``, takes),
and the micro-batches whose activations are held are counted, with their bytes
(what autograd saved, :func:`pcourse.activations.count_saved`), after every action;
a bare stage (``instrumented=False``) does neither, for timing against another library.
A sent tensor is let go as soon as its send is done, not at the step's end.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch
from torch import nn

from pcourse.activations import count_saved
from pcourse.backends.base import Backend, Work

Action = tuple[str, int]  # ("F", i) or ("B", i)

__all__ = ["Action", "Stage", "Timeline", "bubble_fraction", "check_order", "gpipe_order",
           "in_flight_prediction", "micro_sizes", "one_f_one_b_order", "run_step",
           "simulated_step", "split_model"]


def gpipe_order(p: int, rank: int, m: int) -> list[Action]:
    """GPipe: every forward, then every backward (the same on every stage)."""
    _check(p, rank, m)
    return [("F", i) for i in range(m)] + [("B", i) for i in range(m)]


def one_f_one_b_order(p: int, rank: int, m: int) -> list[Action]:
    """1F1B: ``p - 1 - rank`` warm-up forwards, then forward/backward pairs, then the
    backwards left. The last stage starts a backward right after each forward."""
    _check(p, rank, m)
    warm = min(p - 1 - rank, m)
    order = [("F", i) for i in range(warm)]
    for i in range(m - warm):
        order += [("F", warm + i), ("B", i)]
    return order + [("B", i) for i in range(m - warm, m)]


def in_flight_prediction(schedule: str, p: int, rank: int, m: int) -> int:
    """The most micro-batches whose activations stage ``rank`` holds at once."""
    return m if schedule == "gpipe" else min(m, p - rank)


def bubble_fraction(p: int, m: int) -> float:
    """The idle fraction of a step with p equal stages and m micro-batches."""
    return (p - 1) / (m + p - 1)


def simulated_step(orders: Sequence[Sequence[Action]], t_f: Sequence[float],
                   t_b: Sequence[float]) -> tuple[float, list[float]]:
    """The step's length and each stage's busy time when stage r's forwards take
    ``t_f[r]`` and its backwards ``t_b[r]``, and nothing else takes time: no message,
    no code between actions. ``orders[r]``: stage r's schedule.

    Each action starts once its stage is free and what it needs has arrived (a forward
    the previous stage's forward of that micro-batch, a backward the next stage's
    backward). With equal stages this is (m + p - 1)(t_f + t_b) and the bubble
    (p - 1)/(m + p - 1); with unequal ones the slowest stage sets the pace, so it
    predicts the bubble of stages as they were measured.
    """
    p = len(orders)
    done: dict[tuple[str, int, int], float] = {}
    free, nxt = [0.0] * p, [0] * p
    while any(nxt[r] < len(orders[r]) for r in range(p)):
        moved = False
        for r in range(p):
            if nxt[r] == len(orders[r]):
                continue
            kind, i = orders[r][nxt[r]]
            need = (kind, i, r - 1 if kind == "F" else r + 1)
            if 0 <= need[2] < p and need not in done:
                continue  # its input is not there yet
            start = max(free[r], done.get(need, 0.0))
            free[r] = done[kind, i, r] = start + (t_f[r] if kind == "F" else t_b[r])
            nxt[r], moved = nxt[r] + 1, True
        if not moved:
            raise ValueError("these orders wait on each other: the pipeline deadlocks")
    busy = [sum(t_f[r] if k == "F" else t_b[r] for k, _ in orders[r]) for r in range(p)]
    return max(free), busy


def _check(p: int, rank: int, m: int) -> None:
    if not (p >= 1 and 0 <= rank < p and m >= 1):
        raise ValueError(f"need p >= 1 stages, 0 <= rank < p and m >= 1 micro-batches; "
                         f"got p={p}, rank={rank}, m={m}")


def check_order(order: Sequence[Action], m: int) -> None:
    """Refuse an order that is not every forward and backward once, each backward after
    its forward: a wrong schedule fails here, not in a hang."""
    want = {(k, i) for k in "FB" for i in range(m)}
    if sorted(order) != sorted(want):
        raise ValueError(f"a schedule of m={m} micro-batches has each of F 0..{m - 1} and "
                         f"B 0..{m - 1} once; got {list(order)}")
    for i in range(m):
        if order.index(("B", i)) < order.index(("F", i)):
            raise ValueError(f"backward of micro-batch {i} comes before its forward: {list(order)}")


def micro_sizes(n: int, m: int) -> list[int]:
    """The sizes of m micro-batches of a batch of n (torch.tensor_split's: the first
    n % m one larger). Every stage computes them, so no size is ever sent."""
    if not 1 <= m <= n:
        raise ValueError(f"cannot cut a batch of {n} into {m} micro-batches: need 1 <= m <= {n}")
    return [n // m + (i < n % m) for i in range(m)]


def split_model(layers: Sequence[nn.Module], p: int, rank: int) -> nn.Sequential:
    """Stage ``rank`` of p: its consecutive share of ``layers`` (the first len % p one more)."""
    sizes = micro_sizes(len(layers), p) if len(layers) >= p else None
    if sizes is None:
        raise ValueError(f"cannot cut {len(layers)} layers into {p} stages: need at least {p}")
    start = sum(sizes[:rank])
    return nn.Sequential(*layers[start:start + sizes[rank]])


@dataclass
class Timeline:
    """Per action: ``events`` (name, start and length in ms from the step's start, the
    format of lesson 07's traces); held micro-batches and their bytes after each."""

    t0: float = field(default_factory=time.perf_counter)
    events: list[dict] = field(default_factory=list)
    held: list[int] = field(default_factory=list)
    held_bytes: list[int] = field(default_factory=list)

    def record(self, name: str, start: float, stop: float) -> None:
        self.events.append({"name": name, "start": (start - self.t0) * 1e3,
                            "ms": (stop - start) * 1e3, "kind": "annotation"})

    def busy_ms(self) -> float:
        """Time spent computing (forward and backward actions; not waiting)."""
        return sum(e["ms"] for e in self.events if e["name"][0] in "FB")

    def end_ms(self) -> float:
        return max(e["start"] + e["ms"] for e in self.events)


class Stage:
    """One stage: ``module`` on rank ``group.rank`` of a pipeline of ``group.size``.

    ``in_shape``: what one sample entering this stage looks like (its features), so
    that a received activation's buffer is made without a message about its size.
    The last stage computes ``loss_fn(output, target)`` (a mean over the micro-batch).
    ``dtype``: of what arrives (default: the module's parameters'). ``instrumented``:
    time every action and count what autograd saves (the lesson's measurements); False
    runs the same step bare, as a step to be timed against another library's is.

    A send's tensor is kept until the send is done, and no longer: every action first
    lets go of the sends that completed (MPI says so when asked; a Gloo send only when
    waited for), and a micro-batch's backward waits for the send of its forward's
    output, which the next stage has received by then (its gradient came back).
    """

    def __init__(self, module: nn.Module, group: Backend, in_shape: Sequence[int],
                 loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None = None,
                 dtype: torch.dtype | None = None, instrumented: bool = True) -> None:
        if dtype is None:  # what arrives is what the previous stage computes in
            dtype = next(module.parameters(), torch.empty(0)).dtype
        self.module, self.group, self.in_shape, self.dtype = module, group, tuple(in_shape), dtype
        self.rank, self.p = group.rank, group.size
        self.prev = self.rank - 1 if self.rank > 0 else None
        self.next = self.rank + 1 if self.rank < self.p - 1 else None
        if self.next is None and loss_fn is None:
            raise ValueError("the last stage needs loss_fn: it computes the loss")
        self.loss_fn, self.instrumented = loss_fn, instrumented
        self._sends: list[Work] = []  # sends not known to be done
        self._sent: dict[int, Work] = {}  # i -> the send of micro-batch i's output
        self._held: dict[int, tuple[torch.Tensor, torch.Tensor, int]] = {}  # i -> in, out, bytes

    def forward(self, i: int, x: torch.Tensor | None, target: torch.Tensor | None,
                rows: int, scale: float, timeline: Timeline) -> torch.Tensor | None:
        """Forward of micro-batch i: receive (or take) its input, compute, send it on.
        Returns the scaled loss on the last stage."""
        self._let_go()
        if self.prev is not None:
            x = torch.empty((rows, *self.in_shape), dtype=self.dtype)
            start = time.perf_counter()
            self.group.recv(x, self.prev)
            self._mark(timeline, f"wait F {i}", start)
        assert x is not None  # the first stage is given its input; the others received it
        x = x.detach().requires_grad_(self.prev is not None)
        start = time.perf_counter()
        with count_saved(self.module.parameters()) if self.instrumented else _Uncounted() as saved:
            out = self.module(x)
            if self.next is None:
                assert self.loss_fn is not None and target is not None  # the last stage's
                out = self.loss_fn(out, target) * scale
        self._mark(timeline, f"F {i}", start)
        self._held[i] = (x, out, saved.bytes)
        if self.next is not None:
            self._sent[i] = self.group.send(out.detach().contiguous(), self.next)
            self._sends.append(self._sent[i])
        return out.detach() if self.next is None else None

    def backward(self, i: int, timeline: Timeline) -> None:
        """Backward of micro-batch i: receive its output's gradient (the last stage: the
        loss itself), accumulate into the parameters, send the input's gradient back."""
        self._let_go()
        x, out, _ = self._held.pop(i)
        grad = None
        if self.next is not None:
            grad = torch.empty_like(out)
            start = time.perf_counter()
            self.group.recv(grad, self.next)
            self._mark(timeline, f"wait B {i}", start)
            self._sent.pop(i).wait()  # received: its gradient came back
        start = time.perf_counter()
        out.backward(grad)
        self._mark(timeline, f"B {i}", start)
        if self.prev is not None:
            assert x.grad is not None  # x requires grad on every stage but the first
            self._sends.append(self.group.send(x.grad.contiguous(), self.prev))

    def _mark(self, timeline: Timeline, name: str, start: float) -> None:
        if self.instrumented:
            timeline.record(name, start, time.perf_counter())

    def _let_go(self) -> None:
        """Drop the sends that are done, and with them the tensors they kept."""
        self._sends = [work for work in self._sends if not work.test()]

    def held(self) -> tuple[int, int]:
        """Micro-batches whose activations this stage holds now, and their bytes."""
        return len(self._held), sum(b for _, _, b in self._held.values())

    def finish(self) -> None:
        """Wait for every send of the step (each with the deadline)."""
        sends, self._sends, self._sent = self._sends, [], {}
        for work in sends:
            work.wait()


class _Uncounted:
    """What a bare stage counts of autograd's saved tensors: nothing."""

    bytes = 0

    def __enter__(self) -> _Uncounted:
        return self

    def __exit__(self, *exc: object) -> None:
        return None


def run_step(stage: Stage, order: Sequence[Action], m: int, batch: int,
             inputs: torch.Tensor | None = None, targets: torch.Tensor | None = None,
             timeline: Timeline | None = None) -> tuple[torch.Tensor | None, Timeline]:
    """One step of the pipeline on every stage: the actions of ``order`` in turn.

    ``batch``: the whole batch's size (every stage cuts it the same way); ``inputs``
    on the first stage, ``targets`` on the last. Gradients accumulate into the
    module's parameters (zero them before). Returns the batch's mean loss on the last
    stage (None elsewhere) and the timeline.
    """
    check_order(order, m)
    sizes = micro_sizes(batch, m)
    starts = [sum(sizes[:i]) for i in range(m)]
    for name, t in (("inputs", inputs if stage.prev is None else None),
                    ("targets", targets if stage.next is None else None)):
        if t is not None and len(t) != batch:
            raise ValueError(f"{name} has {len(t)} samples but batch={batch}")
    timeline = timeline or Timeline()
    loss = None
    for kind, i in order:
        if kind == "F":
            rows = slice(starts[i], starts[i] + sizes[i])
            # each micro-batch a tensor of its own, so that what autograd saves of it
            # is its own bytes, not the whole batch's storage
            out = stage.forward(i, None if inputs is None else inputs[rows].clone(),
                                None if targets is None else targets[rows].clone(),
                                sizes[i], sizes[i] / batch, timeline)
            if out is not None:
                loss = out if loss is None else loss + out
        else:
            stage.backward(i, timeline)
        if stage.instrumented:
            n, nbytes = stage.held()
            timeline.held.append(n)
            timeline.held_bytes.append(nbytes)
    stage.finish()
    return loss, timeline
