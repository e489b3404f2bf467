"""Grade exercise notebooks, or a whole class, and say in plain words what failed.

``python -m pcourse.tools.grading.grade [notebooks...]`` grades the given notebooks (default:
every notebook in exercises/) and prints one row per notebook::

    exercise                  checks  first failure
    01_partitioner            4/4     -
    02_average_gradients      0/4     check 1/4: not solved yet (NotImplementedError) ...

``python -m pcourse.tools.grading.grade --class DIR`` grades ``DIR/<learner>/<exercise>.ipynb``
for every learner (a folder of DIR) and every exercise (a notebook of solutions/):
one row per learner and exercise, a total per learner, and two CSV files, written
atomically: ``grades.csv`` (one row per learner and exercise, with the reason) and
``gradebook.csv`` (one row per learner: checks passed per exercise, and totals).
While it grades, every row is appended to ``grades.partial.csv`` as soon as it is
decided, so a grader that dies halfway loses no finished row.

A notebook is never trusted (:mod:`pcourse.tools.grading.submission`): only the learner's
cells are read from the file, and the checks are the course's own
(:mod:`pcourse.tools.grading.refs`). A file that is not a notebook, is missing or renamed,
whose cells were moved or whose code reaches for the checks gets a row saying so and is
not run; so does a file that is not a regular file, is a link, or is too large
(:func:`submission.load`). The rest are graded on a few workers, each learner on a job
of their own (:mod:`pcourse.tools.grading.runner`), with a time limit per notebook; a
notebook that hangs or kills a process gets a row saying so, and the others are graded
all the same. The learner's code runs in learner processes only, in the jail of
:mod:`pcourse.tools.grading.sandbox`: as nobody, in namespaces of its own, it cannot
signal the grader or another learner's processes, nor read or write anything of theirs.
``--class`` refuses to grade without that jail; a single notebook is graded without it
where there is none (a learner's own machine, Gradescope's container), and its row says so.

A notebook's file name says which exercise it is, in both modes alike
(:func:`exercise_of`): ``02_average_gradients.ipynb``, or
``02_average_gradients__anything.ipynb``. A notebook named for no exercise whose
title is an exercise's gets a row saying it was renamed. Arguments, ``--out``
included, are checked before anything is graded.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import time
from collections.abc import Callable
from pathlib import Path

import nbformat

from pcourse.tools.grading import lms, refs, submission
from pcourse.tools.grading.runner import Result, Task, run_batches
from pcourse.tools.grading.verdicts import Check, Grade
from pcourse.utils.io import (
    NotWritable,
    check_writable,
    course_folder,
    course_from,
    save,
    write_csv,
)

NOTEBOOK_TIMEOUT = 240.0  # seconds per notebook; a setting, not a measure
JOBS = max(1, (os.cpu_count() or 2) // 2)  # workers: one per two cores (4 ranks, 4 learners)


# ---------------------------------------------------------------- which exercise, which file

def solutions_of(solutions: Path | None = None) -> Path:
    """``solutions``, else the course folder's (:func:`pcourse.utils.io.course_folder`)."""
    return Path(solutions) if solutions is not None else course_folder() / "solutions"


def exercises(solutions: Path | None = None) -> dict[str, Path]:
    return {p.stem: p for p in sorted(solutions_of(solutions).glob("*.ipynb"))}


def exercise_of(path: Path, known: dict[str, Path]) -> str | None:
    """The exercise a file name names: ``NAME.ipynb`` or ``NAME__anything.ipynb``."""
    stem = Path(path).stem
    return stem if stem in known else (stem.split("__")[0] if stem.split("__")[0] in known
                                      else None)


def looks_like(path: Path, known: dict[str, Path]) -> str | None:
    """The exercise whose title a notebook has: what a renamed copy still shows."""
    title = _title(path)
    return next((name for name, solution in known.items()
                 if title is not None and _title(solution) == title), None)


def find_submission(name: str, files: list[Path], known: dict[str, Path]
                    ) -> tuple[Path | None, str, str]:
    """Which of a learner's ``files`` is exercise ``name``.

    ``(path, "", note)`` when one is: ``NAME.ipynb`` first, else the one
    ``NAME__anything.ipynb`` (the note names versions left ungraded). Otherwise
    ``(None, status, reason)``: several versions and none plain, a renamed copy
    (found by its title), or missing.
    """
    named = [f for f in files if exercise_of(f, known) == name]
    plain = [f for f in named if f.stem == name]
    if plain or len(named) == 1:
        chosen = (plain or named)[0]
        others = [f.name for f in named if f != chosen]
        return chosen, "", (f"graded {chosen.name}, not {', '.join(others)}" if others else "")
    if named:
        return None, "invalid", (f"several versions ({', '.join(f.name for f in named)}) and "
                                 f"none named {name}.ipynb: keep one, or name it so")
    unnamed = [f for f in files if exercise_of(f, known) is None]
    renamed = [f for f in unnamed if looks_like(f, known) == name]
    if renamed:
        return None, "renamed", _renamed(renamed[0], name)
    there = f" (other notebooks there: {', '.join(f.name for f in unnamed)})" if unnamed else ""
    return None, "missing", f"missing: no {name}.ipynb{there}"


def _renamed(path: Path, name: str) -> str:
    return (f"renamed: {path.name} looks like {name}.ipynb; the grader reads only files "
            f"named as in exercises/ ({name}.ipynb, or {name}__anything.ipynb)")


def _checks(solution: Path) -> int:
    """How many checks an exercise has."""
    return len(refs.exercise(Path(solution).stem).CHECKS)


def _title(path: Path) -> str | None:
    """The first line of a notebook's first markdown cell (None if unreadable)."""
    try:
        cells = json.loads(submission.load(path).decode("utf-8")).get("cells", [])
        first = next(c for c in cells if c.get("cell_type") == "markdown")
        source = "".join(first["source"]) if isinstance(first["source"], list) else first["source"]
        return source.strip().splitlines()[0]
    except (Exception, RecursionError):  # noqa: BLE001 - an unreadable file has no title
        return None


# ---------------------------------------------------------------- grading

class NoJail(RuntimeError):
    """A class cannot be graded here: there is no jail for the learners' code."""


def grade(notebooks: list[Path], jobs: int = JOBS, timeout: float = NOTEBOOK_TIMEOUT,
          solutions: Path | None = None, learners: list[str] | None = None,
          progress: Callable[[Grade], None] | None = None, trusted: bool = False,
          first_failure_only: bool = False, jailed: bool | None = None) -> list[Grade]:
    """Grade every notebook; one Grade each, in order.

    ``learners`` (one name per notebook) labels the rows of a class, and says whose
    code is whose: each learner's notebooks are graded on a job of their own (without
    ``learners``, each folder's). ``trusted=True`` grades the notebooks in ``jobs``
    batches, several learners on one job: only for notebooks whose code is trusted (the
    test suite's own wrong answers), never a learner's. ``first_failure_only=True`` stops
    each notebook at its first failing check (the suite's wrong answers need no more):
    the checks after it do not run, and the row says so. ``jailed``: in the jail of
    :mod:`pcourse.tools.grading.sandbox` (by default, where there is one; the rows of a
    notebook graded without it say so).
    ``progress(grade)`` hears of every row as soon as it is decided.
    """
    progress = _made_safe(progress or (lambda g: None))
    solutions = solutions_of(solutions)
    known = exercises(solutions)
    jailed = _jail_here() if jailed is None else jailed
    grades: list[Grade] = []
    batches: dict[int | str, list[Task]] = {}  # owner: a job's index, or a learner
    for k, path in enumerate(map(Path, notebooks)):
        name = exercise_of(path, known)
        g = Grade(path, name or submission.safe_text(path.stem),
                  learner=learners[k] if learners else "")
        grades.append(g)
        if name is None:
            like = looks_like(path, known)
            g.status = "renamed" if like else "invalid"
            g.first_failure = _renamed(path, like) if like else (
                f"no exercise is named {submission.safe_text(path.stem)!r}: name the file as "
                "in exercises/")
            g.total = _checks(known[like]) if like else 0
            progress(g)
            continue
        g.total = _checks(known[name])
        try:
            data = submission.load(path)
            code = submission.learner_code(submission.parse(data),
                                           nbformat.read(known[name], as_version=4), name)
        except submission.Rejected as exc:
            g.status, g.first_failure = exc.kind, exc.reason
            g.notes = _copied(path, known[name])
            progress(g)
            continue
        except Exception as exc:  # noqa: BLE001 - whatever a file does, it is its own row
            g.status = "invalid"
            g.first_failure = f"the grader could not read it: {type(exc).__name__}: {exc}"[:300]
            progress(g)
            continue
        g.notes = code.notes + _copied(path, known[name], data) + (
            [] if jailed else isolation_notes())
        owner = (k % max(1, jobs) if trusted else
                 learners[k] if learners else str(path.parent.resolve()))
        batches.setdefault(owner, []).append(Task(k, name, code.codes, timeout,
                                                  first_failure_only))

    def judged(k: int, result: Result) -> None:
        _judge(grades[k], result)
        progress(grades[k])

    run_batches(list(batches.values()), jobs, jailed, judged)
    return grades


def _jail_here() -> bool:
    from pcourse.tools.grading import sandbox

    return sandbox.available()[0]


def _judge(g: Grade, result: Result) -> None:
    """Fill in a Grade from what grading its exercise gave."""
    g.status, g.passed, g.seconds = result.status, result.passed, result.seconds
    g.first_failure = result.first_failure
    g.checks = [Check(passed, output) for passed, output in result.checks]
    if result.stopped_early:
        g.notes.append(FIRST_FAILURE_ONLY)


def _made_safe(progress: Callable[[Grade], None]) -> Callable[[Grade], None]:
    """``progress``, given each row with the text a learner's file names put in it made
    writable anywhere (:func:`submission.safe_text`): a CSV, a JSON file, a terminal."""
    def decided(g: Grade) -> None:
        g.first_failure = submission.safe_text(g.first_failure or "") or g.first_failure
        g.notes = [submission.safe_text(n) for n in g.notes]
        progress(g)

    return decided


def _copied(path: Path, solution: Path, data: bytes | None = None) -> list[str]:
    """A note when a submission is the course's solution: a link to it, or the same bytes."""
    try:
        if Path(path).is_symlink() and Path(path).resolve() == Path(solution).resolve():
            return ["a symbolic link to the course's own solution"]
        if data is not None and data == Path(solution).read_bytes():
            return ["byte for byte the course's own solution file"]
    except OSError:
        pass
    return []


def isolation_notes() -> list[str]:
    """What every row graded without the jail of :mod:`pcourse.tools.grading.sandbox` says."""
    from pcourse.tools.grading import sandbox

    jailed, why = sandbox.available()
    if jailed:
        return []
    return [f"not sandboxed: {why}; the learner's code ran as this user, in processes of its "
            "own behind the ranks that count its MPI calls, but with this user's files, "
            "processes and network within its reach"]


FIRST_FAILURE_ONLY = "graded to its first failure only: the checks after it did not run"


# ---------------------------------------------------------------- a class

def learners_of(folder: Path, out: Path | None = None) -> list[Path]:
    """The learners' folders of a class, in name order.

    Real folders only (not links), not hidden or ``_``-named (the grader's own), and
    not ``out``, the folder the grader writes to, known by its path: a file a learner
    puts in their folder (a ``grades.csv``) changes nothing.
    """
    out = Path(out).resolve() if out is not None else None
    return sorted(p for p in Path(folder).iterdir()
                  if p.is_dir() and not p.is_symlink() and not p.name.startswith((".", "_"))
                  and p.resolve() != out)


def notebooks_of(learner: Path) -> list[Path]:
    """Every entry of a learner's folder named ``*.ipynb``, whatever it is (read later)."""
    try:
        return sorted(Path(e.path) for e in os.scandir(learner) if e.name.endswith(".ipynb"))
    except OSError:
        return []


def grade_class(folder: Path, jobs: int = JOBS, timeout: float = NOTEBOOK_TIMEOUT,
                solutions: Path | None = None,
                progress: Callable[[Grade], None] | None = None,
                out: Path | None = None) -> list[Grade]:
    """One Grade per learner (a sub-folder) and exercise, learners in name order.

    ``progress(grade)`` hears of every row as soon as it is decided (:class:`RowLog`).
    ``out`` is the folder the grader writes to, when it is a sub-folder of the class.
    """
    from pcourse.tools.grading import sandbox

    jailed, why = sandbox.available()
    if not jailed:
        raise NoJail(f"a class is graded only in the jail, and there is none here: {why}. "
                     "(A single notebook is graded without it, its row saying so.)")
    progress = _made_safe(progress or (lambda g: None))
    solutions = solutions_of(solutions)
    known = exercises(solutions)
    learners = learners_of(folder, out)
    rows: list[Grade] = []
    present: list[tuple[int, Path, str]] = []  # row, file, note
    for learner in learners:
        files = notebooks_of(learner)
        who = submission.safe_text(learner.name)
        for name in known:
            path, status, text = find_submission(name, files, known)
            rows.append(Grade(path or learner / f"{name}.ipynb", name, learner=who,
                              total=_checks(known[name])))
            if path is None:
                rows[-1].status, rows[-1].first_failure = status, text
                progress(rows[-1])
            else:
                present.append((len(rows) - 1, path, text))
    notes = {(rows[k].learner, str(path)): note for k, path, note in present}

    def noted(g: Grade) -> None:
        note = notes.get((g.learner, str(g.path)))
        g.notes[:0] = [note] if note else []
        progress(g)

    paths = [p for _, p, _ in present]
    graded = grade(paths, jobs, timeout, solutions,
                   learners=[rows[k].learner for k, _, _ in present], progress=noted,
                   jailed=True)
    for (k, _, _), g in zip(present, graded, strict=True):
        rows[k] = g
    return rows


GRADE_FIELDS = ["learner", "exercise", "status", "checks_passed", "checks_total", "passed",
                "first_failure", "notes", "seconds"]


def _row(g: Grade) -> dict:
    """A row of grades.csv (file names a learner chose made writable: :func:`safe_text`)."""
    safe = submission.safe_text
    return {"learner": safe(g.learner), "exercise": g.exercise, "status": g.status,
            "checks_passed": g.passed, "checks_total": g.total, "passed": int(g.ok),
            "first_failure": safe(g.first_failure or ""), "notes": safe("; ".join(g.notes)),
            "seconds": f"{g.seconds:.1f}"}


class RowLog:
    """``grades.partial.csv``: every row appended, and on disk, as soon as it is decided.

    A grader that dies halfway (killed, out of memory, the machine down) leaves the
    rows it finished there; a run that ends writes grades.csv and removes it.
    """

    def __init__(self, path: Path) -> None:
        import csv

        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        # open until done(): every row is appended and synced as it comes
        self.file = open(self.path, "w", newline="", encoding="utf-8")  # noqa: SIM115
        self.writer = csv.DictWriter(self.file, GRADE_FIELDS)
        self.writer.writeheader()
        self._sync()

    def __call__(self, g: Grade) -> None:
        self.writer.writerow(_row(g))
        self._sync()

    def _sync(self) -> None:
        self.file.flush()
        os.fsync(self.file.fileno())

    def done(self) -> None:
        self.file.close()
        self.path.unlink(missing_ok=True)


def write_gradebook(rows: list[Grade], out: Path) -> tuple[Path, Path]:
    """grades.csv (learner x exercise, with reasons) and gradebook.csv (per learner).

    Written atomically; if ``out`` fails after all (full disk), into a temporary
    folder instead, said on the terminal: a class's grading is never lost.
    """
    long = save(out / "grades.csv", lambda path: write_csv(path, [_row(g) for g in rows],
                                                           GRADE_FIELDS))
    names = list(dict.fromkeys(g.exercise for g in rows))
    book = []
    for learner, mine in _by_learner(rows).items():
        row = {"learner": learner, **{g.exercise: g.passed for g in mine}}
        row.update(_totals(mine))
        book.append(row)
    wide = save(out / "gradebook.csv", lambda path: write_csv(
        path, book, ["learner", *names, "exercises_passed", "checks_passed", "checks_total"]))
    return long, wide


def _by_learner(rows: list[Grade]) -> dict[str, list[Grade]]:
    found: dict[str, list[Grade]] = {}
    for g in rows:
        found.setdefault(g.learner, []).append(g)
    return found


def _totals(rows: list[Grade]) -> dict[str, int]:
    return {"exercises_passed": sum(g.ok for g in rows),
            "checks_passed": sum(g.passed for g in rows),
            "checks_total": sum(g.total for g in rows)}


# ---------------------------------------------------------------- tables

def table(grades: list[Grade]) -> str:
    """One row per notebook (and per learner, with a total, for a class)."""
    learners = any(g.learner for g in grades)
    width = max([len("exercise")] + [len(g.name) for g in grades]) + 2
    lwidth = max([len("learner")] + [len(g.learner) for g in grades]) + 2
    head = (f"{'learner':<{lwidth}}" if learners else "") + f"{'exercise':<{width}}checks  result"
    rows = [head]
    for learner, mine in (_by_learner(grades).items() if learners else [("", grades)]):
        for g in mine:
            result = "PASS" if g.ok else g.first_failure or "FAIL"
            note = f"  [{'; '.join(g.notes)}]" if g.notes else ""
            rows.append(submission.safe_text((f"{learner:<{lwidth}}" if learners else "")
                        + f"{g.name:<{width}}{f'{g.passed}/{g.total}':<8}{result}{note}"))
        if learners:
            t = _totals(mine)
            rows.append(f"{learner:<{lwidth}}{'TOTAL':<{width}}"
                        f"{t['checks_passed']}/{t['checks_total']:<5} "
                        f"{t['exercises_passed']} of {len(mine)} exercises pass")
    if not learners:
        rows.append(f"\n{sum(g.ok for g in grades)} of {len(grades)} exercises pass.")
    return "\n".join(rows)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m pcourse.tools.grading.grade",
                                     description="Grade exercise notebooks, or a whole class.")
    parser.add_argument("notebooks", nargs="*", type=Path,
                        help="notebooks to grade (default: every notebook in exercises/)")
    parser.add_argument("--class", dest="folder", type=Path, metavar="DIR",
                        help="grade DIR/<learner>/<exercise>.ipynb for every learner")
    parser.add_argument("--out", type=Path, metavar="DIR",
                        help="where --class writes grades.csv and gradebook.csv (default: DIR)")
    parser.add_argument("--timeout", type=float, default=NOTEBOOK_TIMEOUT,
                        help=f"seconds per notebook (default {NOTEBOOK_TIMEOUT:g})")
    parser.add_argument("--course", type=Path, metavar="DIR",
                        help="the course's folder, with solutions/ and exercises/ "
                             "(default: the current folder)")
    parser.add_argument("-j", "--jobs", type=int, default=JOBS,
                        help="notebooks graded at the same time, each worker with its own "
                             f"job (default {JOBS}: one per two cores)")
    args = parser.parse_args(argv)
    if args.jobs < 1:
        parser.error(f"--jobs must be at least 1, got {args.jobs}")
    if args.timeout <= 0:
        parser.error(f"--timeout must be positive, got {args.timeout:g}")
    course = course_from(parser, args.course)
    solutions = course / "solutions"
    # SIGTERM (a CI job cancelled, a terminal closed) cleans up like Ctrl-C does.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    start = time.monotonic()
    if args.folder is not None:
        if args.notebooks:
            parser.error("give either notebooks or --class DIR, not both")
        if not args.folder.is_dir():
            parser.error(f"--class {args.folder}: no such folder")
        try:  # before the grading, which can take a while: never lose it to a typo
            check_writable(args.out or args.folder)
        except NotWritable as exc:
            parser.error(f"--out: {exc}. Nothing was graded.")
        if not _jail_here():
            from pcourse.tools.grading import sandbox

            parser.error(f"--class grades only in the jail, and there is none here: "
                         f"{sandbox.available()[1]}. Nothing was graded.")
        log = RowLog((args.out or args.folder) / "grades.partial.csv")
        rows = grade_class(args.folder, args.jobs, args.timeout, solutions, progress=log,
                           out=args.out)
        if not rows:
            log.done()
            parser.error(f"--class {args.folder}: no learner folders in it")
        print(table(rows))
        long, wide = write_gradebook(rows, args.out or args.folder)
        lms_out = lms.write_class(rows, args.out or args.folder, solutions)
        log.done()
        print(f"\n{len(rows)} notebooks graded in {time.monotonic() - start:.0f} s; "
              f"wrote {long} and {wide}; Gradescope results and feedback under {lms_out}")
        return 1 if any(g.status == "error" for g in rows) else 0
    notebooks = args.notebooks or sorted((course / "exercises").glob("*.ipynb"))
    missing = [str(p) for p in notebooks if not Path(p).is_file()]
    if missing or not notebooks:
        parser.error(f"no such notebook: {', '.join(missing)}" if missing
                     else "no notebooks to grade: exercises/ is empty (run `make exercises`)")
    grades = grade(notebooks, args.jobs, args.timeout, solutions)
    print(table(grades))
    return 0 if all(g.ok for g in grades) else 1


if __name__ == "__main__":
    sys.exit(main())
