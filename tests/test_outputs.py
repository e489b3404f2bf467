"""The stored outputs of every notebook: made by the code as it is, and holding only what a
learner needs (pcourse.tools.workshop.outputs). Read from the files; nothing is executed.

Each check runs on the course's notebooks and on a tiny course of its own, which shows it
can fail.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import nbformat
import pytest
from nbformat.v4 import new_code_cell, new_markdown_cell, new_notebook, new_output

from pcourse.tools.cluster.rank_exit import RANK_EXIT
from pcourse.tools.workshop import course, outputs

REPO = Path(__file__).resolve().parents[1]
STAMPED = outputs.stamped_notebooks(REPO)
EVERY = [Path("index.ipynb")] + [e.path for folder in course.FOLDERS
                                  for e in course.entries(folder, REPO)]
# Outputs that break a rule and wait for their owner's fix (then for `make lessons`):
# (notebook, rule) -> who and why. Every other rule is still checked in that notebook, and
# once fixed the entry fails until it is removed here.
KNOWN: dict[tuple[str, str], str] = {}


# ---------------------------------------------------------------- outputs from the code as it is

@pytest.mark.parametrize("path", STAMPED, ids=str)
def test_stored_outputs_come_from_the_code_as_it_is(path):
    why = outputs.staleness(path, REPO)
    assert not why, (
        f"{path}'s outputs were stored before: {'; '.join(why)}. Re-execute it "
        f"(`make lessons`, or `python -m pcourse.tools.workshop.outputs {path}`); if its "
        f"outputs are current, stamp it (`python -m pcourse.tools.workshop.outputs --stamp "
        f"{path}`)")


def _tiny(tmp: Path, cells: list[str]) -> Path:
    """A course of one lesson whose code is ``cells``, and a package of a few modules."""
    (tmp / "notebooks").mkdir()
    nbformat.write(new_notebook(cells=[new_markdown_cell("# 00 · T")] +
                                [new_code_cell(c) for c in cells]),
                   tmp / "notebooks/00_a.ipynb")
    (tmp / course.REGISTRY).write_text(
        '[[lesson]]\nnotebook = "notebooks/00_a.ipynb"\nteaches = "a"\nmodules = []\n')
    files = {
        "__init__.py": '"""The package."""\n',
        "a.py": '"""A."""\nfrom . import b\n\ndef f():\n    """F."""\n    return b.g()\n',
        "b.py": "def g():\n    from pcourse.sub.c import h\n    return h()\n",
        "sub/__init__.py": "",
        "sub/c.py": "def h():\n    return 1\n",
        "sub/d.py": "import subprocess\n\ndef run():\n"
                    "    subprocess.run(['python', '-m', 'pcourse.tool'])\n",
        "tool/__init__.py": "",
        "tool/__main__.py": "from ..sub import c\n",
        "unused.py": "x = 1\n",
    }
    for rel, text in files.items():
        path = tmp / "pcourse" / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return tmp


def _lesson(tmp: Path) -> Path:
    return Path("notebooks/00_a.ipynb")


def _stamp(tmp: Path) -> None:
    assert outputs.main(["--course", str(tmp), "--stamp"]) == 0


def test_the_fingerprint_follows_imports_engines_and_commands(tmp_path):
    root = _tiny(tmp_path, ["%%px --no-stream\nfrom pcourse import a", "!ls\n%time 1",
                            "def on_engine():\n    import pcourse.sub.d"])
    found = outputs.dependencies(nbformat.read(root / _lesson(root), as_version=4), root)
    assert set(found.modules) == {outputs.CELLS, "pcourse/__init__.py", "pcourse/a.py",
                                  "pcourse/b.py", "pcourse/sub/__init__.py",
                                  "pcourse/sub/c.py", "pcourse/sub/d.py",
                                  "pcourse/tool/__init__.py", "pcourse/tool/__main__.py"}


def test_a_change_to_code_a_lesson_runs_makes_it_stale_and_is_named(tmp_path):
    root = _tiny(tmp_path, ["from pcourse import a\nprint(a.f())"])
    lesson = _lesson(root)
    assert outputs.staleness(lesson, root) == ["never stamped"]
    _stamp(root)
    assert outputs.staleness(lesson, root) == [] and outputs.main(
        ["--course", str(root), "--check"]) == 0
    c = root / "pcourse/sub/c.py"
    c.write_text(c.read_text().replace("return 1", "return 2"))
    assert outputs.staleness(lesson, root) == ["pcourse/sub/c.py changed"]
    assert outputs.main(["--course", str(root), "--check"]) == 1
    _stamp(root)
    b = root / "pcourse/b.py"
    b.write_text("from pcourse import unused\n\ndef g():\n    return unused.x\n")
    assert outputs.staleness(lesson, root) == [
        "pcourse/b.py changed", "pcourse/unused.py now imported",
        "pcourse/sub/__init__.py no longer imported", "pcourse/sub/c.py no longer imported"]
    _stamp(root)
    nb = nbformat.read(root / lesson, as_version=4)
    nb.cells[1].source += "\nprint(2)"
    nbformat.write(nb, root / lesson)
    assert outputs.staleness(lesson, root) == [f"{outputs.CELLS} changed"]


def test_what_no_output_shows_leaves_a_lesson_current(tmp_path):
    root = _tiny(tmp_path, ["from pcourse import a"])
    _stamp(root)
    for rel, old, new in [("a.py", '"""A."""', '"""A, reworded."""'),
                          ("unused.py", "1", "2")]:
        path = root / "pcourse" / rel
        path.write_text(path.read_text().replace(old, new))
    nb = nbformat.read(root / _lesson(root), as_version=4)
    nb.cells[0].source += "\n\nMore prose."
    nbformat.write(nb, root / _lesson(root))
    assert outputs.staleness(_lesson(root), root) == []
    f = root / "pcourse/a.py"  # a function's docstring is shown by show_source: it counts
    f.write_text(f.read_text().replace('"""F."""', '"""F, reworded."""'))
    assert outputs.staleness(_lesson(root), root) == ["pcourse/a.py changed"]


# ---------------------------------------------------------------- only what a learner needs

def _rules_broken(path: Path) -> dict[str, list[str]]:
    found: dict[str, list[str]] = {}
    for problem in outputs.problems(nbformat.read(REPO / path, as_version=4)):
        rule = problem.split(": ")[1]
        found.setdefault(rule, []).append(problem)
    return found


@pytest.mark.parametrize("path", EVERY, ids=str)
def test_stored_outputs_hold_only_what_a_learner_needs(path):
    broken = _rules_broken(path)
    known = {rule for (p, rule) in KNOWN if p == str(path)}
    assert known <= set(broken), (
        f"{path} no longer holds {sorted(known - set(broken))}: remove it from KNOWN")
    left = [p for rule, ps in broken.items() if rule not in known for p in ps]
    assert not left, f"{path}:\n" + "\n".join(left)


def test_the_rules_catch_what_they_are_for():
    def said(*texts: str, kind: str = "stream") -> list[str]:
        cell = new_code_cell("x")
        cell.outputs = [new_output(kind, name="stdout", text=t) if kind == "stream" else
                        new_output(kind, data={"text/plain": t}) for t in texts]
        return [p.split(": ")[1] for p in outputs.problems(new_notebook(cells=[cell]))]

    assert said("ratio 0.99 (target <= 0.9: NOT met)") == ["a development target"] * 2
    assert said(f"127.0.0.1:46313{RANK_EXIT} 0") == ["a launcher marker"]
    assert said("MNIST read from /work/shared/data/mnist", "/tmp/pcourse-x/a.json",
                "in /root/.cache", "/home/ann/x", "/usr/lib/python3/site-packages/torch",
                kind="display_data") == ["a path of this machine"] * 5
    assert said("the target is 2 ms", "a/root of unity", "notebooks/05_franke.ipynb",
                "bandwidth 1.2 GB/s", "ratio /tmp") == []
    empty = new_code_cell("x", outputs=[new_output("display_data", data={})])
    assert outputs.problems(new_notebook(cells=[empty])) == [
        "cell 0: an empty display (run `python -m pcourse.tools.workshop.outputs --strip`)"]


def test_strip_removes_empty_displays_and_nothing_else_and_is_idempotent(tmp_path):
    kept = [new_output("stream", name="stdout", text="a\n"),
            new_output("display_data", data={"text/plain": "b"})]
    cell = new_code_cell("x", outputs=[new_output("display_data", data={}), *kept,
                                       new_output("display_data", data={"text/plain": ""})])
    nb = new_notebook(cells=[cell, new_markdown_cell("m")])
    assert outputs.strip(nb) == 2 and nb.cells[0].outputs == kept
    assert outputs.strip(nb) == 0 and nb.cells[0].outputs == kept


def test_strip_rewrites_only_the_notebooks_that_held_an_empty_display(tmp_path):
    root = _tiny(tmp_path, ["print(1)"])
    (root / "exercises").mkdir()
    (root / "solutions").mkdir()
    shutil.copy(root / _lesson(root), root / "index.ipynb")
    nb = nbformat.read(root / _lesson(root), as_version=4)
    nb.cells[1].outputs = [new_output("display_data", data={})]
    nbformat.write(nb, root / _lesson(root))
    before = (root / "index.ipynb").stat().st_mtime_ns
    assert outputs.main(["--course", str(root), "--strip"]) == 0
    assert nbformat.read(root / _lesson(root), as_version=4).cells[1].outputs == []
    assert (root / "index.ipynb").stat().st_mtime_ns == before


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_make_lessons_executes_what_is_stale_and_stores_it_clean_and_stamped(tmp_path, capsys):
    """`make lessons`: a stale lesson is executed in a kernel, its outputs stored without
    the empty display a cleared progress bar leaves (as pcourse.utils.progress.Bar's),
    and stamped; a current one is left alone."""
    root = _tiny(tmp_path, [
        "from IPython.display import display\n"
        "bar = display({}, raw=True, display_id=True)\n"
        "bar.update({'text/plain': 'half way'}, raw=True)\nbar.update({}, raw=True)\n"
        "print('done')"])
    assert outputs.main(["--course", str(root)]) == 0
    nb = nbformat.read(root / _lesson(root), as_version=4)
    assert [o.get("text") for o in nb.cells[1].outputs] == ["done\n"]
    assert outputs.staleness(_lesson(root), root) == []
    capsys.readouterr()
    assert outputs.main(["--course", str(root)]) == 0
    assert "executing" not in capsys.readouterr().out
