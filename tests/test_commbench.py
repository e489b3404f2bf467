"""The communication benchmark: a seconds-long smoke run, its CSV, and bad input."""

from __future__ import annotations

import csv
import os
import subprocess
import sys
from pathlib import Path

import pytest

from pcourse.tools.bench.commbench import CommSpec, parse_args, sizes
from pcourse.tools.bench.commreport import FIELDS, add_rates, fit_all, read_rows

FROM_SCRATCH = {"mpi", "mpi-pickle", "tree", "ring", "recursive-doubling"}


def commbench(*args: str, timeout: float = 180) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ, PATH=f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}")
    return subprocess.run([sys.executable, "-m", "pcourse.tools.bench.commbench", *args], env=env,
                          capture_output=True, text=True, timeout=timeout)


@pytest.fixture(scope="module")
def quick(tmp_path_factory: pytest.TempPathFactory) -> tuple[subprocess.CompletedProcess, Path]:
    out = tmp_path_factory.mktemp("commbench") / "commbench.csv"
    return commbench("--smoke", "--out", str(out)), out


@pytest.mark.slow
@pytest.mark.mpi
def test_quick_mode_writes_csv_and_plot(quick) -> None:
    done, out = quick
    assert done.returncode == 0, done.stdout + done.stderr
    with open(out, newline="") as f:
        assert set(FIELDS) <= set(csv.DictReader(f).fieldnames or [])
    assert out.with_suffix(".png").stat().st_size > 1000
    assert [p.name for p in out.parent.iterdir() if p.name.startswith(".")] == []  # no temp
    for heading in ("latency [us]", "busbw [GB/s]", "speed vs MPI native", "alpha-beta fit"):
        assert heading in done.stdout


@pytest.mark.slow
@pytest.mark.mpi
def test_quick_rows_are_plausible(quick) -> None:
    _, out = quick
    rows = read_rows(out)
    expected_sizes = sizes(4, 64 << 10, 4)
    assert FROM_SCRATCH <= {r["method"] for r in rows}
    for method in {r["method"] for r in rows}:
        assert sorted(r["bytes"] for r in rows if r["method"] == method) == expected_sizes
    for r in rows:
        assert r["ranks"] == 2 and 1 <= r["iterations"] <= 2
        assert 0 < r["p25_us"] <= r["median_us"] == r["latency_us"] <= r["p75_us"] < 5e6
        assert r["mean_us"] > 0
        # bytes / time, and for 2 ranks 2(p-1)/p = 1: busbw equals algbw
        assert r["algbw_GBps"] == pytest.approx(r["bytes"] / r["latency_us"] / 1e3, rel=1e-6)
        assert r["busbw_GBps"] == pytest.approx(r["algbw_GBps"], rel=1e-6)
    assert all(r["speed_vs_mpi"] == 1.0 for r in rows if r["method"] == "mpi")
    assert set(fit_all(rows)) == {(2, m) for m in {r["method"] for r in rows}}


@pytest.mark.slow
@pytest.mark.mpi
def test_unavailable_backends_are_skipped_with_a_reason(quick) -> None:
    done, out = quick
    methods = {r["method"] for r in read_rows(out)}
    for name in ("gloo", "nccl", "nccl-cupy"):
        assert name in methods or f"skip {name} at 2 ranks: " in done.stdout


def test_busbw_uses_the_nccl_tests_factor() -> None:
    rows = add_rates([{"ranks": 4, "method": m, "bytes": 1 << 20, "seconds": s}
                      for m, s in (("mpi", 1e-3), ("ring", 2e-3))])
    ring = rows[1]
    assert ring["busbw_GBps"] == pytest.approx((1 << 20) / 2e-3 / 1e9 * 2 * 3 / 4)
    assert ring["speed_vs_mpi"] == pytest.approx(0.5)


@pytest.mark.parametrize("bad, message", [
    (["--ranks", "1"], "at least 2 ranks"),
    (["--ranks", "2", "--min-bytes", "8K", "--max-bytes", "4K"], "--min-bytes <= --max-bytes"),
    (["--max-bytes", "2"], "between 4 bytes"),
    (["--max-bytes", "1024G"], "1024G is 1,099,511,627,776 bytes"),
    (["--timeout", "-1"], "argument --timeout: -1 seconds"),
    (["--max-bytes", "lots"], "not a size in bytes"),
    (["--methods", "carrier-pigeon"], "invalid choice"),
])
def test_bad_input_is_a_clear_error_and_writes_nothing(tmp_path: Path, bad, message) -> None:
    out = tmp_path / "commbench.csv"
    done = commbench(*bad, "--smoke", "--out", str(out), timeout=60)
    assert done.returncode == 2
    assert message in done.stderr
    assert list(tmp_path.iterdir()) == []


@pytest.mark.mpi
def test_a_job_out_of_time_leaves_no_partial_results(tmp_path: Path) -> None:
    out = tmp_path / "commbench.csv"
    done = commbench("--smoke", "--timeout", "0.5", "--out", str(out), timeout=60)
    assert done.returncode == 1
    assert "No results written" in done.stderr and "did not finish" in done.stderr
    assert "Traceback" not in done.stderr
    assert list(tmp_path.iterdir()) == []


def test_presets() -> None:
    smoke = parse_args(["--smoke"]).spec
    assert smoke == CommSpec.smoke()
    assert parse_args(["--quick"]).spec == CommSpec.quick()  # the lessons' quick mode
    assert smoke.ranks == (2,) and smoke.max_bytes <= 64 << 10 and smoke.max_iters <= 2
    assert parse_args([]).spec == CommSpec() and CommSpec().ranks == (2, 4)
    assert CommSpec().max_bytes == 64 << 20
    lesson = CommSpec.quick()
    assert lesson.max_bytes >= 4 << 20  # reaches the headline's 4 MiB
    assert lesson.warmup >= 2 and lesson.min_iters >= 5  # medians of warm calls
    changed = parse_args(["--smoke", "--max-bytes", "1K", "--methods", "mpi", "ring"]).spec
    assert changed.max_bytes == 1024 and changed.methods == ("mpi", "ring")
