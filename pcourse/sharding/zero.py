"""ZeRO-1 and ZeRO-2: the optimizer's state, and then the gradients, sharded (lesson 10).

Each rank keeps the optimizer state of, and steps, only its own slice of the
parameters: a reduce-scatter (the allreduce's first half) brings it the averaged
gradient of that slice, an all-gather (the second half) brings everyone's updated
slices back. The parameters are laid out in buckets (lesson 07's, at most
``bucket_cap_bytes`` each), every bucket one flat vector padded with zeros to a
multiple of p (:func:`shard_range`) so that every rank's slice of it has the same
length; a rank's slice is its piece of every bucket. With ``overlap`` a bucket's
reduce-scatter starts as soon as backward has filled it, and the all-gathers after
the step are waited for only when the next forward reaches their parameters.
:mod:`pcourse.sharding.fsdp` cuts its units as :func:`shard_range` says too.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from functools import partial
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from pcourse.backends.base import Backend, Work
from pcourse.backends.groups import as_backend
from pcourse.buckets import DEFAULT_CAP_BYTES, plan_buckets

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup

__all__ = ["ShardedOptimizer", "shard_range"]
IN_FLIGHT = 2  # ZeRO-2 with overlap: buckets reduced at once (each holds a gradient buffer)


def shard_range(numel: int, rank: int, size: int) -> tuple[int, int, int]:
    """(start, stop, padded) of rank's slice of a flat vector of ``numel`` elements.

    The vector is padded with zeros to ``padded``, the next multiple of ``size``, so
    that every rank's slice has the same length (a reduce-scatter and an all-gather
    move equal blocks); the padding sits at the end, in the last ranks' slices.
    """
    padded = math.ceil(numel / size) * size if numel else 0
    s = padded // size
    return rank * s, (rank + 1) * s, padded


def _flat(tensors: list[torch.Tensor], padded: int, like: torch.Tensor) -> torch.Tensor:
    """The tensors one after the other in a new flat vector, zero-padded to ``padded``."""
    out = like.new_zeros(padded)
    offset = 0
    for t in tensors:
        out[offset:offset + t.numel()] = t.reshape(-1)
        offset += t.numel()
    return out


def _views(flat: torch.Tensor, params: list[nn.Parameter]) -> list[torch.Tensor]:
    """Each parameter's place in ``flat``, shaped like it."""
    return list(flat[:sum(p.numel() for p in params)].split([p.numel() for p in params]))


class _Bucket:
    """Parameters that live back to back in one flat vector; this rank steps ``[lo:hi]``.

    ``grad`` is the bucket's flat gradient: ZeRO-1 keeps it for good (each ``.grad``
    a view of it, so autograd adds straight into it: DeepSpeed's contiguous
    gradients); ZeRO-2 only while the bucket is filled and reduced. ``avg`` is where
    this rank's averaged slice arrives.
    """

    def __init__(self, params: list[nn.Parameter], rank: int, size: int) -> None:
        self.params = params
        self.lo, self.hi, padded = shard_range(sum(p.numel() for p in params), rank, size)
        self.flat = _flat([p.detach() for p in params], padded, params[0].detach())
        for p, view in zip(params, _views(self.flat, params), strict=True):
            p.data = view.view_as(p)
        self.grad: torch.Tensor | None = None
        self.avg = self.flat.new_zeros(self.hi - self.lo)
        self.arrived: set[int] = set()
        self.reducing: Work | None = None
        self.gathering: Work | None = None


class ShardedOptimizer(torch.optim.Optimizer):
    """Any torch optimizer, with its state sharded across ranks (ZeRO-1 or ZeRO-2).

    ``ShardedOptimizer(model.parameters(), torch.optim.AdamW, backend=b, lr=1e-3)``:
    like torch's ``ZeroRedundancyOptimizer(params, optimizer_class, **defaults)``,
    and ``param_groups`` (what LR schedulers change) are this object's. Call it
    after a plain ``loss.backward()`` on each rank's local mean loss; ``step()``
    averages the gradients (reduce-scatter), steps this rank's slice with
    ``optimizer_cls``, and all-gathers the slices. ``stage=1`` keeps one flat
    gradient buffer (the ``.grad`` of parameters outside this rank's slice then hold
    this rank's own, unaveraged gradients; ``zero_grad`` zeroes it in place);
    ``stage=2`` keeps only the slice's.

    ``overlap=True``: each bucket's reduce-scatter starts in backward, once its
    gradients are all there (in bucket order, as lesson 07's reducer; ZeRO-2 keeps
    at most ``IN_FLIGHT`` buckets' gradients); given ``module`` too, the all-gathers
    that ``step()`` starts are waited for only when the forward reaches a
    module holding their parameters (before that, or without ``module``, at the end
    of ``step()``; :meth:`synchronize` waits for them at any time). One backward per
    step: gradient accumulation is not supported with these hooks.

    The parameters (those with ``requires_grad``; frozen ones are left alone) become
    views into flat, padded buckets (as torch's ``parameters_as_bucket_view``), so
    the slices a rank steps are views too and the all-gather writes straight into
    the parameters. A slice cuts through parameters, so ``optimizer_cls`` must act
    elementwise (SGD, Adam, AdamW, RMSprop do); a parameter without a gradient
    counts as a zero gradient. ``state_dict()`` is this rank's shard's. Every rank
    must build it with the same parameters.
    """

    def __init__(self, params: Iterable[Any], optimizer_cls: type[torch.optim.Optimizer],
                 backend: Backend | ProcessGroup | None = None, *, stage: int = 1,
                 overlap: bool = False, module: nn.Module | None = None,
                 bucket_cap_bytes: int = DEFAULT_CAP_BYTES, **defaults: Any) -> None:
        if stage not in (1, 2):
            raise ValueError(f"stage must be 1 (optimizer state sharded) or 2 (gradients too), "
                             f"got {stage!r}; for parameters use FullyShardedDataParallel")
        if not (isinstance(optimizer_cls, type) and issubclass(optimizer_cls,
                                                               torch.optim.Optimizer)):
            raise TypeError(f"optimizer_cls must be a torch.optim.Optimizer class such as "
                            f"torch.optim.AdamW, got {optimizer_cls!r}")
        super().__init__(params, defaults)
        self.backend, self.stage, self.overlap = as_backend(backend), stage, overlap
        self.optimizer_cls = optimizer_cls
        self._checked = False
        self.buckets: list[_Bucket] = []
        self._group_of: list[int] = []  # per bucket: its parameter group
        shards = []
        for g, group in enumerate(self.param_groups):
            members = self._dedupe(p for p in group["params"] if p.requires_grad)
            kinds = {(p.dtype, p.device) for p in members}
            if len(kinds) > 1:
                raise ValueError(f"a parameter group mixes dtypes or devices "
                                 f"({sorted(map(str, kinds))}); put each kind in its own group")
            mine = [self._add(g, params) for params in plan_buckets(members[::-1],
                                                                     bucket_cap_bytes)]
            shards.append({"params": [b.flat[b.lo:b.hi] for b in mine] or [torch.zeros(0)],
                           **self._hyper(group)})
        # steps this rank's slices only. The ignore: type[Optimizer] is torch's base class,
        # whose constructor also takes `defaults`; its subclasses (AdamW, ...) default them.
        self.local = optimizer_cls(shards)  # type: ignore[call-arg]
        self._next = 0  # the next bucket to reduce: every rank starts them in this order
        if module is not None and overlap:
            self._wait_in_forward(module)

    @staticmethod
    def _dedupe(params: Iterable[nn.Parameter]) -> list[nn.Parameter]:
        seen: dict[int, nn.Parameter] = {}
        for p in params:
            seen.setdefault(id(p), p)
        return list(seen.values())

    def _add(self, group: int, params: list[nn.Parameter]) -> _Bucket:
        """A bucket for ``params``; a hook on each puts its gradient there once it exists."""
        bucket = _Bucket(params, self.backend.rank, self.backend.size)
        if self.stage == 1:
            bucket.grad = torch.zeros_like(bucket.flat)
            for p, view in zip(params, _views(bucket.grad, params), strict=True):
                p.grad = view.view_as(p)
        for i, p in enumerate(params):
            p.register_post_accumulate_grad_hook(partial(self._arrived, bucket, i))
        self.buckets.append(bucket)
        self._group_of.append(group)
        return bucket

    def _wait_in_forward(self, module: nn.Module) -> None:
        """Before a module's forward: wait for the all-gathers of the buckets it uses."""
        where = {id(p): b for b in self.buckets for p in b.params}
        for m in module.modules():
            mine = {id(where[id(p)]): where[id(p)] for p in m.parameters(recurse=False)
                    if id(p) in where}
            if mine:
                m.register_forward_pre_hook(partial(self._before, list(mine.values())))

    def _before(self, buckets: list[_Bucket], module: nn.Module, args: tuple) -> None:
        self._gathered(buckets)

    @staticmethod
    def _hyper(group: dict[str, Any]) -> dict[str, Any]:
        return {k: v for k, v in group.items() if k != "params"}

    @torch.no_grad()
    def _stage(self, bucket: _Bucket, i: int) -> None:
        """Put parameter i's gradient (zeros if it has none) in the bucket's flat gradient."""
        p = bucket.params[i]
        if bucket.grad is None:  # ZeRO-2: the bucket's gradient exists from its first arrival
            bucket.grad = torch.zeros_like(bucket.flat)
        view = _views(bucket.grad, bucket.params)[i].view_as(p)
        if p.grad is None:
            view.zero_()
        elif p.grad.data_ptr() != view.data_ptr():
            view.copy_(p.grad)
        p.grad = view if self.stage == 1 else None  # ZeRO-2: autograd's copy goes now
        bucket.arrived.add(i)

    def _arrived(self, bucket: _Bucket, i: int, param: nn.Parameter) -> None:
        """Autograd hook: parameter i of ``bucket`` has its gradient for this step."""
        if i in bucket.arrived:
            raise RuntimeError("a gradient arrived twice before step(): ShardedOptimizer "
                               "takes one backward per step (no gradient accumulation)")
        self._stage(bucket, i)
        for b in self.buckets:  # MPI moves a nonblocking collective only inside MPI calls
            if b.reducing is not None:
                b.reducing.test()
        if self.overlap:
            while self._next < len(self.buckets) and self._full(self.buckets[self._next]):
                self._reduce(self.buckets[self._next])

    @staticmethod
    def _full(bucket: _Bucket) -> bool:
        return len(bucket.arrived) == len(bucket.params)

    def _reduce(self, bucket: _Bucket) -> None:
        """Start the bucket's reduce-scatter (the next in order); ZeRO-2 bounds those in flight."""
        assert bucket.grad is not None  # _stage made it, holding every parameter's gradient
        out = bucket.avg if self.stage == 2 else bucket.grad.new_empty(bucket.hi - bucket.lo)
        bucket.reducing = self.backend.reduce_scatter_async(out, bucket.grad, "avg",
                                                            check=not self._checked)
        bucket.avg, self._next = out, self._next + 1
        flying = [b for b in self.buckets[:self._next] if b.reducing is not None]
        if self.stage == 2 and self.overlap and len(flying) > IN_FLIGHT:
            self._reduced(flying[0])

    def _reduced(self, bucket: _Bucket) -> None:
        """Wait for the bucket's reduce-scatter; its averaged slice is the local gradient."""
        assert bucket.reducing is not None and bucket.grad is not None  # _reduce started it
        bucket.reducing.wait()
        bucket.reducing = None
        if self.stage == 1:  # my slice, averaged, in the whole buffer
            bucket.grad[bucket.lo:bucket.hi] = bucket.avg
            bucket.avg = bucket.grad[bucket.lo:bucket.hi]
        else:
            bucket.grad = None
        bucket.arrived.clear()

    def _gathered(self, buckets: list[_Bucket]) -> None:
        for b in buckets:
            if b.gathering is not None:
                b.gathering.wait()
                b.gathering = None

    def synchronize(self) -> None:
        """Wait for every all-gather the last ``step()`` started: every parameter is new."""
        self._gathered(self.buckets)

    # torch declares step as two overloads (with a closure and without); one signature
    # covering both, as torch's own optimizers write it, is not an override mypy accepts.
    @torch.no_grad()
    def step(  # type: ignore[override]
            self, closure: Callable[[], float] | None = None) -> float | None:
        """Average the gradients, step this rank's slice, all-gather the parameters."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self.synchronize()  # a bucket whose parameters no forward used
        for group, local in zip(self.param_groups, self.local.param_groups, strict=True):
            local.update(self._hyper(group))  # what a scheduler changed
        for bucket in self.buckets[self._next:]:  # what backward left: no gradient, no overlap
            for i in set(range(len(bucket.params))) - bucket.arrived:
                self._stage(bucket, i)
            self._reduce(bucket)
        self._next = 0
        slices: list[list[torch.Tensor]] = [[] for _ in self.param_groups]
        for bucket, g in zip(self.buckets, self._group_of, strict=True):
            if bucket.reducing is not None:
                self._reduced(bucket)
            slices[g].append(bucket.avg)
        for local, grads in zip(self.local.param_groups, slices, strict=True):
            for shard, grad in zip(local["params"], grads, strict=False):
                shard.grad = grad
        self.local.step()
        for bucket in reversed(self.buckets):  # the first the forward needs, first
            # my updated slice, copied: MPI may not send from where it receives
            bucket.gathering = self.backend.all_gather_async(
                bucket.flat, bucket.flat[bucket.lo:bucket.hi].clone(), check=not self._checked)
        if not self.overlap:
            self.synchronize()
        self._checked = True
        return loss

    def zero_grad(self, set_to_none: bool = True) -> None:
        """ZeRO-1 zeroes its gradient buffer in place (``set_to_none`` is ignored: the
        gradients live in it for good); ZeRO-2 drops the gradients."""
        for bucket in self.buckets:
            if self.stage == 1:
                assert bucket.grad is not None  # ZeRO-1's buffer, made in _add, kept for good
                bucket.grad.zero_()
                for p, view in zip(bucket.params, _views(bucket.grad, bucket.params),
                                   strict=True):
                    p.grad = view.view_as(p)
            else:
                for p in bucket.params:
                    p.grad = None
        for local in self.local.param_groups:
            for shard in local["params"]:
                shard.grad = None

    def state_dict(self) -> dict[str, Any]:
        """This rank's shard: the local optimizer's state, with where the slice lies."""
        return {"rank": self.backend.rank, "size": self.backend.size, "stage": self.stage,
                "local": self.local.state_dict()}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        if (state_dict.get("rank"), state_dict.get("size")) != (self.backend.rank,
                                                                 self.backend.size):
            raise ValueError(f"this state is rank {state_dict.get('rank')} of "
                             f"{state_dict.get('size')}, but this optimizer is rank "
                             f"{self.backend.rank} of {self.backend.size}: load each rank's own")
        self.local.load_state_dict(state_dict["local"])
