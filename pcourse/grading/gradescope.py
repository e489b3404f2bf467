"""Grades a learning-management system imports: Gradescope's ``results.json``, and feedback.

Instructors grade in an LMS, not in CSV files, and the autograders they already use
(Gradescope, and otter-grader, which targets it) read one ``results.json`` per
submission: a score, and one test per check with its own score, ``max_score``,
output and visibility. So a class graded with ``--class DIR`` also gets

- ``OUT/_gradescope/<learner>/<exercise>/results.json``: one test per check cell of
  the exercise, worth one point, its output the line the check printed (``check 2/4
  ...: FAIL: at 3 ranks, rank 1: ...``) or why it printed none; the score is the
  checks passed, the same partial credit as ``grades.csv``;
- ``OUT/_feedback/<learner>.md``: the same, for the learner to read.

A notebook the grader would not run (missing, renamed, tampered with) scores 0 on
every check, each test saying why. ``python -m pcourse.grading.gradescope
SUBMISSION.ipynb --results results.json`` grades one notebook, as Gradescope's
autograder script does for each submission.

The per-check results come from :func:`outcomes`, which the grader calls when it
judges a notebook (:func:`pcourse.grading.grade._judge`).
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import nbformat

from pcourse.grading import submission
from pcourse.utils.io import atomic_write

if TYPE_CHECKING:  # grade imports this module: only the type, to avoid a cycle
    from pcourse.grading.grade import Grade
    from pcourse.grading.runner import Executed

VISIBILITIES = ("visible", "hidden", "after_due_date", "after_published")  # Gradescope's
# Folders under OUT; their "_" keeps a later `--class DIR` from taking them for learners.
RESULTS, FEEDBACK = "_gradescope", "_feedback"
_VERDICT = re.compile(r"^check (\d+)/(\d+) (.+): PASS$", re.M)


@dataclass(frozen=True)
class Check:
    """One check cell's result: passed, and what it printed (or why nothing)."""

    passed: bool
    output: str


def outcomes(runnable: submission.Runnable, run: Executed) -> list[Check]:
    """One :class:`Check` per check cell, in order, from what running the notebook printed.

    Passed means what :func:`pcourse.grading.grade._judge` counts: the cell raised
    nothing and printed exactly what the solution printed.
    """
    from pcourse.grading.grade import explain  # grade imports this module

    found = []
    for cell in sorted(runnable.checks):
        got = run.stdout.get(cell, "").strip()
        if cell in run.errors:
            found.append(Check(False, explain(": ".join(run.errors[cell]))))
        elif got:
            found.append(Check(got == runnable.checks[cell].strip(), got))
        else:
            found.append(Check(False, "did not run: the notebook stopped before this check"
                               if run.stopped else "printed nothing"))
    return found


def check_names(solution: Path) -> list[str]:
    """What each check of an exercise verifies, from the verdicts its solution printed."""
    nb = nbformat.read(solution, as_version=4)
    names = []
    for cell in (c for c in nb.cells if submission.CHECK_TAG in c.metadata.get("tags", [])):
        text = "".join(o.get("text", "") for o in cell.get("outputs", [])
                       if o.get("name") == "stdout")
        m = _VERDICT.search(text)
        names.append(f"check {m.group(1)}/{m.group(2)} {m.group(3)}" if m else
                     f"check {len(names) + 1}")
    return names


def results(g: Grade, names: list[str], visibility: str = "visible") -> dict:
    """Gradescope's ``results.json`` for one learner's exercise: one test per check."""
    if visibility not in VISIBILITIES:
        raise ValueError(f"visibility {visibility!r}: choose one of {', '.join(VISIBILITIES)}")
    voided = g.status == "tampered"  # the grader counts no check of a tampered notebook
    tests = []
    for k, name in enumerate(names):
        check = g.checks[k] if k < len(g.checks) and not voided else None
        passed = bool(check and check.passed)
        tests.append({"name": name, "number": str(k + 1), "score": float(passed),
                      "max_score": 1.0, "status": "passed" if passed else "failed",
                      "output": check.output if check else (g.first_failure or "not graded"),
                      "visibility": visibility})
    return {"score": sum(t["score"] for t in tests), "execution_time": round(g.seconds),
            "output": summary(g), "visibility": visibility, "stdout_visibility": "hidden",
            "tests": tests,
            "extra_data": {"learner": g.learner, "exercise": g.exercise, "status": g.status,
                           "checks_passed": g.passed, "checks_total": g.total}}


def summary(g: Grade) -> str:
    """One exercise's result in a sentence or two: what the learner reads first."""
    head = f"{g.exercise}: {g.passed}/{g.total} checks pass"
    if g.ok:
        text = f"{head}. Well done."
    else:
        text = f"{head}. First failure: {g.first_failure or 'a check failed'}"
    return text + (f"\nNote: {'; '.join(g.notes)}" if g.notes else "")


def feedback(learner: str, rows: list[Grade], names: dict[str, list[str]]) -> str:
    """A learner's feedback file, in Markdown: every exercise, every check, in plain words."""
    passed, total = sum(g.passed for g in rows), sum(g.total for g in rows)
    lines = [f"# Feedback for {learner}", "",
             f"{sum(g.ok for g in rows)} of {len(rows)} exercises pass; "
             f"{passed} of {total} checks.", ""]
    for g in rows:
        tests = results(g, names[g.exercise])["tests"]
        lines += [f"## {g.exercise}: {g.passed}/{g.total} checks"
                  f"{' — PASS' if g.ok else ''}", ""]
        if not g.ok:
            lines += [f"First failure: {g.first_failure or 'a check failed'}", ""]
        lines += [f"- [{'x' if t['status'] == 'passed' else ' '}] {t['name']}"
                  + ("" if t["status"] == "passed" or t["output"] == g.first_failure
                     else f"\n\n  ```\n  {t['output']}\n  ```")  # said once, above
                  for t in tests]
        lines += ([""] + [f"Note: {n}" for n in g.notes] if g.notes else []) + [""]
    return "\n".join(lines)


def write_class(rows: list[Grade], out: Path, solutions: Path | None = None,
                visibility: str = "visible") -> Path:
    """Every learner's results.json files and feedback file, under ``out``; returns ``out``.

    Written atomically, file by file (:func:`pcourse.utils.io.atomic_write`).
    """
    from pcourse.grading.grade import solutions_of  # grade imports this module

    solutions = solutions_of(solutions)
    names = {g.exercise: _names_or_counted(solutions / f"{g.exercise}.ipynb", g.total)
             for g in rows}
    learners: dict[str, list[Grade]] = {}
    for g in rows:
        learners.setdefault(g.learner, []).append(g)
    for learner, mine in learners.items():
        for g in mine:
            _write(out / RESULTS / learner / g.exercise / "results.json",
                   json.dumps(results(g, names[g.exercise], visibility), indent=1) + "\n")
        _write(out / FEEDBACK / f"{learner}.md", feedback(learner, mine, names))
    return out


def _names_or_counted(solution: Path, total: int) -> list[str]:
    """The check names of an exercise; for a notebook named for none, ``total`` numbered."""
    return check_names(solution) if solution.exists() else [
        f"check {k + 1}" for k in range(total)]


def _write(path: Path, text: str) -> None:
    with atomic_write(path, encoding="utf-8") as f:
        f.write(text)


def main(argv: list[str] | None = None) -> int:
    from pcourse.grading.grade import NOTEBOOK_TIMEOUT, grade
    from pcourse.utils.io import course_from

    parser = argparse.ArgumentParser(
        prog="python -m pcourse.grading.gradescope",
        description="Grade one submitted notebook and write Gradescope's results.json.")
    parser.add_argument("notebook", type=Path, help="the submission, named as in exercises/")
    parser.add_argument("--results", type=Path, default=Path("results.json"),
                        help="where to write it (Gradescope: /autograder/results/results.json)")
    parser.add_argument("--visibility", choices=VISIBILITIES, default="visible",
                        help="when learners see the tests (Gradescope's setting)")
    parser.add_argument("--timeout", type=float, default=NOTEBOOK_TIMEOUT,
                        help=f"seconds for the notebook (default {NOTEBOOK_TIMEOUT:g})")
    parser.add_argument("--course", type=Path, metavar="DIR",
                        help="the course's folder, with solutions/ (default: the current one)")
    args = parser.parse_args(argv)
    solutions = course_from(parser, args.course) / "solutions"
    if not args.notebook.is_file():
        parser.error(f"no such notebook: {args.notebook}")
    if args.timeout <= 0:
        parser.error(f"--timeout must be positive, got {args.timeout:g}")
    (g,) = grade([args.notebook], jobs=1, timeout=args.timeout, solutions=solutions)
    names = _names_or_counted(solutions / f"{g.exercise}.ipynb", g.total)
    _write(args.results, json.dumps(results(g, names, args.visibility), indent=1) + "\n")
    print(f"{summary(g)}\nwrote {args.results}")
    return 0 if g.status != "error" else 1


if __name__ == "__main__":
    sys.exit(main())
