"""The taught wing is what the lessons show.

Every ``show_source`` target of every lesson, exercise and solution is defined in a taught
module (:func:`pcourse.tools.workshop.shown.layer`: the wall, written once), apart from the few
named in :data:`EXCEPTIONS`, each with its reason. ``.ci/lesson_lines.py`` counts what the
lessons show: checked here against the notebooks' text and an independent count of lines.
"""

from __future__ import annotations

import ast
import importlib.util
import inspect
import io
import json
import re
import subprocess
import sys
import tokenize
from collections import Counter
from pathlib import Path

import pytest

from pcourse.tools.workshop import shown
from pcourse.tools.workshop.course import FOLDERS

REPO = Path(__file__).resolve().parents[1]

# What a lesson shows from outside the taught wing, on purpose: qualified name -> why
EXCEPTIONS = {
    "pcourse.tools.cluster.netns.create":
        "lesson 09 shows how two network namespaces stand in for two nodes: the stand-in "
        "is the lesson's apparatus (a laptop has one node), not what it teaches",
    "pcourse.tools.cluster.netns.run_allreduce":
        "lesson 09 shows how its allreduce runs across the stand-in nodes, for the same reason",
    "pcourse.tools.cluster.netns.pingpong":
        "lesson 09 shows the ping-pong each stand-in node's rank times to fit the stand-in "
        "link's alpha and beta: the apparatus again, measured as lesson 03 measures",
}


def outside_the_wing(found: list[shown.Shown]) -> dict[str, list[str]]:
    """Shown name -> where it is shown, for every target outside the taught wing that is
    not an exception."""
    allowed = EXCEPTIONS.keys()
    outside: dict[str, list[str]] = {}
    for s in found:
        if shown.layer(s.module) != "taught" and s.name not in allowed:
            outside.setdefault(s.name, []).append(f"{s.notebook}, cell {s.cell}")
    return outside


@pytest.fixture(scope="module")
def found() -> list[shown.Shown]:
    return shown.shown(REPO)


def test_everything_the_lessons_show_is_taught(found):
    outside = outside_the_wing(found)
    assert not outside, (
        f"shown by the notebooks but defined outside the taught wing: {outside}. Move it into "
        "a taught module (CONTRIBUTING.md, Layout), or name it in EXCEPTIONS with the reason")


def test_the_exceptions_are_few_shown_and_outside_the_wing(found):
    by_name = {s.name: s for s in found}
    assert len(EXCEPTIONS) <= 4, "the exceptions are a short list: move code into the wing"
    for name, reason in EXCEPTIONS.items():
        assert name in by_name, f"{name} is no longer shown: drop it from EXCEPTIONS"
        assert shown.layer(by_name[name].module) != "taught", f"{name} is taught: drop it"
        assert len(reason.split()) > 5, f"say why {name} is shown from outside the wing"


# ---------------------------------------------------------------- the parser, on the repository
_CALL = re.compile(r"show_source\(([^()]*)\)")


def _written(root: Path = REPO) -> Counter:
    """(notebook, cell, expression) of every show_source argument, read from the cells' text
    with a regular expression: independent of the parser's ast walk."""
    found: Counter = Counter()
    for folder in FOLDERS:
        for path in sorted((root / folder).glob("*.ipynb")):
            cells = json.loads(path.read_text())["cells"]
            for index, cell in enumerate(cells):
                text = "".join(cell["source"]) if cell["cell_type"] == "code" else ""
                for call in _CALL.finditer(text):
                    for arg in filter(None, (a.strip() for a in call[1].split(","))):
                        found[path.relative_to(root), index, arg] += 1
    return found


def test_the_parser_finds_every_call_the_notebooks_write(found):
    parsed = Counter((s.notebook, s.cell, s.expression) for s in found)
    assert parsed == _written()
    showing = {s.notebook.name[:2] for s in found if s.notebook.parts[0] == "notebooks"}
    lessons = {p.name[:2] for p in (REPO / "notebooks").glob("[0-9][0-9]_*.ipynb")}
    assert showing == lessons - {"00"}, "every lesson but the setup check shows its code"


def test_a_shown_object_is_the_one_its_expression_names(found):
    """The name is where the object is defined; its expression reaches the same object."""
    for s in found:
        assert shown.resolve(s.target) is s.obj
        module = sys.modules[s.module]
        assert s.name.startswith(s.module + ".") or s.name == s.module
        obj = module
        for attr in s.name[len(s.module) + 1:].split("."):
            obj = getattr(obj, attr) if attr else obj
        assert obj is s.obj or getattr(s.obj, "fget", None) is obj, s


# ---------------------------------------------------------------- the parser, on made-up notebooks
def _notebook(root: Path, *cells: str) -> Path:
    import nbformat

    (root / "notebooks").mkdir(exist_ok=True)
    nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(c) for c in cells])
    path = root / "notebooks" / "01_made_up.ipynb"
    nbformat.write(nb, path)
    return path


def test_the_check_fails_on_a_tool_a_lesson_shows(tmp_path):
    _notebook(tmp_path, "%matplotlib inline\nfrom pcourse.tools.workshop.course import entries",
              "from pcourse.utils.show import show_source\nshow_source(entries)")
    outside = outside_the_wing(shown.shown(tmp_path))
    assert outside == {"pcourse.tools.workshop.course.entries": ["notebooks/01_made_up.ipynb, "
                                                                 "cell 1"]}


def test_names_are_followed_through_aliases_and_modules(tmp_path):
    _notebook(tmp_path, "import pcourse.buckets as b\nfrom pcourse import collectives as c",
              "from pcourse.workloads.franke import make_model as franke_model",
              "show_source(b.plan_buckets, c.ring_allreduce, franke_model)")
    names = [s.name for s in shown.shown(tmp_path)]
    assert names == ["pcourse.buckets.plan_buckets", "pcourse.collectives.ring_allreduce",
                     "pcourse.workloads.franke.make_model"]


@pytest.mark.parametrize("cells, says", [
    (["def f():\n    from pcourse import buckets\n", "show_source(buckets.plan_buckets)"],
     "'buckets' is not imported at the top level"),  # an engine's import is not the kernel's
    (["from pcourse import buckets\nshow_source(buckets.no_such_thing)"], "does not exist"),
    (["from pcourse import buckets\nshow_source(getattr(buckets, 'Bucket'))"], "pass a name"),
])
def test_a_target_that_cannot_be_read_is_named_with_its_cell(tmp_path, cells, says):
    _notebook(tmp_path, *cells)
    with pytest.raises(shown.NotebookError, match=says) as info:
        shown.shown(tmp_path)
    assert f"01_made_up.ipynb, cell {len(cells) - 1}" in str(info.value)


@pytest.mark.parametrize("module, side", [
    ("pcourse.buckets", "taught"), ("pcourse.backends.mpi", "taught"),
    ("pcourse.runtime.ranks", "runtime"), ("pcourse.utils.show", "runtime"),
    ("pcourse.tools.cluster.netns", "tooling"), ("pcourse.tools.bench", "tooling"),
    ("pcourse.benchmarks_of_a_lesson", "taught"), ("torch.nn", "outside")])
def test_the_wall_is_drawn_by_prefix(module, side):
    assert shown.layer(module) == side


# ---------------------------------------------------------------- lines a learner reads
def _lesson_lines():
    spec = importlib.util.spec_from_file_location("lesson_lines", REPO / ".ci/lesson_lines.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _node(tree: ast.AST, qualname: str) -> ast.AST:
    for part in qualname.split("."):
        found = [n for n in tree.body if getattr(n, "name", None) == part]
        assert found, f"no {part!r} of {qualname!r} at its place in the file"
        tree = found[0]
    return tree


def _read_lines(obj) -> dict[tuple[str, int], bool]:
    """(file, line) -> whether it is code, for one object's source: its node in its module's
    ast, decorators included; code by its tokens (anything but comments and line ends),
    docstrings out."""
    # torch.no_grad() wraps, and torch's Optimizer wraps a subclass's step again once one is
    # made: the source is the innermost
    obj = inspect.unwrap(obj)
    path = inspect.getsourcefile(obj)
    text = Path(path).read_text()
    tree = ast.parse(text)
    try:
        node = tree if inspect.ismodule(obj) else _node(tree, obj.__qualname__)
    except AssertionError as exc:
        raise AssertionError(f"{obj!r} in {path}: {exc}") from None
    first = min([getattr(node, "lineno", 1), *(d.lineno for d in
                                               getattr(node, "decorator_list", []))])
    last = getattr(node, "end_lineno", len(text.splitlines()))
    tokens = set()
    for tok in tokenize.generate_tokens(io.StringIO(text).readline):
        if tok.type not in (tokenize.COMMENT, tokenize.NL, tokenize.NEWLINE, tokenize.INDENT,
                            tokenize.DEDENT, tokenize.ENDMARKER):
            tokens.update(range(tok.start[0], tok.end[0] + 1))
    docs = set()
    for n in ast.walk(node):
        if isinstance(n, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef | ast.Module) \
                and ast.get_docstring(n) is not None:
            docs.update(range(n.body[0].lineno, n.body[0].end_lineno + 1))
    return {(path, k): k in tokens and k not in docs for k in range(first, last + 1)}


def test_lesson_lines_counts_what_each_lesson_shows(found):
    rows = {row["notebook"]: row for row in _lesson_lines().table(REPO)}
    assert set(rows) == {notebook for notebook, _, _ in _written()}
    done = subprocess.run([sys.executable, ".ci/lesson_lines.py"], capture_output=True,
                          text=True, timeout=120, cwd=REPO)
    assert done.returncode == 0, done.stderr
    printed = {m[1]: (int(m[2]), int(m[3])) for m in
               re.finditer(r"^(\S+/\d\d_\S+)\s+(\d+) / (\d+)", done.stdout, re.M)}
    for notebook, row in rows.items():
        items = [s for s in found if s.notebook == notebook]
        assert row["names"] == {s.name for s in items}, notebook
        read: dict = {}
        for s in items:  # a line shown twice is read once
            read.update(_read_lines(s.obj))
        expected = (len(read), sum(read.values()))
        assert row["lines"] == expected, notebook
        assert printed[f"{notebook.parent.name}/{notebook.stem}"] == expected, done.stdout
