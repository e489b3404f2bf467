"""The per-step DDP comparison runs end to end in quick mode and writes its CSV.

Speed is not asserted here (CONTRIBUTING: benchmarks print figures, tests check
that they run); the rows must be complete and the ratios consistent with the times.
"""

from __future__ import annotations

import csv
from pathlib import Path

import pytest

from pcourse.bench import steps as stepbench


@pytest.mark.slow
@pytest.mark.mpi
def test_quick_run_writes_every_path(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "steps.csv"
    assert stepbench.main(["--quick", "--out", str(out), "--timeout", "150"]) == 0
    rows = list(csv.DictReader(out.open()))
    expected = {tuple(p.split("@")) for p in stepbench.paths("gloo")}
    for workload in ("franke", "mnist"):
        mine = [r for r in rows if r["workload"] == workload]
        assert {(r["path"], r["backend"]) for r in mine} == expected
        ddp = next(float(r["median_ms"]) for r in mine if r["path"] == "DDP")
        per_param = {r["backend"]: float(r["median_ms"]) for r in mine if r["path"] == "per-param"}
        for r in mine:
            assert 0 < float(r["p25_ms"]) <= float(r["median_ms"]) <= float(r["p75_ms"])
            ratio = float(r["median_ms"]) / ddp
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
        for path in stepbench.paths(torch_backend):
            kind, _, backend = path.partition("@")
            kinds.setdefault(kind, set()).add(backend)
        for kind in ("per-param", "bucketed", "bucketed+overlap"):
            assert {"mpi", torch_backend} <= kinds[kind]


@pytest.mark.parametrize("argv, says", [
    (["--ranks", "0"], "at least 1"),
    (["--ranks", "3"], "split evenly"),  # Franke's global batch of 256 over 3 ranks
])
def test_bad_arguments_are_refused(argv: list[str], says: str,
                                   capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        stepbench.main(argv)
    assert says in capsys.readouterr().err
