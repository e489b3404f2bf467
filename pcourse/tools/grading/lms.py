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
every check, each test saying why. This module only writes what the grader decided
(:mod:`pcourse.tools.grading.verdicts`); ``python -m pcourse.tools.grading.gradescope`` grades one
notebook and writes its file, as Gradescope's autograder script does per submission.
"""

from __future__ import annotations

import json
from pathlib import Path

from pcourse.tools.grading import refs
from pcourse.tools.grading.verdicts import Grade
from pcourse.utils.io import atomic_write

VISIBILITIES = ("visible", "hidden", "after_due_date", "after_published")  # Gradescope's
# Folders under OUT; their "_" keeps a later `--class DIR` from taking them for learners.
RESULTS, FEEDBACK = "_gradescope", "_feedback"


def check_names(solution: Path) -> list[str]:
    """What each check of an exercise verifies (:mod:`pcourse.tools.grading.refs`)."""
    checks = refs.exercise(Path(solution).stem).CHECKS
    return [f"check {i}/{len(checks)} {c.what}" for i, c in enumerate(checks, 1)]


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


def write_class(rows: list[Grade], out: Path, solutions: Path,
                visibility: str = "visible") -> Path:
    """Every learner's results.json files and feedback file, under ``out``; returns ``out``.

    ``solutions``: the course's solutions folder (the checks' names). Written
    atomically, file by file (:func:`pcourse.utils.io.atomic_write`).
    """
    names = {g.exercise: names_or_counted(solutions / f"{g.exercise}.ipynb", g.total)
             for g in rows}
    learners: dict[str, list[Grade]] = {}
    for g in rows:
        learners.setdefault(g.learner, []).append(g)
    for learner, mine in learners.items():
        for g in mine:
            write(out / RESULTS / learner / g.exercise / "results.json",
                   json.dumps(results(g, names[g.exercise], visibility), indent=1) + "\n")
        write(out / FEEDBACK / f"{learner}.md", feedback(learner, mine, names))
    return out


def names_or_counted(solution: Path, total: int) -> list[str]:
    """The check names of an exercise; for a notebook named for none, ``total`` numbered."""
    return check_names(solution) if solution.exists() else [
        f"check {k + 1}" for k in range(total)]


def write(path: Path, text: str) -> None:
    with atomic_write(path, encoding="utf-8") as f:
        f.write(text)
