"""What DDP does under the hood: flat gradient buckets, reduced while backward runs.

:class:`BucketedAllreduce` lays the gradients out back to back in a few flat
buckets (at most ``bucket_cap_bytes`` each: 25 MiB by default, as DDP) and averages
each bucket with one collective; with ``overlap`` a hook starts a bucket's allreduce
as soon as backward has filled it. Lesson 07 explains why both help, and measures
them against DDP. Usage::

    reducer = BucketedAllreduce(model, backend)     # once, after freezing layers
    loss.backward()                                 # hooks launch full buckets
    reducer.finish()                                # wait; p.grad is the average
    optimizer.step(); optimizer.zero_grad()

``drive_progress`` makes every gradient hook also *test* the buckets in flight:
an MPI library without a progress thread of its own advances a nonblocking
allreduce only inside MPI calls, and a test is such a call (lesson 07 measures
the difference). Other backends move the bytes on threads of their own; for them
a test only asks.

``on_event`` watches a step without touching the reducer's internals: it is
called with (event, bucket index) at ``"launch"`` (the bucket is about to be
sent), ``"launched"`` (the call returned; with overlap the reduction is in
flight), ``"wait"`` (``finish()`` starts waiting for it) and ``"done"`` (its
average is in place). Lesson 07 timestamps these to draw a step's timeline.

Every rank must issue the *same collectives in the same order*, so buckets launch
strictly in index order, and a parameter without a gradient on this rank adds
zeros. Each bucket carries one flag per parameter (1: this rank has a gradient);
where no rank had one, the gradient stays ``None``, as in a single process and in
DDP, so optimizers with weight decay or momentum skip it there too.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from functools import partial
from numbers import Integral
from typing import TypeVar

import torch
from torch import nn

from pcourse.backends import Backend, Work
from pcourse.data_parallel import check_same_model

MiB = 1 << 20
# DDP's default, bucket_cap_mb=25, which torch reads as MiB (25 * 1024 * 1024 bytes)
DEFAULT_CAP_BYTES = 25 * MiB
EVENTS = ("launch", "launched", "wait", "done")  # in this order, once per bucket and step
EventHook = Callable[[str, int], None]  # (event, bucket index)


@dataclass
class Bucket:
    """Gradients of ``params`` laid out back to back in ``flat``, then one flag each."""

    params: list[nn.Parameter]
    flat: torch.Tensor  # [grad of params[0] | grad of params[1] | ... | flags]
    views: list[torch.Tensor]  # views[i]: params[i]'s gradient, a view into flat
    has_grad: list[float] = field(default_factory=list)  # this step's flags, per param
    staged: list[bool] = field(default_factory=list)  # gradient already in flat?
    work: Work | None = None

    def reset(self) -> None:
        self.has_grad = [0.0] * len(self.params)
        self.staged = [False] * len(self.params)
        self.work = None

    @property
    def complete(self) -> bool:
        return all(self.staged)


P = TypeVar("P", bound=torch.Tensor)  # a parameter, or a tensor standing for one (sizes)


def plan_buckets(params: list[P], cap_bytes: int) -> list[list[P]]:
    """Group parameters, in the order given, into buckets of at most ``cap_bytes``.

    One bucket holds one dtype on one device (a flat tensor has one of each). A
    parameter larger than the cap gets a bucket of its own.
    """
    buckets: list[list[P]] = []
    open_: dict[tuple[torch.device, torch.dtype], tuple[list[P], int]] = {}
    for p in params:
        key, nbytes = (p.device, p.dtype), p.numel() * p.element_size()
        current, used = open_.get(key, (None, 0))
        if current is None or (current and used + nbytes > cap_bytes):
            current, used = [], 0
            buckets.append(current)
        current.append(p)
        open_[key] = (current, used + nbytes)
    return buckets


def cap_bytes(bucket_cap_bytes: int = DEFAULT_CAP_BYTES,
              bucket_cap_mb: float | None = None) -> int:
    """The bucket cap in bytes, from bytes or, as DDP's ``bucket_cap_mb``, from MiB.

    torch reads ``bucket_cap_mb`` as MiB (25 -> 25 * 2**20 bytes), and so does this;
    given, it replaces the default in bytes. A float in bytes is refused: it is what
    a cap in MiB passed where bytes go looks like.
    """
    if bucket_cap_mb is not None:
        if bucket_cap_bytes != DEFAULT_CAP_BYTES:
            raise ValueError(f"give the bucket cap once: bucket_cap_bytes={bucket_cap_bytes} "
                             f"or bucket_cap_mb={bucket_cap_mb}, not both")
        if not bucket_cap_mb > 0:
            raise ValueError(f"bucket_cap_mb must be positive (MiB, as DDP's), "
                             f"got {bucket_cap_mb}")
        return max(1, int(bucket_cap_mb * MiB))
    if isinstance(bucket_cap_bytes, bool) or not isinstance(bucket_cap_bytes, Integral):
        raise TypeError(f"bucket_cap_bytes is a whole number of bytes, got "
                        f"{bucket_cap_bytes!r}; for a cap in MiB, as DDP's, pass "
                        f"bucket_cap_mb={bucket_cap_bytes!r}")
    if bucket_cap_bytes <= 0:
        raise ValueError(f"bucket_cap_bytes must be positive, got {bucket_cap_bytes}")
    return int(bucket_cap_bytes)


def _make_bucket(params: list[nn.Parameter]) -> Bucket:
    sizes = [p.numel() for p in params]
    flat = torch.zeros(sum(sizes) + len(params), dtype=params[0].dtype, device=params[0].device)
    grads = flat.split(sizes + [len(params)])[:-1]  # the last piece is the flags
    views = [g.view_as(p) for g, p in zip(grads, params, strict=True)]
    bucket = Bucket(params, flat, views)
    bucket.reset()
    return bucket


class BucketedAllreduce:
    """Average the gradients of ``model`` across ranks, one collective per bucket.

    Parameters are bucketed in *reverse* registration order (as DDP does) because
    backward usually reaches the last-registered layers first. Frozen parameters
    (``requires_grad=False``) are left out; tied weights are one ``Parameter``,
    listed and reduced once. Collective: the ranks' models are compared first
    (one tiny allreduce), so different models are one ValueError on every rank.

    After the first step each ``p.grad`` *is* a view into its bucket, so autograd
    accumulates straight into the bucket (with ``zero_grad(set_to_none=False)``, no
    copy at all); a gradient that is not the view is copied in once, in the hook,
    while the rest of backward still runs.

    The cap is in bytes (``bucket_cap_bytes``); ``bucket_cap_mb`` says it as DDP
    does, in MiB (:func:`cap_bytes`).
    """

    def __init__(
        self,
        model: nn.Module,
        backend: Backend,
        bucket_cap_bytes: int = DEFAULT_CAP_BYTES,
        overlap: bool = True,
        on_event: EventHook | None = None,
        drive_progress: bool = False,
        *,
        bucket_cap_mb: float | None = None,
    ) -> None:
        cap = cap_bytes(bucket_cap_bytes, bucket_cap_mb)
        params = [p for p in model.parameters() if p.requires_grad][::-1]
        check_same_model(params, backend, "model (the parameters that require grad)")
        if not params:
            raise ValueError("the model has no parameter with requires_grad=True to reduce")
        self.backend, self.overlap, self.drive_progress = backend, overlap, drive_progress
        self.on_event: EventHook = on_event or (lambda event, b: None)
        self.buckets = [_make_bucket(group) for group in plan_buckets(params, cap)]
        self._next = 0  # index of the next bucket to launch: launches go in order
        self._syncing = True  # False inside no_sync()
        self._hooks = []
        if overlap:
            for b, bucket in enumerate(self.buckets):
                for i, p in enumerate(bucket.params):
                    hook = partial(self._on_grad_ready, b, i)
                    self._hooks.append(p.register_post_accumulate_grad_hook(hook))

    @contextmanager
    def no_sync(self) -> Iterator[None]:
        """Gradient accumulation, as DDP's ``no_sync()``: backwards here only add up locally.

        The first backward after the block adds its gradients to the accumulated
        ones, and :meth:`finish` averages the sum across ranks::

            with reducer.no_sync():
                loss_1.backward()
            loss_2.backward()
            reducer.finish()            # p.grad: the average over ranks of both
        """
        if not self._syncing:
            raise RuntimeError("no_sync() is already active")
        if self._next or any(any(b.staged) for b in self.buckets):
            raise RuntimeError("a backward before no_sync() was not finished: call "
                               "reducer.finish() first")
        self._syncing = False
        try:
            yield
        finally:
            self._syncing = True

    def _stage(self, bucket: Bucket, i: int) -> None:
        """Put parameter i's local gradient into the bucket (zeros if it has none)."""
        p, view = bucket.params[i], bucket.views[i]
        if p.grad is None:
            view.zero_()
        else:
            if p.grad.data_ptr() != view.data_ptr():
                view.copy_(p.grad)
                p.grad = view
            bucket.has_grad[i] = 1.0
        bucket.staged[i] = True

    def _on_grad_ready(self, b: int, i: int, param: nn.Parameter) -> None:
        """Autograd hook: parameter i of bucket b has its gradient for this step."""
        if not self._syncing:
            return
        bucket = self.buckets[b]
        if bucket.staged[i]:
            raise RuntimeError(
                "a gradient arrived twice before finish(): call reducer.finish() after "
                "every backward, or run the backwards before the last inside "
                "reducer.no_sync() to accumulate gradients"
            )
        self._stage(bucket, i)
        if self.drive_progress:
            for earlier in self.buckets[:self._next]:
                assert earlier.work is not None  # every bucket before _next was launched
                earlier.work.test()
        self._launch_in_order()

    def _launch_in_order(self) -> None:
        """Start every complete bucket, in index order, stopping at the first gap."""
        while self._next < len(self.buckets) and self.buckets[self._next].complete:
            self._launch(self._next)
            self._next += 1

    def _launch(self, b: int) -> None:
        bucket = self.buckets[b]
        self.on_event("launch", b)
        n = len(bucket.params)
        bucket.flat[-n:] = torch.tensor(bucket.has_grad, dtype=bucket.flat.dtype)
        # check=False: the layout, the same on every rank, was checked once, at creation.
        if self.overlap:
            bucket.work = self.backend.allreduce_async(bucket.flat, "avg", check=False)
        else:
            self.backend.allreduce(bucket.flat, "avg", check=False)
        self.on_event("launched", b)

    def finish(self) -> None:
        """Reduce what backward left pending, wait for every bucket, set ``p.grad``.

        Call it after ``backward()`` and before ``optimizer.step()``, on every rank.
        ValueError on every rank if no rank had any gradient (no backward ran).
        """
        if not self._syncing:
            raise RuntimeError("finish() inside no_sync(): leave the block, run the last "
                               "backward, then call finish()")
        for b in range(self._next, len(self.buckets)):
            bucket = self.buckets[b]
            for i, staged in enumerate(bucket.staged):
                if not staged:
                    self._stage(bucket, i)
            self._launch(b)
        had_any = False
        for b, bucket in enumerate(self.buckets):
            self.on_event("wait", b)
            if bucket.work is not None:
                bucket.work.wait()
            had_any |= self._unpack(bucket)
            self.on_event("done", b)
            bucket.reset()
        self._next = 0
        if not had_any:  # the flags are averaged: every rank takes the same decision
            raise ValueError("no rank had a gradient for any parameter: call loss.backward() "
                             "before reducer.finish()")

    @staticmethod
    def _unpack(bucket: Bucket) -> bool:
        """Point each gradient at its averaged view; None where no rank had one.

        Returns whether any rank had a gradient for any parameter of the bucket.
        """
        anyone = bucket.flat[-len(bucket.params) :].tolist()
        for p, view, flag in zip(bucket.params, bucket.views, anyone, strict=True):
            if flag == 0:
                p.grad = None
            elif p.grad is not view:  # assigning .grad has a cost: only when it changes
                p.grad = view
        return any(anyone)

    def remove(self) -> None:
        """Detach the hooks; the model trains as if this reducer never existed."""
        for handle in self._hooks:
            handle.remove()
        self._hooks.clear()

    def __repr__(self) -> str:
        sizes = ", ".join(str(len(b.params)) for b in self.buckets)
        return (
            f"<BucketedAllreduce {len(self.buckets)} buckets (params per bucket: {sizes}), "
            f"overlap={self.overlap}, backend={self.backend.name}>"
        )


def profiler_hook() -> EventHook:
    """An ``on_event`` hook that puts the buckets in ``torch.profiler``'s trace, on backward's
    clock: a ``record_function`` range from a bucket's launch until its call returns, and
    from the start of its wait until its average is in place (lesson 07)."""
    from torch.profiler import record_function

    opened: dict[tuple[str, int], record_function] = {}

    def on_event(event: str, b: int) -> None:
        if event in ("launch", "wait"):
            opened[event, b] = record_function(f"{event} bucket {b}")
            opened[event, b].__enter__()
        else:  # "launched" closes the launch's range, "done" the wait's
            opened.pop(("launch" if event == "launched" else "wait", b)).__exit__(None, None, None)

    return on_event
