"""Pipeline parallelism (lesson 12): exact against one process, the schedules' orders."""

from __future__ import annotations

import pytest

from pcourse.pipeline import (
    bubble_fraction,
    check_order,
    gpipe_order,
    in_flight_prediction,
    micro_sizes,
    one_f_one_b_order,
    simulated_step,
)


@pytest.mark.parametrize("p", [2, 3, 4])
def test_pipeline_equals_one_process(mpi_run, p: int) -> None:
    # m = 1, 2, 3, 4, 8 (m < p, m not a multiple of p), GPipe and 1F1B, wrong schedules,
    # a receive past its deadline
    mpi_run(p, "check_pipeline.py", expect=f"pipeline OK on {p} ranks", timeout=240)


def test_pipeline_on_gloo(mpi_run) -> None:
    mpi_run(4, "check_pipeline.py", "gloo", expect="pipeline OK on 4 ranks (gloo)", timeout=240)


def held_peak(order: list[tuple[str, int]]) -> int:
    held, peak = 0, 0
    for kind, _ in order:
        held += 1 if kind == "F" else -1
        peak = max(peak, held)
    return peak


@pytest.mark.parametrize("p", [2, 3, 4])
@pytest.mark.parametrize("m", [1, 2, 3, 4, 8])
def test_orders_hold_what_is_predicted(p: int, m: int) -> None:
    for rank in range(p):
        for name, order_of in (("gpipe", gpipe_order), ("1f1b", one_f_one_b_order)):
            order = order_of(p, rank, m)
            check_order(order, m)
            assert held_peak(order) == in_flight_prediction(name, p, rank, m)
    # the last stage of 1F1B runs each backward right after its forward
    assert one_f_one_b_order(p, p - 1, m)[:2] == [("F", 0), ("B", 0)]


def test_wrong_orders_and_sizes_are_refused() -> None:
    with pytest.raises(ValueError, match="before its forward"):
        check_order([("B", 0), ("F", 0)], 1)
    with pytest.raises(ValueError, match="once"):
        check_order([("F", 0), ("F", 0), ("B", 0)], 1)
    with pytest.raises(ValueError, match="cannot cut a batch of 3 into 4"):
        micro_sizes(3, 4)
    with pytest.raises(ValueError, match="rank=3"):
        gpipe_order(3, 3, 2)


def test_micro_sizes_and_bubble() -> None:
    assert micro_sizes(22, 8) == [3, 3, 3, 3, 3, 3, 2, 2]
    assert sum(micro_sizes(22, 4)) == 22
    assert bubble_fraction(4, 1) == 0.75
    assert bubble_fraction(2, 8) == pytest.approx(1 / 9)


def test_counting_backend_counts_a_send_once() -> None:
    import torch

    from pcourse.backends.base import Work
    from pcourse.backends.counting import CountingBackend

    class Inner:  # a stand-in backend that records what it was asked to move
        name, rank, size, any_device, timeout, needs_gpu = "stand-in", 0, 2, True, 1.0, False
        device = torch.device("cpu")

        def __init__(self) -> None:
            self.moved: list[tuple[str, int]] = []

        def send(self, tensor, dst):
            self.moved.append(("send", dst))
            return Work()

        def recv(self, tensor, src):
            self.moved.append(("recv", src))
            return tensor

    inner = Inner()
    counting = CountingBackend(inner)
    counting.send(torch.zeros(10, dtype=torch.float64), 1).wait()
    counting.recv(torch.zeros(10, dtype=torch.float64), 1)
    assert counting.sent == {"send": 80} and counting.calls == {"send": 1}
    assert inner.moved == [("send", 1), ("recv", 1)]


def test_bench_pp_prints_bubble_memory_and_torch(tmp_path) -> None:
    import subprocess
    import sys

    run = subprocess.run([sys.executable, "-m", "pcourse.tools.bench", "pp", "--quick", "--ms", "1",
                          "4", "--repeats", "1"], capture_output=True, text=True, timeout=300,
                         cwd=tmp_path)
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-2000:]
    lines = run.stdout.splitlines()
    rows = [line.split() for line in lines if line.startswith(("gpipe", "1f1b"))]
    assert len(rows) == 2 * 2 * 2  # schedules x m x ranks
    # held micro-batches counted == predicted; the allocator's peak within a backward's
    # transients of the activations and gradients predicted, either way
    assert all(r[8] == r[9] and abs(int(r[10]) - int(r[11])) <= int(r[12]) for r in rows), rows
    assert any(line.startswith("torch's gpipe") or "pipelining on Gloo failed" in line
               for line in lines), lines


def test_a_simulated_step_is_the_formula_for_equal_stages_and_plays_out_unequal_ones() -> None:
    for p in (2, 3, 4):
        for m in (1, 2, 3, 8):
            for order_of in (gpipe_order, one_f_one_b_order):
                step, busy = simulated_step([order_of(p, r, m) for r in range(p)], [1.0] * p,
                                            [2.0] * p)
                assert step == (m + p - 1) * 3.0 and busy == [3.0 * m] * p
                assert 1 - busy[0] / step == pytest.approx(bubble_fraction(p, m))
    # p = 2, GPipe, m = 2, stage 1 slower: by hand, stage 0 F 0-1 1-2; stage 1 F 1-3 3-5,
    # B 5-8 8-11; stage 0 B 8-10 11-13
    step, busy = simulated_step([gpipe_order(2, r, 2) for r in range(2)], [1, 2], [2, 3])
    assert (step, busy) == (13, [6, 10])
    stuck = [[("F", 0), ("B", 0), ("F", 1), ("B", 1)], [("F", 1), ("F", 0), ("B", 0), ("B", 1)]]
    with pytest.raises(ValueError, match="deadlocks"):
        simulated_step(stuck, [1, 1], [1, 1])
