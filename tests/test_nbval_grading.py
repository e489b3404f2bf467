"""nbval grades an exercise: an unsolved one fails with the check's own words, a solved one
passes (exercises/conftest.py gives nbval the checks' lines from solutions/).

One quick exercise, twice: as shipped (the instructor's command), and solved, as a
learner's copy in an exercises folder of its own beside that conftest.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import subprocess
import sys
from pathlib import Path

import nbformat
import pytest

REPO = Path(__file__).resolve().parents[1]
_spec = importlib.util.spec_from_file_location("exercises_conftest",
                                               REPO / "exercises" / "conftest.py")
nbval_checks = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(nbval_checks)
NAME = "01_partitioner"  # the quickest exercise: its trials are plain Python on the ranks
FIRST_CHECK = "check 1/4 every rank gets n // size samples, none twice"


def _nbval(*args: str, timeout: float = 600) -> subprocess.CompletedProcess:
    """pytest --nbval in a process of its own, from the course's folder, with its settings."""
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    return subprocess.run([sys.executable, "-m", "pytest", "-c", str(REPO / "pyproject.toml"),
                           "--rootdir", str(REPO), "-p", "no:cacheprovider", "-q", *args],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout)


def test_the_check_cells_and_their_lines_come_from_the_solution():
    exercise = nbformat.read(REPO / "exercises" / f"{NAME}.ipynb", as_version=4)
    solution = nbformat.read(REPO / "solutions" / f"{NAME}.ipynb", as_version=4)
    checks = [c for c in exercise.cells if "check" in c.metadata.get("tags", [])]
    checks[0].source = "print('check 1/4 forged: PASS')"
    assert nbval_checks.give_checks(exercise, solution) is None
    theirs = [c for c in solution.cells if "check" in c.metadata.get("tags", [])]
    assert [c.source for c in checks] == [c.source for c in theirs]
    assert [c.outputs for c in checks] == [c.outputs for c in theirs]
    assert checks[0].outputs[0]["text"].startswith(f"{FIRST_CHECK}: PASS")
    exercise.cells.remove(checks[-1])
    assert "3 check cells, its solution 4" in nbval_checks.give_checks(exercise, solution)
    assert nbval_checks.solution_for(REPO / "exercises" / f"{NAME}.ipynb") == \
        REPO / "solutions" / f"{NAME}.ipynb"
    assert nbval_checks.solution_for(REPO / "solutions" / f"{NAME}.ipynb") is None
    assert nbval_checks.solution_for(REPO / "exercises" / f"{NAME}__ann.ipynb") == \
        REPO / "solutions" / f"{NAME}.ipynb"


@pytest.mark.slow
@pytest.mark.mpi
@pytest.mark.timeout(1500)
def test_nbval_fails_an_unsolved_exercise_and_passes_a_solved_one(tmp_path):
    shipped = _nbval("--nbval", f"exercises/{NAME}.ipynb")
    out = shipped.stdout + shipped.stderr
    assert shipped.returncode != 0, out
    # nbval's diff of the expected PASS line and the check's own FAIL line, with its reason
    assert "FAIL: at 2 ranks, rank 0 raised NotImplementedError: one permutation" in out, out
    assert "4 failed" in out, out  # each check, with its own line

    solved = nbformat.read(REPO / "solutions" / f"{NAME}.ipynb", as_version=4)
    for cell in solved.cells:  # a learner's copy: solved, never run
        if cell.cell_type == "code":
            cell.outputs, cell.execution_count = [], None
    folder = tmp_path / "exercises"  # solutions/ is found in the current folder, the course's
    folder.mkdir()
    shutil.copy(REPO / "exercises" / "conftest.py", folder)
    nbformat.write(solved, folder / f"{NAME}__ann.ipynb")
    run = _nbval("--nbval", str(folder / f"{NAME}__ann.ipynb"))
    assert run.returncode == 0, run.stdout + run.stderr
    assert "passed" in run.stdout and "failed" not in run.stdout, run.stdout
