"""nbval grades an exercise: this conftest gives nbval the checks' expected lines.

The exercises ship without outputs (no ``PASS`` may show before the learner writes a
line), so plain ``pytest --nbval exercises/NN_name.ipynb`` would have nothing to compare
and pass an unsolved notebook. For every notebook here named for an exercise
(``NN_name.ipynb`` or ``NN_name__anything.ipynb``, as the grader matches names), this
gives nbval what the grader takes from ``solutions/`` (pcourse.tools.grading.submission):
every check cell's source, as the course wrote it whatever the notebook says, and its
expected output, the solution's ``check i/n ...: PASS`` line. nbval then fails every check
that does not pass, showing the check's own ``FAIL`` line and why; a solved notebook
passes. A notebook with check cells added or removed fails, saying so.

From the course's folder: ``pytest --nbval exercises/03_ring_allreduce.ipynb``; a
learner's copy goes here as ``03_ring_allreduce__ann.ipynb``. The solutions are found in
``solutions/`` beside this folder, else in the current folder's. nbval runs the notebook
in the instructor's own kernel and engines; a class goes through the grader
(``python -m pcourse.tools.grading.grade --class``), which runs it apart from the course.
pyproject's testpaths leave this folder out: an unsolved exercise must fail.
"""

from __future__ import annotations

import copy
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import nbformat
import pytest
from nbval.plugin import IPyNbFile

CHECK = "check"  # the tag of a check cell (pcourse.tools.grading.exercises)


def solution_for(notebook: Path) -> Path | None:
    """The solution a notebook is an exercise of, or None (then nbval runs it as it is)."""
    from pcourse.tools.grading.grade import exercise_of, exercises

    for folder in (notebook.resolve().parent.parent / "solutions", Path.cwd() / "solutions"):
        if folder.is_dir():
            name = exercise_of(notebook, exercises(folder))
            if name is not None and (folder / f"{name}.ipynb").resolve() != notebook.resolve():
                return folder / f"{name}.ipynb"  # (a solution itself runs as it is)
    return None


def _checks(nb: nbformat.NotebookNode) -> list:
    return [c for c in nb.cells if CHECK in c.metadata.get("tags", [])]


def give_checks(nb: nbformat.NotebookNode, solution: nbformat.NotebookNode) -> str | None:
    """Put the solution's check cells' sources and outputs into ``nb``'s, in order, in place.

    Returns what is wrong when the two do not have the same number of check cells.
    """
    mine, theirs = _checks(nb), _checks(solution)
    if len(mine) != len(theirs):
        return (f"the notebook has {len(mine)} check cells, its solution {len(theirs)}: a check "
                "cell was removed, added or untagged; take the course's exercise again and "
                "change only the YOUR CODE cells")
    for cell, course in zip(mine, theirs, strict=True):
        cell.source = course.source
        cell.outputs = copy.deepcopy(course.outputs)
        cell.execution_count = course.execution_count  # nbval compares only cells that ran
    return None


class GradedNotebook(IPyNbFile):
    """nbval's notebook, with the course's check cells and their expected outputs."""

    solution: Path

    def collect(self) -> Iterator[Any]:
        cells = list(super().collect())  # nbval has read self.nb; its items hold its cells
        problem = give_checks(self.nb, nbformat.read(self.solution, as_version=4))
        if problem:
            yield Refused.from_parent(self, name="check cells", problem=problem)
            return
        yield from cells


class RefusedNotebook(Exception):
    """A notebook nbval cannot grade: its check cells are not the exercise's."""


class Refused(pytest.Item):
    """One failing item that says why the notebook is not graded."""

    def __init__(self, *, problem: str, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.problem = problem

    def runtest(self) -> None:
        raise RefusedNotebook(self.problem)

    def repr_failure(self, excinfo: Any, style: Any = None) -> str:
        return self.problem

    def reportinfo(self) -> tuple[Path, int, str]:
        return self.path, 0, f"{self.path.name}: check cells"


@pytest.hookimpl(wrapper=True)
def pytest_collect_file(file_path: Path, parent: Any) -> Any:
    """nbval's collector of an exercise, replaced by one that knows the checks' lines."""
    found = yield
    if not found or file_path.suffix != ".ipynb":
        return found
    solution = solution_for(file_path)
    if solution is None:
        return found
    out = []
    for item in found:
        if isinstance(item, IPyNbFile) and not isinstance(item, GradedNotebook):
            item = GradedNotebook.from_parent(parent, path=file_path)
            item.solution = solution
        out.append(item)
    return out
