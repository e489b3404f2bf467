"""BucketedAllreduce: layout and launch order in-process; correctness across ranks via MPI.

The in-process tests use the one-rank fake backend (an average over one rank is the
identity), so they check the bookkeeping: which parameters land in which bucket, in
which order buckets are launched, missing gradients, no_sync(), bad input, remove().
The MPI test compares parameters after several steps with torch DDP and with a
single-process reference (tests/mpi/check_buckets.py); tests/torchrun/check_gloo.py
does the same for gradient accumulation without MPI.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from pcourse.buckets import BucketedAllreduce

TINY_CAP = 320  # bytes, 80 float32s: several buckets for mlp()


def mlp() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 2))


def sizes(calls) -> list[int]:
    return [tensor.numel() for _, tensor, _ in calls]


def test_layout_reverse_order_and_cap(one_rank) -> None:
    model = mlp()
    params = list(model.parameters())
    # cap of 80 floats: [w2 (16) b2 (2)], [b1 (8), w1 (64)] ... each bucket <= cap
    reducer = BucketedAllreduce(model, one_rank(), bucket_cap_bytes=TINY_CAP)
    flat_order = [p for b in reducer.buckets for p in b.params]
    assert flat_order == params[::-1]
    for b in reducer.buckets:
        assert sum(p.numel() for p in b.params) * 4 <= 320 or len(b.params) == 1
    assert len(reducer.buckets) > 1


def test_frozen_excluded_and_tied_counted_once(one_rank) -> None:
    model = mlp()
    model[0].requires_grad_(False)
    model[4].weight = nn.Parameter(torch.randn(2, 8))
    model.add_module("tied", nn.Linear(8, 2))
    model.tied.weight = model[4].weight  # the same Parameter reached twice
    reducer = BucketedAllreduce(model, one_rank())
    reduced = [p for b in reducer.buckets for p in b.params]
    assert all(p.requires_grad for p in reduced)
    assert len({id(p) for p in reduced}) == len(reduced)
    expected = {id(p) for p in model.parameters() if p.requires_grad}
    assert {id(p) for p in reduced} == expected


@pytest.mark.parametrize("overlap", [True, False])
def test_grads_are_bucket_views_and_unused_stays_none(one_rank, overlap: bool) -> None:
    body, extra = mlp(), nn.Linear(2, 2)  # extra: never used, so no gradient anywhere
    model = nn.ModuleDict({"body": body, "extra": extra})
    backend = one_rank()
    reducer = BucketedAllreduce(model, backend, bucket_cap_bytes=TINY_CAP, overlap=overlap)
    x = torch.randn(5, 4)
    expected = torch.autograd.grad(body(x).square().mean(), list(body.parameters()))
    body(x).square().mean().backward()
    reducer.finish()
    views = {id(q): v for b in reducer.buckets for q, v in zip(b.params, b.views, strict=True)}
    for p, g in zip(body.parameters(), expected, strict=True):
        torch.testing.assert_close(p.grad, g)
        assert p.grad.data_ptr() == views[id(p)].data_ptr()
    assert extra.weight.grad is None and extra.bias.grad is None
    kinds = {kind for kind, _, _ in backend.calls}
    assert kinds == ({"allreduce_async"} if overlap else {"allreduce"})
    assert len(backend.calls) == len(reducer.buckets)


def test_buckets_launch_in_index_order_during_backward(one_rank) -> None:
    model = mlp()
    backend = one_rank()
    reducer = BucketedAllreduce(model, backend, bucket_cap_bytes=TINY_CAP)
    model(torch.randn(3, 4)).sum().backward()
    launched_in_backward = sizes(backend.calls)
    reducer.finish()
    expected = [b.flat.numel() for b in reducer.buckets]
    assert launched_in_backward == expected  # all full, all in order
    assert sizes(backend.calls) == expected  # finish launched nothing more


def test_the_model_is_compared_once_and_buckets_skip_the_per_call_check(one_rank) -> None:
    model, backend = mlp(), one_rank()
    reducer = BucketedAllreduce(model, backend, bucket_cap_bytes=TINY_CAP)
    for _ in range(3):
        model(torch.randn(3, 4)).sum().backward()
        reducer.finish()
    assert len(backend.sent) == 1  # the fingerprint at creation; no check per bucket


def test_different_models_are_refused_before_any_bucket_moves(one_rank) -> None:
    theirs = one_rank.facts_of(lambda b: BucketedAllreduce(nn.Linear(4, 3), b))
    backend = one_rank(peer=theirs)
    with pytest.raises(ValueError, match="every rank must hold the same model.*number of"):
        BucketedAllreduce(mlp(), backend)
    assert backend.calls == []


def test_a_model_without_gradients_is_a_clear_error(one_rank) -> None:
    with pytest.raises(ValueError, match="no parameter with requires_grad=True"):
        BucketedAllreduce(mlp().requires_grad_(False), one_rank())
    reducer = BucketedAllreduce(mlp(), one_rank())
    with pytest.raises(ValueError, match="call loss.backward"):
        reducer.finish()  # no backward ran anywhere


@pytest.mark.parametrize("overlap", [True, False])
def test_no_sync_accumulates_like_one_process(one_rank, overlap: bool) -> None:
    """Three micro-batches, two in no_sync(): the sum of their gradients, one exchange."""
    batches = [torch.randn(3, 4, generator=torch.Generator().manual_seed(i)) for i in range(3)]
    ref = mlp()
    for x in batches:
        ref(x).square().mean().backward()
    model, backend = mlp(), one_rank()
    reducer = BucketedAllreduce(model, backend, bucket_cap_bytes=TINY_CAP, overlap=overlap)
    for step in range(2):  # the second step accumulates into the bucket views
        model.zero_grad(set_to_none=False)
        with reducer.no_sync():
            for x in batches[:-1]:
                model(x).square().mean().backward()
        assert backend.calls == [] if step == 0 else len(backend.calls) == len(reducer.buckets)
        model(batches[-1]).square().mean().backward()
        reducer.finish()
        for p, q in zip(model.parameters(), ref.parameters(), strict=True):
            torch.testing.assert_close(p.grad, q.grad)
    assert len(backend.calls) == 2 * len(reducer.buckets)


def test_no_sync_misuse_is_explained(one_rank) -> None:
    model = mlp()
    reducer = BucketedAllreduce(model, one_rank())
    with reducer.no_sync(), pytest.raises(RuntimeError, match="inside no_sync"):
        reducer.finish()
    model(torch.randn(3, 4)).sum().backward()
    with pytest.raises(RuntimeError, match="call reducer.finish"), reducer.no_sync():
        pass


def test_second_backward_before_finish_points_to_no_sync(one_rank) -> None:
    model = mlp()
    BucketedAllreduce(model, one_rank())
    model(torch.randn(3, 4)).sum().backward()
    with pytest.raises(RuntimeError, match="no_sync"):
        model(torch.randn(3, 4)).sum().backward()


def test_remove_detaches_hooks(one_rank) -> None:
    model = mlp()
    backend = one_rank()
    reducer = BucketedAllreduce(model, backend)
    reducer.remove()
    model(torch.randn(3, 4)).sum().backward()
    assert backend.calls == []


def test_bad_cap_is_rejected(one_rank) -> None:
    with pytest.raises(ValueError, match="bucket_cap_mb"):
        BucketedAllreduce(mlp(), one_rank(), bucket_cap_mb=0)
    with pytest.raises(ValueError, match="bucket_cap_bytes must be positive"):
        BucketedAllreduce(mlp(), one_rank(), bucket_cap_bytes=0)
    with pytest.raises(TypeError, match="bucket_cap_mb=0.5"):  # MiB where bytes go
        BucketedAllreduce(mlp(), one_rank(), 0.5)
    with pytest.raises(ValueError, match="not both"):
        BucketedAllreduce(mlp(), one_rank(), bucket_cap_bytes=320, bucket_cap_mb=1)


def test_a_cap_in_mib_as_ddps_is_the_same_cap_in_bytes(one_rank) -> None:
    """``bucket_cap_mb`` is MiB, as torch reads DDP's: 2**-20 MiB is one byte. The caps
    swept cross every layout change of mlp() (at 288, 360, 392 bytes), where a cap read
    as 10**6 bytes per MB would fall on the other side."""
    def layout(**cap: float) -> list[int]:
        return [len(b.params) for b in BucketedAllreduce(mlp(), one_rank(), **cap).buckets]

    seen = set()
    for cap in (284, 288, 356, 360, 388, 392):  # each change, and a cap just below it
        seen.add(tuple(layout(bucket_cap_bytes=cap)))
        assert layout(bucket_cap_mb=cap / 2**20) == layout(bucket_cap_bytes=cap), cap
    assert len(seen) > 2


# make test-fast runs p = 3, which catches direction and indexing bugs p = 2 hides
@pytest.mark.parametrize("ranks", [pytest.param(2, marks=pytest.mark.slow), 3])
def test_matches_ddp_and_single_process_reference(mpi_run, ranks: int) -> None:
    """Every model x backend x overlap x cap, and accumulation; one launch per rank count."""
    mpi_run(ranks, "check_buckets.py", expect=f"buckets ok on {ranks} ranks", timeout=240,
            env={"OMP_NUM_THREADS": "1"})


@pytest.mark.parametrize("overlap", [True, False])
def test_event_hook_sees_every_bucket_in_order(one_rank, overlap: bool) -> None:
    """launch, launched, wait, done once per bucket and step; with overlap the launches
    come during backward, without it all in finish()."""
    events: list[tuple[str, int, str]] = []
    phase = ["backward"]
    model = mlp()
    reducer = BucketedAllreduce(model, one_rank(), bucket_cap_bytes=TINY_CAP, overlap=overlap,
                                on_event=lambda event, b: events.append((event, b, phase[0])))
    n = len(reducer.buckets)
    for _ in range(2):
        events.clear()
        phase[0] = "backward"
        model(torch.randn(3, 4)).sum().backward()
        phase[0] = "finish"
        reducer.finish()
        for k in range(n):
            assert [e for e, b, _ in events if b == k] == ["launch", "launched", "wait", "done"]
        launches = [(b, where) for e, b, where in events if e == "launch"]
        assert [b for b, _ in launches] == list(range(n))
        assert {where for _, where in launches} == {"backward" if overlap else "finish"}


def test_drive_progress_tests_the_buckets_in_flight_from_the_hooks(one_rank) -> None:
    """With drive_progress, each gradient hook tests every bucket already launched (an MPI
    request moves only inside MPI calls); without it, nothing is tested."""
    from pcourse.backends import Work

    tested: list[int] = []

    class Counted(Work):
        def __init__(self, k: int) -> None:
            self.k = k

        def test(self) -> bool:
            tested.append(self.k)
            return False

    for drive in (True, False):
        tested.clear()
        backend = one_rank()
        launched = iter(range(100))
        backend.allreduce_async = (lambda t, op="sum", *, check=True, ids=launched:
                                   Counted(next(ids)))
        model = mlp()
        reducer = BucketedAllreduce(model, backend, bucket_cap_bytes=TINY_CAP,
                                    drive_progress=drive)
        model(torch.randn(3, 4)).sum().backward()
        reducer.finish()
        n = len(reducer.buckets)
        assert n >= 3
        if drive:  # the first bucket is tested by every later hook
            assert set(tested) == set(range(n - 1)) and tested.count(0) > tested.count(n - 2)
        else:
            assert tested == []


def test_a_pending_collective_says_whether_it_is_done() -> None:
    from pcourse.backends.base import Pending

    done = [False]
    waited = []
    work = Pending(lambda: waited.append(1), test=lambda: done[0])
    assert not work.test()
    done[0] = True
    assert work.test() and not waited  # testing never waits
    work.wait()
    assert work.test() and waited == [1]
    assert not Pending(lambda: None).test()  # without a test: not known to be done
