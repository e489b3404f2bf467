"""The course's notebooks in order: lessons, exercises and their solutions.

The instructor's tools (the timing script, the index, the reset command) all need the
same list; it is read from the folders, so a new lesson appears without editing code.
What each lesson teaches, in one line, is the README's course table: written once,
there, and reused here.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

import nbformat

from pcourse.utils.io import course_folder

FOLDERS = ("notebooks", "exercises", "solutions")

# Which lesson an exercise practises (it is done after that lesson). Exercises are
# numbered in their own order, so this cannot be read from the names.
EXERCISE_AFTER = {
    "01_partitioner": "02",
    "02_average_gradients": "01",
    "03_ring_allreduce": "03",
    "04_gloo_bootstrap": "04",
    "05_broadcast_consistency": "05",
    "06_bucketed_allreduce": "07",
    "07_parameter_averaging": "08",
    "08_sharded_optimizer": "10",
    "09_tensor_parallel": "11",
}


@dataclass(frozen=True)
class Entry:
    """One notebook of the course."""

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


def entries(folder: str, root: Path | None = None) -> list[Entry]:
    """The notebooks of one folder (``notebooks``, ``exercises``, ``solutions``), in order;
    ``root``: the course's folder (default: :func:`~pcourse.utils.io.course_folder`)."""
    root = course_folder(root)
    if folder not in FOLDERS:
        raise ValueError(f"unknown folder {folder!r}; choose one of {', '.join(FOLDERS)}")
    found = []
    for path in sorted((root / folder).glob("[0-9][0-9]_*.ipynb")):
        found.append(Entry(path.relative_to(root), path.name[:2], title(path)))
    return found


def readme_summaries(root: Path | None = None) -> dict[str, str]:
    """Lesson number -> what it teaches, from the README's course table."""
    text = (course_folder(root) / "README.md").read_text()
    return {m.group(1): m.group(2).strip()
            for m in re.finditer(r"^\| *(\d\d) [^|]*\| *([^|]+?) *\|\s*$", text, re.M)}
