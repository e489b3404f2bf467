"""Grade exercise notebooks with nbval and say, in plain words, what failed.

``python -m pcourse.grading.grade [notebooks...]`` (default: every notebook in exercises/)
re-executes each notebook with nbval, which compares every check cell's output with
the ``PASS`` lines the solution stored, and prints one row per exercise::

    exercise                  checks  first failure
    01_partitioner            3/3     -
    02_average_gradients      0/3     cell 2 (check 1/3): NotImplementedError: not solved yet ...

The notebooks run in one or a few pytest processes (``--jobs``), one kernel and one
engine cluster per notebook; nbval's results come back through JUnit XML files. The exit code is 1
when any exercise fails, so ``make grade`` fails too.
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from dataclasses import dataclass
from pathlib import Path

import nbformat

from pcourse.cluster.launch import kill_group

REPO = Path(__file__).resolve().parents[2]
CELL_TIMEOUT = 300  # seconds per cell; the checks' own deadline is shorter (checks.RUN_TIMEOUT)
NOTEBOOK_TIMEOUT = 600  # seconds per notebook, for the whole pytest run
CHECK_TAG = "check"
# Used when the repository's tests/ (and its sanitizer) is not next to the package.
FALLBACK_SANITIZE = "[memory addresses]\nregex: 0x[0-9a-fA-F]+\nreplace: 0xADDRESS\n"
ANSI = re.compile(r"(?:\x1b|#x1B)\[[0-9;]*m")  # JUnit XML writes ESC as "#x1B"
EXCEPTION = re.compile(r"^([A-Za-z_][\w.]*(?:Error|Exception|Interrupt|Exit)): ?(.*)$")


@dataclass
class Grade:
    """One exercise's result."""

    path: Path
    passed: int  # check cells that ran and printed what the solution printed
    total: int  # check cells in the notebook
    first_failure: str | None  # None when every cell passed

    @property
    def name(self) -> str:
        return self.path.stem

    @property
    def ok(self) -> bool:
        return self.first_failure is None


def _check_cells(nb: nbformat.NotebookNode) -> dict[int, tuple[int, str]]:
    """nbval's cell number (index among code cells) -> (check number, stored output)."""
    checks, k = {}, 0
    code = [c for c in nb.cells if c.cell_type == "code"]
    for i, cell in enumerate(code):
        if CHECK_TAG in cell.metadata.get("tags", []):
            k += 1
            text = "".join(o.get("text", "") for o in cell.outputs).strip()
            checks[i] = (k, text)
    return checks


def _pytest_command(notebooks: list[Path], tmp: Path, cell_timeout: float) -> list[str]:
    sanitize = REPO / "tests" / "nbval_sanitize.cfg"
    if not sanitize.exists():
        sanitize = tmp / "sanitize.cfg"
        sanitize.write_text(FALLBACK_SANITIZE)
    ini = tmp / "pytest.ini"  # our own, so the repository's addopts and testpaths stay out
    ini.write_text("[pytest]\njunit_family = xunit1\n")
    return [sys.executable, "-m", "pytest", "-c", str(ini), "--rootdir", str(tmp),
            "-p", "no:cacheprovider", "-q", "--nbval", "--nbval-current-env",
            f"--nbval-cell-timeout={cell_timeout:g}", f"--nbval-sanitize-with={sanitize}",
            f"--junitxml={tmp / 'junit.xml'}", *map(str, notebooks)]


def run_nbval(notebooks: list[Path], cell_timeout: float = CELL_TIMEOUT, jobs: int = 1) -> dict:
    """nbval's verdict on every cell: {(notebook, cell number): failure text or None}.

    ``jobs`` pytest processes share the notebooks; most of a notebook's time is spent
    waiting for its kernel and engines to start, so two run in little more than one's time.
    """
    env = dict(os.environ)
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
    groups = [notebooks[i::jobs] for i in range(max(1, min(jobs, len(notebooks))))]
    results: dict = {}
    # One deadline for all groups, since they run side by side.
    deadline = time.monotonic() + NOTEBOOK_TIMEOUT * max(len(g) for g in groups)
    with tempfile.TemporaryDirectory(prefix="pcourse-grade-") as name:
        dirs = [Path(name) / f"job{i}" for i in range(len(groups))]
        procs: list[subprocess.Popen] = []
        try:
            for group, tmp in zip(groups, dirs, strict=True):
                tmp.mkdir()
                # Own session: a timeout reaps pytest *and* its kernels and engines.
                procs.append(subprocess.Popen(
                    _pytest_command(group, tmp, cell_timeout), env=env, text=True,
                    stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True))
            for group, tmp, proc in zip(groups, dirs, procs, strict=True):
                try:
                    out, _ = proc.communicate(timeout=max(1.0, deadline - time.monotonic()))
                except subprocess.TimeoutExpired:
                    kill_group(proc, grace=30)
                    out, _ = proc.communicate()
                xml = tmp / "junit.xml"
                if not xml.exists():
                    raise RuntimeError(f"nbval did not run (exit code {proc.returncode}):\n"
                                       f"{out[-3000:]}")
                results.update(_parse_junit(ET.parse(xml), group, tmp))
        finally:
            for proc in procs:
                kill_group(proc, grace=30)
    return results


def _parse_junit(tree: ET.ElementTree, notebooks: list[Path], rootdir: Path) -> dict:
    """{(notebook, cell number): failure text, or None if the cell passed}."""
    by_file = {p.resolve(): p for p in notebooks}
    results: dict = {}
    for case in tree.iter("testcase"):
        match = re.search(r"Cell (\d+)$", case.get("name", ""))
        file = case.get("file")
        if not match or not file:
            continue
        path = by_file.get((rootdir / file).resolve())  # JUnit paths are relative to it
        problem = next((el for el in case if el.tag in ("failure", "error")), None)
        text = None
        if problem is not None:
            text = ANSI.sub("", (problem.get("message") or "") + "\n" + (problem.text or ""))
        elif any(el.tag == "skipped" for el in case):
            text = "skipped"
        results[(path, int(match.group(1)))] = text
    return results


def explain(text: str, expected: str | None) -> str:
    """A failure of one cell, in plain words."""
    if "Timeout of" in text and "exceeded" in text:
        return "the cell did not finish in time (an endless loop, or a deadlock?)"
    if "Cell outputs differ" in text:
        # pytest's diff may cut the start of the line; the verdict starts where FAIL does
        found = re.search(r"(FAIL: .*?)(?:\\n['\"]|$)", text.split("Traceback:")[-1], re.M)
        if found and expected and expected.endswith("PASS"):
            return f"expected {expected!r} but got {expected[:-4] + found.group(1)!r}"
        return "its output differs from the solution's (see nbval's report)"
    errors = [EXCEPTION.match(ln.strip()) for ln in text.splitlines()]
    errors = [m for m in errors if m]
    if errors:
        first = next((m for m in errors if m.group(1).endswith("ExerciseError")), errors[-1])
        line = f"{first.group(1).split('.')[-1]}: {first.group(2)}".strip()
        if "NotImplementedError" in line:
            return "not solved yet (NotImplementedError): fill in the cells marked YOUR CODE HERE"
        return line
    return text.strip().splitlines()[0] if text.strip() else "failed"


def grade(notebooks: list[Path], cell_timeout: float = CELL_TIMEOUT, jobs: int = 1) -> list[Grade]:
    """Run nbval on every notebook (``jobs`` pytest processes) and grade each."""
    notebooks = [Path(p) for p in notebooks]
    cells = run_nbval(notebooks, cell_timeout, jobs)
    grades = []
    for path in notebooks:
        checks = _check_cells(nbformat.read(path, as_version=4))
        mine = sorted((num, text) for (p, num), text in cells.items() if p == path)
        passed = sum(1 for num, text in mine if num in checks and text is None)
        first = next(((num, text) for num, text in mine if text is not None), None)
        failure = None
        if not mine:
            failure = "nbval collected no cells (is it a notebook?)"
        elif first:
            num, text = first
            where = f"cell {num}" + (f" (check {checks[num][0]}/{len(checks)})"
                                     if num in checks else "")
            failure = f"{where}: {explain(text, checks.get(num, (0, None))[1])}"
        grades.append(Grade(path, passed, len(checks), failure))
    return grades


def table(grades: list[Grade]) -> str:
    width = max([len("exercise")] + [len(g.name) for g in grades]) + 2
    rows = [f"{'exercise':<{width}}checks  first failure"]
    for g in grades:
        rows.append(f"{g.name:<{width}}{f'{g.passed}/{g.total}':<8}{g.first_failure or '-'}")
    ok = sum(g.ok for g in grades)
    rows.append(f"\n{ok} of {len(grades)} exercises pass.")
    return "\n".join(rows)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m pcourse.grading.grade",
                                     description="Grade exercise notebooks with nbval.")
    parser.add_argument("notebooks", nargs="*", type=Path,
                        help="notebooks to grade (default: every notebook in exercises/)")
    parser.add_argument("--cell-timeout", type=float, default=CELL_TIMEOUT,
                        help=f"seconds per cell (default {CELL_TIMEOUT})")
    parser.add_argument("-j", "--jobs", type=int, default=2,
                        help="notebooks graded at the same time (default 2)")
    args = parser.parse_args(argv)
    if args.jobs < 1:
        parser.error(f"--jobs must be at least 1, got {args.jobs}")
    notebooks = args.notebooks or sorted((REPO / "exercises").glob("*.ipynb"))
    missing = [str(p) for p in notebooks if not Path(p).is_file()]
    if missing or not notebooks:
        parser.error(f"no such notebook: {', '.join(missing)}" if missing
                     else "no notebooks to grade: exercises/ is empty (run `make exercises`)")
    grades = grade(notebooks, args.cell_timeout, args.jobs)
    print(table(grades))
    return 0 if all(g.ok for g in grades) else 1


if __name__ == "__main__":
    sys.exit(main())
