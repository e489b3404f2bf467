"""ZeRO-1 and ZeRO-2: the optimizer's state, and then the gradients, sharded (lesson 10).

Each rank keeps the optimizer state of, and steps, only its own slice of the
parameters: a reduce-scatter (the allreduce's first half) brings it the averaged
gradient of that slice, an all-gather (the second half) brings everyone's updated
slices back. Slices are cut from one flat vector per parameter group, padded with
zeros to a multiple of p (:func:`shard_range`), so every rank's slice has the same
length. :mod:`pcourse.sharding.fsdp` cuts its units the same way.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from pcourse.backends.base import Backend
from pcourse.backends.groups import as_backend

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup

__all__ = ["ShardedOptimizer", "shard_range"]


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
                 backend: Backend | ProcessGroup | None = None, *, stage: int = 1,
                 **defaults: Any) -> None:
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
