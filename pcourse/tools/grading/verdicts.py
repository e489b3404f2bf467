"""What the grader decides about a notebook: a :class:`Grade`, one :class:`Check` per check.

The grader (:mod:`pcourse.tools.grading.grade`) fills these in; the exporters
(:mod:`pcourse.tools.grading.lms`: Gradescope's ``results.json``, the learner's feedback)
only read them. Both import this module and it imports neither, so the arrows run
one way: verdicts <- lms <- grade <- gradescope (the one-notebook command).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from pcourse.tools.grading import submission
from pcourse.tools.grading.runner import Executed


@dataclass(frozen=True)
class Check:
    """One check cell's result: passed, and what it printed (or why nothing)."""

    passed: bool
    output: str


@dataclass
class Grade:
    """One notebook's result (or one learner's missing notebook)."""

    path: Path | None
    exercise: str
    passed: int = 0  # check cells that printed what the solution printed
    total: int = 0  # check cells in the exercise
    first_failure: str | None = None  # None when every check passed
    status: str = "graded"  # or: missing, renamed, invalid, tampered, syntax, timeout,
    #                           crashed, error
    learner: str = ""
    notes: list[str] = field(default_factory=list)
    seconds: float = 0.0
    checks: list[Check] = field(default_factory=list)  # per check cell, if run

    @property
    def name(self) -> str:
        return self.path.stem if self.path else self.exercise

    @property
    def ok(self) -> bool:
        return self.status == "graded" and self.first_failure is None \
            and self.passed == self.total > 0


def outcomes(runnable: submission.Runnable, run: Executed) -> list[Check]:
    """One :class:`Check` per check cell, in order, from what running the notebook printed.

    Passed means what :func:`pcourse.tools.grading.grade._judge` counts: the cell raised
    nothing and printed exactly what the solution printed.
    """
    found = []
    for cell in sorted(runnable.checks):
        got = run.stdout.get(cell, "").strip()
        if cell in run.errors:
            found.append(Check(False, explain(": ".join(run.errors[cell]))))
        elif got:
            found.append(Check(run.passed(cell, runnable.checks[cell]), got))
        else:
            found.append(Check(False, "did not run: the notebook stopped before this check"
                               if run.stopped or run.first_failure is not None
                               else "printed nothing"))
    return found


def explain(text: str) -> str:
    """A failure in plain words; an unsolved exercise says so."""
    if "NotImplementedError" in text:
        return "not solved yet (NotImplementedError): fill in the cells marked YOUR CODE HERE"
    return text.strip().splitlines()[0] if text.strip() else "failed"
