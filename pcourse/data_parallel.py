"""The three functions that turn N copies of a model into one data-parallel model.

1. ``broadcast_parameters``: every rank starts from rank 0's weights (and buffers,
   such as BatchNorm's running statistics), whatever its own random init was.
2. ``average_gradients``: after ``backward()``, every rank replaces its gradients by
   the average over ranks (``average_gradients_flat``: the same, in one message).
   With equal shards and a mean loss this is exactly the gradient of the mean loss
   over the union of the ranks' batches, so the optimizer steps that follow are
   identical on every rank (lesson 01; the loop of lesson 05 relies on it).
3. ``check_consistency``: prove it. The largest spread of every tensor across
   ranks, and the names of those that differ.

Each begins by comparing a fingerprint of the model across ranks, in one tiny
allreduce (:func:`check_same_model`): ranks holding differently shaped models would
otherwise issue collectives of different sizes or counts, which deadlocks or
silently mixes tensors; with the fingerprint they all raise the same ValueError.
The collectives after it skip the backends' own per-call check (``check=False``).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field

import torch

from pcourse.agree import agree
from pcourse.backends import Backend


def _named_tensors(model: torch.nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    # named_parameters()/named_buffers() yield each tensor object once, so tied
    # weights (one Parameter reached from two modules) appear, and are sent, once.
    yield from model.named_parameters()
    yield from model.named_buffers()


def check_same_model(tensors: Sequence[torch.Tensor], backend: Backend, what: str,
                     **also: int) -> None:
    """Raise ValueError on every rank if the ranks' tensor lists differ in shape or dtype.

    Collective. ``also``: further numbers every rank must agree on (a root rank).
    """
    facts: dict[str, int | str] = {
        "number of tensors": len(tensors),
        "number of elements": sum(t.numel() for t in tensors),
        "list of shapes": ";".join(f"{tuple(t.shape)}:{t.dtype}" for t in tensors),
        **also,
    }
    agree(facts, backend.max_over_ranks, subject=f"every rank must hold the same {what}",
          hint="Build the same model (same architecture and arguments) on every rank.")


def _gradients(model: torch.nn.Module, backend: Backend, check: bool) -> list[torch.Tensor]:
    """The gradients to average, the same list on every rank (``check``)."""
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    if check:
        check_same_model(grads, backend, "gradients (the same model, and a gradient for "
                                         "the same parameters)")
    if not grads:
        raise ValueError("the model has no gradients to average: call loss.backward() first, "
                         "and check that some parameters have requires_grad=True")
    return grads


def _on_backend_device(tensor: torch.Tensor, backend: Backend,
                       collective: Callable[[torch.Tensor], object]) -> None:
    """Run ``collective(t)`` in place on ``tensor``, staged through the backend's device
    if the tensor lives elsewhere and the backend does not stage it itself."""
    if tensor.device == backend.device or backend.any_device:
        collective(tensor)
    else:
        staged = tensor.detach().to(backend.device)
        collective(staged)
        tensor.detach().copy_(staged)


def _reduce(tensor: torch.Tensor, backend: Backend, op: str) -> None:
    _on_backend_device(tensor, backend, lambda t: backend.allreduce(t, op, check=False))


def average_gradients(model: torch.nn.Module, backend: Backend, check: bool = True) -> None:
    """Replace every gradient by its average across ranks, in place, one message each.

    Parameters whose ``grad`` is None (frozen, or unused in this step) are skipped;
    every rank must skip the same ones, which ``check`` verifies with one small
    fingerprint allreduce (pass False to save it once you trust your model).
    Tied weights are one Parameter object: ``model.parameters()`` yields it once,
    so it is reduced once, with the gradient summed from all its uses.
    """
    for g in _gradients(model, backend, check):
        _reduce(g, backend, "avg")


def average_gradients_flat(model: torch.nn.Module, backend: Backend, check: bool = True) -> None:
    """Average every gradient across ranks with ONE allreduce of one flat buffer.

    Per-parameter messages pay the latency once per tensor; the copy into one
    buffer costs a pass over the gradients. ``check`` as in :func:`average_gradients`.
    """
    grads = _gradients(model, backend, check)
    flat = torch.cat([g.reshape(-1) for g in grads])
    _reduce(flat, backend, "avg")
    torch._foreach_copy_(grads, [piece.view_as(g) for piece, g in
                                 zip(flat.split([g.numel() for g in grads]), grads, strict=True)])


@torch.no_grad()
def broadcast_parameters(model: torch.nn.Module, backend: Backend, root: int = 0) -> None:
    """Overwrite every parameter and buffer with ``root``'s, so all ranks start alike.

    The ranks must agree on ``root`` (checked with the model), a rank of the backend.
    """
    tensors = [t for _, t in _named_tensors(model)]
    check_same_model(tensors, backend, "model", root=root)
    if isinstance(root, bool) or not isinstance(root, int) or not 0 <= root < backend.size:
        raise ValueError(f"root must be a rank from 0 to {backend.size - 1}, got {root!r}")
    for t in tensors:
        _on_backend_device(t, backend, lambda buf: backend.broadcast(buf, root, check=False))


@dataclass
class ConsistencyReport:
    """How far the ranks' copies of a model are apart (identical on every rank)."""

    max_deviation: float  # largest (max over ranks - min over ranks) of any element
    diverging: list[str]  # names of tensors that differ between ranks
    spreads: dict[str, float] = field(default_factory=dict)  # every tensor's spread

    @property
    def consistent(self) -> bool:
        return not self.diverging

    def __str__(self) -> str:
        if self.consistent:
            return f"consistent: largest deviation across ranks {self.max_deviation:.3g}"
        return (f"INCONSISTENT: largest deviation {self.max_deviation:.3g} in "
                f"{', '.join(self.diverging)}")


@torch.no_grad()
def check_consistency(model: torch.nn.Module, backend: Backend) -> ConsistencyReport:
    """Compare every parameter and buffer across ranks; collective, so call it on all.

    For each tensor, allreduce with MAX and with MIN: their difference is the spread
    of every element across ranks, zero where all ranks agree. Tensors with any
    spread (or NaN) are named in the report.
    """
    named = list(_named_tensors(model))
    check_same_model([t for _, t in named], backend, "model")
    spreads = {}
    for name, t in named:
        if t.dtype == torch.bool:  # no backend sums bools; compare them as 0/1
            t = t.to(torch.uint8)
        hi = t.detach().to(backend.device, copy=True)
        lo = t.detach().to(backend.device, copy=True)
        _reduce(hi, backend, "max")
        _reduce(lo, backend, "min")
        spread = (hi.double() - lo.double()).abs()
        spreads[name] = float(spread.max()) if spread.numel() else 0.0
    diverging = [name for name, s in spreads.items() if s != 0.0]  # NaN != 0: diverges
    return ConsistencyReport(max(spreads.values(), default=0.0), diverging, spreads)
