"""BucketedAllreduce: layout and launch order in-process; correctness across ranks via MPI.

The in-process tests use a recording one-rank backend (average over one rank is the
identity), so they check the bookkeeping: which parameters land in which bucket, in
which order buckets are launched, what happens to missing gradients, and remove().
The MPI test compares parameters after several steps with torch DDP and with a
single-process reference (see tests/mpi/check_buckets.py).
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

from pcourse.backends import Backend, Work
from pcourse.buckets import BucketedAllreduce
from pcourse.cluster.launch import mpirun

REPO = Path(__file__).resolve().parents[1]


class RecordingBackend(Backend):
    """One rank; records the size of every tensor it is asked to reduce, in order."""

    name, rank, size, device = "recording", 0, 1, torch.device("cpu")

    def __init__(self) -> None:
        self.calls: list[tuple[str, int]] = []

    def allreduce(self, tensor: torch.Tensor, op: str = "sum") -> torch.Tensor:
        self.calls.append(("blocking", tensor.numel()))
        return tensor

    def allreduce_async(self, tensor: torch.Tensor, op: str = "sum") -> Work:
        self.calls.append(("async", tensor.numel()))
        return Work()

    def broadcast(self, tensor: torch.Tensor, root: int = 0) -> torch.Tensor:
        return tensor

    def barrier(self) -> None:
        pass


def mlp() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 2))


def test_layout_reverse_order_and_cap() -> None:
    model = mlp()
    params = list(model.parameters())
    # cap of 80 floats: [w2 (16) b2 (2)], [b1 (8), w1 (64)] ... each bucket <= cap
    reducer = BucketedAllreduce(model, RecordingBackend(), bucket_cap_mb=320 / 2**20)
    flat_order = [p for b in reducer.buckets for p in b.params]
    assert flat_order == params[::-1]
    for b in reducer.buckets:
        assert sum(p.numel() for p in b.params) * 4 <= 320 or len(b.params) == 1
    assert len(reducer.buckets) > 1


def test_frozen_excluded_and_tied_counted_once() -> None:
    model = mlp()
    model[0].requires_grad_(False)
    model[4].weight = nn.Parameter(torch.randn(2, 8))
    model.add_module("tied", nn.Linear(8, 2))
    model.tied.weight = model[4].weight  # the same Parameter reached twice
    reducer = BucketedAllreduce(model, RecordingBackend())
    reduced = [p for b in reducer.buckets for p in b.params]
    assert all(p.requires_grad for p in reduced)
    assert len({id(p) for p in reduced}) == len(reduced)
    expected = {id(p) for p in model.parameters() if p.requires_grad}
    assert {id(p) for p in reduced} == expected


@pytest.mark.parametrize("overlap", [True, False])
def test_grads_are_bucket_views_and_unused_stays_none(overlap: bool) -> None:
    body, extra = mlp(), nn.Linear(2, 2)  # extra: never used, so no gradient anywhere
    model = nn.ModuleDict({"body": body, "extra": extra})
    backend = RecordingBackend()
    reducer = BucketedAllreduce(model, backend, bucket_cap_mb=320 / 2**20, overlap=overlap)
    x = torch.randn(5, 4)
    expected = torch.autograd.grad(body(x).square().mean(), list(body.parameters()))
    body(x).square().mean().backward()
    reducer.finish()
    views = {id(q): v for b in reducer.buckets for q, v in zip(b.params, b.views, strict=True)}
    for p, g in zip(body.parameters(), expected, strict=True):
        torch.testing.assert_close(p.grad, g)
        assert p.grad.data_ptr() == views[id(p)].data_ptr()
    assert extra.weight.grad is None and extra.bias.grad is None
    kinds = {kind for kind, _ in backend.calls}
    assert kinds == ({"async"} if overlap else {"blocking"})
    assert len(backend.calls) == len(reducer.buckets)


def test_buckets_launch_in_index_order_during_backward() -> None:
    model = mlp()
    backend = RecordingBackend()
    reducer = BucketedAllreduce(model, backend, bucket_cap_mb=320 / 2**20)
    model(torch.randn(3, 4)).sum().backward()
    launched_in_backward = list(backend.calls)
    reducer.finish()
    sizes = [b.flat.numel() for b in reducer.buckets]
    assert [n for _, n in launched_in_backward] == sizes  # all full, all in order
    assert [n for _, n in backend.calls] == sizes  # finish launched nothing more


def test_second_backward_before_finish_is_an_error() -> None:
    model = mlp()
    BucketedAllreduce(model, RecordingBackend())
    model(torch.randn(3, 4)).sum().backward()
    with pytest.raises(RuntimeError, match="finish"):
        model(torch.randn(3, 4)).sum().backward()


def test_remove_detaches_hooks() -> None:
    model = mlp()
    backend = RecordingBackend()
    reducer = BucketedAllreduce(model, backend)
    reducer.remove()
    model(torch.randn(3, 4)).sum().backward()
    assert backend.calls == []


def test_bad_cap_is_rejected() -> None:
    with pytest.raises(ValueError, match="bucket_cap_mb"):
        BucketedAllreduce(mlp(), RecordingBackend(), bucket_cap_mb=0)


@pytest.mark.parametrize("ranks", [2, 3])
def test_matches_ddp_and_single_process_reference(ranks: int) -> None:
    """Every model x backend x overlap x cap; one mpiexec launch per rank count."""
    env = {"OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO) + os.pathsep + os.environ.get(
        "PYTHONPATH", "")}
    out = mpirun(ranks, [str(REPO / "tests" / "mpi" / "check_buckets.py")], timeout=150,
                 env=env).stdout
    assert f"buckets ok on {ranks} ranks" in out, out
    assert sys.executable  # the ranks ran with this interpreter (mpirun uses it)
