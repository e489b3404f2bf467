"""The lesson registry (``course.toml``, :mod:`pcourse.tools.workshop.course`) and what must agree
with it: the folders, the package's docstring, the lessons' "Next:" lines, which lesson
is the last, and the course-wide facts README.md and INSTRUCTORS.md state.

The generated tables (README's, the index's, INSTRUCTORS.md's) are checked by
``tests/test_workshop.py``; the website's order by ``tests/test_book.py``. Nothing here
runs a notebook: the lessons are read as files.
"""

from __future__ import annotations

import importlib
import re
import shutil
from pathlib import Path

import nbformat
import pytest
from nbformat.v4 import new_markdown_cell, new_notebook

import pcourse
from pcourse.tools.workshop import course

REPO = Path(__file__).resolve().parents[1]
COURSE = course.load(REPO)
LESSONS = {x.number: x for x in COURSE.lessons}
# "This is the last lesson", "the final lesson", "the course ends here": a lesson's own
# claim to be the last, which only the registry's last lesson may make.
CLAIMS_LAST = re.compile(r"\b(?:this is|is) the (?:last|final) lesson\b|"
                         r"\bthe course ends here\b", re.I)
# "Next: **09 · Several nodes** — ..." or "**Next: 02 · Partitioning data.**"
NEXT = re.compile(r"Next:\s*\**\s*(\d\d) · (.+?)\.?\*\*")
NUMBER_WORDS = ("no", "one", "two", "three", "four", "five", "six", "seven", "eight",
                "nine", "ten", "eleven", "twelve", "thirteen", "fourteen", "fifteen")


def _markdown(path: Path) -> str:
    nb = nbformat.read(REPO / path, as_version=4)
    return "\n\n".join(c.source for c in nb.cells if c.cell_type == "markdown")


def _code(path: Path) -> str:
    nb = nbformat.read(REPO / path, as_version=4)
    return "\n".join(c.source for c in nb.cells if c.cell_type == "code")


# ---------------------------------------------------------------- the registry itself

def _tiny_course(tmp: Path) -> Path:
    """A course of two lessons and one exercise, registered."""
    for rel in ("notebooks/00_a.ipynb", "notebooks/01_b.ipynb", "exercises/01_x.ipynb",
                "solutions/01_x.ipynb"):
        (tmp / rel).parent.mkdir(parents=True, exist_ok=True)
        nbformat.write(new_notebook(cells=[new_markdown_cell(f"# {Path(rel).name[:2]} · T")]),
                       tmp / rel)
    (tmp / course.REGISTRY).write_text(
        '[[lesson]]\nnotebook = "notebooks/00_a.ipynb"\nteaches = "a"\nmodules = []\n\n'
        '[[lesson]]\nnotebook = "notebooks/01_b.ipynb"\nteaches = "b"\nmodules = ["loop"]\n\n'
        '[[exercise]]\nnotebook = "exercises/01_x.ipynb"\nafter = "01"\n')
    return tmp


def test_the_registry_lists_the_courses_notebooks_in_order():
    assert [x.number for x in COURSE.lessons] == sorted(x.number for x in COURSE.lessons)
    for folder in course.FOLDERS:
        on_disk = sorted(p.relative_to(REPO) for p in (REPO / folder).glob("[0-9][0-9]_*.ipynb"))
        assert sorted(e.path for e in course.entries(folder, REPO)) == on_disk, folder
    assert all(x.teaches for x in COURSE.lessons)
    assert {x.after for x in COURSE.exercises} <= set(LESSONS)


def test_a_tiny_registered_course_loads(tmp_path):
    tiny = course.load(_tiny_course(tmp_path))
    assert [x.number for x in tiny.lessons] == ["00", "01"] and tiny.last.number == "01"
    assert tiny.next(tiny.lessons[0]) == tiny.last and tiny.next(tiny.last) is None
    assert tiny.after("01_x") == "01" and [x.name for x in tiny.practising("01")] == ["01_x"]
    assert [e.title for e in course.entries("solutions", tmp_path)] == ["T"]


@pytest.mark.parametrize("drift, says", [
    # a lesson's notebook added without its entry: the tools would silently leave it out
    (lambda t: shutil.copy(t / "notebooks/01_b.ipynb", t / "notebooks/02_c.ipynb"),
     r"notebooks/ holds \['02_c.ipynb'\], which course.toml does not list"),
    (lambda t: (t / "notebooks/01_b.ipynb").unlink(),
     r"lists \['01_b.ipynb'\], which notebooks/ does not hold"),
    (lambda t: (t / "solutions/01_x.ipynb").unlink(),
     r"lists \['01_x.ipynb'\], which solutions/ does not hold"),
    (lambda t: _edit(t, 'after = "01"', 'after = "07"'), r"after lesson '07', which is not"),
    (lambda t: _edit(t, 'after = "01"', "after = 1"), r"after = 1; the number of the lesson"),
    (lambda t: _edit(t, '"notebooks/00_a.ipynb"', '"notebooks/02_a.ipynb"'),
     "lesson 01 comes after lesson 02"),
    (lambda t: _edit(t, 'teaches = "a"', 'teach = "a"'),
     r"missing \['teaches'\], unknown \['teach'\]"),
    (lambda t: _edit(t, 'teaches = "b"', 'teaches = "b | c"'), "without '|'"),
    (lambda t: _edit(t, '"exercises/01_x.ipynb"', '"solutions/01_x.ipynb"'),
     "each exercise's is 'exercises/NN_name.ipynb'"),
    (lambda t: _edit(t, "[[exercise]]", "[[exercises]]"), r"unknown tables \['exercises'\]"),
    (lambda t: _edit(t, "modules = []", "modules = ["), "not valid TOML"),
    (lambda t: (t / course.REGISTRY).unlink(), "has no course.toml"),
], ids=["unregistered", "missing", "no-solution", "after-nothing", "after-int", "order",
        "typo", "pipe", "folder", "table", "toml", "no-file"])
def test_a_registry_that_disagrees_with_the_folders_is_refused(tmp_path, drift, says):
    drift(_tiny_course(tmp_path))
    with pytest.raises(course.RegistryError, match=says):
        course.load(tmp_path)


def _edit(tmp: Path, old: str, new: str) -> None:
    path = tmp / course.REGISTRY
    assert old in path.read_text()
    path.write_text(path.read_text().replace(old, new, 1))


# ---------------------------------------------------------------- the package's docstring

def _taught() -> set[str]:
    """The taught top-level names: modules, and the taught subpackages (the wall as
    pcourse.tools.workshop.shown.layer draws it)."""
    from pcourse.tools.workshop.shown import layer

    names = set()
    for path in REPO.glob("pcourse/**/*.py"):
        parts = path.relative_to(REPO).with_suffix("").parts
        if layer(".".join(p for p in parts if p != "__init__")) != "taught" or len(parts) < 2:
            continue
        if parts[1] != "__init__":
            names.add(parts[1])
    return names


def module_table(text: str, entry: str, more: str) -> dict[str, tuple[set[str], str]]:
    """A lesson table by module: name -> (the lesson numbers it gives, its text).

    An entry is a line that matches ``entry`` (the module's name, then its text), with
    the lines after it that start with ``more`` (deeper indentation); its lessons are
    the entry's last ``(NN, NN)``."""
    table: dict[str, tuple[set[str], str]] = {}
    name = None
    for line in text.splitlines():
        m = re.match(entry, line)
        if m:
            name = m.group(1)
            table[name] = (set(), m.group(2))
        elif name and line.startswith(more):
            table[name] = (set(), table[name][1] + " " + line.strip())
        else:
            name = None
    for name, (_, said) in table.items():
        groups = re.findall(r"\((\d\d(?:, \d\d)*)\)", said)
        table[name] = (set(groups[-1].split(", ")) if groups else set(), said)
    return table


def docstring_table(doc: str) -> dict[str, tuple[set[str], str]]:
    """pcourse's docstring: entries indented four spaces, ````name```` or ````name/````."""
    text = doc.partition("The top level is")[2].partition("Under both")[0]
    return module_table(text, r"^    ``(\w+)/?``\s+(.*)$", " " * 8)


def readme_layout(readme: str) -> dict[str, tuple[set[str], str]]:
    """README's *Layout* block: entries indented two spaces, ``name.py`` or ``name/``."""
    block = readme.partition("## Layout")[2].partition("```")[2].partition("```")[0]
    return module_table(block, r"^  (\w+)(?:\.py|/)\s+(.*)$", " " * 4)


def test_the_package_docstring_lists_every_taught_module_with_the_lessons_that_teach_it():
    table = docstring_table(pcourse.__doc__)
    taught = _taught()
    assert set(table) == taught, (
        f"pcourse/__init__.py's lesson table lacks {sorted(taught - set(table))} and lists "
        f"{sorted(set(table) - taught)}, which are not taught modules")
    for name, (lessons, _) in table.items():
        registered = {x.number for x in COURSE.lessons if name in x.modules}
        assert lessons == registered, (
            f"pcourse's docstring says {name} is taught in {sorted(lessons)}; course.toml's "
            f"lessons list it in {sorted(registered)}")


def test_readmes_layout_gives_each_taught_module_the_registrys_lessons():
    layout = readme_layout((REPO / "README.md").read_text())
    numbered = {name for name, (lessons, _) in layout.items() if lessons}
    assert numbered <= _taught(), f"README's Layout gives lessons to {numbered - _taught()}"
    for name in sorted(_taught()):
        registered = {x.number for x in COURSE.lessons if name in x.modules}
        assert name in layout and layout[name][0] == registered, (
            f"README's Layout should list {name} with lessons {sorted(registered)} "
            f"(course.toml); it has {layout[name][0] if name in layout else 'no line'}")


def test_each_lesson_teaches_modules_that_exist_and_uses_them():
    taught = _taught()
    for lesson in COURSE.lessons:
        code = _code(lesson.path)
        imported = set(re.findall(r"\bpcourse\.(\w+)", code)) | {
            n.strip() for m in re.finditer(r"from pcourse import (?:\(([^)]*)\)|([\w, ]+))", code)
            for n in (m.group(1) or m.group(2)).split(",")}
        for name in lesson.modules:
            assert name in taught, f"{lesson.name} registers {name!r}, not a taught module"
            importlib.import_module(f"pcourse.{name}")
            assert name in imported, f"{lesson.name} registers {name!r} but never imports it"


def test_each_taught_subpackage_names_every_module_it_holds():
    table = docstring_table(pcourse.__doc__)
    for name in _taught():
        folder = REPO / "pcourse" / name
        if not folder.is_dir():
            continue
        said = table[name][1] + " " + (importlib.import_module(f"pcourse.{name}").__doc__ or "")
        for module in sorted(p.stem for p in folder.glob("*.py") if p.stem != "__init__"):
            assert re.search(rf"\b{module}\b", said), (
                f"pcourse.{name}.{module} is named neither in pcourse/{name}/__init__.py's "
                "docstring nor in pcourse's lesson table")


def test_each_tool_subpackage_names_every_module_it_holds():
    """The tools are held to the taught code's rule: a subpackage's docstring is its map."""
    folders = [p.parent for p in (REPO / "pcourse" / "tools").glob("**/__init__.py")]
    assert len(folders) >= 7
    for folder in folders:
        said = importlib.import_module(
            ".".join(folder.relative_to(REPO).parts)).__doc__ or ""
        held = [p.stem for p in folder.glob("*.py") if p.stem not in ("__init__", "__main__")]
        held += [p.name for p in folder.iterdir() if (p / "__init__.py").is_file()]
        for module in sorted(held):
            assert re.search(rf"\b{module}\b", said), (
                f"{folder.relative_to(REPO)}/__init__.py's docstring does not name {module}")


def test_the_module_tables_are_read_as_written():
    doc = ("The top level is:\n\n    ``a``   one (01)\n    ``b/``  two, and\n"
           "            more (03, 10)\n    ``c``   none\n\nUnder both")
    assert docstring_table(doc) == {"a": ({"01"}, "one (01)"),
                                    "b": ({"03", "10"}, "two, and more (03, 10)"),
                                    "c": (set(), "none")}
    readme = ("## Layout\n\n```\npcourse/   what\n  a.py      one (01)\n  b/        two,\n"
              "            more (03, 10)\n  x/ y/     tools\nnotebooks/ (04)\n```\n")
    assert readme_layout(readme) == {"a": ({"01"}, "one (01)"),
                                     "b": ({"03", "10"}, "two, more (03, 10)"),
                                     "x": (set(), "y/     tools")}


# ---------------------------------------------------------------- which lesson is last

@pytest.mark.parametrize("lesson", COURSE.lessons, ids=lambda x: x.number)
def test_a_lesson_points_to_the_next_and_only_the_last_says_it_is_last(lesson):
    text = _markdown(lesson.path)
    following = COURSE.next(lesson)
    pointers = [(m.group(1), m.group(2).strip()) for m in NEXT.finditer(text)]
    if following is None:
        assert not pointers, f"{lesson.name}, the registry's last lesson, points to {pointers}"
        return
    claim = CLAIMS_LAST.search(text)
    assert not claim, (f"{lesson.name} says {claim.group(0)!r}, but the registry's last "
                       f"lesson is {COURSE.last.name}")
    wanted = (following.number, course.title(REPO / following.path))
    assert pointers == [wanted], (
        f"{lesson.name} should end with 'Next: **{wanted[0]} · {wanted[1]}**' (the "
        f"registry's next lesson); it has {pointers or 'none'}")


def test_the_pointer_and_claim_patterns_catch_what_they_are_for():
    assert CLAIMS_LAST.search("Summary.\n\nThis is the last lesson. The exercises ...")
    assert not CLAIMS_LAST.search("the last section of this lesson measures both")
    found = [NEXT.search(t).groups() for t in (
        "Next: **01 · Parallel SGD**.", "**Next: 02 · Partitioning data.**",
        "**Next: 10 · Sharding: ZeRO-1, ZeRO-2 and FSDP** — what ...")]
    assert found == [("01", "Parallel SGD"), ("02", "Partitioning data"),
                     ("10", "Sharding: ZeRO-1, ZeRO-2 and FSDP")]


# ---------------------------------------------------------------- course-wide facts

def test_readme_and_the_guide_say_what_quick_mode_trains_on():
    n = course.quick_mnist_images()
    saved = re.search(r"training: (\d+) images of the test split",
                      "".join(o.get("text", "") for c in nbformat.read(
                          REPO / LESSONS["06"].path, as_version=4).cells
                          for o in c.get("outputs", [])))
    assert saved and int(saved.group(1)) == n, (
        f"lesson 06's saved run trained on {saved and saved.group(1)} images; "
        f"course.quick_mnist_images() says {n}")
    readme = (REPO / "README.md").read_text()
    bullet = readme.partition("**Quick mode's MNIST.**")[2].partition("\n- ")[0]
    assert f"on the {n:,} test images" in " ".join(bullet.split()), \
        f"README's 'Quick mode's MNIST' does not say 'on the {n:,} test images'"
    guide = " ".join((REPO / "INSTRUCTORS.md").read_text().split())
    assert f"test split's last {n:,} images" in guide


def test_readme_and_the_guide_say_how_many_ranks_the_grader_starts():
    from pcourse.tools.grading.checks import GRADER_SIZES

    n = course.grader_engines()
    assert n == max(GRADER_SIZES), "the grader's jobs must hold its largest check"
    readme = " ".join((REPO / "README.md").read_text().split())
    guide = " ".join((REPO / "INSTRUCTORS.md").read_text().split())
    assert f"a fresh job of {n} MPI ranks" in readme
    assert f"under the grader at {max(GRADER_SIZES)} as well" in readme
    assert f"a job of their own ({n} MPI ranks" in guide


def test_readme_counts_the_exercises():
    readme = (REPO / "README.md").read_text()
    n = len(COURSE.exercises)
    assert f"\n{NUMBER_WORDS[n].capitalize()} exercises (`exercises/`" in readme, \
        f"README's Grading section should open with '{NUMBER_WORDS[n].capitalize()} exercises'"


# Where any text of the course states a fact, it states the registry's (course.facts):
# the README, the guide, the index, and every lesson's prose and code comments.
FACTS = course.facts(REPO)
QUICK_IMAGES = re.compile(r"\b(\d{1,3}(?:,\d{3})+|\d+)\s+(?:\w+\s+){0,3}?images\b")


def _sentences() -> list[tuple[str, str]]:
    """(where, sentence) for every sentence of the course's text: docs, then each
    lesson's markdown (a paragraph's lines joined) and code (line by line: comments and
    strings say facts too)."""
    prose = [(name, (REPO / name).read_text()) for name in ("README.md", "INSTRUCTORS.md")]
    prose.append(("index.ipynb", _markdown(Path("index.ipynb"))))
    prose += [(x.name, _markdown(x.path)) for x in COURSE.lessons]
    found = [(where, s) for where, text in prose for para in re.split(r"\n\s*\n", text)
             for s in re.split(r"(?<=[.;])\s+", " ".join(para.split())) if s]
    return found + [(x.name, s) for x in COURSE.lessons for line in _code(x.path).splitlines()
                    for s in re.split(r"(?<=[.;])\s+", line) if s.strip()]


def test_every_text_says_the_registrys_quick_mode_image_count():
    n = FACTS.quick_mnist_images
    said = [(where, s, m.group(1)) for where, s in _sentences() if re.search(r"quick mode", s, re.I)
            for m in QUICK_IMAGES.finditer(s)]
    assert said, "no text says how many images quick mode trains on; the pattern is stale"
    wrong = [f"{where}: {s.strip()[:150]!r}" for where, s, k in said
             if int(k.replace(",", "")) != n]
    assert not wrong, f"quick mode trains on {n:,} images (course.facts); these say otherwise:\n" \
        + "\n".join(wrong)


def test_only_the_registrys_last_lesson_is_called_the_last_anywhere():
    last = FACTS.last_lesson.number
    wrong = [f"{where}: {s.strip()[:150]!r}" for where, s in _sentences()
             if re.search(r"\b(?:last|final) lesson\b", s, re.I)
             and (numbers := set(re.findall(r"\b(\d\d)\b", s))) and last not in numbers]
    assert not wrong, f"the last lesson is {last} (course.toml); these name another:\n" + \
        "\n".join(wrong)


def test_the_fact_checks_catch_what_they_are_for():
    assert [m.group(1) for m in QUICK_IMAGES.finditer(
        "quick mode: 9,000 test images; README once said the 2,048 test images")] == \
        ["9,000", "2,048"]
    assert not QUICK_IMAGES.search("quick mode trains for 2 epochs")
    assert FACTS.grader_engines == max(FACTS.grader_sizes)
