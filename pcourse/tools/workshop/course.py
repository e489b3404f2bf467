"""The lesson registry: the course's lessons and exercises, in order, and the facts that
hold course-wide.

One list, ``course.toml`` in the course's folder, says which lessons there are, in what
order, what each teaches (the one line README's and the index's tables show), which
package modules it teaches, and which lesson each exercise practises. Everything else
that lists the lessons is generated from it (README's course table, the index,
INSTRUCTORS.md's tables: :mod:`pcourse.tools.workshop.render`; the website's order:
:mod:`pcourse.tools.book.build`) or checked against it (the package's docstring, the lessons'
"Next:" lines and which lesson is the last: ``tests/test_registry.py``). A new lesson is
one ``[[lesson]]`` entry and its files (CONTRIBUTING.md, "Adding a lesson or an
exercise").

Why a TOML file in the course's folder, read here, rather than:

- **a list in this module**: the tools read the course from a folder (the current one,
  or ``--course DIR``), never from where pcourse is installed, so a non-editable
  install works and a test can build a small course of its own; a registry inside the
  package would describe some other folder's lessons. The file sits beside the
  notebooks it lists and changes in the same commit;
- **notebook metadata**: that would scatter the list over nineteen JSON files, out of
  sight in JupyterLab and in a diff, where nothing can see the whole (the order, a
  number used twice, an exercise after a lesson that does not exist); and exercises are
  generated from solutions, so an exercise's metadata would be a copy.

What the file does not hold, because it is written once elsewhere: a notebook's title
(its ``# NN · Title`` heading), its number (its file name's ``NN_``), and how many
engines it starts (its own code: :func:`pcourse.tools.workshop.render.engines_started`).
:func:`load` refuses a registry that disagrees with the folders, so a lesson cannot be
added, renamed or removed without it.
"""

from __future__ import annotations

import argparse
import re
import tomllib
from dataclasses import dataclass
from pathlib import Path

import nbformat

from pcourse.utils.io import course_folder

FOLDERS = ("notebooks", "exercises", "solutions")
REGISTRY = "course.toml"  # in the course's folder
_KEYS = {"lesson": {"notebook", "teaches", "modules"}, "exercise": {"notebook", "after"}}
_FOLDER_OF = {"lesson": "notebooks", "exercise": "exercises"}
_NAME = re.compile(r"^(\d\d)_\w+\.ipynb$")
# Seconds one cell may run when a tool executes a notebook: full mode trains for many
# minutes in one cell.
CELL_TIMEOUT = 3600


def add_execution_options(parser: argparse.ArgumentParser) -> None:
    """``--cell-timeout`` and ``--course``: what every tool that executes the course's
    notebooks (timings, outputs) takes, with the same names and defaults."""
    parser.add_argument("--cell-timeout", type=float, default=CELL_TIMEOUT, metavar="S")
    parser.add_argument("--course", "--root", dest="root", type=Path, metavar="DIR",
                        help="the course's folder (default: the current folder)")


class RegistryError(ValueError):
    """``course.toml`` is malformed, or disagrees with the course's folders."""


class _Notebook:
    """What a registry entry's file name says: its number (``NN_``) and its name."""

    path: Path

    @property
    def number(self) -> str:
        return self.path.name[:2]

    @property
    def name(self) -> str:
        return self.path.stem


@dataclass(frozen=True)
class Lesson(_Notebook):
    """One lesson of the registry."""

    path: Path  # relative to the course root: notebooks/05_franke.ipynb
    teaches: str  # what you learn, in one line
    modules: tuple[str, ...]  # the package modules it teaches: "loop", "backends"


@dataclass(frozen=True)
class Exercise(_Notebook):
    """One exercise of the registry; its solution has the same name in ``solutions/``."""

    path: Path  # exercises/03_ring_allreduce.ipynb
    after: str  # the number of the lesson it practises

    @property
    def solution(self) -> Path:
        return Path("solutions") / self.path.name


@dataclass(frozen=True)
class Course:
    """The registry, read and checked against the folders (:func:`load`)."""

    root: Path
    lessons: tuple[Lesson, ...]
    exercises: tuple[Exercise, ...]

    def lesson(self, number: str) -> Lesson:
        for lesson in self.lessons:
            if lesson.number == number:
                return lesson
        raise KeyError(f"no lesson {number!r}; the lessons are "
                       f"{', '.join(x.number for x in self.lessons)}")

    @property
    def last(self) -> Lesson:
        """The last lesson: the only one that may say so, and the only one with no "Next:"."""
        return self.lessons[-1]

    def next(self, lesson: Lesson) -> Lesson | None:
        """The lesson after ``lesson``; None after the last."""
        i = self.lessons.index(lesson)
        return self.lessons[i + 1] if i + 1 < len(self.lessons) else None

    def practising(self, number: str) -> list[Exercise]:
        """The exercises done after lesson ``number``, in their order."""
        return [e for e in self.exercises if e.after == number]

    def after(self, name: str) -> str | None:
        """The lesson an exercise (by name: ``03_ring_allreduce``) practises; None if unknown."""
        return next((e.after for e in self.exercises if e.name == name), None)


@dataclass(frozen=True)
class Entry:
    """One notebook of the course, with its title."""

    path: Path  # relative to the course root
    number: str  # "05"
    title: str  # the notebook's first heading, without its number: "Franke"

    @property
    def name(self) -> str:
        return self.path.stem

    @property
    def folder(self) -> str:
        return self.path.parent.name


def title(path: Path) -> str:
    """The first ``# `` heading of a notebook, without its ``NN ·`` prefix."""
    nb = nbformat.read(path, as_version=4)
    for cell in nb.cells:
        if cell.cell_type == "markdown":
            m = re.search(r"^# +(.+)$", cell.source, re.M)
            if m:
                return re.sub(r"^\d+\s*·\s*", "", m.group(1)).strip()
    return path.stem


def load(root: Path | None = None) -> Course:
    """The registry of the course in ``root`` (default:
    :func:`~pcourse.utils.io.course_folder`), checked: well formed, in order, and naming
    exactly the notebooks the folders hold. Raises :class:`RegistryError` saying what
    disagrees and what to do."""
    root = course_folder(root)
    path = root / REGISTRY
    if not path.is_file():
        raise RegistryError(f"{root} has no {REGISTRY}, the list of its lessons and exercises "
                            "(CONTRIBUTING.md, 'Adding a lesson or an exercise')")
    try:
        data = tomllib.loads(path.read_text(encoding="utf-8"))
    except tomllib.TOMLDecodeError as exc:
        raise RegistryError(f"{path} is not valid TOML: {exc}") from exc
    unknown = set(data) - set(_KEYS)
    if unknown:
        raise RegistryError(f"{path}: unknown tables {sorted(unknown)}; it holds only "
                            "[[lesson]] and [[exercise]] entries")
    lessons = tuple(_lesson(path, i, raw) for i, raw in enumerate(data.get("lesson", []), 1))
    exercises = tuple(_exercise(path, i, raw)
                      for i, raw in enumerate(data.get("exercise", []), 1))
    course = Course(root, lessons, exercises)
    _check_order(path, "lesson", [x.number for x in lessons])
    _check_order(path, "exercise", [x.number for x in exercises])
    numbers = {x.number for x in lessons}
    for x in exercises:
        if x.after not in numbers:
            raise RegistryError(f"{path}: exercise {x.name} is after lesson {x.after!r}, "
                                f"which is not a lesson; the lessons are {sorted(numbers)}")
    _check_folders(course)
    return course


def _fields(path: Path, kind: str, i: int, raw: dict) -> str:
    """The entry's notebook, after checking its keys and its file name."""
    where = f"{path}: {kind} entry {i}"
    missing, extra = _KEYS[kind] - set(raw), set(raw) - _KEYS[kind]
    if missing or extra:
        said = [f"{what} {sorted(keys)}" for what, keys in (("missing", missing),
                                                              ("unknown", extra)) if keys]
        raise RegistryError(f"{where}: {', '.join(said)}; each {kind} entry has exactly "
                            f"{sorted(_KEYS[kind])}")
    notebook = raw["notebook"]
    folder = _FOLDER_OF[kind]
    if not isinstance(notebook, str) or Path(notebook).parent != Path(folder) \
            or not _NAME.match(Path(notebook).name):
        raise RegistryError(f"{where}: notebook = {notebook!r}; each {kind}'s is "
                            f"'{folder}/NN_name.ipynb', NN its two-digit number")
    return notebook


def _lesson(path: Path, i: int, raw: dict) -> Lesson:
    notebook = _fields(path, "lesson", i, raw)
    teaches, modules = raw["teaches"], raw["modules"]
    if not isinstance(teaches, str) or not teaches.strip() or "|" in teaches \
            or "\n" in teaches:
        raise RegistryError(f"{path}: lesson {notebook}: teaches = {teaches!r}; say what it "
                            "teaches in one line, without '|' (it goes in a table)")
    if not isinstance(modules, list) or not all(isinstance(m, str) for m in modules):
        raise RegistryError(f"{path}: lesson {notebook}: modules = {modules!r}; a list of "
                            "module names, as pcourse's docstring lists them: [\"loop\"]")
    return Lesson(Path(notebook), teaches.strip(), tuple(modules))


def _exercise(path: Path, i: int, raw: dict) -> Exercise:
    notebook = _fields(path, "exercise", i, raw)
    after = raw["after"]
    if not isinstance(after, str) or not re.fullmatch(r"\d\d", after):
        raise RegistryError(f"{path}: exercise {notebook}: after = {after!r}; the number of "
                            "the lesson it practises, as a string: \"05\"")
    return Exercise(Path(notebook), after)


def _check_order(path: Path, kind: str, numbers: list[str]) -> None:
    for before, now in zip(numbers, numbers[1:], strict=False):
        if now <= before:
            raise RegistryError(f"{path}: {kind} {now} comes after {kind} {before}; list the "
                                f"{kind}s in the order of their numbers, each number once")


def _check_folders(course: Course) -> None:
    """The registry names exactly the notebooks of the folders, and each exists."""
    registered = {"notebooks": {x.path.name for x in course.lessons},
                  "exercises": {x.path.name for x in course.exercises},
                  "solutions": {x.path.name for x in course.exercises}}
    for folder, names in registered.items():
        found = {p.name for p in (course.root / folder).glob("[0-9][0-9]_*.ipynb")}
        if found - names:
            kind = "lesson" if folder == "notebooks" else "exercise"
            raise RegistryError(f"{folder}/ holds {sorted(found - names)}, which {REGISTRY} "
                                f"does not list: add a [[{kind}]] entry for each "
                                "(CONTRIBUTING.md, 'Adding a lesson or an exercise')")
        if names - found:
            raise RegistryError(f"{REGISTRY} lists {sorted(names - found)}, which {folder}/ "
                                "does not hold: add the notebook, or remove its entry")


def entries(folder: str, root: Path | None = None) -> list[Entry]:
    """The notebooks of one folder (``notebooks``, ``exercises``, ``solutions``), in the
    registry's order, with their titles; ``root``: the course's folder (default:
    :func:`~pcourse.utils.io.course_folder`)."""
    if folder not in FOLDERS:
        raise ValueError(f"unknown folder {folder!r}; choose one of {', '.join(FOLDERS)}")
    course = load(root)
    paths = ([x.path for x in course.lessons] if folder == "notebooks" else
             [x.path if folder == "exercises" else x.solution for x in course.exercises])
    return [Entry(p, p.name[:2], title(course.root / p)) for p in paths]


# ---------------------------------------------------------------- course-wide facts
# Each is read from the code that makes it true; README.md and INSTRUCTORS.md state
# them, and tests/test_registry.py checks that they state these.

def grader_engines() -> int:
    """Ranks of each learner's grading job (:data:`pcourse.tools.grading.job.RANKS`)."""
    from pcourse.tools.grading.job import RANKS  # the grader's own number, not a copy

    return RANKS


def quick_mnist_images() -> int:
    """The MNIST images lesson 06 trains on in quick mode: every image of the test split
    after the held-out ones (its ``LIMIT = None``; :func:`pcourse.workloads.mnist.
    train_and_held_out`), 9,000 with the source's 1,000 held out."""
    from pcourse.workloads.config import MNISTConfig
    from pcourse.workloads.mnist import COUNTS

    return COUNTS["test"] - MNISTConfig().n_eval


@dataclass(frozen=True)
class Facts:
    """The course-wide facts that text states (README.md, INSTRUCTORS.md, the index, the
    lessons), each read from where it is made true; ``tests/test_registry.py`` checks
    the text against them."""

    last_lesson: Lesson  # the registry's last: the only one that may say it is the last
    grader_engines: int  # engines per worker of the class grader
    grader_sizes: tuple[int, ...]  # the rank counts a graded check runs at
    quick_mnist_images: int  # the images lesson 06 trains on in quick mode


def facts(root: Path | None = None) -> Facts:
    """The course-wide facts of the course in ``root`` (:class:`Facts`)."""
    from pcourse.tools.grading.checks import GRADER_SIZES

    return Facts(load(root).last, grader_engines(), tuple(GRADER_SIZES), quick_mnist_images())
