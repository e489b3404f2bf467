"""FSDP (ZeRO-3): the parameters themselves sharded, gathered one unit at a time (lesson 10).

Each unit (a submodule the caller names) keeps one flat slice of its parameters per
rank. It is all-gathered just before its forward, freed after it, gathered again
before its backward, and its gradient is reduce-scattered: the gradient of an
all-gather is a reduce-scatter (:class:`_Gather`). With ``prefetch`` the next units'
all-gathers start while this one computes, in the forward and in the backward; with
``overlap`` a unit's reduce-scatter is waited for only later (:class:`_Schedule`).
Torch's FSDP2 splits the same roles over a parameter group (here :class:`_Unit`), its
collectives (:class:`_Gather`) and the module wrapper (:class:`FullyShardedDataParallel`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import partial
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from pcourse.backends.base import Backend, Work
from pcourse.backends.groups import as_backend
from pcourse.sharding.zero import IN_FLIGHT, _flat, shard_range

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup

__all__ = ["FullyShardedDataParallel", "MinimalUnit"]


@dataclass
class _Schedule:
    """What the units of one model share: how far ahead to gather, and the step so far.

    ``order``: the units in the order this forward reached them (``last``: the
    previous forward's, the order to prefetch by); ``saved``: (unit, forward call)
    whose gathered parameters autograd saved, in forward order (a backward needs them
    again, in reverse); ``reducing``: reduce-scatters in flight (slice, its gradient,
    the handle).
    """

    prefetch: int = 0
    overlap: bool = False
    order: list[_Unit] = field(default_factory=list)
    last: list[_Unit] = field(default_factory=list)
    saved: list[tuple[_Unit, int]] = field(default_factory=list)
    reducing: list[tuple[nn.Parameter, torch.Tensor, Work]] = field(default_factory=list)

    def progress(self) -> None:
        """Test what is in flight: MPI moves a nonblocking collective only inside MPI calls."""
        for _, _, work in self.reducing:
            work.test()

    def reduced(self, keep: int = 0) -> None:
        """Wait for the oldest reduce-scatters until ``keep`` are left; each adds its slice's
        averaged gradient to the slice's ``.grad``."""
        while len(self.reducing) > keep:
            shard, mine, work = self.reducing.pop(0)
            work.wait()
            shard.grad = mine if shard.grad is None else shard.grad + mine


class _Unit:
    """One sharded unit: where its parameters live in the module, and this rank's slice.

    While the unit computes its forward, :meth:`gather` has put views of the gathered
    parameters where the module's parameters were. What autograd saves of them for
    the backward is packed as a place (offset, size, stride) instead of the tensor,
    so the gathered parameters are freed as soon as the forward ends; the first
    unpacking in the backward all-gathers them again, and they are freed once more as
    soon as every use of them in the backward is done, before the parameters'
    gradients are joined into the one the reduce-scatter reads: a unit's backward
    holds two units' worth at a time (gathered + gradients, then gradients + joined).
    """

    def __init__(self, module: nn.Module, params: list[tuple[nn.Parameter, list]],
                 backend: Backend, compute_dtype: torch.dtype | None,
                 schedule: _Schedule) -> None:
        self.module, self.backend, self.compute_dtype = module, backend, compute_dtype
        self.schedule = schedule
        self.places = [(owners, p.shape, p.numel()) for p, owners in params]
        numel = sum(p.numel() for p, _ in params)
        lo, hi, self.padded = shard_range(numel, backend.rank, backend.size)
        flat = _flat([p.detach() for p, _ in params], self.padded, params[0][0].detach())
        self.shard = nn.Parameter(flat[lo:hi].clone())
        self.calls = 0  # forwards so far: each one's gathered copy has its own number
        self.full: torch.Tensor | None = None  # the gathered parameters, during a forward
        self.again: dict[int, torch.Tensor] = {}  # gathered again, during a backward
        # gathers started ahead: None for the next forward, a call's number for its backward
        self.coming: dict[int | None, tuple[Work, torch.Tensor]] = {}
        self.hooks: Any = None
        for owners, _, _ in self.places:  # the module no longer holds the full tensors
            for mod, name in owners:
                delattr(mod, name)
                setattr(mod, name, None)

    @property
    def gathered_dtype(self) -> torch.dtype:
        return self.compute_dtype or self.shard.dtype

    def start_gather(self, key: int | None) -> None:
        """Start the all-gather that ``all_gather(key)`` will want (prefetch)."""
        if key not in self.coming and (key is None or key not in self.again):
            full = self.shard.new_empty(self.padded, dtype=self.gathered_dtype)
            work = self.backend.all_gather_async(full, self.shard.detach().to(full.dtype),
                                                 check=False)
            self.coming[key] = (work, full)

    def all_gather(self, key: int | None = None) -> torch.Tensor:
        """The gathered parameters: the prefetched ones for ``key``, or gathered now."""
        self.start_gather(key)
        work, full = self.coming.pop(key)
        work.wait()
        return full

    def gather(self) -> None:
        """Before the forward: gather, put the views in place, pack what autograd saves."""
        self.calls += 1
        call, full = self.calls, _Gather.apply(self.shard, self, self.calls)
        sizes = [n for _, _, n in self.places]
        # one split, not a slice per parameter: each slice's backward would fill a zero
        # gradient the size of the whole unit; split's backward joins them once
        views = full.split([*sizes, self.padded - sum(sizes)])
        for (owners, shape, _), view in zip(self.places, views, strict=False):
            for mod, name in owners:
                setattr(mod, name, view.view(shape))
        if views[0].grad_fn is not None:  # split's backward runs once every use is done
            views[0].grad_fn.register_prehook(partial(self._used, call))
        ptr = full.untyped_storage().data_ptr()

        saved, ahead = self.schedule.saved, self.schedule.prefetch

        def pack(t: torch.Tensor) -> Any:
            if t.untyped_storage().data_ptr() != ptr:
                return t
            if ahead and (not saved or saved[-1] != (self, call)):
                saved.append((self, call))  # its backward will gather it again: prefetch it
            return (call, t.storage_offset(), t.size(), t.stride())

        def unpack(packed: Any) -> torch.Tensor:
            if isinstance(packed, torch.Tensor):
                return packed
            key, offset, size, stride = packed
            if key not in self.again:  # the first use in this backward: gather again
                self.again[key] = self.all_gather(key)
                self.schedule.progress()
                self._prefetch_backward(key)
            return self.again[key].as_strided(size, stride, offset)

        self.full = full
        self.hooks = torch.autograd.graph.saved_tensors_hooks(pack, unpack)
        self.hooks.__enter__()

    def _used(self, call: int, grads: Any) -> None:
        """Before the parameters' gradients are joined into one: every use of the
        gathered copy in this backward is done, so free it (torch's FSDP2 reshards at
        the same moment, before it copies the gradients out)."""
        self.again.pop(call, None)

    def _prefetch_backward(self, call: int) -> None:
        """Start gathering the units whose backward comes next (the forward's, reversed)."""
        saved, depth = self.schedule.saved, self.schedule.prefetch
        if depth and (self, call) in saved:
            j = saved.index((self, call))
            for unit, c in reversed(saved[max(0, j - depth):j]):
                unit.start_gather(c)

    def prefetch_forward(self) -> None:
        """Start gathering the units the last forward reached after this one."""
        s = self.schedule
        s.order.append(self)
        i = len(s.order) - 1
        if s.prefetch and i < len(s.last) and s.last[i] is self:
            for unit in s.last[i + 1:i + 1 + s.prefetch]:
                unit.start_gather(None)

    def release(self) -> None:
        """After the forward: drop every reference to the gathered parameters."""
        self.hooks.__exit__(None, None, None)
        self.hooks, self.full = None, None
        for owners, _, _ in self.places:
            for mod, name in owners:
                setattr(mod, name, None)


class MinimalUnit:
    """FSDP's idea in one unit, as small as it goes: what lesson 10 shows before the
    production class below.

    The module's own parameters become this rank's slice of one flat vector
    (``shard``, what the optimizer steps). Before each forward they are all-gathered
    and put back in place as views of the gathered vector; a hook on that vector
    reduce-scatters (averages) its gradient into the slice's ``.grad`` and lets the
    gathered vector go. So the parameters are whole from the forward to the backward:
    :class:`FullyShardedDataParallel` frees them in between and gathers them again in
    the backward (saved-tensor hooks), prefetches, overlaps, and handles nested,
    tied and frozen parameters, none of which this does.
    """

    def __init__(self, module: nn.Module, backend: Backend) -> None:
        self.module, self.backend = module, backend
        self.names = [n for n, _ in module.named_parameters(recurse=False)]
        params = [getattr(module, n).detach() for n in self.names]
        self.shapes, self.sizes = [q.shape for q in params], [q.numel() for q in params]
        lo, hi, self.padded = shard_range(sum(self.sizes), backend.rank, backend.size)
        self.shard = nn.Parameter(_flat(params, self.padded, params[0])[lo:hi].clone())
        for n in self.names:  # the module holds no whole parameter between steps
            delattr(module, n)
            setattr(module, n, None)
        module.register_forward_pre_hook(self._gather)

    def _gather(self, module: nn.Module, args: tuple) -> None:
        full = self.shard.new_empty(self.padded)
        self.backend.all_gather(full, self.shard.detach())
        full.requires_grad_()
        full.register_hook(self._reduce)  # its gradient, once backward has made it whole
        pieces = full.split([*self.sizes, self.padded - sum(self.sizes)])
        for n, piece, shape in zip(self.names, pieces, self.shapes, strict=False):
            setattr(module, n, piece.view(shape))

    def _reduce(self, grad: torch.Tensor) -> None:
        mine = torch.empty_like(self.shard)
        self.backend.reduce_scatter(mine, grad.contiguous(), "avg")
        self.shard.grad = mine if self.shard.grad is None else self.shard.grad + mine
        for n in self.names:  # let the gathered vector go
            setattr(self.module, n, None)


class _Gather(torch.autograd.Function):
    """All-gather a unit's slices; backward: reduce-scatter (average) its gradient."""

    @staticmethod
    def forward(ctx: Any, shard: torch.Tensor, unit: _Unit, call: int) -> torch.Tensor:
        ctx.unit, ctx.call = unit, call
        return unit.all_gather()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, None, None]:
        unit, schedule = ctx.unit, ctx.unit.schedule
        unit.again.pop(ctx.call, None)  # the unit's backward is done: free them again
        mine = torch.empty_like(unit.shard)
        # gradients reduced in the shard's dtype (fp32 under mixed precision)
        work = unit.backend.reduce_scatter_async(mine, grad.to(unit.shard.dtype).contiguous(),
                                                 "avg", check=False)
        if not schedule.overlap:
            work.wait()
            return mine, None, None
        schedule.reducing.append((unit.shard, mine, work))  # finish() waits for the last
        schedule.reduced(keep=IN_FLIGHT)  # each holds a unit's whole gradient: a few at most
        return None, None, None


def _unit_roots(module: nn.Module, shard: Any) -> list[nn.Module]:
    """The submodules the caller shards, outermost first; none inside another."""
    if shard is None:
        return [module]
    if isinstance(shard, type) or (isinstance(shard, tuple) and shard
                                   and all(isinstance(t, type) for t in shard)):
        types = shard
        shard = lambda m: isinstance(m, types)  # noqa: E731
    if not callable(shard):
        raise TypeError(f"shard must be None, a module type, a tuple of types or a predicate "
                        f"module -> bool, got {shard!r}")
    roots: list[nn.Module] = []
    inside: set[int] = set()
    for m in module.modules():
        if id(m) in inside:
            continue
        if shard(m):
            roots.append(m)
            inside.update(id(x) for x in m.modules())
    return roots


def _owners(root: nn.Module) -> dict[int, tuple[nn.Parameter, list[tuple[nn.Module, str]]]]:
    """Every parameter under ``root`` with every (module, attribute) that holds it."""
    found: dict[int, tuple[nn.Parameter, list[tuple[nn.Module, str]]]] = {}
    for m in root.modules():
        for name, p in m._parameters.items():
            if p is not None:
                found.setdefault(id(p), (p, []))[1].append((m, name))
    return found


class FullyShardedDataParallel(nn.Module):
    """Parameters, gradients and optimizer state sharded across ranks (ZeRO-3, FSDP).

    ``FullyShardedDataParallel(model, backend, shard=nn.Linear)`` makes every
    submodule for which ``shard`` holds (a module type, a tuple of types, or a
    predicate ``module -> bool``; None: the whole model, one unit) a unit whose
    trainable parameters live as one flat slice per rank. Before a unit's forward
    its parameters are all-gathered (in ``compute_dtype`` if given: floating inputs
    are cast to it and its outputs back, the fp32 slices stay the master weights; a
    unit that also holds whole parameters computes in their dtype);
    after the forward they are freed, before its backward gathered again, and their
    gradient is reduce-scattered (averaged) into the slice's ``.grad`` during
    backward. ``prefetch=k``: the all-gathers of the next k units (in the order the
    previous forward reached them; in the backward, that order reversed) start
    while a unit computes, holding up to k more units gathered. ``overlap=True``: a
    reduce-scatter is waited for once ``IN_FLIGHT`` newer ones are started, or in
    ``finish()``, so the slices' ``.grad`` are complete only after ``finish()``.
    Parameters outside every unit, frozen ones, and ones shared between a
    unit and anything outside it (tied weights) stay whole on every rank.

    Train as usual: ``opt = torch.optim.AdamW(fsdp.parameters())`` (the slices and
    the replicated parameters); ``loss.backward()``; ``fsdp.finish()``
    (averages the replicated parameters' gradients); ``opt.step()``.
    ``full_parameters()`` all-gathers every parameter by its name in the model.
    """

    def __init__(self, module: nn.Module, backend: Backend | ProcessGroup | None = None, *,
                 shard: Any = None, compute_dtype: torch.dtype | None = None,
                 prefetch: int = 0, overlap: bool = False) -> None:
        super().__init__()
        if compute_dtype is not None and not compute_dtype.is_floating_point:
            raise ValueError(f"compute_dtype must be a floating dtype (torch.bfloat16, "
                             f"torch.float16), got {compute_dtype}")
        if isinstance(prefetch, bool) or not isinstance(prefetch, int) or prefetch < 0:
            raise ValueError(f"prefetch is how many units to gather ahead, 0 or more, "
                             f"got {prefetch!r}")
        self.backend = as_backend(backend)
        self.compute_dtype = compute_dtype
        self.schedule = _Schedule(prefetch, overlap)
        self.names = {id(p): n for n, p in module.named_parameters()}  # tied: first name
        everywhere = _owners(module)
        self.units: list[_Unit] = []
        shards = []
        for root in _unit_roots(module, shard):
            mine = [(p, owners) for key, (p, owners) in _owners(root).items()
                    if p.requires_grad and len(everywhere[key][1]) == len(owners)]
            if mine:
                kinds = {(p.dtype, p.device) for p, _ in mine}
                if len(kinds) > 1:
                    raise ValueError(f"unit {type(root).__name__} mixes dtypes or devices "
                                     f"({sorted(map(str, kinds))}); make them one")
                unit = _Unit(root, mine, self.backend, compute_dtype, self.schedule)
                if any(True for _ in root.parameters()):  # whole ones left: tied, frozen
                    unit.compute_dtype = None  # compute in their dtype, not a mix
                self._hook(unit)
                self.units.append(unit)
                shards.append(unit.shard)
        self.module = module
        self.shards = nn.ParameterList(shards)
        self.replicated = [p for p in module.parameters() if p.requires_grad]

    def _hook(self, unit: _Unit) -> None:
        dtype = unit.compute_dtype

        def before(mod: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
            unit.gather()
            unit.prefetch_forward()
            if dtype is not None:
                return _cast(args, dtype), _cast(kwargs, dtype)
            return args, kwargs

        def after(mod: nn.Module, args: tuple, kwargs: dict, output: Any) -> Any:
            unit.release()
            if dtype is not None:
                output = _cast(output, unit.shard.dtype, only=dtype)
            return output

        unit.module.register_forward_pre_hook(before, with_kwargs=True)
        unit.module.register_forward_hook(after, with_kwargs=True)

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        s = self.schedule
        s.order = []
        try:
            return self.module(*args, **kwargs)
        finally:
            s.last = s.order
            for unit in self.units:  # gathered ahead for a unit this forward did not reach
                if None in unit.coming:
                    unit.coming.pop(None)[0].wait()

    @torch.no_grad()
    def finish(self) -> None:
        """After backward, before the step: average the replicated parameters' gradients.

        The units' gradients were reduce-scattered during backward already (with
        ``overlap``, the last are waited for here). One flat allreduce for all
        replicated parameters (missing gradients count as zero). The name is
        :meth:`pcourse.buckets.BucketedAllreduce.finish`'s: the same moment.
        """
        s = self.schedule
        s.reduced()
        s.saved.clear()
        for unit in self.units:  # gathered ahead for a backward that did not need them
            for work, _ in unit.coming.values():
                work.wait()
            unit.coming.clear()
        if not self.replicated:
            return
        grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in self.replicated]
        flat = torch.cat([g.reshape(-1) for g in grads])
        self.backend.allreduce(flat, "avg")
        offset = 0
        for p in self.replicated:
            p.grad = flat[offset:offset + p.numel()].view_as(p).clone()
            offset += p.numel()

    @torch.no_grad()
    def full_parameters(self) -> dict[str, torch.Tensor]:
        """Every parameter of the model, whole, by its name in the model (collective).

        Sharded ones are all-gathered (in their own dtype), replicated ones copied.
        """
        out = {}
        for unit in self.units:
            full = unit.shard.new_empty(unit.padded)
            self.backend.all_gather(full, unit.shard.detach().clone())
            offset = 0
            for owners, shape, n in unit.places:
                mod, name = owners[0]
                out[(mod, name)] = full[offset:offset + n].view(shape).clone()
                offset += n
        named = {}
        for name, p in self.module.named_parameters():
            named[name] = p.detach().clone()
        for m_name, m in self.module.named_modules():
            for (mod, attr), t in list(out.items()):
                if mod is m:
                    named[f"{m_name}.{attr}" if m_name else attr] = t
                    del out[(mod, attr)]
        return dict(sorted(named.items()))


def _cast(x: Any, dtype: torch.dtype, only: torch.dtype | None = None) -> Any:
    """``x`` with its floating tensors cast to ``dtype`` (those of dtype ``only``, if given)."""
    if isinstance(x, torch.Tensor):
        hit = x.is_floating_point() if only is None else x.dtype == only
        return x.to(dtype) if hit else x
    if isinstance(x, tuple | list):
        return type(x)(_cast(y, dtype, only) for y in x)
    if isinstance(x, dict):
        return {k: _cast(v, dtype, only) for k, v in x.items()}
    return x
