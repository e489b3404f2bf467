"""The partitioner: disjoint, covering, the same in every process, like DistributedSampler."""

from __future__ import annotations

import math
import re
import subprocess
import sys
from collections import Counter

import pytest
import torch
from torch.utils.data import DistributedSampler, TensorDataset

from pcourse.partition import ParallelDataset, all_partitions, partition_indices

CASES = [(n, size) for n in (3, 10, 11, 97, 100) for size in (1, 2, 3, 4, 7) if n >= size]


@pytest.mark.parametrize("n,size", CASES)
@pytest.mark.parametrize("layout", ["segments", "strided"])
def test_drop_gives_disjoint_equal_shares(n, size, layout):
    parts = all_partitions(n, size, seed=3, remainder="drop", layout=layout)
    assert all(len(p) == n // size for p in parts)
    everything = torch.cat(parts).tolist()
    assert len(set(everything)) == len(everything), "ranks share a sample"
    assert set(everything) <= set(range(n))
    assert n - len(everything) == n % size  # only the remainder is left out


@pytest.mark.parametrize("n,size", CASES)
@pytest.mark.parametrize("layout", ["segments", "strided"])
def test_pad_covers_everything_and_repeats_only_the_padding(n, size, layout):
    parts = all_partitions(n, size, seed=3, remainder="pad", layout=layout)
    per = math.ceil(n / size)
    assert all(len(p) == per for p in parts)
    counts = Counter(torch.cat(parts).tolist())
    assert set(counts) == set(range(n)), "some sample is on no rank"
    assert sum(c - 1 for c in counts.values()) == per * size - n
    assert max(counts.values()) <= 2


def test_the_shuffle_is_seeded_and_ignores_the_global_rng():
    a = partition_indices(100, 1, 3, seed=5)
    torch.manual_seed(123)
    torch.rand(10)  # a model init between two calls must not change the partition
    assert torch.equal(a, partition_indices(100, 1, 3, seed=5))
    assert not torch.equal(a, partition_indices(100, 1, 3, seed=6))
    assert not torch.equal(a, partition_indices(100, 1, 3, seed=5, shuffle=False))


def test_identical_whatever_the_launch_order():
    """Each 'rank' computes its own share, in any order, in another process: same answer."""
    forward = [partition_indices(101, r, 4, seed=9, epoch=2).tolist() for r in range(4)]
    backward = [partition_indices(101, r, 4, seed=9, epoch=2).tolist() for r in reversed(range(4))]
    assert forward == backward[::-1]
    code = ("from pcourse.partition import partition_indices as p; "
            "print([p(101, r, 4, seed=9, epoch=2).tolist() for r in (3, 1, 2, 0)])")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=120, check=True).stdout
    other = eval(out)  # a list literal printed by the child
    assert [other[3], other[1], other[2], other[0]] == forward


@pytest.mark.parametrize("remainder", ["drop", "pad"])
def test_epoch_reshuffle_keeps_ranks_disjoint(remainder):
    ds = [ParallelDataset(torch.arange(50), r, 3, seed=1, remainder=remainder) for r in range(3)]
    first = [d.indices.clone() for d in ds]
    for d in ds:
        d.set_epoch(1)
    second = [d.indices for d in ds]
    assert any(not torch.equal(a, b) for a, b in zip(first, second, strict=True)), "no reshuffle"
    if remainder == "drop":
        flat = torch.cat(second).tolist()
        assert len(set(flat)) == len(flat) == 48
    else:
        assert set(torch.cat(second).tolist()) == set(range(50))


@pytest.mark.parametrize("remainder,drop_last", [("drop", True), ("pad", False)])
@pytest.mark.parametrize("n,size", [(10, 3), (12, 4), (97, 7), (5, 5)])
def test_strided_layout_is_distributed_sampler(remainder, drop_last, n, size):
    data = TensorDataset(torch.arange(n))
    for epoch in (0, 3):
        for rank in range(size):
            sampler = DistributedSampler(data, num_replicas=size, rank=rank, shuffle=True,
                                         seed=11, drop_last=drop_last)
            sampler.set_epoch(epoch)
            mine = partition_indices(n, rank, size, seed=11, epoch=epoch, remainder=remainder,
                                     layout="strided")
            assert mine.tolist() == list(sampler)


@pytest.mark.parametrize("remainder,drop_last", [("drop", True), ("pad", False)])
def test_segments_hold_the_same_samples_as_distributed_sampler(remainder, drop_last):
    n, size = 23, 3
    data = TensorDataset(torch.arange(n))
    theirs = Counter(i for r in range(size) for i in DistributedSampler(
        data, num_replicas=size, rank=r, seed=4, drop_last=drop_last))
    ours = Counter(torch.cat(all_partitions(n, size, seed=4, remainder=remainder)).tolist())
    assert ours == theirs


@pytest.mark.parametrize("args,message", [
    ((10, 0, 0), "size must be at least 1"),
    ((10, -1, 2), "outside [0, 2)"),
    ((10, 2, 2), "outside [0, 2)"),
    ((3, 0, 4), "3 samples but there are 4 ranks"),
])
def test_bad_arguments_say_what_is_wrong(args, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        partition_indices(*args)


def test_bad_policy_names_are_refused():
    with pytest.raises(ValueError, match="remainder"):
        partition_indices(10, 0, 2, remainder="keep")
    with pytest.raises(ValueError, match="layout"):
        partition_indices(10, 0, 2, layout="blocks")


def test_tensors_tuples_and_datasets():
    x, y = torch.randn(11, 2), torch.arange(11)
    part = ParallelDataset((x, y), 1, 2, seed=0)
    lx, ly = part.local()
    assert torch.equal(lx, x[part.indices]) and torch.equal(ly, y[part.indices])
    assert len(part) == 5 and torch.equal(part[2][1], y[part.indices[2]])
    single = ParallelDataset(x, 0, 2, remainder="pad")
    assert torch.equal(single.local(), x[single.indices]) and len(single) == 6
    ds = ParallelDataset(TensorDataset(x, y), 1, 2, seed=0)
    assert torch.equal(ds.indices, part.indices) and torch.equal(ds[0][1], ly[0])
    with pytest.raises(TypeError, match="local"):
        ds.local()
    with pytest.raises(ValueError, match="first dimension"):
        ParallelDataset((x, torch.arange(10)), 0, 2)
    with pytest.raises(TypeError, match="cannot partition"):
        ParallelDataset(42, 0, 2)
    loader = torch.utils.data.DataLoader(ds, batch_size=2)  # usable as an ordinary Dataset
    assert sum(len(b[0]) for b in loader) == 5
