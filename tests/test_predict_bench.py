"""``python -m pcourse.tools.bench.calibrate`` and ``.predict``: the constants measured and
written, bad input refused before anything starts (and alike on every rank), and the
predictions set beside a real MPI run with every peak within 10%.
"""

from __future__ import annotations

import csv
import json
import subprocess
import sys
from pathlib import Path

import pytest

from pcourse.cost_model.machine import load


def bench(command: str, *args: str, timeout: float = 600) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", f"pcourse.tools.bench.{command}", *args],
                          capture_output=True, text=True, timeout=timeout)


@pytest.fixture(scope="module")
def calibration(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("cal") / "calibration.json"
    done = bench("calibrate", "--quick", "--ranks", "2", "--out", str(out))
    assert done.returncode == 0, done.stdout + done.stderr
    assert f"wrote {out}" in done.stdout and "mpi allreduce 2" in done.stdout, done.stdout
    return out


@pytest.mark.mpi
def test_calibrate_measures_every_constant_and_writes_them(calibration):
    machine = load(calibration)
    assert {k.rsplit(" ", 1)[0] for k in machine.links} == {
        "mpi allreduce", "mpi reduce_scatter", "mpi all_gather", "mpi send"}
    assert set(machine.slowdown) == {2} and machine.attention and machine.per_byte
    assert json.loads(calibration.read_text())["cores"] >= 1


@pytest.mark.parametrize("args, says", [
    (["calibrate", "--backends", "ucx"], "unknown backend 'ucx'"),
    (["predict", "--strategies", "zero3"], "unknown strategy 'zero3'"),
    (["predict", "--micro", "0"], "micro = 0"),
    (["predict", "--ranks", "5"], r"does not divide by 5"),
    (["predict", "--calibration", "/nonexistent/c.json"], "no calibration at"),
])
def test_bad_input_starts_nothing_and_says_why(args, says, tmp_path):
    done = bench(*args, "--out", str(tmp_path / "out"), timeout=120)
    assert done.returncode == 2, done.stdout + done.stderr
    assert says.replace("\\", "") in done.stderr or __import__("re").search(says, done.stderr)
    assert "Nothing was started" in done.stderr and not (tmp_path / "out").exists()


def test_bad_input_is_the_same_error_on_every_rank(mpi_run):
    mpi_run(3, "check_cost_model.py", expect="cost model errors agree on 3 ranks")


@pytest.mark.slow
@pytest.mark.mpi
def test_predictions_beside_a_run_and_every_peak_within_10_percent(calibration, tmp_path):
    out = tmp_path / "predict.csv"
    done = bench("predict", "--quick", "--ranks", "2", "--strategies", "ddp", "zero2", "fsdp",
                 "tp", "1f1b", "--repeats", "2", "--calibration", str(calibration),
                 "--out", str(out))
    assert done.returncode == 0, done.stdout + done.stderr
    head, _, tail = done.stdout.partition("predicted beside measured")
    assert "predicted, before anything runs" in head and tail  # predictions first
    rows = list(csv.DictReader(out.open()))
    assert len(rows) == 5 * 2
    for r in rows:  # the allocator's peak, rank by rank
        assert abs(float(r["peak_error"])) <= 0.10, r
        assert float(r["time"]) > 0 and float(r["compute"]) > 0
