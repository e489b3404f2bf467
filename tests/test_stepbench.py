"""The per-step DDP comparison runs end to end in quick mode and writes its CSV.

Speed is not asserted here (CONTRIBUTING: benchmarks print figures, tests check
that they run); the rows must be complete and the ratios consistent with the times.
"""

from __future__ import annotations

import csv
from pathlib import Path

import pytest

from pcourse.tools.bench import steps as stepbench


def make_model(workload: str):
    from pcourse.workloads.franke import make_model as franke
    from pcourse.workloads.vae import make_model as vae

    return franke() if workload == "franke" else vae()


@pytest.mark.slow
@pytest.mark.mpi
def test_quick_run_writes_every_path(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "steps.csv"
    assert stepbench.main(["--smoke", "--out", str(out), "--timeout", "150"]) == 0
    rows = list(csv.DictReader(out.open()))
    caps = stepbench.StepSpec.smoke().caps
    expected = {(kind, backend, "" if cap is None else str(cap))
                for kind, backend, cap in map(stepbench.split_path, stepbench.paths("gloo", caps))}
    for workload in ("franke", "mnist"):
        mine = [r for r in rows if r["workload"] == workload]
        assert {(r["path"], r["backend"], r["bucket_cap"]) for r in mine} == expected
        n_params = len(list(make_model(workload).parameters()))
        ddp = {r["bucket_cap"]: float(r["median_ms"]) for r in mine if r["path"] == "DDP"}
        per_param = {r["backend"]: float(r["median_ms"]) for r in mine if r["path"] == "per-param"}
        for r in mine:
            assert 0 < float(r["p25_ms"]) <= float(r["median_ms"]) <= float(r["p75_ms"])
            if r["bucket_cap"] == "1":  # a bucket per parameter, ours and DDP's
                assert int(r["buckets"]) == n_params
            elif r["bucket_cap"]:  # 25 MiB: both models fit in one bucket
                assert int(r["buckets"]) == 1
            else:
                assert r["buckets"] == ""
            same_cap = r["bucket_cap"] or str(stepbench.DEFAULT_CAP)
            ratio = float(r["median_ms"]) / ddp[same_cap]
            assert float(r["ratio_to_ddp"]) == pytest.approx(ratio, rel=1e-2, abs=1e-3)
            if r["backend"] in per_param:  # the strategy alone: same backend, per-param = 1
                ratio = float(r["median_ms"]) / per_param[r["backend"]]
                assert float(r["ratio_to_per_param"]) == pytest.approx(ratio, rel=1e-2, abs=1e-3)
            else:
                assert r["ratio_to_per_param"] == ""
    assert "÷ DDP" in capsys.readouterr().out
    assert not list(tmp_path.glob(".steps.csv.*"))  # no temporary file left behind


def test_every_strategy_runs_on_mpi_and_the_torch_backend() -> None:
    """Issue 13: bucketed and per-parameter compared on the same backend."""
    for torch_backend in ("gloo", "nccl"):
        kinds = {}
        for path in stepbench.paths(torch_backend, stepbench.QUICK_CAPS):
            kind, backend, _ = stepbench.split_path(path)
            kinds.setdefault(kind, set()).add(backend)
        for kind in ("per-param", "bucketed", "bucketed+overlap"):
            assert {"mpi", torch_backend} <= kinds[kind]
        caps = {stepbench.split_path(p)[2] for p in stepbench.paths(torch_backend, (1, 2))}
        assert caps == {None, 1, 2}  # every cap swept, and the paths without buckets


def row(path: str, backend: str, cap: int | str, ms: float, buckets: int | str = 2) -> dict:
    return {"workload": "w", "ranks": 2, "path": path, "backend": backend, "bucket_cap": cap,
            "buckets": buckets, "median_ms": ms}


def test_ratios_and_the_target_compare_at_the_same_cap() -> None:
    """DDP is fastest at 25 MiB, ours at 1 MiB: the target compares with DDP at 1 MiB."""
    rows = [row("no averaging", "-", "", 1.0, ""),
            row("bucketed+overlap", "gloo", 2**20, 3.0), row("bucketed", "gloo", 2**20, 4.0),
            row("bucketed+overlap", "gloo", 25 * 2**20, 9.0, 1),
            row("bucketed+overlap", "mpi", 2**20, 1.0),  # another backend: not ours here
            row("DDP", "gloo", 2**20, 5.0), row("DDP", "gloo", 25 * 2**20, 2.0, 1)]
    stepbench.with_ratios(rows)
    assert [r["ratio_to_ddp"] for r in rows] == [0.5, 0.6, 0.8, 4.5, 0.2, 1.0, 1.0]
    (t,) = stepbench.targets(rows)
    assert (t["cap"], t["backend"], t["met"], t["overlap_paid"]) == (2**20, "gloo", True, True)
    assert t["ratio"] == pytest.approx(0.6)
    rows[1]["median_ms"] = 4.6  # now slower than DDP's 0.9 and than no overlap
    (t,) = stepbench.targets(rows)
    assert (t["met"], t["overlap_paid"]) == (False, False)


def test_the_lesson_compares_with_ddp_beyond_the_quartiles_and_prints_no_target(
        capsys: pytest.CaptureFixture[str]) -> None:
    def timed(path: str, backend: str, cap: int, q: tuple, buckets: int = 2) -> dict:
        return {**row(path, backend, cap, q[1], buckets), "p25_ms": q[0], "p75_ms": q[2]}

    rows = [timed("bucketed+overlap", "gloo", 2**20, (2.9, 3.0, 3.1)),
            timed("bucketed", "gloo", 2**20, (3.9, 4.0, 4.2)),
            timed("DDP", "gloo", 2**20, (4.8, 5.0, 5.3))]
    stepbench.print_against_ddp(rows)
    out = capsys.readouterr().out
    assert "bucketed+overlap is faster than DDP: 0.60×" in out, out
    assert "bucketed+overlap is faster than bucketed" in out and "target" not in out
    rows[2].update(p25_ms=3.05, median_ms=3.2)  # the quartiles overlap: no verdict
    stepbench.print_against_ddp(rows)
    assert "not decided between bucketed+overlap and DDP: their quartiles overlap" in \
        capsys.readouterr().out


@pytest.mark.parametrize("text, nbytes", [("1", 1), ("64KiB", 65536), ("25MiB", 25 * 2**20),
                                          ("0.5mib", 2**19), ("300B", 300)])
def test_caps_are_read_with_units(text: str, nbytes: int) -> None:
    assert stepbench.parser().parse_args(["--caps", text]).caps == [nbytes]


@pytest.mark.parametrize("argv, says", [
    (["--caps", "0"], "under one byte"),
    (["--caps", "big"], "not a bucket cap"),
    (["--ranks", "0"], "at least 1"),
    (["--ranks", "3"], "split evenly"),  # Franke's global batch of 256 over 3 ranks
])
def test_bad_arguments_are_refused(argv: list[str], says: str,
                                   capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        stepbench.main(argv)
    assert says in capsys.readouterr().err


def test_what_a_learner_runs_prints_no_development_target(capsys, tmp_path) -> None:
    """Lessons 07 and 10 send learners to `bench steps` and `bench sharding`: their default
    report holds none of the course's development targets (the output rules of
    pcourse.tools.workshop.outputs, as for a lesson's stored outputs); --targets adds them."""
    from pcourse.tools.bench import sharding
    from pcourse.tools.workshop.outputs import RULES

    def timed(path: str, backend: str, cap: int, q: tuple) -> dict:
        return {**row(path, backend, cap, q[1], 2), "p25_ms": q[0], "p75_ms": q[2]}

    steps_rows = [timed("bucketed+overlap", "gloo", 2**20, (4.9, 5.0, 5.1)),
                  timed("bucketed", "gloo", 2**20, (3.9, 4.0, 4.2)),
                  timed("DDP", "gloo", 2**20, (2.8, 3.0, 3.3))]
    shard_rows = [{"workload": "franke", "ranks": 2, "strategy": s, "median_ms": ms,
                   "ratio_to_ddp": ms / 10, "max_diff_vs_ddp": 0.0}
                  for s, ms in (("ddp", 10.0), ("zero1", 13.0), ("torch-zero", 10.0))]
    for with_targets in (False, True):
        stepbench.report(steps_rows, str(tmp_path / "steps.csv"), with_targets)
        sharding.report(shard_rows, str(tmp_path / "sharding.csv"), with_targets)
        out = capsys.readouterr().out
        flagged = RULES["a development target"].findall(out)
        assert bool(flagged) == with_targets, (with_targets, out)
