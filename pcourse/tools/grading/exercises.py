"""Generate exercises/ from solutions/: the solutions are the single source of truth.

A solution notebook marks what the learner must write, in the spirit of nbgrader::

    def shard(n, rank, size):
        ### BEGIN SOLUTION
        ### HINT: one permutation, the same on every rank ...
        ...the solution...
        ### END SOLUTION

The exercise keeps everything else and replaces each marked region by::

        # YOUR CODE HERE
        # Hint: one permutation, the same on every rank ...
        raise NotImplementedError("one permutation, the same on every rank ...")

Cells with a region are the learner's: they get the tag ``nbval-ignore-output``
(a learner's own prints are not compared). Every code cell loses its outputs and
execution count: an exercise must not show ``PASS`` under a check before the
learner has written a line. The expected outputs stay where they are needed, in
``solutions/``: the grader takes every check cell, source and output, from there
(:mod:`pcourse.tools.grading.submission`).

``python -m pcourse.tools.grading.exercises`` regenerates exercises/; ``--check`` only reports
whether the committed files are stale, as the tests do.
"""

from __future__ import annotations

import argparse
import copy
import re
import sys
import textwrap
from pathlib import Path

import nbformat

from pcourse.utils.io import atomic_write, course_from

BEGIN, END, HINT = "### BEGIN SOLUTION", "### END SOLUTION", "### HINT:"
YOUR_CODE = "# YOUR CODE HERE"
DEFAULT_HINT = "write this part, then run the check cells"
LEARNER_TAG = "nbval-ignore-output"  # a learner's own prints are not compared


class MarkerError(ValueError):
    """A solution's BEGIN/END SOLUTION markers do not pair up."""


def _regions(lines: list[str], where: str) -> list[tuple[int, int]]:
    """(begin, end) line numbers of every marked region, validated."""
    found, start = [], None
    for i, line in enumerate(lines):
        mark = line.strip()
        if mark == BEGIN:
            if start is not None:
                raise MarkerError(f"{where}, line {i + 1}: {BEGIN} inside another region")
            start = i
        elif mark == END:
            if start is None:
                raise MarkerError(f"{where}, line {i + 1}: {END} without {BEGIN}")
            found.append((start, i))
            start = None
    if start is not None:
        raise MarkerError(f"{where}, line {start + 1}: {BEGIN} never closed by {END}")
    return found


def _stub(indent: str, body: list[str]) -> list[str]:
    """What replaces a region: the hint as comments, then NotImplementedError."""
    hints = [ln.strip()[len(HINT):].strip() for ln in body if ln.strip().startswith(HINT)]
    message = " ".join(hints) if hints else DEFAULT_HINT
    return ([indent + YOUR_CODE] + [f"{indent}# Hint: {h}" for h in hints]
            + [f"{indent}raise NotImplementedError({message!r})"])


def strip_solutions(source: str, where: str = "cell") -> str:
    """The source with every marked region replaced by its stub."""
    lines = source.split("\n")
    for begin, end in reversed(_regions(lines, where)):
        blank = re.match(r"\s*", lines[begin])
        assert blank is not None  # \s* matches every string
        indent = blank.group(0)
        lines[begin:end + 1] = _stub(indent, lines[begin + 1:end])
    return "\n".join(lines)


def solution_regions(nb: nbformat.NotebookNode) -> list[str]:
    """The code inside every marked region, in notebook order, dedented, hints removed."""
    codes = []
    for i, cell in enumerate(nb.cells):
        if cell.cell_type != "code":
            continue
        lines = cell.source.split("\n")
        for begin, end in _regions(lines, f"cell {i}"):
            body = [ln for ln in lines[begin + 1:end] if not ln.strip().startswith(HINT)]
            codes.append(textwrap.dedent("\n".join(body)))
    return codes


def generate(solution: nbformat.NotebookNode, name: str = "notebook") -> nbformat.NotebookNode:
    """The exercise notebook for one solution notebook."""
    nb = copy.deepcopy(solution)
    nb.metadata.pop("pcourse", None)  # the solution's outputs stamp: an exercise has none
    for i, cell in enumerate(nb.cells):
        cell.metadata.pop("execution", None)  # timestamps: noise in every diff
        if cell.cell_type != "code":
            continue
        cell.outputs, cell.execution_count = [], None
        stripped = strip_solutions(cell.source, f"{name}, cell {i}")
        if stripped != cell.source:
            cell.source = stripped
            tags = cell.metadata.setdefault("tags", [])
            if LEARNER_TAG not in tags:
                tags.append(LEARNER_TAG)
    return nb


def _comparable(nb: nbformat.NotebookNode) -> list[tuple]:
    """What matters in an exercise: cells, sources, tags, outputs (not ids, timestamps)."""
    cells = []
    for cell in nb.cells:
        outputs = []
        for out in cell.get("outputs", []):
            out = {k: v for k, v in out.items() if k not in ("execution_count", "metadata")}
            outputs.append(repr(sorted(out.items())))
        cells.append((cell.cell_type, cell.source, tuple(cell.metadata.get("tags", [])),
                      cell.get("execution_count") is None, tuple(outputs)))
    return cells


def stale(solutions: Path, exercises: Path) -> list[str]:
    """Why exercises/ does not match what solutions/ generates; empty when in sync."""
    problems = []
    wanted = {p.name for p in solutions.glob("*.ipynb")}
    have = {p.name for p in exercises.glob("*.ipynb")}
    problems += [f"{exercises / n} is missing" for n in sorted(wanted - have)]
    problems += [f"{exercises / n} has no solution" for n in sorted(have - wanted)]
    for n in sorted(wanted & have):
        fresh = generate(nbformat.read(solutions / n, as_version=4), n)
        if _comparable(fresh) != _comparable(nbformat.read(exercises / n, as_version=4)):
            problems.append(f"{exercises / n} differs from what {solutions / n} generates")
    return problems


def write_atomic(nb: nbformat.NotebookNode, path: Path) -> None:
    with atomic_write(path, encoding="utf-8") as f:
        nbformat.write(nb, f)


def regenerate(solutions: Path, exercises: Path) -> list[Path]:
    """Write every exercise from its solution; remove exercises without one."""
    exercises.mkdir(parents=True, exist_ok=True)
    written = []
    for src in sorted(solutions.glob("*.ipynb")):
        nb = generate(nbformat.read(src, as_version=4), src.name)
        if not solution_regions(nbformat.read(src, as_version=4)):
            raise MarkerError(f"{src} has no {BEGIN} region: nothing for a learner to do")
        write_atomic(nb, exercises / src.name)
        written.append(exercises / src.name)
    for orphan in set(exercises.glob("*.ipynb")) - set(written):
        orphan.unlink()
    return written


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m pcourse.tools.grading.exercises",
                                     description="Generate exercises/ from solutions/.")
    parser.add_argument("--course", type=Path, metavar="DIR",
                        help="the course's folder (default: the current folder)")
    parser.add_argument("--solutions", type=Path, help="default: the course's solutions/")
    parser.add_argument("--exercises", type=Path, help="default: the course's exercises/")
    parser.add_argument("--check", action="store_true",
                        help="write nothing; exit 1 if exercises/ is stale")
    args = parser.parse_args(argv)
    if args.solutions is None or args.exercises is None:
        course = course_from(parser, args.course)
        args.solutions = args.solutions or course / "solutions"
        args.exercises = args.exercises or course / "exercises"
    if args.check:
        problems = stale(args.solutions, args.exercises)
        for p in problems:
            print(p)
        print("exercises are stale: run `make exercises`" if problems else "exercises up to date")
        return 1 if problems else 0
    for path in regenerate(args.solutions, args.exercises):
        print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
