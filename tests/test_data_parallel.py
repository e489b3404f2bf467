"""pcourse.data_parallel and the loop's gradient sync: real data-parallel runs under MPI,
their bookkeeping and their refusals in-process."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from pcourse.data_parallel import (
    ConsistencyReport,
    average_gradients,
    average_gradients_flat,
    broadcast_parameters,
    check_consistency,
    check_same_model,
)
from pcourse.loop import gradient_sync


# make test-fast runs p = 3, which catches direction and indexing bugs p = 2 hides
@pytest.mark.parametrize("n", [pytest.param(2, marks=pytest.mark.slow), 3])
def test_data_parallel_training_under_mpi(mpi_run, n):
    """Broadcast, consistency, N-rank training == serial on the union, mismatch errors."""
    mpi_run(n, "check_data_parallel.py", expect=f"data-parallel checks on {n} ranks: ALL OK")


def tied() -> nn.Sequential:
    """The second layer reuses the first one's weight; the last bias is frozen."""
    model = nn.Sequential(nn.Linear(3, 3), nn.Linear(3, 3), nn.Linear(3, 1))
    model[1].weight = model[0].weight
    model[2].bias.requires_grad_(False)
    return model


def test_tied_weights_are_reduced_once_and_frozen_ones_skipped(one_rank):
    model = tied()
    model(torch.randn(4, 3)).sum().backward()
    backend = one_rank()
    average_gradients(model, backend, check=False)
    per_module = [p for m in model.modules() for p in m.parameters(recurse=False)]
    assert len(per_module) == 6  # a per-module loop would see the tied weight twice
    expected = [p.grad for p in model.parameters() if p.requires_grad]
    assert len(backend.calls) == len(expected) == 4
    assert all(t is g for (_, t, _), g in zip(backend.calls, expected, strict=True))


def test_flat_average_is_one_message_and_writes_back(one_rank):
    model = tied()
    model(torch.randn(4, 3)).sum().backward()
    before = [p.grad.clone() for p in model.parameters() if p.grad is not None]
    backend = one_rank()
    average_gradients_flat(model, backend)
    assert [(kind, t.numel(), op) for kind, t, op in backend.calls] == [
        ("allreduce", sum(g.numel() for g in before), "avg")]
    after = [p.grad for p in model.parameters() if p.grad is not None]
    assert all(torch.equal(a, b) for a, b in zip(after, before, strict=True))


def test_broadcast_covers_parameters_and_buffers(one_rank):
    model = nn.Sequential(nn.Linear(2, 2), nn.BatchNorm1d(2))
    backend = one_rank()
    broadcast_parameters(model, backend)
    sent = {t.data_ptr() for _, t, _ in backend.calls}
    wanted = {t.data_ptr() for t in [*model.parameters(), *model.buffers()]}
    assert sent == wanted and len(backend.calls) == 7  # 4 parameters, 3 buffers
    assert len(backend.sent) == 1  # one fingerprint; no per-tensor check after it


@pytest.mark.parametrize("fn", [broadcast_parameters, check_consistency])
def test_a_different_model_on_another_rank_is_refused_before_anything_moves(one_rank, fn):
    theirs = one_rank.facts_of(lambda b: fn(nn.Linear(2, 3), b))
    backend = one_rank(peer=theirs)
    with pytest.raises(ValueError, match="same model, but number of elements ranges from 9 to "
                                         "12 .*list of shapes differs"):
        fn(nn.Linear(3, 3), backend)
    assert backend.calls == []


def test_fingerprint_names_what_differs(one_rank):
    tensors = [torch.zeros(3), torch.zeros(2, 2)]
    check_same_model(tensors, one_rank(), "models")  # one rank agrees with itself
    theirs = one_rank.facts_of(lambda b: check_same_model(tensors[:1], b, "models"))
    with pytest.raises(ValueError, match="number of tensors ranges from 1 to 2"):
        check_same_model(tensors, one_rank(peer=theirs), "models")


@pytest.mark.parametrize("average", [average_gradients, average_gradients_flat])
def test_gradients_missing_on_another_rank_or_everywhere_are_refused(one_rank, average):
    model = nn.Linear(3, 2)
    model(torch.randn(4, 3)).sum().backward()
    theirs = one_rank.facts_of(lambda b: check_same_model([model.weight.grad], b, "x"))
    with pytest.raises(ValueError, match="same gradients"):
        average(model, one_rank(peer=theirs))
    with pytest.raises(ValueError, match="no gradients to average: call loss.backward"):
        average(nn.Linear(3, 2), one_rank())


def test_broadcast_root_must_be_a_rank_and_the_same_everywhere(one_rank):
    for root in (1, -1, "0"):
        with pytest.raises(ValueError, match="root must be a rank from 0 to 0"):
            broadcast_parameters(nn.Linear(2, 2), one_rank(), root=root)
    theirs = one_rank.facts_of(lambda b: broadcast_parameters(nn.Linear(2, 2), b, root=0))
    theirs[-2] += 1  # the other rank asked for root 1 (facts: ..., root, -root)
    with pytest.raises(ValueError, match="root ranges from 0 to 1"):
        broadcast_parameters(nn.Linear(2, 2), one_rank(peer=theirs))


def test_consistency_on_one_rank_and_the_report(one_rank):
    report = check_consistency(nn.Linear(3, 2), one_rank())
    assert report.consistent and report.max_deviation == 0.0
    assert set(report.spreads) == {"weight", "bias"}
    bad = ConsistencyReport(0.5, ["fc.bias"], {"fc.bias": 0.5})
    assert not bad.consistent and "fc.bias" in str(bad) and "INCONSISTENT" in str(bad)


@pytest.mark.parametrize("backend", [None, "fake"])
def test_gradient_sync_refuses_an_unknown_mode_with_or_without_a_backend(one_rank, backend):
    with pytest.raises(ValueError, match="unknown gradient sync 'sideways'"):
        with gradient_sync(nn.Linear(2, 1), one_rank() if backend else None, "sideways"):
            pass


def test_at_one_rank_auto_skips_the_average_and_the_step_is_the_serial_one(one_rank):
    """One rank's gradient is the average: "auto" sends nothing, and its training run
    (the workload's own loop) makes the serial run's weights, bit for bit; a mode asked
    for by name still runs."""
    from pcourse.loop import train
    from pcourse.workloads.config import FrankeConfig

    backend = one_rank()
    with gradient_sync(nn.Linear(2, 1), backend, "auto") as sync:
        assert sync is None
    with gradient_sync(nn.Linear(2, 1), backend, "bucketed") as sync:
        assert sync is not None
    assert len(backend.sent) == 1  # the bucketed mode's model check; "auto" sent nothing
    cfg = FrankeConfig(epochs=2, n_points=64, batch_size=16)
    serial = train("franke", None, cfg, progress=False).model
    alone = train("franke", one_rank(), cfg, progress=False).model
    for a, b in zip(serial.parameters(), alone.parameters(), strict=True):
        assert torch.equal(a, b)


@pytest.mark.parametrize("mode", ["flat", "per-parameter", "bucketed"])
def test_gradient_sync_compares_the_model_once(one_rank, mode):
    model, backend = nn.Linear(2, 1), one_rank()
    with gradient_sync(model, backend, mode) as sync:
        for _ in range(3):
            model(torch.randn(4, 2)).sum().backward()
            sync()
    assert len(backend.sent) == 1
