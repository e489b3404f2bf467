"""Give each rank its own share of the data: one seeded shuffle, equal shares.

:func:`partition_indices` is a pure function: every rank shuffles the full index
list with the same seed (the same permutation, with no message sent) and takes its
own share. ``remainder="drop"`` (the source's) leaves up to ``size - 1`` samples out;
``"pad"`` wraps around so every rank gets ``ceil(n / size)``, as torch's
``DistributedSampler`` does. ``layout="segments"`` (the source's) gives rank r the
r-th contiguous block; ``"strided"`` every size-th index from r, exactly
``DistributedSampler``'s assignment. :class:`ParallelDataset` wraps a dataset with it.

Lesson 02 explains why disjoint, equal shares make data-parallel SGD large-batch SGD.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import torch

REMAINDERS = ("drop", "pad")
LAYOUTS = ("segments", "strided")


def _check(n: int, rank: int, size: int, remainder: str, layout: str) -> None:
    if size < 1:
        raise ValueError(f"size must be at least 1 rank, got {size}")
    if not 0 <= rank < size:
        raise ValueError(f"rank {rank} is outside [0, {size}): ranks are numbered 0..size-1")
    if n < size:
        raise ValueError(
            f"dataset has {n} samples but there are {size} ranks: every rank needs at "
            f"least one sample; use fewer ranks or more data"
        )
    if remainder not in REMAINDERS:
        raise ValueError(f"remainder must be one of {REMAINDERS}, got {remainder!r}")
    if layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}")


def samples_per_rank(n: int, size: int, remainder: str = "drop") -> int:
    """How many samples each rank gets from n: the same number on every rank."""
    return n // size if remainder == "drop" else math.ceil(n / size)


def partition_indices(
    n: int,
    rank: int,
    size: int,
    *,
    seed: int = 0,
    epoch: int = 0,
    remainder: str = "drop",
    shuffle: bool = True,
    layout: str = "segments",
) -> torch.Tensor:
    """The indices (int64 tensor) of the n samples that ``rank`` of ``size`` owns.

    A pure function of its arguments: any process computes any rank's share, in any
    order, and gets the same answer, which is why no communication is needed.
    """
    _check(n, rank, size, remainder, layout)
    if shuffle:
        # A private generator: the global RNG (and so model init) is left untouched.
        gen = torch.Generator().manual_seed(seed + epoch)
        order = torch.randperm(n, generator=gen)
    else:
        order = torch.arange(n)
    per = samples_per_rank(n, size, remainder)
    total = per * size
    if total > n:  # pad: n >= size, so one wrap-around always suffices
        order = torch.cat([order, order[: total - n]])
    order = order[:total]
    if layout == "strided":
        return order[rank:total:size]
    return order[rank * per : (rank + 1) * per]


class ParallelDataset(torch.utils.data.Dataset):
    """This rank's share of a dataset: a view that indexes like the original.

    ``data`` is a tensor, a tuple/list of tensors sharing their first dimension
    (inputs, targets), or any torch Dataset with ``__len__``. ``self[i]`` is the
    i-th sample of this rank's share; ``local()`` gives the whole share at once for
    tensor data (fast slicing instead of a DataLoader, the course's default).
    """

    def __init__(
        self,
        data: Any,
        rank: int,
        size: int,
        *,
        seed: int = 0,
        remainder: str = "drop",
        shuffle: bool = True,
        layout: str = "segments",
    ) -> None:
        self.data = data
        self.n = _length(data)
        self.rank, self.size, self.seed = rank, size, seed
        self.remainder, self.shuffle, self.layout = remainder, shuffle, layout
        self.epoch = 0
        self.indices = self._compute()  # validates the arguments at construction

    def _compute(self) -> torch.Tensor:
        return partition_indices(
            self.n, self.rank, self.size, seed=self.seed, epoch=self.epoch,
            remainder=self.remainder, shuffle=self.shuffle, layout=self.layout,
        )

    def set_epoch(self, epoch: int) -> None:
        """Reshuffle for ``epoch`` (seed + epoch); every rank must call it alike."""
        self.epoch = epoch
        self.indices = self._compute()

    def __len__(self) -> int:
        return len(self.indices)

    def __getitem__(self, i: int) -> Any:
        j = int(self.indices[i])
        if isinstance(self.data, torch.Tensor):
            return self.data[j]
        if _is_tensor_tuple(self.data):
            return tuple(t[j] for t in self.data)
        return self.data[j]

    def local(self) -> torch.Tensor | tuple[torch.Tensor, ...]:
        """This rank's whole share of tensor data, gathered in one indexing step."""
        if isinstance(self.data, torch.Tensor):
            return self.data[self.indices]
        if _is_tensor_tuple(self.data):
            return tuple(t[self.indices] for t in self.data)
        raise TypeError(
            "local() needs tensor data; for a Dataset, iterate this view or use "
            "torch.utils.data.Subset(dataset, view.indices.tolist())"
        )


def _is_tensor_tuple(data: Any) -> bool:
    return isinstance(data, tuple | list) and all(isinstance(t, torch.Tensor) for t in data)


def _length(data: Any) -> int:
    if isinstance(data, torch.Tensor):
        return len(data)
    if _is_tensor_tuple(data):
        if not data:
            raise ValueError("an empty tuple of tensors has no samples to partition")
        lengths = {len(t) for t in data}
        if len(lengths) != 1:
            raise ValueError(
                f"tensors must share their first dimension (one row per sample), "
                f"got lengths {sorted(lengths)}"
            )
        return lengths.pop()
    if hasattr(data, "__len__") and hasattr(data, "__getitem__"):
        return len(data)
    raise TypeError(
        f"cannot partition {type(data).__name__}: pass a tensor, a tuple of tensors, "
        f"or a Dataset with __len__"
    )


def all_partitions(n: int, size: int, **kwargs: Any) -> Sequence[torch.Tensor]:
    """Every rank's indices, rank by rank: for drawing the assignment in a notebook."""
    return [partition_indices(n, r, size, **kwargs) for r in range(size)]
