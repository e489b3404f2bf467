"""The three functions that turn N copies of a model into one data-parallel model.

1. ``broadcast_parameters``: every rank starts from rank 0's weights (and buffers,
   such as BatchNorm's running statistics), whatever its own random init was.
2. ``average_gradients``: after ``backward()``, every rank replaces its gradients by
   the average over ranks. With equal shards and a mean loss, this is exactly the
   gradient of the mean loss over the union of the ranks' batches, so the
   optimizer steps that follow are identical on every rank.
3. ``check_consistency``: prove it. The largest spread of every tensor across
   ranks, and the names of those that differ.

All three begin by comparing a fingerprint of the model across ranks. Ranks that
hold differently shaped models would otherwise issue collectives of different
sizes or counts, which deadlocks or silently mixes tensors; with the fingerprint
they all raise the same ValueError instead.
"""

from __future__ import annotations

import zlib
from collections.abc import Iterator
from dataclasses import dataclass, field

import torch

from pcourse.backends import Backend


def _named_tensors(model: torch.nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    # named_parameters()/named_buffers() yield each tensor object once, so tied
    # weights (one Parameter reached from two modules) appear, and are sent, once.
    yield from model.named_parameters()
    yield from model.named_buffers()


def _fingerprint(tensors: list[torch.Tensor]) -> list[int]:
    shapes = ";".join(f"{tuple(t.shape)}:{t.dtype}" for t in tensors)
    # crc32, not hash(): Python salts str hashes per process, crc32 is the same everywhere.
    return [len(tensors), sum(t.numel() for t in tensors), zlib.crc32(shapes.encode())]


def check_same_model(tensors: list[torch.Tensor], backend: Backend, what: str) -> None:
    """Raise ValueError on every rank if the ranks' tensor lists differ in shape.

    One allreduce with MAX and one with MIN of (count, elements, shape hash): the
    ranks agree exactly when max == min for all three.
    """
    fp = torch.tensor(_fingerprint(tensors), dtype=torch.int64, device=backend.device)
    hi = backend.allreduce(fp.clone(), "max").tolist()
    lo = backend.allreduce(fp.clone(), "min").tolist()
    labels = ("number of tensors", "total number of elements", "hash of the shapes")
    diffs = [f"{lab} ranges from {a} to {b}"
             for lab, a, b in zip(labels, lo, hi, strict=True) if a != b]
    if diffs:
        raise ValueError(
            f"ranks hold different {what}: " + "; ".join(diffs)
            + ". Build the same model (same architecture and arguments) on every rank."
        )


def _on_backend_device(tensor: torch.Tensor, backend: Backend, collective) -> None:
    """Run ``collective(t)`` in place on ``tensor``, staged through the backend's device
    if the tensor lives elsewhere (the MPI backends stage any device themselves)."""
    if tensor.device == backend.device or backend.name.startswith("mpi"):
        collective(tensor)
    else:
        staged = tensor.detach().to(backend.device)
        collective(staged)
        tensor.detach().copy_(staged)


def _reduce(tensor: torch.Tensor, backend: Backend, op: str) -> None:
    _on_backend_device(tensor, backend, lambda t: backend.allreduce(t, op))


def average_gradients(model: torch.nn.Module, backend: Backend, check: bool = True) -> None:
    """Replace every gradient by its average across ranks, in place.

    Parameters whose ``grad`` is None (frozen, or unused in this step) are skipped;
    every rank must skip the same ones, which ``check`` verifies with one small
    fingerprint allreduce (pass False to save it once you trust your model).
    Tied weights are one Parameter object: ``model.parameters()`` yields it once,
    so it is reduced once, with the gradient summed from all its uses.
    """
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    if check:
        check_same_model(grads, backend, "gradients (different models, or a parameter "
                                         "without a gradient on some ranks only)")
    for g in grads:
        _reduce(g, backend, "avg")


def average_gradients_flat(model: torch.nn.Module, backend: Backend) -> None:
    """Average every gradient across ranks with ONE allreduce of one flat buffer.

    A small model has few, small gradients: per-parameter messages pay the latency
    once per tensor (6 times for Franke's net), and the copy into one buffer costs
    microseconds. This is the fast path; the per-parameter one is
    :func:`pcourse.data_parallel.average_gradients`.
    """
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    flat = torch.cat([g.reshape(-1) for g in grads])
    backend.allreduce(flat, "avg")
    torch._foreach_copy_(grads, [piece.view_as(g) for piece, g in
                                 zip(flat.split([g.numel() for g in grads]), grads, strict=True)])


@torch.no_grad()
def broadcast_parameters(model: torch.nn.Module, backend: Backend, root: int = 0) -> None:
    """Overwrite every parameter and buffer with ``root``'s, so all ranks start alike."""
    tensors = [t for _, t in _named_tensors(model)]
    check_same_model(tensors, backend, "models")
    for t in tensors:
        _on_backend_device(t, backend, lambda buf: backend.broadcast(buf, root))


@dataclass
class ConsistencyReport:
    """How far the ranks' copies of a model are apart (identical on every rank)."""

    max_deviation: float  # largest (max over ranks - min over ranks) of any element
    diverging: list[str]  # names of tensors whose spread exceeds the tolerance
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
def check_consistency(
    model: torch.nn.Module, backend: Backend, atol: float = 0.0
) -> ConsistencyReport:
    """Compare every parameter and buffer across ranks; collective, so call it on all.

    For each tensor, allreduce with MAX and with MIN: their difference is the spread
    of every element across ranks, zero where all ranks agree. Tensors whose largest
    spread exceeds ``atol`` are named in the report.
    """
    named = list(_named_tensors(model))
    check_same_model([t for _, t in named], backend, "models")
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
    diverging = [name for name, s in spreads.items() if not s <= atol]  # NaN diverges
    return ConsistencyReport(max(spreads.values(), default=0.0), diverging, spreads)
