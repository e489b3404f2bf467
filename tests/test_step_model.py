"""The step model against closed forms, and the trace's summary against a hand-made trace."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from pcourse import step_model
from pcourse.tools.bench import trace


def test_one_bucket_is_all_exposed_and_no_overlap_is_the_sum() -> None:
    a, b, backward = 1e-3, 1e-9, 5e-3
    assert step_model.exposed_time([4000], a, b, backward) == pytest.approx(a + b * 4000)
    sizes = [1000, 2000, 3000]
    plain = step_model.exposed_time(sizes, a, b, backward, overlap=False)
    assert plain == pytest.approx(3 * a + b * 6000)


def test_equal_buckets_faster_than_backward_leave_only_the_last() -> None:
    """k equal buckets each reduced before the next is ready: only the last is exposed."""
    a, b, backward, k, n = 1e-4, 1e-9, 1e-2, 4, 10_000
    assert step_model.exposed_time([n] * k, a, b, backward) == pytest.approx(a + b * n)


def test_communication_slower_than_backward_queues_up() -> None:
    """Each bucket costs more than backward takes to fill the next: they queue behind
    the first, which starts when its share of backward is done."""
    a, backward, k = 1e-2, 1e-3, 4
    want = backward / k + k * a - backward
    assert step_model.exposed_time([1] * k, a, 0.0, backward) == pytest.approx(want)


def test_predictions_and_the_best_cap() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(100, 100), nn.Linear(100, 100))
    params = list(model.parameters())[::-1]
    preds = step_model.predict(params, [1, 10**9], 1e-3, 1e-6, 1.0)
    assert [p.buckets for p in preds] == [4, 1]
    # a long backward: many buckets hide all but the last, which holds half the bytes
    assert step_model.best_cap(preds).cap == 1
    preds = step_model.predict(params, [1, 10**9], 1e-3, 1e-6, 0.0)
    assert step_model.best_cap(preds).cap == 10**9  # no backward to hide behind: one bucket
    assert sum(step_model.bucket_bytes(params, 1)) == (sum(p.numel() for p in params) + 4) * 4
    with pytest.raises(ValueError, match="non-negative"):
        step_model.exposed_time([1], -1.0, 0.0, 1.0)


def test_trace_summary_reads_the_hidden_share() -> None:
    """Backward 0-10 ms; bucket 0 in flight 4-12 ms (6 of 8 ms inside), waited 10.5-12."""
    events = [{"name": "step", "start": 0.0, "ms": 14.0, "kind": "annotation"},
              {"name": "backward", "start": 0.0, "ms": 10.0, "kind": "annotation"},
              {"name": "launch bucket 0", "start": 4.0, "ms": 0.5, "kind": "annotation"},
              {"name": "finish", "start": 10.0, "ms": 2.0, "kind": "annotation"},
              {"name": "wait bucket 0", "start": 10.5, "ms": 1.5, "kind": "annotation"}]
    record = {"rank": 0, "buckets": 1, "overlap": True, "backend": "gloo", "workload": "w",
              "cap": 1, "events": events}
    (s,) = trace.summary(trace.chrome_trace([record]))
    assert s["in_flight_ms"] == pytest.approx(8.0)
    assert s["hidden"] == pytest.approx(6 / 8)
    assert s["exposed_ms"] == pytest.approx(1.5)
    assert s["backward_ms"] == pytest.approx(10.0)


@pytest.mark.slow
@pytest.mark.mpi
def test_the_progress_modes_each_trace_the_step_and_the_thread_is_really_started() -> None:
    traces = trace.record_progress(2, workload="franke", repeats=1, timeout=240)
    assert list(traces) == list(trace.PROGRESS)
    for mode, (t,) in traces.items():
        ranks = trace.summary(t)
        assert [s["rank"] for s in ranks] == [0, 1] and all(s["buckets"] for s in ranks), mode
    table = {r["mode"]: r for r in trace.progress_table(traces)}
    # MPICH's progress thread is one more thread in each rank process, and only with it on
    assert table["progress thread"]["threads"] == table["inside MPI calls"]["threads"] + 1
    assert table["tested in hooks"]["threads"] == table["inside MPI calls"]["threads"]
