"""Lay out the course's website and render it: ``python -m pcourse.tools.book`` (``make book``).

The pages are the repository's own files, copied into a staging folder with the same
layout (so every link between them resolves as it does in JupyterLab) and changed
only where a website must differ from a clone:

- each lesson and exercise says, under its title, how to run it: the README's two
  commands, then the notebook to open. The page shows a run's stored outputs; no
  kernel is behind it, and it does not pretend otherwise;
- a link to a file the site does not have (a solution, a module) becomes the file's
  path in the repository, in code type: the site links to no solution;
- an exercise whose page would hold a line of its solution stops the build
  (:func:`leaked`): exercises/ is generated from solutions/, and a stale one could.

Sphinx then renders the staged pages with MyST-NB, from their stored outputs only
(``nb_execution_mode = "off"`` in :mod:`pcourse.tools.book.conf`). A plotting cell
(``plt.show()``) that stored no image is named on the terminal
(:func:`missing_figures`): its page would show the figure's text in its place.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path, PurePosixPath

import nbformat

from pcourse.tools.grading import exercises as ex
from pcourse.tools.workshop import course
from pcourse.utils.io import course_folder

CONF_DIR = Path(__file__).resolve().parent  # conf.py
OUT = Path("build") / "book"  # in the course's folder
BUILD_TIMEOUT = 600.0  # s for Sphinx: a bound on a hang, not a measure of speed
PAGES_FILE = "pages.json"  # in OUT: what was built, for the tests and for readers of OUT
# The pages that are not notebooks, in the order of the site's "About" section.
ABOUT = ("README.md", "INSTRUCTORS.md")
ABOUT_TITLE = "# About the course: its source, its departures, installing it"
_LINK = re.compile(r"(?<!!)\[([^\]\n]+)\]\(([^)\s]+)\)")  # [text](target), not images
_FIGURE = re.compile(r"\bplt\.show\(\)")


class BookError(RuntimeError):
    """The site cannot be built as the course promises (a leaked solution, a failed render)."""


@dataclass(frozen=True)
class Page:
    """One page of the site."""

    doc: str  # path in the site without suffix: "notebooks/05_franke"
    kind: str  # "index", "lesson", "exercise" or "about"
    source: str  # the repository's file it is made from
    title: str


@dataclass(frozen=True)
class Book:
    html: Path  # the site: html/index.html
    pages: list[Page]
    seconds: float  # the render's wall time, said on the terminal
    missing_figures: dict[str, list[int]]  # page source -> plotting cells without an image


# ---------------------------------------------------------------- what a page must say

def two_commands(readme: str) -> str:
    """The README's two commands (its first code block under "The two commands"), as is."""
    m = re.search(r"^## The two commands\s*\n+```(\w*)\n(.*?)\n```", readme, re.M | re.S)
    if not m:
        raise BookError("README.md has no ```bash block under '## The two commands': the "
                        "lesson pages repeat it to say how to run a lesson")
    return f"```{m.group(1)}\n{m.group(2)}\n```"


def run_note(entry: course.Entry, commands: str, after: str | None = None) -> str:
    """The box under a lesson's or an exercise's title: how to run it yourself; ``after``:
    the lesson an exercise practises (the registry's, :meth:`course.Course.after`)."""
    if entry.folder == "exercises":
        what = (f"It practises lesson {after}. " if after else "") + (
            f"`make lab` opens the course's index in JupyterLab; open "
            f"`{entry.path.as_posix()}` from it and do as said above.")
    else:
        what = (f"`make lab` opens the course's index in JupyterLab; open "
                f"`{entry.path.as_posix()}` from it and run all cells "
                "(*Run → Run All Cells*). `make test` runs it as a test, as CI does.")
    return ("````{admonition} Run it yourself\n:class: tip\n"
            "This page shows the notebook as the course ships it, with the outputs of one "
            "run in quick mode. Nothing runs in your browser: to run it, clone the "
            "course's repository and, in its folder:\n\n"
            f"{commands}\n\n{what}\n````")


# ---------------------------------------------------------------- links

def rewrite_links(markdown: str, here: PurePosixPath, files: set[str]) -> str:
    """Links to files the site lacks become their repository path, in code type.

    ``here`` is the page's path in the site, ``files`` every path the site has
    (``notebooks/05_franke.ipynb``, ``README.md``). Web links, anchors and links to
    pages of the site are kept.
    """
    def fix(m: re.Match) -> str:
        text, target = m.group(1), m.group(2)
        if re.match(r"^[a-z][a-z0-9+.-]*:", target, re.I) or target.startswith("#"):
            return m.group(0)
        path = _normalise(here.parent / target.split("#", 1)[0])
        if path in files:
            return m.group(0)
        return f"{text} (`{path}` in the repository)" if text.strip("`") != path else f"`{path}`"

    return _LINK.sub(fix, markdown)


def _normalise(path: PurePosixPath) -> str:
    parts: list[str] = []
    for part in path.parts:
        if part == "..":
            if parts:
                parts.pop()
        elif part != ".":
            parts.append(part)
    return "/".join(parts)


# ---------------------------------------------------------------- solutions stay out

def solution_lines(solution: nbformat.NotebookNode) -> set[str]:
    """The solution's own lines: inside its marked regions, and nowhere in its exercise.

    Stripped of indentation. Lines that the exercise generated from it also has
    (``return None``, a comment it keeps) say nothing about the solution and are left
    out; the exercise is generated here, so a stale exercises/ file cannot hide one.
    """
    exercise = ex.generate(solution)
    shown = {ln.strip() for cell in exercise.cells for ln in cell.source.split("\n")}
    return {ln.strip() for code in ex.solution_regions(solution) for ln in code.split("\n")
            if ln.strip() and ln.strip() not in shown and not ln.strip().startswith("#")}


def leaked(text: str, lines: set[str]) -> list[str]:
    """The solution ``lines`` that appear, as whole lines, in ``text`` (a page's code)."""
    present = {ln.strip() for ln in text.split("\n")}
    return sorted(lines & present)


def missing_figures(nb: nbformat.NotebookNode) -> list[int]:
    """Code cells that call ``plt.show()`` but stored no image: a figure the page lacks."""
    return [i for i, cell in enumerate(nb.cells) if cell.cell_type == "code"
            and _FIGURE.search(cell.source) and not _images(cell)]


def _images(cell: nbformat.NotebookNode) -> int:
    return sum(1 for out in cell.get("outputs", [])
               if any(k.startswith("image/") for k in out.get("data", {})))


def figure_cells(nb: nbformat.NotebookNode) -> list[int]:
    """Code cells that show a figure: they stored an image, or they call ``plt.show()``."""
    return [i for i, cell in enumerate(nb.cells) if cell.cell_type == "code"
            and (_images(cell) or _FIGURE.search(cell.source))]


# ---------------------------------------------------------------- staging

def stage(root: Path, src: Path) -> list[Page]:
    """Write the site's pages into ``src``; the pages, in the site's order."""
    if src.exists():
        shutil.rmtree(src)
    src.mkdir(parents=True)
    readme = (root / "README.md").read_text(encoding="utf-8")
    commands = two_commands(readme)
    registry = course.load(root)  # the site's order is the registry's
    lessons = course.entries("notebooks", root)
    exercises = course.entries("exercises", root)
    notebooks = [e.path.as_posix() for e in lessons + exercises]
    files = {"index.ipynb", *notebooks, *ABOUT}
    pages = [Page("index", "index", "index.ipynb", "The course")]
    for entry in lessons + exercises:
        kind = "lesson" if entry.folder == "notebooks" else "exercise"
        nb = nbformat.read(root / entry.path, as_version=4)
        if kind == "exercise":
            _refuse_solutions(nb, root / "solutions" / entry.path.name, entry.path)
        title_at = next(i for i, c in enumerate(nb.cells) if c.cell_type == "markdown")
        note = run_note(entry, commands, registry.after(entry.name))
        nb.cells.insert(title_at + 1, nbformat.v4.new_markdown_cell(note))
        _write_notebook(nb, src / entry.path, files)
        pages.append(Page(entry.path.with_suffix("").as_posix(), kind, entry.path.as_posix(),
                          f"{entry.number} · {entry.title}"))
    index = nbformat.read(root / "index.ipynb", as_version=4)
    index.cells.append(nbformat.v4.new_markdown_cell(_toctree(lessons, exercises)))
    _write_notebook(index, src / "index.ipynb", files)
    for name in ABOUT:
        text = (root / name).read_text(encoding="utf-8")
        if name == "README.md":  # the index is the site's front page; this is "About"
            text = re.sub(r"^# .*$", ABOUT_TITLE, text, count=1, flags=re.M)
        (src / name).write_text(rewrite_links(text, PurePosixPath(name), files), "utf-8")
        pages.append(Page(Path(name).stem, "about", name, _first_heading(text)))
    return pages


def _refuse_solutions(exercise: nbformat.NotebookNode, solution: Path, where: Path) -> None:
    if not solution.exists():
        return
    text = "\n".join(c.source for c in exercise.cells)
    found = leaked(text, solution_lines(nbformat.read(solution, as_version=4)))
    if found:
        raise BookError(f"{where} holds lines of its solution ({found[0]!r} and "
                        f"{len(found) - 1} more): run `make exercises`, then `make book`")


def _write_notebook(nb: nbformat.NotebookNode, path: Path, files: set[str]) -> None:
    here = PurePosixPath(path.parent.name, path.name) if path.parent.name in (
        "notebooks", "exercises") else PurePosixPath(path.name)
    for cell in nb.cells:
        if cell.cell_type == "markdown":
            cell.source = rewrite_links(cell.source, here, files)
    path.parent.mkdir(parents=True, exist_ok=True)
    nbformat.write(nb, path)


def _toctree(lessons: list[course.Entry], exercises: list[course.Entry]) -> str:
    def tree(caption: str, docs: list[str]) -> str:
        return "```{toctree}\n:hidden:\n:caption: " + caption + "\n\n" + "\n".join(docs) + "\n```"

    return "\n\n".join([
        tree("Lessons", [e.path.with_suffix("").as_posix() for e in lessons]),
        tree("Exercises", [e.path.with_suffix("").as_posix() for e in exercises]),
        tree("About", [Path(n).stem for n in ABOUT])])


def _first_heading(text: str) -> str:
    m = re.search(r"^# +(.+)$", text, re.M)
    return m.group(1).strip() if m else ""


# ---------------------------------------------------------------- rendering

def render(src: Path, html: Path, doctrees: Path, jobs: str = "auto") -> None:
    """Sphinx's HTML build of ``src`` into ``html``; a warning fails it, all of them said."""
    warnings = doctrees.parent / "warnings.txt"
    cmd = [sys.executable, "-m", "sphinx", "-b", "html", "-q", "-W", "--keep-going",
           "-E", "-j", jobs, "-c", str(CONF_DIR), "-d", str(doctrees), "-w", str(warnings),
           str(src), str(html)]
    try:
        result = subprocess.run(cmd, capture_output=True, text=True, timeout=BUILD_TIMEOUT)
    except subprocess.TimeoutExpired as exc:
        raise BookError(f"Sphinx did not finish within {BUILD_TIMEOUT:g} s") from exc
    if result.returncode:
        said = warnings.read_text() if warnings.exists() else ""
        raise BookError(f"Sphinx failed (exit {result.returncode}):\n"
                        f"{said or result.stderr[-4000:]}")


def build(root: Path | None = None, out: Path | None = None, jobs: str = "auto") -> Book:
    """Stage and render the site into ``out`` (``out/html/index.html``; default: the
    course folder's ``build/book``). ``root``: the course's folder (default: the current)."""
    root = course_folder(root)
    out = Path(out) if out is not None else root / OUT
    start = time.monotonic()
    pages = stage(Path(root), out / "src")
    shutil.rmtree(out / "html", ignore_errors=True)  # no page of a lesson since removed
    render(out / "src", out / "html", out / "doctrees", jobs)
    missing = {p.source: cells for p in pages if p.kind == "lesson"
               for cells in [missing_figures(nbformat.read(Path(root) / p.source, 4))] if cells}
    (out / PAGES_FILE).write_text(json.dumps(
        {"pages": [p.__dict__ for p in pages], "missing_figures": missing}, indent=1))
    return Book(out / "html", pages, time.monotonic() - start, missing)
