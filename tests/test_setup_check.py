"""The setup check, as an instructor's participants run it from a terminal."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from pcourse.backends import BACKENDS, backend_status
from pcourse.checks import setup_check

REPO = Path(__file__).resolve().parents[1]


def test_backend_table_names_every_backend_with_a_reason():
    rows = backend_status()
    assert [r.name for r in rows] == list(BACKENDS)
    for row in rows:
        assert row.reason, f"{row.name}: no reason given"
    by_name = {r.name: r for r in rows}
    assert by_name["mpi"].usable and by_name["gloo"].usable


def test_verdict_needs_mpi_and_gloo(capsys):
    assert setup_check.print_verdict({"mpi": "OK", "gloo": "OK", "nccl": "FAILED: x"})
    assert capsys.readouterr().out.strip() == "READY"
    assert not setup_check.print_verdict({"mpi": "OK", "gloo": "FAILED: boom"})
    assert "NOT READY" in capsys.readouterr().out


@pytest.mark.slow
@pytest.mark.mpi
def test_command_line_check_is_ready_here():
    result = subprocess.run([sys.executable, "-m", "pcourse.checks.setup_check", "-n", "2"],
                            capture_output=True, text=True, timeout=300)
    out = result.stdout
    assert result.returncode == 0, out + result.stderr
    assert out.strip().splitlines()[-1] == "READY"
    assert "allreduce over mpi         OK" in out and "allreduce over gloo        OK" in out


@pytest.mark.slow
@pytest.mark.mpi
def test_setup_notebook_passes_under_nbval_again():
    """The suite runs notebooks/ through nbval once; this is the second run in a row, so a
    first run that left state behind (a cluster, a file, a port) would fail here or there."""
    result = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
         "notebooks/00_setup_check.ipynb"],
        cwd=REPO, capture_output=True, text=True, timeout=600,
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-2000:]
    assert " passed" in result.stdout and "failed" not in result.stdout
