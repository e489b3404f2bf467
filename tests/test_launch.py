"""The MPI launcher: results come back from rank 0, failures and deadlines are explained."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from pcourse.cluster.launch import MPIJobError, mpirun, mpirun_rows

REPORTS = """
from mpi4py import MPI
from pcourse.cluster.launch import report_rows
comm = MPI.COMM_WORLD
print("noise that is not a row", flush=True)
sys.stderr.write("a warning on stderr, mid-line")  # shares the pipe with stdout
rows = comm.gather({"rank": comm.rank, "size": comm.size}, root=0)
if comm.rank == 0:
    report_rows(rows)
"""


def _script(tmp_path: Path, body: str) -> str:
    path = tmp_path / "job.py"
    path.write_text("import sys, time\n" + body)
    return str(path)


@pytest.mark.mpi
def test_rows_come_back_from_rank_zero_whatever_else_is_printed(tmp_path: Path) -> None:
    rows, output = mpirun_rows(3, [_script(tmp_path, REPORTS)], timeout=60)
    assert rows == [{"rank": r, "size": 3} for r in range(3)]
    assert "noise that is not a row" in output
    assert not list(tmp_path.glob(".*"))  # the rows file lives in its own temporary folder


@pytest.mark.mpi
def test_a_job_that_reports_nothing_is_an_error(tmp_path: Path) -> None:
    with pytest.raises(MPIJobError, match="reported no results") as info:
        mpirun_rows(2, [_script(tmp_path, "print('forgot to report')")], timeout=60)
    assert "forgot to report" in str(info.value)  # the output tail says what happened


@pytest.mark.mpi
def test_a_failing_rank_is_an_error_with_its_output(tmp_path: Path) -> None:
    body = "from mpi4py import MPI\nif MPI.COMM_WORLD.rank == 1: raise SystemExit('rank 1 gave up')"
    with pytest.raises(MPIJobError, match="exited with code") as info:
        mpirun(2, [_script(tmp_path, body)], timeout=60)
    assert "rank 1 gave up" in str(info.value)


@pytest.mark.mpi
def test_the_deadline_kills_a_hung_job(tmp_path: Path) -> None:
    with pytest.raises(MPIJobError, match="did not finish within 3 s"):
        mpirun(2, [_script(tmp_path, "time.sleep(600)")], timeout=3)


def test_zero_ranks_is_refused() -> None:
    with pytest.raises(ValueError, match="at least 1"):
        mpirun(0, [sys.executable])


def test_outside_mpirun_rows_the_caller_reports_itself(monkeypatch: pytest.MonkeyPatch,
                                                       tmp_path: Path) -> None:
    from pcourse.cluster.launch import ROWS_ENV, report_rows

    monkeypatch.delenv(ROWS_ENV, raising=False)
    monkeypatch.chdir(tmp_path)
    assert report_rows([{"a": 1}]) is False
    assert not list(tmp_path.iterdir())  # nothing written anywhere
