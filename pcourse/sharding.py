"""Sharded data parallelism: ZeRO-1, ZeRO-2 and FSDP, built on reduce-scatter and all-gather.

Data parallelism as lessons 01-08 teach it keeps everything on every rank: the
parameters, the gradients and the optimizer's state (with fp32 Adam 4 + 4 + 8 bytes
per parameter: 16Ψ for Ψ parameters). Sharding cuts what only one rank needs into p
pieces, one per rank:

- :class:`ShardedOptimizer` ``stage=1`` (ZeRO-1): each rank keeps the optimizer
  state of, and steps, only its own slice of the parameters. It needs the averaged
  gradient of that slice only: a reduce-scatter, the allreduce's first half, brings
  it; an all-gather, the second half, brings everyone's updated slices to every
  rank. The whole gradient buffer stays allocated, as in DDP: 8Ψ + 8Ψ/p bytes.
- ``stage=2`` (ZeRO-2): the same messages, but the full gradients are freed once
  reduce-scattered; each rank keeps its slice's only. 4Ψ + 12Ψ/p.
- :class:`FullyShardedDataParallel` (ZeRO-3, FSDP): the parameters themselves are
  sharded. Each unit (a submodule the caller names) is all-gathered just before its
  forward, freed after it, gathered again before its backward, and its gradient is
  reduce-scattered: the gradient of an all-gather is a reduce-scatter. 16Ψ/p, plus
  the unit being computed.

Slices are cut from one flat vector per parameter group (or unit), padded with zeros
to a multiple of p so every rank's slice has the same length. Every rank then runs
the same elementwise optimizer arithmetic on its slice as one process would on the
whole, so the result equals single-process training up to the order of the sums.

The wire: DDP, ZeRO-1 and ZeRO-2 send 2(p-1)/p·Ψ elements per rank and step (an
allreduce is a reduce-scatter plus an all-gather); FSDP 3(p-1)/p·Ψ (two all-gathers
and one reduce-scatter). :class:`CountingBackend` counts what really goes through a
backend; :func:`state_bytes` what is really held.

Both classes take a pcourse backend, a torch.distributed process group, or nothing
(torch's default group, as under torchrun). Lesson 10 builds and measures all of it.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import torch
from torch import nn

from pcourse.backends.base import Backend

__all__ = ["CountingBackend", "FullyShardedDataParallel", "ShardedOptimizer", "as_backend",
           "shard_range", "state_bytes", "theory_bytes"]


# ------------------------------------------------------------------ backends
def as_backend(backend: Any = None) -> Backend:
    """A pcourse backend for ``backend``: a Backend as it is; a torch.distributed
    process group wrapped (gloo or nccl by the group's kind); None: torch's default
    group, which must be initialised (as under torchrun)."""
    if isinstance(backend, Backend):
        return backend
    import torch.distributed as dist

    if backend is None:
        if not dist.is_available() or not dist.is_initialized():
            raise ValueError("no backend given and torch.distributed is not initialised: pass "
                             "backend=make_backend(...) or a process group, or run under "
                             "torchrun after init_process_group")
        backend = dist.group.WORLD
    if isinstance(backend, dist.ProcessGroup):
        from pcourse.backends import make_backend

        kind = "nccl" if "nccl" in str(dist.get_backend(backend)) and torch.cuda.is_available() \
            else "gloo"
        return make_backend(kind, comm=backend)
    raise TypeError(f"backend must be a pcourse Backend, a torch.distributed ProcessGroup or "
                    f"None, got {type(backend).__name__}")


def shard_range(numel: int, rank: int, size: int) -> tuple[int, int, int]:
    """(start, stop, padded) of rank's slice of a flat vector of ``numel`` elements.

    The vector is padded with zeros to ``padded``, the next multiple of ``size``, so
    that every rank's slice has the same length (a reduce-scatter and an all-gather
    move equal blocks); the padding sits at the end, in the last ranks' slices.
    """
    padded = math.ceil(numel / size) * size if numel else 0
    s = padded // size
    return rank * s, (rank + 1) * s, padded


class CountingBackend(Backend):
    """A backend that counts the bytes each rank sends through the backend it wraps.

    Every collective is passed on unchanged; what a ring implementation of it sends
    from this rank is added to ``sent`` (bytes, by collective): an allreduce of N
    bytes 2(p-1)/p·N, a reduce-scatter of an N-byte input (p-1)/p·N, an all-gather
    into an N-byte output (p-1)/p·N, a broadcast N (the most any rank sends down a
    chain). The agreement checks run inside the wrapped backend and are not counted.
    """

    def __init__(self, inner: Backend) -> None:
        self.inner = inner
        self.name, self.rank, self.size = inner.name, inner.rank, inner.size
        self.device, self.any_device, self.timeout = inner.device, inner.any_device, inner.timeout
        self.sent: dict[str, float] = {}
        self.calls: dict[str, int] = {}

    def _count(self, kind: str, nbytes: float) -> None:
        self.sent[kind] = self.sent.get(kind, 0.0) + nbytes
        self.calls[kind] = self.calls.get(kind, 0) + 1

    def total(self) -> float:
        return float(sum(self.sent.values()))

    def reset(self) -> None:
        self.sent, self.calls = {}, {}

    def allreduce(self, tensor, op="sum", *, check=True):
        p = self.size
        self._count("allreduce", 2 * (p - 1) / p * tensor.numel() * tensor.element_size())
        return self.inner.allreduce(tensor, op, check=check)

    def broadcast(self, tensor, root=0, *, check=True):
        self._count("broadcast", (self.size > 1) * tensor.numel() * tensor.element_size())
        return self.inner.broadcast(tensor, root, check=check)

    def reduce_scatter(self, output, input, op="sum", *, check=True):
        p = self.size
        self._count("reduce_scatter", (p - 1) / p * input.numel() * input.element_size())
        return self.inner.reduce_scatter(output, input, op, check=check)

    def all_gather(self, output, input, *, check=True):
        p = self.size
        self._count("all_gather", (p - 1) / p * output.numel() * output.element_size())
        return self.inner.all_gather(output, input, check=check)

    def barrier(self) -> None:
        self.inner.barrier()

    def close(self) -> None:
        return None  # the wrapped backend belongs to the caller


# ------------------------------------------------------------------ ZeRO-1 and ZeRO-2
def _flat(tensors: list[torch.Tensor], padded: int, like: torch.Tensor) -> torch.Tensor:
    """The tensors one after the other in a new flat vector, zero-padded to ``padded``."""
    out = like.new_zeros(padded)
    offset = 0
    for t in tensors:
        out[offset:offset + t.numel()] = t.reshape(-1)
        offset += t.numel()
    return out


class ShardedOptimizer(torch.optim.Optimizer):
    """Any torch optimizer, with its state sharded across ranks (ZeRO-1 or ZeRO-2).

    ``ShardedOptimizer(model.parameters(), torch.optim.AdamW, backend=b, lr=1e-3)``:
    like torch's ``ZeroRedundancyOptimizer(params, optimizer_class, **defaults)``,
    and ``param_groups`` (what LR schedulers change) are this object's. Call it
    after a plain ``loss.backward()`` on each rank's local mean loss; ``step()``
    reduce-scatters (averages) the gradients itself, steps this rank's slice with
    ``optimizer_cls``, and all-gathers the slices. ``stage=1`` keeps the gradient
    buffer whole (the ``.grad`` of parameters outside this rank's slice then hold
    this rank's own, unaveraged gradients); ``stage=2`` frees it.

    The parameters of each group (those with ``requires_grad``; frozen ones are left
    alone) become views into one flat, padded vector per group (as torch's
    ``parameters_as_bucket_view``), so the slice a rank steps is a view too and the
    all-gather writes straight into the parameters. The slice cuts through
    parameters, so ``optimizer_cls`` must act elementwise (SGD, Adam, AdamW, RMSprop
    do); a parameter without a gradient counts as a zero gradient. ``state_dict()``
    is this rank's shard's. Every rank must build it with the same parameters.
    """

    def __init__(self, params: Iterable[Any], optimizer_cls: type[torch.optim.Optimizer],
                 backend: Any = None, *, stage: int = 1, **defaults: Any) -> None:
        if stage not in (1, 2):
            raise ValueError(f"stage must be 1 (optimizer state sharded) or 2 (gradients too), "
                             f"got {stage!r}; for parameters use FullyShardedDataParallel")
        if not (isinstance(optimizer_cls, type) and issubclass(optimizer_cls,
                                                               torch.optim.Optimizer)):
            raise TypeError(f"optimizer_cls must be a torch.optim.Optimizer class such as "
                            f"torch.optim.AdamW, got {optimizer_cls!r}")
        super().__init__(params, defaults)
        self.backend, self.stage = as_backend(backend), stage
        self.optimizer_cls = optimizer_cls
        self._checked = False
        self._flats: list[torch.Tensor] = []  # per group: the flat, padded parameters
        self._members: list[list[nn.Parameter]] = []  # per group: the params in it
        shards = []
        for group in self.param_groups:
            members = self._dedupe(p for p in group["params"] if p.requires_grad)
            flat = self._adopt(members)
            lo, hi, _ = shard_range(sum(p.numel() for p in members), self.backend.rank,
                                    self.backend.size)
            self._flats.append(flat)
            self._members.append(members)
            shards.append({"params": [flat[lo:hi]], **self._hyper(group)})
        self.local = optimizer_cls(shards)  # steps this rank's slices only

    @staticmethod
    def _dedupe(params: Iterable[nn.Parameter]) -> list[nn.Parameter]:
        seen: dict[int, nn.Parameter] = {}
        for p in params:
            seen.setdefault(id(p), p)
        return list(seen.values())

    def _adopt(self, members: list[nn.Parameter]) -> torch.Tensor:
        """Move the parameters into one flat padded vector; each becomes a view of it."""
        if not members:
            return torch.zeros(0)
        kinds = {(p.dtype, p.device) for p in members}
        if len(kinds) > 1:
            raise ValueError(f"a parameter group mixes dtypes or devices "
                             f"({sorted(map(str, kinds))}); put each kind in its own group")
        _, _, padded = shard_range(sum(p.numel() for p in members), 0, self.backend.size)
        flat = _flat([p.detach() for p in members], padded, members[0].detach())
        offset = 0
        for p in members:
            p.data = flat[offset:offset + p.numel()].view_as(p)
            offset += p.numel()
        return flat

    @staticmethod
    def _hyper(group: dict[str, Any]) -> dict[str, Any]:
        return {k: v for k, v in group.items() if k != "params"}

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:
        """Average the gradients, step this rank's slice, all-gather the parameters."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        b, check = self.backend, not self._checked
        for group, flat, members, local in zip(self.param_groups, self._flats, self._members,
                                               self.local.param_groups, strict=True):
            local.update(self._hyper(group))  # what a scheduler changed
            if not members:
                continue
            grads = _flat([p.grad if p.grad is not None else torch.zeros_like(p)
                           for p in members], flat.numel(), flat)
            lo, hi, _ = shard_range(flat.numel(), b.rank, b.size)
            mine = grads.new_empty(hi - lo)  # only my slice's average arrives
            b.reduce_scatter(mine, grads, "avg", check=check)
            if self.stage == 1:  # the gradient buffer stays whole: my slice averaged in it
                grads[lo:hi] = mine
                offset = 0
                for p in members:
                    p.grad = grads[offset:offset + p.numel()].view_as(p)
                    offset += p.numel()
                mine = grads[lo:hi]
            else:  # the full gradients go
                for p in members:
                    p.grad = None
            local["params"][0].grad = mine
            del grads
        self.local.step()
        for flat, members, local in zip(self._flats, self._members, self.local.param_groups,
                                        strict=True):
            if members:  # my updated slice, copied: MPI may not send from where it receives
                b.all_gather(flat, local["params"][0].detach().clone(), check=check)
        self._checked = True
        return loss

    def zero_grad(self, set_to_none: bool = True) -> None:
        super().zero_grad(set_to_none)
        for local in self.local.param_groups:
            local["params"][0].grad = None

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


# ------------------------------------------------------------------ FSDP
class _Unit:
    """One sharded unit: where its parameters live in the module, and this rank's slice.

    While the unit computes its forward, :meth:`gather` has put views of the gathered
    parameters where the module's parameters were. What autograd saves of them for
    the backward is packed as a place (offset, size, stride) instead of the tensor,
    so the gathered parameters are freed as soon as the forward ends; the first
    unpacking in the backward all-gathers them again, and :class:`_Gather`'s
    backward (the unit's last) frees them once more.
    """

    def __init__(self, module: nn.Module, params: list[tuple[nn.Parameter, list]],
                 backend: Backend, compute_dtype: torch.dtype | None) -> None:
        self.module, self.backend, self.compute_dtype = module, backend, compute_dtype
        self.places = [(owners, p.shape, p.numel()) for p, owners in params]
        numel = sum(p.numel() for p, _ in params)
        lo, hi, self.padded = shard_range(numel, backend.rank, backend.size)
        flat = _flat([p.detach() for p, _ in params], self.padded, params[0][0].detach())
        self.shard = nn.Parameter(flat[lo:hi].clone())
        self.calls = 0  # forwards so far: each one's gathered copy has its own number
        self.full: torch.Tensor | None = None  # the gathered parameters, during a forward
        self.again: dict[int, torch.Tensor] = {}  # gathered again, during a backward
        self.hooks: Any = None
        for owners, _, _ in self.places:  # the module no longer holds the full tensors
            for mod, name in owners:
                delattr(mod, name)
                setattr(mod, name, None)

    @property
    def gathered_dtype(self) -> torch.dtype:
        return self.compute_dtype or self.shard.dtype

    def all_gather(self) -> torch.Tensor:
        dtype = self.gathered_dtype
        full = self.shard.new_empty(self.padded, dtype=dtype)
        self.backend.all_gather(full, self.shard.detach().to(dtype), check=False)
        return full

    def gather(self) -> None:
        """Before the forward: gather, put the views in place, pack what autograd saves."""
        self.calls += 1
        call, full = self.calls, _Gather.apply(self.shard, self, self.calls)
        offset = 0
        for owners, shape, n in self.places:
            view = full[offset:offset + n].view(shape)
            for mod, name in owners:
                setattr(mod, name, view)
            offset += n
        ptr = full.untyped_storage().data_ptr()

        def pack(t: torch.Tensor) -> Any:
            if t.untyped_storage().data_ptr() != ptr:
                return t
            return (call, t.storage_offset(), t.size(), t.stride())

        def unpack(packed: Any) -> torch.Tensor:
            if isinstance(packed, torch.Tensor):
                return packed
            key, offset, size, stride = packed
            if key not in self.again:  # the first use in this backward: gather again
                self.again[key] = self.all_gather()
            return self.again[key].as_strided(size, stride, offset)

        self.full = full
        self.hooks = torch.autograd.graph.saved_tensors_hooks(pack, unpack)
        self.hooks.__enter__()

    def release(self) -> None:
        """After the forward: drop every reference to the gathered parameters."""
        self.hooks.__exit__(None, None, None)
        self.hooks, self.full = None, None
        for owners, _, _ in self.places:
            for mod, name in owners:
                setattr(mod, name, None)


class _Gather(torch.autograd.Function):
    """All-gather a unit's slices; backward: reduce-scatter (average) its gradient."""

    @staticmethod
    def forward(ctx: Any, shard: torch.Tensor, unit: _Unit, call: int) -> torch.Tensor:
        ctx.unit, ctx.call = unit, call
        return unit.all_gather()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        unit = ctx.unit
        unit.again.pop(ctx.call, None)  # the unit's backward is done: free them again
        mine = torch.empty_like(unit.shard)
        # gradients reduced in the shard's dtype (fp32 under mixed precision)
        unit.backend.reduce_scatter(mine, grad.to(unit.shard.dtype).contiguous(), "avg",
                                    check=False)
        return mine, None, None


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
    backward. Parameters outside every unit, frozen ones, and ones shared between a
    unit and anything outside it (tied weights) stay whole on every rank.

    Train as usual: ``opt = torch.optim.AdamW(fsdp.parameters())`` (the slices and
    the replicated parameters); ``loss.backward()``; ``fsdp.finish_gradients()``
    (averages the replicated parameters' gradients); ``opt.step()``.
    ``full_parameters()`` all-gathers every parameter by its name in the model.
    """

    def __init__(self, module: nn.Module, backend: Any = None, *, shard: Any = None,
                 compute_dtype: torch.dtype | None = None) -> None:
        super().__init__()
        if compute_dtype is not None and not compute_dtype.is_floating_point:
            raise ValueError(f"compute_dtype must be a floating dtype (torch.bfloat16, "
                             f"torch.float16), got {compute_dtype}")
        self.backend = as_backend(backend)
        self.compute_dtype = compute_dtype
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
                unit = _Unit(root, mine, self.backend, compute_dtype)
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
        return self.module(*args, **kwargs)

    @torch.no_grad()
    def finish_gradients(self) -> None:
        """After backward: average the replicated parameters' gradients across ranks.

        The units' gradients were reduce-scattered during backward already. One flat
        allreduce for all replicated parameters (missing gradients count as zero).
        """
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


def _tensors(x: Any) -> Iterator[torch.Tensor]:
    if isinstance(x, torch.Tensor):
        yield x
    elif isinstance(x, tuple | list):
        for y in x:
            yield from _tensors(y)
    elif isinstance(x, dict):
        for y in x.values():
            yield from _tensors(y)


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


# ------------------------------------------------------------------ memory
def state_bytes(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, int]:
    """Bytes of parameters, gradients and optimizer state this rank holds, from the
    live tensors: each storage counted once, at its allocated size (views and padding
    included, freed storages as zero)."""
    seen: set[int] = set()

    def size(t: torch.Tensor | None) -> int:
        if t is None or not isinstance(t, torch.Tensor):
            return 0
        s = t.untyped_storage()
        if s.data_ptr() in seen or s.nbytes() == 0:
            return 0
        seen.add(s.data_ptr())
        return s.nbytes()

    params = list(model.parameters())
    if isinstance(model, FullyShardedDataParallel):  # gathered ones alive now, if any
        params += [t for u in model.units for t in (u.full, *u.again.values())
                   if t is not None]
    opt = optimizer.local if isinstance(optimizer, ShardedOptimizer) else optimizer
    grads_of = params + [p for g in opt.param_groups for p in g["params"]]
    counts = {"parameters": sum(size(p) for p in params)}
    counts["gradients"] = sum(size(p.grad) for p in grads_of)
    counts["optimizer"] = sum(size(v) for st in opt.state.values() for v in st.values()
                              if isinstance(v, torch.Tensor) and v.dim() > 0)
    counts["total"] = sum(counts.values())
    return counts


def theory_bytes(strategy: str, psi: int, p: int, *, bytes_per: int = 4,
                 unit: int = 0) -> float:
    """Per-rank bytes of fp32 Adam training state for Ψ = ``psi`` parameters on p ranks.

    ddp 16Ψ; zero1 8Ψ + 8Ψ/p; zero2 4Ψ + 12Ψ/p; fsdp 16Ψ/p + the largest gathered
    unit (``unit`` parameters, while it is computed).
    """
    b = bytes_per
    table = {"ddp": 4 * b * psi, "zero1": 2 * b * psi + 2 * b * psi / p,
             "zero2": b * psi + 3 * b * psi / p, "fsdp": 4 * b * psi / p + b * unit}
    if strategy not in table:
        raise ValueError(f"unknown strategy {strategy!r}; use one of {', '.join(table)}")
    return float(table[strategy])
