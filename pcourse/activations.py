"""What autograd keeps for the backward pass, counted as it is saved (lessons 11, 12).

Every operation of a forward pass that needs its inputs (or outputs) again for the
backward saves them; they stay alive until the backward has used them. Their bytes
are the activation memory, and at the end of the forward, before the backward starts
freeing them, they are at their peak. :func:`count_saved` counts them through
torch's ``saved_tensors_hooks``: each storage once (``q``, ``k`` and ``v`` may be views
of one tensor; one input is saved by several layers), parameters not at all (they are
held anyway; lesson 10 counts them).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch


@dataclass
class Saved:
    """Bytes saved for backward inside a :func:`count_saved` block, by storage."""

    storages: dict[int, int] = field(default_factory=dict)  # storage address -> bytes

    @property
    def bytes(self) -> int:
        return sum(self.storages.values())


@contextmanager
def count_saved(parameters: Iterable[torch.Tensor] = ()) -> Iterator[Saved]:
    """Count what the forward passes run inside the block save for backward.

    ``parameters``: tensors not to count (a model's parameters). The tensors themselves
    are saved unchanged: the count changes nothing that is computed.
    """
    skip = {p.untyped_storage().data_ptr() for p in parameters}
    saved = Saved()

    def pack(t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        if storage.data_ptr() not in skip:
            saved.storages.setdefault(storage.data_ptr(), storage.nbytes())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        yield saved
