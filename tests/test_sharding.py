"""Reduce-scatter and all-gather (from scratch and on every backend) and ZeRO-1/2, FSDP.

The MPI programs compare against MPI's own collectives and a single-process float64
run; here they are launched at p = 2, 3, 4 (3 catches direction and indexing bugs,
which p = 2 hides). In-process: the contracts that need no second rank.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from pcourse.collectives import chunk_bounds, half_cost_terms
from pcourse.sharding import (
    FullyShardedDataParallel,
    ShardedOptimizer,
    peak_bytes,
    peak_theory_bytes,
    shard_range,
    state_bytes,
    theory_bytes,
)
from pcourse.sharding.zero import IN_FLIGHT
from pcourse.tools.cluster.launch import kill_group

SLOW_P = [3, *(pytest.param(p, marks=pytest.mark.slow) for p in (2, 4))]


@pytest.mark.parametrize("p", SLOW_P)
def test_reduce_scatter_and_all_gather_equal_mpi(mpi_run, p: int) -> None:
    mpi_run(p, "check_reduce_scatter.py", expect=f"reduce-scatter OK on {p} ranks", timeout=240)


@pytest.mark.slow
@pytest.mark.parametrize("p", [2, 3, 4])
def test_zero_and_fsdp_equal_one_process(mpi_run, p: int) -> None:
    mpi_run(p, "check_sharding.py", expect=f"sharding OK on {p} ranks", timeout=300)


@pytest.mark.slow
def test_sharding_on_gloo(mpi_run) -> None:
    mpi_run(3, "check_sharding.py", "gloo", expect="sharding OK on 3 ranks (gloo)", timeout=300)


def test_chunks_and_shards_cover_everything_once() -> None:
    for n in (0, 1, 5, 7, 100):
        for p in (1, 2, 3, 4):
            bounds = chunk_bounds(n, p)
            assert bounds[0][0] == 0 and bounds[-1][1] == n
            assert all(a[1] == b[0] for a, b in zip(bounds, bounds[1:], strict=False))
            lo, hi, padded = shard_range(n, p - 1, p)
            assert padded % p == 0 and n <= padded < n + p and hi == padded
    assert half_cost_terms(4) == (3.0, 0.75)


def test_theory_matches_the_zero_paper() -> None:
    psi = 1000
    assert theory_bytes("ddp", psi, 4) == 16 * psi
    assert theory_bytes("zero1", psi, 4) == 8 * psi + 8 * psi / 4
    assert theory_bytes("zero2", psi, 4) == 4 * psi + 12 * psi / 4
    assert theory_bytes("fsdp", psi, 4, unit=10) == 16 * psi / 4 + 40
    with pytest.raises(ValueError, match="unknown strategy"):
        theory_bytes("zero4", psi, 4)


def model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(3, 5), nn.ReLU(), nn.Linear(5, 2))


def test_one_rank_sharded_optimizer_is_the_optimizer(one_rank) -> None:
    """On one rank the slices are the whole: the same as plain AdamW, bit for bit."""
    x = torch.randn(8, 3)
    for stage in (1, 2):
        a, b = model(), model()
        plain = torch.optim.AdamW(a.parameters(), lr=0.1)
        ours = ShardedOptimizer(b.parameters(), torch.optim.AdamW, backend=one_rank(),
                                stage=stage, lr=0.1)
        for _ in range(3):
            for m, opt in ((a, plain), (b, ours)):
                opt.zero_grad()
                m(x).square().mean().backward()
                opt.step()
        for p, q in zip(a.parameters(), b.parameters(), strict=True):
            assert torch.equal(p, q)
    held = state_bytes(b, ours)
    psi = sum(p.numel() for p in b.parameters())
    assert held["parameters"] == 4 * psi and held["optimizer"] == 8 * psi


def test_one_rank_fsdp_is_the_model(one_rank) -> None:
    a, b = model(), FullyShardedDataParallel(model(), one_rank(), shard=nn.Linear)
    x = torch.randn(8, 3)
    oa, ob = torch.optim.SGD(a.parameters(), lr=0.1), torch.optim.SGD(b.parameters(), lr=0.1)
    for _ in range(3):
        for m, opt in ((a, oa), (b, ob)):
            opt.zero_grad()
            m(x).square().mean().backward()
            if m is b:
                m.finish()
            opt.step()
    full = b.full_parameters()
    assert sorted(full) == sorted(n for n, _ in a.named_parameters())
    for n, p in a.named_parameters():
        assert torch.allclose(full[n], p, atol=1e-6)
    with torch.no_grad():  # eval: no gathered copy outlives the forward
        assert torch.allclose(b(x), a(x), atol=1e-6)
    assert all(u.full is None and not u.again for u in b.units)


def test_bad_arguments_say_what_to_do(one_rank) -> None:
    with pytest.raises(ValueError, match="stage must be 1"):
        ShardedOptimizer(model().parameters(), torch.optim.AdamW, backend=one_rank(), stage=3)
    with pytest.raises(TypeError, match="torch.optim.Optimizer class"):
        ShardedOptimizer(model().parameters(), "adamw", backend=one_rank())
    with pytest.raises(TypeError, match="shard must be"):
        FullyShardedDataParallel(model(), one_rank(), shard=3)
    with pytest.raises(ValueError, match="compute_dtype"):
        FullyShardedDataParallel(model(), one_rank(), compute_dtype=torch.int8)
    backend = one_rank()
    with pytest.raises(ValueError, match="pad it"):
        backend.reduce_scatter(torch.empty(2), torch.empty(3))


def test_overlapped_variants_are_the_optimizer_on_one_rank(one_rank) -> None:
    """Buckets cut through the model, reduced from backward's hooks, gathered lazily:
    on one rank still plain AdamW, bit for bit; FSDP with prefetch still the model."""
    x = torch.randn(8, 3)
    for stage in (1, 2):
        a, b = model(), model()
        plain = torch.optim.AdamW(a.parameters(), lr=0.1)
        ours = ShardedOptimizer(b.parameters(), torch.optim.AdamW, backend=one_rank(),
                                stage=stage, lr=0.1, overlap=True, module=b, bucket_cap_bytes=40)
        assert len(ours.buckets) >= 3
        for _ in range(3):
            for m, opt in ((a, plain), (b, ours)):
                opt.zero_grad()
                m(x).square().mean().backward()
                opt.step()
        ours.synchronize()
        for p, q in zip(a.parameters(), b.parameters(), strict=True):
            assert torch.equal(p, q)
    c = FullyShardedDataParallel(model(), one_rank(), shard=nn.Linear, prefetch=2, overlap=True)
    oc = torch.optim.SGD(c.parameters(), lr=0.1)
    for _ in range(2):
        oc.zero_grad()
        c(x).square().mean().backward()
        assert all(s.grad is None for s in c.shards)  # the reduce-scatters wait for finish()
        c.finish()
        oc.step()
    assert all(s.grad is not None for s in c.shards)
    assert [u.module for u in c.schedule.last] == [c.module[0], c.module[2]]
    assert all(not u.coming and not u.again for u in c.units)
    with pytest.raises(ValueError, match="prefetch is how many units"):
        FullyShardedDataParallel(model(), one_rank(), prefetch=-1)


def test_a_gradient_arriving_twice_is_refused(one_rank) -> None:
    m = model()
    opt = ShardedOptimizer(m.parameters(), torch.optim.SGD, backend=one_rank(), lr=0.1)
    x = torch.randn(4, 3)
    m(x).sum().backward()
    assert opt.buckets  # its hooks saw the first backward
    with pytest.raises(RuntimeError, match="one backward per step"):
        m(x).sum().backward()


def test_peak_bytes_sees_what_a_step_frees_again() -> None:
    """Closed form: 4000 bytes held, freed, then 2000: the peak is 4000 above the start."""
    def step() -> None:
        a = torch.ones(1000)
        del a
        b = torch.ones(500)
        del b

    assert peak_bytes(step) == 4000
    assert peak_bytes(lambda: None) == 0


def test_zero2_with_overlap_never_holds_every_gradient(one_rank) -> None:
    """ZeRO-2 with overlap keeps at most IN_FLIGHT + 1 buckets of gradients; without it,
    all of them until the step: the measured peaks differ by about the rest."""
    def deep() -> nn.Module:
        torch.manual_seed(0)
        return nn.Sequential(*(nn.Linear(64, 64) for _ in range(12)))

    class Forgetful(one_rank):  # the fake backend without its record of every call
        def allreduce(self, tensor: torch.Tensor, op: str = "sum", *,
                      check: bool = True) -> torch.Tensor:
            return tensor

    x = torch.randn(2, 64)
    peaks = {}
    for overlap in (False, True):
        m = deep()
        layer = 64 * 64 + 64
        opt = ShardedOptimizer(m.parameters(), torch.optim.SGD, backend=Forgetful(), stage=2,
                               lr=0.1, overlap=overlap, bucket_cap_bytes=4 * layer)

        def step(m: nn.Module = m, opt: ShardedOptimizer = opt) -> None:
            m(x).square().mean().backward()
            opt.step()

        for _ in range(2):
            opt.zero_grad()
            peaks[overlap] = peak_bytes(step)
    psi = 12 * layer
    assert peaks[False] - peaks[True] >= 4 * (psi - (IN_FLIGHT + 2) * layer), peaks


def test_the_peak_theory_adds_the_transients() -> None:
    """Closed forms on two Linear layers (220 and 630 parameters, Ψ = 850) at p = 2, in
    elements times 4 bytes: each strategy's state at rest plus its largest moment."""
    model = nn.Sequential(nn.Linear(10, 20), nn.Linear(20, 30))
    psi, largest = 850, 600  # the largest parameter: the second weight
    # DDP: 16Ψ, and AdamW's two temporaries of the largest parameter
    assert peak_theory_bytes("ddp", model, 2) == 4 * (4 * psi + 2 * largest)
    # ZeRO-1: 8Ψ + 8Ψ/p, and the two temporaries of its one slice (425)
    assert peak_theory_bytes("zero1", model, 2) == 4 * (2 * psi + psi + 2 * 425)
    # ZeRO-2: 4Ψ + 12Ψ/p, and in backward every gradient waiting plus the largest one
    assert peak_theory_bytes("zero2", model, 2) == 4 * (psi + 3 * psi / 2 + psi + largest)
    # FSDP: 12Ψ/p, and the last unit's backward: the unit gathered and its gradients
    assert peak_theory_bytes("fsdp", model, 2, shard=nn.Linear) == 4 * (3 * 425 + 2 * 630)
    # one unit gathered ahead for the backward: the first, while the last's runs
    assert peak_theory_bytes("fsdp", model, 2, shard=nn.Linear, prefetch=1) == \
        4 * (3 * 425 + 220 + 2 * 630)
    # bfloat16: gathered and its gradients in 2 bytes, joined and cast to fp32 2 + 4:
    # 6 * 630 < 8 * 630, so now the optimizer's step is the peak: every slice's
    # gradient and two temporaries of the largest slice (315)
    assert peak_theory_bytes("fsdp", model, 2, shard=nn.Linear,
                             compute_dtype=torch.bfloat16) == 4 * (4 * 425 + 2 * 315)
    assert 4 * 3 * 425 + 6 * 630 < 4 * (4 * 425 + 2 * 315)
    for s in ("ddp", "zero1", "zero2"):
        assert peak_theory_bytes(s, model, 2) >= theory_bytes(s, psi, 2)
    with pytest.raises(ValueError, match="unknown strategy"):
        peak_theory_bytes("zero3", model, 2)


@pytest.mark.parametrize("p", SLOW_P)
def test_the_peak_theory_is_what_the_allocator_holds(mpi_run, p: int) -> None:
    """The allocator's peak of a step, counted from before the model was built, is the
    theory plus what it leaves out, checked both ways for every strategy (check_peaks.py)."""
    mpi_run(p, "check_peaks.py", expect=f"peaks OK on {p} ranks", timeout=240)


def test_exposure_is_read_from_the_trace() -> None:
    """Closed form on a made-up step: two collectives in flight over [1, 5] and [3, 9] ms
    (7 ms together), the rank inside calls and waits for 1 + 2 ms of them."""
    from pcourse.tools.bench.overlap import chrome_trace, exposure

    rec = {"rank": 0, "strategy": "zero2-overlap", "workload": "franke", "backend": "gloo",
           "phases": [("step", 0.0, 10.0), ("backward", 0.0, 6.0)],
           "events": [("call", 0, 1.0, 1.5), ("call", 1, 3.0, 3.5), ("wait", 1, 8.0, 9.0)],
           "flights": [(0, 1.0, 5.0), (1, 3.0, 9.0)], "kinds": ["reduce_scatter", "all_gather"]}
    (got,) = exposure(chrome_trace([rec]))
    assert got["step_ms"] == 10.0 and got["in_flight_ms"] == 8.0 and got["exposed_ms"] == 2.0
    assert abs(got["hidden"] - 0.75) < 1e-12


def test_a_traced_step_sees_every_collective(one_rank) -> None:
    """The tracing backend records each bucket's reduce-scatter and all-gather once a step;
    what it reads back is ordered: exposed ≤ in flight ≤ the step."""
    from pcourse.tools.bench.overlap import TracedBackend, chrome_trace, exposure, last_step

    traced, m, x = TracedBackend(one_rank()), model(), torch.randn(4, 3)
    opt = ShardedOptimizer(m.parameters(), torch.optim.SGD, traced, lr=0.1, overlap=True,
                           module=m, bucket_cap_bytes=40)
    for _ in range(3):
        with traced.phase("step"):
            opt.zero_grad()
            m(x).sum().backward()
            opt.step()
    step = last_step(traced)
    calls = [step["kinds"][k] for what, k, _, _ in step["events"] if what == "call"]
    assert sorted(calls) == sorted(["reduce_scatter", "all_gather"] * len(opt.buckets))
    rec = {"rank": 0, "strategy": "zero1-overlap", "workload": "toy", "backend": "one-rank",
           **step}
    (got,) = exposure(chrome_trace([rec]))
    assert 0 <= got["exposed_ms"] <= got["in_flight_ms"] + 1e-9 <= got["step_ms"] + 2e-9


def test_the_benchmark_says_whether_each_target_is_met() -> None:
    from pcourse.tools.bench.sharding import targets

    rows = [{"workload": "franke", "ranks": 2, "strategy": s, "median_ms": ms}
            for s, ms in (("ddp", 10.0), ("zero1", 10.5), ("zero2", 9.0), ("torch-zero", 10.0),
                          ("fsdp", 13.0), ("torch-fsdp2", 12.0))]
    said = "\n".join(targets(rows))
    assert "zero1 ≤ 1.1× ddp (franke, 2 ranks): 1.05× — met" in said
    assert "zero1 ≤ 1× torch-zero (franke, 2 ranks): 1.05× — NOT met" in said
    assert "fsdp ≤ 1× torch-fsdp2 (franke, 2 ranks): 1.08× — NOT met" in said
    four = [dict(r, ranks=4) for r in rows]
    assert "fsdp" not in "\n".join(line for line in targets(four) if "torch-fsdp2" in line)


def test_a_target_not_met_says_whether_this_machine_could_meet_it() -> None:
    """The floor is the rank's CPU work per step over its cores: out of reach only when
    that floor itself breaks the bound, never for a target met."""
    from pcourse.tools.bench.sharding import floor_ms, targets

    def rows(prefetch_ms: float, cpu_ms: float, cores: int) -> list[dict]:
        return [{"workload": "vae", "ranks": 2, "strategy": "ddp", "median_ms": 20.0},
                {"workload": "vae", "ranks": 2, "strategy": "fsdp-prefetch",
                 "median_ms": prefetch_ms, "cpu_ms": cpu_ms, "cores": cores}]

    def line(*args: float) -> str:
        (said,) = [t for t in targets(rows(*args)) if "fsdp-prefetch ≤ 1.6× ddp" in t]
        return said

    assert floor_ms(rows(40.0, 34.0, 1)[1]) == 34.0 and floor_ms(rows(40.0, 34.0, 2)[1]) == 17.0
    assert floor_ms({"cpu_ms": "", "cores": 1}) is None
    out = line(40.0, 34.0, 1)  # 2.0× ddp; no schedule gets under 34 ms = 1.7×
    assert "NOT met; out of reach on this machine" in out and "34.0 ms (1.70× ddp)" in out
    assert "out of reach" not in line(40.0, 34.0, 2)  # two cores: the floor is 0.85×
    assert "out of reach" not in line(40.0, 30.0, 1)  # the floor, 1.5×, is within the bound
    assert line(30.0, 34.0, 1).endswith("1.50× — met")  # met: nothing more is said


def test_zero_not_met_says_what_its_collectives_cost_against_ddps() -> None:
    from pcourse.tools.bench.sharding import targets

    costs = {"model_rs_ms": 3.0, "model_ag_ms": 2.0, "model_ar_ms": 4.0}
    rows = [{"workload": "vae", "ranks": 2, "strategy": "ddp", "median_ms": 20.0, **costs},
            {"workload": "vae", "ranks": 2, "strategy": "zero1", "median_ms": 24.0,
             "cpu_ms": 19.0, "cores": 1, **costs},  # floor 0.95×: within reach
            {"workload": "vae", "ranks": 2, "strategy": "zero2-overlap", "median_ms": 21.0,
             "cpu_ms": 19.0, "cores": 1, **costs}]
    said = {t.split(":")[0]: t for t in targets(rows)}
    assert said["target zero1 ≤ 1.1× ddp (vae, 2 ranks)"].endswith(
        "1.20× — NOT met; ZeRO's reduce-scatter and all-gather of the whole model take 5.00 ms "
        "here, DDP's allreduce of it 4.00 ms (1.25×)")
    assert said["target zero2-overlap ≤ 1.1× ddp (vae, 2 ranks)"].endswith("1.05× — met")


@pytest.mark.slow
def test_sharding_under_torchrun_on_torchs_own_group() -> None:
    import subprocess
    import sys
    from pathlib import Path

    repo = Path(__file__).resolve().parents[1]
    torchrun = Path(sys.executable).parent / "torchrun"
    proc = subprocess.Popen([str(torchrun), "--standalone", "--nproc-per-node", "3",
                             "tests/torchrun/check_sharding.py"], cwd=repo, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=240)
    finally:
        kill_group(proc)
    assert proc.returncode == 0, out[-4000:]
    assert "sharding without MPI OK (torchrun, 3 ranks)" in out


def test_a_scheduler_steers_the_sharded_optimizer_as_it_does_torchs(one_rank) -> None:
    """LR schedulers change ``param_groups``; the local optimizer must follow them."""
    a, b = model(), model()
    x = torch.randn(8, 3)
    plain = torch.optim.SGD(a.parameters(), lr=0.1, momentum=0.9)
    ours = ShardedOptimizer(b.parameters(), torch.optim.SGD, backend=one_rank(), lr=0.1,
                            momentum=0.9)
    scheds = [torch.optim.lr_scheduler.StepLR(o, step_size=1, gamma=0.5) for o in (plain, ours)]
    for _ in range(3):
        for m, opt, sched in ((a, plain, scheds[0]), (b, ours, scheds[1])):
            opt.zero_grad()
            m(x).square().mean().backward()
            opt.step()
            sched.step()
    assert ours.param_groups[0]["lr"] == plain.param_groups[0]["lr"] == 0.1 / 8  # read at step()
    for p, q in zip(a.parameters(), b.parameters(), strict=True):
        assert torch.allclose(p, q, rtol=1e-6, atol=1e-7)
    state = ours.state_dict()
    assert state["rank"] == 0 and state["local"]["state"]
    ours.load_state_dict(state)


def test_a_backend_a_group_or_nothing_and_else_a_clear_error(one_rank, monkeypatch) -> None:
    """``as_backend``: a Backend as it is; anything else but a group or None is refused."""
    import torch.distributed as dist

    from pcourse.backends.groups import as_backend

    backend = one_rank()
    assert as_backend(backend) is backend
    with pytest.raises(TypeError, match="ProcessGroup or None, got str"):
        as_backend("gloo")
    monkeypatch.setattr(dist, "is_initialized", lambda: False)
    with pytest.raises(ValueError, match="not initialised"):
        as_backend(None)
