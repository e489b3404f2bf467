"""What the grader decides about a notebook: a :class:`Grade`, one :class:`Check` per check.

The grader (:mod:`pcourse.tools.grading.grade`) fills these in; the exporters
(:mod:`pcourse.tools.grading.lms`: Gradescope's ``results.json``, the learner's feedback)
only read them. Both import this module and it imports neither, so the arrows run
one way: verdicts <- lms <- grade <- gradescope (the one-notebook command).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path


@dataclass(frozen=True)
class Check:
    """One check's result: passed, and its verdict line (or why it did not run)."""

    passed: bool
    output: str


@dataclass
class Grade:
    """One notebook's result (or one learner's missing notebook)."""

    path: Path | None
    exercise: str
    passed: int = 0  # checks that passed
    total: int = 0  # checks of the exercise
    first_failure: str | None = None  # None when every check passed
    status: str = "graded"  # or: missing, renamed, invalid, tampered, syntax, timeout,
    #                           crashed, error
    learner: str = ""
    notes: list[str] = field(default_factory=list)
    seconds: float = 0.0
    checks: list[Check] = field(default_factory=list)  # per check, if graded

    @property
    def name(self) -> str:
        return self.path.stem if self.path else self.exercise

    @property
    def ok(self) -> bool:
        return self.status == "graded" and self.first_failure is None \
            and self.passed == self.total > 0
