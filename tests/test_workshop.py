"""The instructor's kit: the timing script, the generated tables, and the course index."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import nbformat
import psutil
import pytest
from nbformat.v4 import new_code_cell, new_markdown_cell, new_notebook

from pcourse.tools.workshop import course, render, timings

REPO = Path(__file__).resolve().parents[1]


# --- the tables in index.ipynb and INSTRUCTORS.md --------------------------------------

def test_generated_tables_are_up_to_date():
    """Edited by hand, or measurements stored without re-rendering: regenerate them."""
    for rel, names in render.TARGETS.items():
        text = (REPO / rel).read_text()
        for name in names:
            assert text.count(render.begin(name)) == 1, f"{rel}: no block {name!r}"
    stale = [str(p.relative_to(REPO)) for p, text in render.updated(timings.load(), REPO).items()
             if p.read_text() != text]
    assert not stale, (f"{stale} differ from what course.toml and the stored measurements "
                       "give; run `python -m pcourse.tools.workshop.timings --render`")


def test_every_lesson_and_solution_has_a_quick_mode_time():
    runs = timings.load().get("quick", {}).get("runs", {})
    missing = [str(p) for p in timings.notebooks(REPO) if str(p) not in runs]
    assert not missing, f"no measured time for {missing}: run `make timings` (on a quiet machine)"


def test_index_links_every_lesson_and_exercise_and_nothing_broken():
    nb = nbformat.read(REPO / "index.ipynb", as_version=4)
    text = "\n".join(c.source for c in nb.cells if c.cell_type == "markdown")
    targets = re.findall(r"\]\(([^)#]+)\)", text)
    for target in targets:
        assert (REPO / target).exists(), f"index.ipynb links to {target}, which does not exist"
    for folder in ("notebooks", "exercises", "solutions"):
        for entry in course.entries(folder, REPO):
            assert entry.path.as_posix() in targets, f"index.ipynb does not link {entry.path}"


def test_every_lesson_has_a_summary_and_every_exercise_a_lesson():
    registry = course.load(REPO)
    summaries = {x.number: x.teaches for x in registry.lessons if x.teaches}
    lessons = {e.number for e in course.entries("notebooks", REPO)}
    assert lessons <= set(summaries), f"course.toml says nothing of {lessons - set(summaries)}"
    exercises = {e.name for e in course.entries("exercises", REPO)}
    after = {x.name: x.after for x in registry.exercises}
    assert exercises == set(after), "course.toml's exercises are out of date"
    assert set(after.values()) <= lessons


def test_readmes_table_is_the_registrys():
    """README's course table is generated: every lesson, in order, with its line."""
    readme = (REPO / "README.md").read_text()
    block = readme.partition(render.begin("course-table"))[2].partition(
        render.end("course-table"))[0]
    rows = [r for r in block.splitlines() if r.startswith("| [")]
    registry = course.load(REPO)
    assert len(rows) == len(registry.lessons)
    for row, lesson in zip(rows, registry.lessons, strict=True):
        assert f"]({lesson.path.as_posix()})" in row and f"| {lesson.teaches} |" in row
        for x in registry.practising(lesson.number):
            assert f"]({x.path.as_posix()})" in row


def test_replace_block_needs_exactly_one_pair_of_markers():
    text = f"a\n{render.begin('x')}\nold\n{render.end('x')}\nb"
    assert render.replace_block(text, "x", "new") == \
        f"a\n{render.begin('x')}\nnew\n{render.end('x')}\nb"
    for bad in ("no markers", text + text, f"{render.end('x')}{render.begin('x')}"):
        with pytest.raises(ValueError, match="markers"):
            render.replace_block(bad, "x", "new")


@pytest.mark.parametrize("seconds, text", [(None, "not measured"), (4.4, "4 s"), (89, "89 s"),
                                           (91, "2 min"), (3540, "59 min"), (3599, "1 h 00 min"),
                                           (3900, "1 h 05 min")])
def test_duration(seconds, text):
    assert render.duration(seconds) == text


def _item(minutes: int, name: str) -> render._Item:
    entry = course.Entry(Path("notebooks") / f"{name}.ipynb", name[:2], name)
    return render._Item("lesson", entry, 60.0 * minutes, minutes)


def test_plan_keeps_order_fills_blocks_and_says_what_is_left():
    m = render.SESSION_MINUTES
    items = [_item(m // 2, "01_a"), _item(m // 2, "02_b"), _item(m // 3, "03_c"),
             _item(m, "04_d"), _item(1, "05_e")]
    rows, left = render.plan(items, sessions=2)
    planned = [re.search(r"\[(\d\d) ·", r).group(1) for r in rows if "break" not in r]
    assert planned == ["01", "02", "03"]  # 04 needs a whole block: none is left after 03
    assert [i.entry.number for i in left] == ["04", "05"]
    assert sum("break" in r for r in rows) == 1
    start_of_03 = next(r for r in rows if "[03 ·" in r).split("|")[1].strip()
    assert start_of_03 == render._clock(m + render.BREAK_MINUTES)
    rows, left = render.plan(items, sessions=4)
    assert not left and sum("break" in r for r in rows) == 3  # 04 fills block 3 alone


def test_the_engines_column_follows_the_notebooks_code(tmp_path):
    nb = new_notebook(cells=[
        new_code_cell("FULL = False\nN_ENGINES = 4 if FULL else 2"),
        new_code_cell("mc = start_cluster(N_ENGINES)"),
        new_code_cell("%%px\nx = start_cluster(99)"),  # magics: not Python, not read
        new_code_cell("mc = pcourse.tools.cluster.start_cluster(3, timeout=60)\nstart_cluster()")])
    nbformat.write(nb, tmp_path / "a.ipynb")
    assert render.engines_started(tmp_path, Path("a.ipynb"), full=False) == [2, 3, None]
    assert render.engines_started(tmp_path, Path("a.ipynb"), full=True) == [4, 3, None]
    assert render._engines(tmp_path, Path("a.ipynb"), True) == \
        "2 → 3 → one per GPU, else 2 / 4 → 3 → one per GPU, else 2"


# --- the timing script ------------------------------------------------------------------

def test_switch_to_full_flips_only_the_mode_cell():
    nb = new_notebook(cells=[new_code_cell("x = 1  # FULL = False is the default"),
                             new_code_cell("FULL = False  # quick mode\nN = 2"),
                             new_code_cell("print(FULL)")])
    assert timings.switch_to_full(nb)
    assert [c.source for c in nb.cells] == ["x = 1  # FULL = False is the default",
                                            "FULL = True  # quick mode\nN = 2", "print(FULL)"]
    assert not timings.switch_to_full(new_notebook(cells=[new_code_cell("print(1)")]))


def _course(tmp: Path) -> Path:
    """A two-notebook course: a lesson that runs 2 MPI ranks, a solution that fails."""
    for folder in course.FOLDERS:
        (tmp / folder).mkdir(parents=True)
    mpiexec = Path(sys.executable).parent / "mpiexec"
    estimate = f"{render.begin(render.ESTIMATE)}\n{render.end(render.ESTIMATE)}"
    lesson = new_notebook(cells=[
        new_markdown_cell(f"# 00 · Tiny\n\nfour words of narrative\n\n{estimate}"),
        new_code_cell("FULL = False"),
        # a process that would outlive the kernel: the script must stop it
        new_code_cell("import subprocess, time\n"
                      "orphan = subprocess.Popen(['sleep', '120'], start_new_session=True)\n"
                      "open('orphan.pid', 'w').write(str(orphan.pid))\n"
                      f"subprocess.run([{str(mpiexec)!r}, '-n', '2', {sys.executable!r}, "
                      "'-c', 'import time; time.sleep(3)'], check=True)\n"
                      "print('mode', 'full' if FULL else 'quick')")])
    broken = new_notebook(cells=[new_markdown_cell(f"# 01 · Exercise: broken\n\n{estimate}"),
                                 new_code_cell("1 / 0")])
    nbformat.write(lesson, tmp / "notebooks" / "00_tiny.ipynb")
    nbformat.write(broken, tmp / "solutions" / "01_broken.ipynb")
    nbformat.write(broken, tmp / "exercises" / "01_broken.ipynb")
    (tmp / course.REGISTRY).write_text(
        '[[lesson]]\nnotebook = "notebooks/00_tiny.ipynb"\nteaches = "a tiny lesson"\n'
        'modules = []\n\n[[exercise]]\nnotebook = "exercises/01_broken.ipynb"\nafter = "00"\n')
    for rel, names in render.TARGETS.items():
        blocks = "\n\n".join(f"{render.begin(n)}\n{render.end(n)}" for n in names)
        if rel.endswith(".ipynb"):
            nbformat.write(new_notebook(cells=[new_markdown_cell(blocks)]), tmp / rel)
        else:
            (tmp / rel).write_text(f"# guide\n\n{blocks}\n")
    return tmp


@pytest.mark.slow
@pytest.mark.mpi
def test_timing_script_measures_renders_and_leaves_nothing_running(tmp_path):
    root = _course(tmp_path)
    result = subprocess.run([sys.executable, "-m", "pcourse.tools.workshop.timings", "--root",
                             str(root), "--cell-timeout", "120"],
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout + result.stderr
    data = json.loads((root / timings.DATA).read_text())
    lesson = data["quick"]["runs"]["notebooks/00_tiny.ipynb"]
    assert lesson["status"] == "ok" and lesson["ranks"] == 2
    assert lesson["seconds"] >= 3 and lesson["peak_mib"] > 0
    assert data["quick"]["runs"]["solutions/01_broken.ipynb"]["status"] == \
        "failed: ZeroDivisionError"
    assert data["quick"]["machine"]["cores"] > 0
    orphan = int((root / "notebooks" / "orphan.pid").read_text())
    assert not psutil.pid_exists(orphan) or \
        psutil.Process(orphan).status() == psutil.STATUS_ZOMBIE, "the orphan is still running"
    assert lesson["left_running"] == ["sleep 120"]
    assert "now stopped: sleep 120" in result.stdout
    # the tables now hold the measured time, and the test above holds for this course too
    index = nbformat.read(root / "index.ipynb", as_version=4).cells[0].source
    row = next(r for r in index.splitlines() if "00_tiny.ipynb" in r)
    assert render.duration(lesson["seconds"]) in row and "a tiny lesson" in row
    assert "failed: ZeroDivisionError" in index
    first = nbformat.read(root / "notebooks" / "00_tiny.ipynb", as_version=4).cells[0].source
    assert "**Estimated time:**" in first and render.duration(lesson["seconds"]) in first
    assert all(p.read_text() == t for p, t in render.updated(data, root).items())


def test_timing_script_refuses_an_unknown_notebook(tmp_path):
    root = _course(tmp_path)
    with pytest.raises(SystemExit, match="no lesson or solution called 99_nope"):
        timings.notebooks(root, ["99_nope"])
    assert [p.name for p in timings.notebooks(root, ["01_broken"])] == ["01_broken.ipynb"]


def test_course_entries_refuse_an_unknown_folder():
    with pytest.raises(ValueError, match="unknown folder"):
        course.entries("lessons")


def test_the_gpu_column_reads_gpu_cells_not_words(tmp_path) -> None:
    """Lesson 01 names the NCCL snippet in a function's name and has no GPU cell; lesson
    07's step benchmark picks NCCL by itself where every rank has a GPU."""
    import nbformat

    def lesson(*code: str):
        path = tmp_path / "n.ipynb"
        nbformat.write(nbformat.v4.new_notebook(
            cells=[nbformat.v4.new_code_cell(c) for c in code]), path)
        return render._needs_gpu(tmp_path, path.relative_to(tmp_path))

    assert lesson("average_gradients_as_in_the_nccl_snippet(m)  # cuda, gpu") == "no"
    assert lesson('why = unavailable_reason("nccl")').startswith("optional")
    assert lesson("reason = netns.unavailable_reason()") == "no"  # not a GPU
    assert lesson("rows = stepbench.run_on(mc.view)").startswith("optional")
