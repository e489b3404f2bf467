"""Lesson 13's cost model, against closed forms, torch's own counts and the allocator.

- The constants: bad values, missing links and unknown backends are errors naming the
  value; a calibration written is read back the same.
- Counting: the FLOPs counted for a step of the course's blocks are the closed form's;
  views are not operators.
- Memory: the state at rest is lesson 10's table; every strategy's predicted peak is
  within 10% of what the CPU allocator saw for the same step (one process, the other
  ranks replaced by a stand-in group, so no MPI is needed); the pipeline's walk holds
  lesson 12's micro-batches in flight.
- Time: the closed forms reduce to lessons 07 and 12's where they should.
- At scale: the published points are within the issue's bars, the fitted point exactly.
"""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch
from torch import nn

from pcourse.cost_model import compare, memory, scale, step_time
from pcourse.cost_model.counting import compute_time, count_ops
from pcourse.cost_model.machine import (
    CostModelError,
    Link,
    Machine,
    NotCalibrated,
    load,
    save,
)
from pcourse.cost_model.shapes import Stack
from pcourse.pipeline import bubble_fraction, in_flight_prediction
from pcourse.sharding.memory import theory_bytes

SMALL = Stack(layers=4, d=48, heads=12, hidden=96, seq=12, batch=12)


def machine(**changes: object) -> Machine:
    base = Machine(matmul=((1e3, 1e9), (1e6, 1e10)), bandwidth=1e10, op_overhead=1e-6,
                   cores=2, links={"mpi allreduce 2": Link(1e-5, 1e-9, 2e-5)})
    return dataclasses.replace(base, **changes)


# ------------------------------------------------------------------ the constants
@pytest.mark.parametrize("change, says", [
    ({"bandwidth": -1.0}, "bandwidth = -1.0"),
    ({"op_overhead": float("nan")}, "op_overhead = nan"),
    ({"cores": 0}, "cores = 0"),
    ({"matmul": ((1e3, 0.0),)}, "matmul rate at 1e\\+03 FLOPs = 0.0"),
])
def test_a_constant_that_is_not_a_positive_number_is_refused_by_name(change, says):
    with pytest.raises(CostModelError, match=says):
        machine(**change)


def test_a_link_not_measured_says_where_it_was_measured_and_what_to_run():
    m = machine()
    with pytest.raises(NotCalibrated, match=r"at 3 ranks .*measured at: 2\).*--ranks 3"):
        m.link("mpi", "allreduce", 3)
    with pytest.raises(CostModelError, match="unknown backend 'nccl'"):
        m.link("nccl", "allreduce", 2)
    with pytest.raises(CostModelError, match="unknown collective 'alltoall'"):
        m.link("mpi", "alltoall", 2)


def test_a_calibration_is_read_back_as_written(tmp_path):
    m = machine(slowdown={2: 1.25}, per_byte={"gelu": 1e-10}, attention=((1e5, 1e9),),
                mode_overhead=3e-5, step_overhead=2e-6)
    path = save(m, tmp_path / "c.json")
    assert load(path) == m
    with pytest.raises(NotCalibrated, match="no calibration at .*calibrate"):
        load(tmp_path / "none.json")
    (tmp_path / "bad.json").write_text("{")
    with pytest.raises(NotCalibrated, match="not a calibration"):
        load(tmp_path / "bad.json")


def test_rates_are_the_measured_ones_at_their_sizes_and_between_them_in_between():
    m = machine()
    assert m.rate(1e3) == 1e9 and m.rate(1e6) == 1e10 and m.rate(1e9) == 1e10
    assert 1e9 < m.rate(3e4) < 1e10
    assert m.share(1) == m.share(2) == 1.0 and m.share(4) == 0.5  # c/p past the cores
    assert machine(slowdown={2: 1.6}).share(2) == pytest.approx(1 / 1.6)  # measured wins


def test_a_links_check_costs_only_when_asked_for():
    link = Link(1e-5, 1e-9, 2e-5)
    assert link.time(1000) == pytest.approx(1e-5 + 1e-6)
    assert link.time(1000, checked=True) == pytest.approx(3e-5 + 1e-6)


# ------------------------------------------------------------------ counting
def test_a_products_flops_are_counted_and_views_are_not_operators():
    a, b = torch.randn(8, 16), torch.randn(16, 4)
    counts, _ = count_ops(lambda: (a @ b).view(-1).unsqueeze(0).t())
    assert [(op.name, op.view) for op in counts.ops] == [
        ("mm", False), ("view", True), ("unsqueeze", True), ("t", True)]
    assert counts.operators == 1 and counts.flops == 2 * 8 * 16 * 4
    assert counts.bytes == (8 * 16 + 16 * 4 + 8 * 4) * 4 and counts.ops[0].fresh == 8 * 4 * 4
    m = machine(view_overhead=1e-7, first_touch=1e-10)
    assert compute_time(counts, m) == pytest.approx(
        m.op_overhead + max(counts.flops / m.rate(counts.flops), counts.bytes / m.bandwidth)
        + 8 * 4 * 4 * m.first_touch + 3 * m.view_overhead)
    splits, _ = count_ops(lambda: torch.zeros(12).split(3))
    assert [(op.name, op.tensors) for op in splits.ops if op.view] == [("split", 4)]


def test_an_operator_passing_python_dispatch_modes_costs_one_overhead_per_mode():
    from torch.utils._python_dispatch import TorchDispatchMode

    class Passes(TorchDispatchMode):  # hands every operator on, as a checkpointing mode does
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            return func(*args, **(kwargs or {}))

    a, b = torch.randn(8, 16), torch.randn(16, 4)
    plain, _ = count_ops(lambda: a @ b)

    def twice_wrapped():
        with Passes(), Passes():
            return a @ b

    wrapped, _ = count_ops(twice_wrapped)
    assert [op.modes for op in plain.ops] == [0] and [op.modes for op in wrapped.ops] == [2]
    m = machine(mode_overhead=5e-6)
    assert compute_time(wrapped, m) - compute_time(plain, m) == pytest.approx(2 * 5e-6)


def test_selective_checkpointing_passes_every_operator_it_watches_through_a_mode():
    from pcourse.checkpointing import run_segments
    from pcourse.workloads.transformer import Block

    block, x = Block(8, 2, 16), torch.randn(4, 2, 8)
    for how, wrapped in (("none", False), ("scratch", False), ("selective", True)):
        forward, y = count_ops(lambda how=how: run_segments([block], x, 1, how))
        backward, _ = count_ops(lambda y=y: y.square().mean().backward())
        assert all((op.modes > 0) == wrapped for op in forward.ops), how
        assert any(op.modes for op in backward.ops) == wrapped, how  # the recomputation


def test_an_optimizers_step_is_priced_at_its_own_overhead_per_operator():
    m = machine(op_overhead=1e-5)
    assert m.stepping() == m  # not measured: the one overhead
    stepping = machine(op_overhead=1e-5, step_overhead=2e-6).stepping()
    assert stepping.op_overhead == 2e-6 and stepping.step_overhead == 2e-6


def test_a_steps_counted_flops_are_the_closed_forms():
    torch.manual_seed(0)
    from pcourse.workloads.transformer import Block

    model = nn.Sequential(*[Block(SMALL.d, SMALL.heads, SMALL.hidden) for _ in range(SMALL.layers)])
    x = torch.randn(SMALL.seq, SMALL.batch, SMALL.d)
    counts, _ = count_ops(lambda: model(x).square().mean().backward())
    tokens = SMALL.seq * SMALL.batch
    recomputed_scores = SMALL.layers * 2 * SMALL.d * SMALL.seq * tokens  # flash's backward
    assert counts.flops == SMALL.flops_per_token() * tokens + recomputed_scores


# ------------------------------------------------------------------ memory
def test_the_state_at_rest_is_lesson_10s_table():
    psi = SMALL.params()
    for p in (2, 3, 4):
        assert memory.dp_memory(SMALL, p).rest == theory_bytes("ddp", psi, p)
        z1, z2 = memory.zero_memory(SMALL, p, 1), memory.zero_memory(SMALL, p, 2)
        padded = sum(memory.padded(n, p) for n in memory.buckets(SMALL))
        assert z1.rest == theory_bytes("zero1", padded, p)
        assert z2.rest == theory_bytes("zero2", padded, p)


def test_parameters_held_are_the_real_models():
    from pcourse.tensor_parallel import ParallelBlock
    from pcourse.tools.bench.strategies import Absent
    from pcourse.workloads.transformer import Block

    block = Block(SMALL.d, SMALL.heads, SMALL.hidden)
    for t in (1, 2, 3, 4):
        held = block if t == 1 else ParallelBlock(block, Absent(0, t))
        assert SMALL.params(t) == SMALL.layers * sum(p.numel() for p in held.parameters())
    assert sum(t.numel() for t in memory.param_tensors(SMALL)) == SMALL.params()


def test_the_pipelines_walk_holds_lesson_12s_micro_batches():
    shape = Stack(layers=4, d=48, heads=12, hidden=96, seq=12, batch=8)
    u = shape.unit(1)
    for schedule in ("gpipe", "1f1b"):
        for p in (2, 4):
            for r in range(p):
                got = memory.pipeline_memory(shape, p, r, 8, schedule)
                held = u + shape.saved(batch=1, layers=shape.layers // p) - (
                    0 if r == p - 1 else u) + (0 if r == p - 1 else u)
                # at most lesson 12's count of micro-batches' activations at once
                assert got.activations <= in_flight_prediction(schedule, p, r, 8) * held + (
                    8 * 2 * u)


@pytest.mark.parametrize("call, says", [
    (lambda: memory.dp_memory(SMALL, 5), r"the batch \(12\) does not divide by 5"),
    (lambda: memory.tp_memory(SMALL, 5), "heads = 12 does not divide by .* t = 5"),
    (lambda: memory.pipeline_memory(SMALL, 2, 0, 0), r"does not divide by 0|at least 1"),
    (lambda: memory.pipeline_memory(SMALL, 8, 0, 2), "of 4 blocks"),
    (lambda: memory.pipeline_memory(SMALL, 2, 0, 2, "zb"), "unknown schedule 'zb'"),
    (lambda: memory.zero_memory(SMALL, 2, 3), "ZeRO stage 3"),
    (lambda: SMALL.block_saved(policy="some"), "unknown checkpointing policy 'some'"),
])
def test_bad_input_is_an_error_naming_the_value(call, says):
    with pytest.raises(CostModelError, match=says):
        call()


STRATEGIES = ("ddp", "ddp-buckets", "zero1", "zero2", "fsdp", "fsdp-prefetch", "tp", "sp",
              "ddp-full", "ddp-selective")


@pytest.mark.parametrize("p", [2, 3])
def test_every_predicted_peak_is_within_10_percent_of_the_allocators(p):
    """One process, the other ranks a stand-in group: the allocator's peak of the step's
    real tensors beside the prediction (the MPI runs: tests/test_predict_bench.py)."""
    from pcourse.tools.bench import measured, predict, strategies

    spec = predict.Spec(ranks=(p,), strategies=STRATEGIES, layers=3, d=48, heads=12,
                        hidden=96, seq=12, batch=12)
    shape = spec.shape()
    x = torch.randn(shape.seq, shape.batch, shape.d)
    predicted = {s: predict._memory(s, p, spec)[0] for s in STRATEGIES}
    for s in STRATEGIES:
        group = strategies.Absent(0, p)
        mine = strategies.local_input(s, group, x)
        _, rest, peak, _ = measured.profiled(lambda: strategies.build(
            s, group, shape, mine, bucket_cap=64 << 10), lambda: None)  # noqa: B023
        assert rest == pytest.approx(predicted[s].rest, rel=1e-3), s
        assert abs(compare.error(predicted[s].peak, peak)) <= 0.10, (s, predicted[s].peak, peak)


# ------------------------------------------------------------------ time
def test_dp_without_overlap_is_the_work_and_every_buckets_call():
    work, link = step_time.Work(0.01, 0.02, 0.003), Link(1e-4, 1e-9)
    sizes = [4000, 8000]
    assert step_time.dp_step_time(work, sizes, link) == pytest.approx(
        work.total + sum(link.a + link.b * n for n in sizes))
    assert step_time.dp_step_time(work, sizes, link, overlap=True) <= \
        step_time.dp_step_time(work, sizes, link)


def test_equal_stages_take_lesson_12s_bubble():
    f, b, p, m = 0.002, 0.004, 4, 8
    free = Link(0.0, 0.0)
    got = step_time.pipeline_step_time([f] * p, [b] * p, m, free, 0, 0.0)
    assert got == pytest.approx(m * (f + b) / (1 - bubble_fraction(p, m)))
    with pytest.raises(CostModelError, match="m = 0"):
        step_time.pipeline_step_time([f], [b], 0, free, 0, 0.0)


def test_tensor_parallel_pays_four_checked_allreduces_per_block():
    work, link = step_time.Work(0.0, 0.0, 0.0), Link(1e-5, 1e-9, 3e-5)
    assert step_time.tp_step_time(work, 3, 1000, link) == pytest.approx(
        12 * link.time(1000, checked=True))


# ------------------------------------------------------------------ comparing
def test_kendalls_tau_of_orders_known_by_hand():
    assert compare.kendall_tau([1, 2, 3, 4], [10, 20, 30, 40]) == 1.0
    assert compare.kendall_tau([1, 2, 3, 4], [40, 30, 20, 10]) == -1.0
    assert compare.kendall_tau([1, 2, 3], [1, 3, 2]) == pytest.approx(1 / 3)
    s = compare.summary([1.1, 2.0, 2.7], [1.0, 2.0, 3.0])
    assert s["median"] == pytest.approx(0.1) and s["worst"] == pytest.approx(0.1)
    assert s["pairs"] == s["all"] == 3  # no repeats: every pair decided by its values


def test_kendalls_tau_counts_only_the_pairs_the_repeats_decide():
    # configurations 0 and 1 overlap, 2 is apart from both: four repeats each (the
    # fewest whose falling apart decides, pcourse.utils.verdict)
    repeats = [[1.0, 1.2, 1.1, 1.3], [1.15, 1.25, 1.05, 1.2], [2.0, 2.1, 2.2, 2.05]]
    medians = [1.15, 1.175, 2.075]
    assert compare.decided_pairs(repeats) == 2
    right = compare.summary([2.0, 1.0, 3.0], medians, repeats)  # 0, 1 swapped: undecided
    assert right["tau"] == 1.0 and (right["pairs"], right["all"]) == (2, 3)
    assert compare.kendall_tau([2.0, 1.0, 3.0], medians) == pytest.approx(1 / 3)  # unrepeated
    wrong = compare.summary([1.0, 3.0, 2.0], medians, repeats)  # 1 above 2: decided, wrong
    assert wrong["tau"] == 0.0
    assert compare.summary([3.0, 2.0, 1.0], medians, repeats)["tau"] == -1.0
    few = [r[:3] for r in repeats]  # three repeats each: too few to decide any pair
    assert math.isnan(compare.summary([1.0, 2.0, 3.0], medians, few)["tau"])
    assert compare.decided_pairs(few) == 0


# ------------------------------------------------------------------ at scale
def test_published_points_are_within_the_bars_and_the_fitted_one_exactly():
    for points, fitted in ((scale.torchtitan_points(), 0), (scale.megatron_points(), 6)):
        rows = scale.table(points, points[fitted])
        assert rows[fitted]["fitted"] and abs(rows[fitted]["error"]) < 1e-9
        for r in rows:
            assert abs(r["error"]) <= (0.25 if r["kind"] == "time" else 0.15), r


def test_megatrons_flop_count_is_its_equation_3():
    m = scale.LLM("x", 1e9, 24, 2304, 24, 51200, 2048)
    b, s, n, h, v = 512, 2048, 24, 2304, 51200
    assert m.megatron_flops(b) == pytest.approx(
        96 * b * s * n * h**2 * (1 + s / (6 * h) + v / (16 * n * h)))
    with pytest.raises(CostModelError, match="do not divide"):
        _ = scale.Mesh(8, 3, 100, 64).dp


def test_the_chosen_mesh_keeps_tensor_parallelism_inside_a_node():
    points = scale.megatron_points()
    e = scale.fit_efficiency(points[6])
    model = scale.LLM("GPT 145.6B", 145.6e9, 80, 12288, 96, 51200, 2048)
    best = scale.choose_mesh(model, scale.A100, 1536, 2304, e)[0]
    assert best["fits"] and best["tp"] <= scale.A100.per_node
    assert math.isclose(scale.ring("allreduce", 1, 1e9, 1e9), 0.0)


def test_the_time_bar_needs_a_ranking_the_run_decided():
    from pcourse.tools.bench.predict import bars

    def rows(repeats):
        return [{"strategy": s, "ranks": 2, "rank": 0, "time": sorted(r)[1], "time_predicted": p,
                 "times": r, "peak_error": 0.0}
                for s, p, r in zip("abc", (1.0, 2.0, 2.5), repeats, strict=True)]

    apart = [[1.0, 1.1, 0.9, 1.05], [2.0, 2.1, 1.9, 2.05], [3.0, 3.1, 2.9, 3.05]]
    assert bars(rows(apart))["times_met"]
    one = [[1.0, 1.1, 0.9, 1.05], [2.0, 2.1, 1.9, 3.05], [1.0, 3.1, 2.9, 3.05]]  # a-b only
    got = bars(rows(one))
    assert got["tau"] == 1.0 and got["pairs"] == 1 and not got["times_met"]  # 1 < n - 1
    wrong = bars(rows(apart[::-1]))  # every pair decided, every one the other way round
    assert wrong["tau"] == -1.0 and not wrong["times_met"]
