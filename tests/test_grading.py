"""Grading: exercises/ is generated from solutions/, and a grade cannot be fooled.

A grader's worst case is a check that passes a wrong answer. So one class is graded,
once per test session, the way an instructor would (``grade_class``, a fresh jailed
job per learner): a learner who solved everything, one who handed in the exercises as
shipped, one wrong answer of each kind in ``tests/grading/wrong.py`` (world size,
missed point, deadlock, saved outputs, tampering), a learner whose notebooks are broken
in every way the grader must survive (invalid JSON, renamed, missing, a hang, a dead
learner process), and hostile learners (``tests/grading/hostile.py``: one probes the
jail, leaves a process behind, patches what its next exercise meets and hands in the
solution file, one plants files, one kills what it can). The other wrong answers are the
test suite's own, trusted code: they are graded by the same runner and checks, several
on one job (``grade(..., trusted=True)``), each only up to the first failure its row
reports (``first_failure_only=True``: what their tests read); the class's wrong answers
are graded that way too, and must get the same rows. The tests below read the rows of both.
"""

from __future__ import annotations

import copy
import csv
import importlib.util
import os
import re
import shutil
import sys
import sysconfig
import textwrap
import time
from pathlib import Path

import nbformat
import pytest

from pcourse.tools.grading import exercises as ex
from pcourse.tools.grading import runner, sandbox, submission
from pcourse.tools.grading.grade import (
    FIRST_FAILURE_ONLY,
    exercise_of,
    exercises,
    grade,
    grade_class,
    main,
    table,
    write_gradebook,
)
from pcourse.tools.grading.job import Job
from pcourse.tools.grading.runner import explain
from pcourse.tools.grading.verdicts import Grade

REPO = Path(__file__).resolve().parents[1]
SOLUTIONS, EXERCISES = REPO / "solutions", REPO / "exercises"
NAMES = sorted(p.stem for p in SOLUTIONS.glob("*.ipynb"))
CLASS_TIMEOUT = 60  # seconds per notebook in the class below; the hang uses all of it
PLANTED = (Path(sysconfig.get_paths()["purelib"]) / "zz_planted.pth",
           REPO / "pcourse" / "tools" / "grading" / "zz_planted.txt",
           SOLUTIONS / "zz_planted.txt")  # the venv first: a .pth runs in every later Python

_spec = importlib.util.spec_from_file_location("wrong_answers", REPO / "tests/grading/wrong.py")
wrong = sys.modules[_spec.name] = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(wrong)
WRONG = wrong.WRONG
_spec = importlib.util.spec_from_file_location("hostile_code", REPO / "tests/grading/hostile.py")
hostile = sys.modules[_spec.name] = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(hostile)
# graded end to end, in the class: the first wrong answer of each kind
END_TO_END = {next((n, label) for n in NAMES for label, w in WRONG[n].items() if w.kind == kind)
              for kind in wrong.KINDS}


def _solution(name: str) -> nbformat.NotebookNode:
    return nbformat.read(SOLUTIONS / f"{name}.ipynb", as_version=4)


def _exercise(name: str) -> nbformat.NotebookNode:
    return nbformat.read(EXERCISES / f"{name}.ipynb", as_version=4)


def inject(exercise: nbformat.NotebookNode, codes: list[str]) -> nbformat.NotebookNode:
    """The exercise with its k-th stub replaced by ``codes[k]`` (indented to fit): a learner."""
    nb = copy.deepcopy(exercise)
    k = 0
    for cell in nb.cells:
        if cell.cell_type != "code":
            continue
        lines, out, i = cell.source.split("\n"), [], 0
        while i < len(lines):
            if lines[i].strip() != ex.YOUR_CODE:
                out.append(lines[i])
                i += 1
                continue
            j = i
            while not lines[j].lstrip().startswith("raise NotImplementedError("):
                j += 1
            if k >= len(codes):
                raise ValueError(f"the exercise has more than {len(codes)} regions to fill")
            indent = re.match(r"\s*", lines[i]).group(0)
            out += textwrap.indent(textwrap.dedent(codes[k]).strip("\n"), indent,
                                   lambda _: True).split("\n")
            k, i = k + 1, j + 1
        cell.source = "\n".join(out)
    if k != len(codes):
        raise ValueError(f"the exercise has {k} regions to fill, {len(codes)} codes given")
    return nb


def _solved(name: str, codes: list | None = None) -> nbformat.NotebookNode:
    """The exercise filled in: the solution's code, or ``codes`` (RIGHT/UNSOLVED allowed)."""
    real = ex.solution_regions(_solution(name))
    codes = real if codes is None else [
        real[k] if c is wrong.RIGHT else
        'raise NotImplementedError("not written")' if c is wrong.UNSOLVED else c
        for k, c in enumerate(codes)]
    return inject(_exercise(name), codes)


def _wrong_learner(name: str, label: str) -> str:
    return f"wrong-{name[:2]}-{list(WRONG[name]).index(label):02d}"


def _write(nb: nbformat.NotebookNode, path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    nbformat.write(nb, path)


def _class(folder: Path, trusted: Path) -> None:
    """The class described in the module docstring; the trusted wrong answers in ``trusted``."""
    for name in NAMES:
        _write(_solved(name), folder / "solved" / f"{name}.ipynb")
        _write(_exercise(name), folder / "shipped" / f"{name}.ipynb")
        for label, w in WRONG[name].items():
            nb = _solved(name, w.codes)
            if w.edit:
                w.edit(nb, _solution(name))
            _write(nb, trusted / _wrong_learner(name, label) / f"{name}.ipynb")
            if (name, label) in END_TO_END:  # and graded whole, in the class
                _write(nb, folder / _wrong_learner(name, label) / f"{name}.ipynb")
    broken = folder / "broken"
    broken.mkdir()
    (broken / f"{NAMES[0]}.ipynb").write_text('{"cells": [ this is not JSON')
    _write(_solved(NAMES[1]), broken / f"{NAMES[1]} (1).ipynb")  # renamed; NAMES[2] missing
    hang = _solved(NAMES[3])
    wrong.learner_adds("import time\ntime.sleep(10_000)")(hang, None)
    _write(hang, broken / f"{NAMES[3]}.ipynb")
    crash = _solved(NAMES[4])
    wrong.learner_adds("import os\nos._exit(1)")(crash, None)
    _write(crash, broken / f"{NAMES[4]}.ipynb")
    kill = _solved(NAMES[5], ["import os\nos._exit(3)"])  # in a trial: a learner process dies
    _write(kill, broken / f"{NAMES[5]}.ipynb")
    _write(_solved(NAMES[6]), broken / f"{NAMES[6]}.ipynb")
    killer = _solved(NAMES[0])
    wrong.learner_adds(wrong.KILL_EVERYTHING)(killer, None)
    _write(killer, folder / "killer" / f"{NAMES[0]}.ipynb")
    planter = _solved(NAMES[1])  # writes into the venv, the course's references, solutions/
    wrong.learner_adds(wrong.plant(*map(str, PLANTED)))(planter, None)
    _write(planter, folder / "planter" / f"{NAMES[1]}.ipynb")
    # one hostile learner (one cluster): probes the jail, leaves a process behind, and
    # hands in the solution file itself
    prober = _solved(NAMES[0])  # who it runs as, and what it can read and undo
    wrong.learner_adds(hostile.probe(_secrets(folder)))(prober, None)
    _write(prober, folder / "hostile" / f"{NAMES[0]}.ipynb")
    leaver = _solved(NAMES[2])  # a process left behind, writing the class's grades
    wrong.learner_adds(hostile.daemon(list(map(str, _grades_files(folder)))))(leaver, None)
    _write(leaver, folder / "hostile" / f"{NAMES[2]}.ipynb")
    shutil.copyfile(SOLUTIONS / f"{NAMES[3]}.ipynb",
                    _mkdir(folder / "hostile") / f"{NAMES[3]}.ipynb")
    patcher = _solved(NAMES[4])  # patches what its process holds, for its next exercise
    wrong.learner_adds(hostile.PATCH_MODULES)(patcher, None)
    _write(patcher, folder / "hostile" / f"{NAMES[4]}.ipynb")
    finder = _solved(NAMES[5])
    wrong.learner_adds(hostile.FIND_PATCH_IN_MODULES)(finder, None)
    _write(finder, folder / "hostile" / f"{NAMES[5]}.ipynb")


def _row(g: Grade) -> str:
    """A row in a line, for a failed assertion (a Grade's repr is cut short by pytest)."""
    return (f"{g.learner}/{g.exercise}: {g.status}, {g.passed}/{g.total} in {g.seconds:.1f} s: "
            f"{g.first_failure} {g.notes}")


def _mkdir(path: Path) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    return path


def _secrets(folder: Path) -> list[str]:
    """What learner code must not read: solutions, tests, history, other learners, the
    grader's output, every kernel's connection file (in the home folder), the machine's
    passwords."""
    from jupyter_core.paths import jupyter_runtime_dir

    return [str(SOLUTIONS), str(REPO / "tests"), str(REPO / ".git"),
            str(folder / "solved" / f"{NAMES[0]}.ipynb"), str(folder), jupyter_runtime_dir(),
            "/etc/shadow"]


def _grades_files(folder: Path) -> list[Path]:
    return [folder / "grades.csv", folder / "grades.partial.csv", folder / "pwned.txt"]


@pytest.fixture(scope="module")
def graded(tmp_path_factory) -> dict[tuple[str, str], Grade]:
    _jailed()  # a class is graded only in the jail
    folder, trusted = tmp_path_factory.mktemp("class"), tmp_path_factory.mktemp("trusted")
    _class(folder, trusted)
    start = time.monotonic()
    rows = grade_class(folder, jobs=2, timeout=CLASS_TIMEOUT)
    write_gradebook(rows, folder)
    (folder / "table.txt").write_text(table(rows))
    middle = time.monotonic()
    paths = sorted(trusted.glob("*/*.ipynb"))
    more = grade(paths, jobs=2, timeout=CLASS_TIMEOUT, learners=[f"{p.parent.name}-first"
                                                                   for p in paths],
                 trusted=True, first_failure_only=True)
    print(f"\nclass graded in {middle - start:.0f} s ({len(rows)} rows), trusted wrong answers "
          f"in {time.monotonic() - middle:.0f} s ({len(more)} rows)")
    graded = {(g.learner, g.exercise): g for g in rows + more}
    graded["folder"] = folder  # type: ignore[assignment]
    return graded


# ---------------------------------------------------------------- generation (fast)

def test_every_exercise_has_six_wrong_answers_and_every_kind_is_covered():
    assert set(WRONG) == set(NAMES) and len(NAMES) >= 7
    assert all(len(answers) >= 6 for answers in WRONG.values())
    kinds = {w.kind for answers in WRONG.values() for w in answers.values()}
    assert kinds == set(wrong.KINDS)


def test_exercises_are_generated_from_the_solutions():
    assert ex.stale(SOLUTIONS, EXERCISES) == [], "run `make exercises` and commit the result"


def test_stale_exercises_are_detected(tmp_path):
    shutil.copytree(EXERCISES, tmp_path / "ex")
    victim = tmp_path / "ex" / f"{NAMES[0]}.ipynb"
    nb = nbformat.read(victim, as_version=4)
    next(c for c in nb.cells if "check" in c.metadata.get("tags", [])).source += "\n# edited"
    nbformat.write(nb, victim)
    (tmp_path / "ex" / "99_orphan.ipynb").write_text(victim.read_text())
    problems = ex.stale(SOLUTIONS, tmp_path / "ex")
    assert any(victim.name in p and "differs" in p for p in problems)
    assert any("99_orphan" in p for p in problems)


@pytest.mark.parametrize("name", NAMES)
def test_exercise_hides_the_solution_and_shows_no_outputs(name):
    solution, exercise = _solution(name), _exercise(name)
    regions = ex.solution_regions(solution)
    assert regions, "a solution must mark what the learner writes"
    text = "\n".join(c.source for c in exercise.cells)
    assert ex.BEGIN not in text and ex.END not in text and "### HINT" not in text
    assert text.count("raise NotImplementedError(") == len(regions)
    for sol, exe in zip(solution.cells, exercise.cells, strict=True):
        if exe.cell_type == "code":  # no PASS under a check before the learner wrote a line
            assert exe.outputs == [] and exe.execution_count is None
        if "check" in exe.metadata.get("tags", []):  # the solution keeps what checks print
            assert re.fullmatch(r"check \d+/\d+ .*: PASS\n", sol.outputs[0]["text"])
    assert sum("check" in c.metadata.get("tags", []) for c in exercise.cells) >= 3
    submission.compare(solution, exercise)  # the solution grades as a learner's notebook


def test_markers_must_pair_up():
    with pytest.raises(ex.MarkerError, match="never closed"):
        ex.strip_solutions("x = 1\n### BEGIN SOLUTION\ny = 2")
    with pytest.raises(ex.MarkerError, match="without"):
        ex.strip_solutions("### END SOLUTION")
    with pytest.raises(ex.MarkerError, match="inside another"):
        ex.strip_solutions("### BEGIN SOLUTION\n### BEGIN SOLUTION\n### END SOLUTION")


def test_strip_and_inject_round_trip():
    source = ("def f(x):\n    y = 1\n    ### BEGIN SOLUTION\n    ### HINT: add one\n"
              "    return x + y\n    ### END SOLUTION")
    stub = ex.strip_solutions(source)
    assert stub == ("def f(x):\n    y = 1\n    # YOUR CODE HERE\n    # Hint: add one\n"
                    "    raise NotImplementedError('add one')")
    nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(stub)])
    filled = inject(nb, ["return x - y"])
    assert filled.cells[0].source == "def f(x):\n    y = 1\n    return x - y"
    with pytest.raises(ValueError, match="1 regions"):
        inject(nb, ["a", "b"])


# ---------------------------------------------------------------- what the learner's code meets

def test_the_checks_communicator_counts_blocks_honestly_and_gives_up_on_deadlocks(mpi_run):
    """Synchronous sends, deadlines on every wait, reversed sub-worlds (tests/mpi)."""
    out = mpi_run(3, "check_grading_trials.py", timeout=120)
    assert out.count(": ok") == 3, out


# ---------------------------------------------------------------- reading a submission (fast)

def test_failures_are_explained_in_plain_words():
    assert explain("at 2 ranks, rank 0 raised NotImplementedError: write it").startswith(
        "not solved yet")
    assert explain("at 3 ranks, rank 1: tensor 0 is off\n  in f, line 3") == \
        "at 3 ranks, rank 1: tensor 0 is off"


def test_a_file_names_its_exercise():
    known = exercises(SOLUTIONS)
    assert exercise_of(Path("x/02_average_gradients.ipynb"), known) == "02_average_gradients"
    assert exercise_of(Path("02_average_gradients__v2.ipynb"), known) == "02_average_gradients"
    assert exercise_of(Path("02_average_gradients (1).ipynb"), known) is None


@pytest.mark.parametrize("text,reason", [('{"cells": [', "not valid JSON"),
                                         ("{}", "not a valid notebook"),
                                         ("\x89PNG\x00\xff", "not")])
def test_a_file_that_is_not_a_notebook_is_rejected(tmp_path, text, reason):
    path = tmp_path / "nb.ipynb"
    path.write_bytes(text.encode("latin-1"))
    with pytest.raises(submission.Rejected, match=reason) as info:
        submission.read(path)
    assert info.value.kind == "invalid"


def test_the_grader_runs_the_learners_cells_and_the_setups_imports_only():
    """What the grader runs of a notebook: the setup's imports (not the course's: the checks
    are its own), then the learner's cells; edited check cells and saved outputs are noted
    and never read."""
    name = NAMES[1]
    nb = _solved(name)
    wrong.saved("FAIL: forged")(nb, _solution(name))
    wrong.check_prints_pass(0)(nb, _solution(name))
    nb.cells.append(nbformat.v4.new_code_cell(""))  # Jupyter's trailing empty cell: harmless
    code = submission.learner_code(nb, _solution(name), name)
    mine = [c.source for c in nb.cells if "exercise" in c.metadata.get("tags", [])]
    assert code.codes[1:] == mine
    assert code.codes[0] == "import numpy as np\nimport torch\nfrom mpi4py import MPI"
    assert code.notes == [f"cell {nb.cells.index(wrong._checks(nb)[0])} edited; graded with "
                          "the course's own"]


class _Job(Job):
    """A job whose ranks answer each trial with ``answers`` (no processes)."""

    def __init__(self, answers: list) -> None:
        self.n, self.broken, self.opened, self.jailed, self.answers = 4, "", 1, True, answers

    def trial(self, spec: tuple, ranks: int, timeout: float) -> tuple[list, bool]:
        return self.answers, True

    def close(self) -> None:
        pass


def _trial() -> None:
    """Stands for a trial: it is named, and never run here."""


def test_results_are_placed_by_their_rank_in_the_world_never_by_a_label():
    """Each rank's place in a trial's world is known where the checks run (the sub-world
    numbers the last ranks in reverse); a result's own label is never read, and a rank
    that answers out of its turn is refused."""
    from pcourse.tools.grading import checks, wire

    def answer(value: str, label: int | None) -> dict:
        return {"rank": label, "value": wire.dumps(value), "calls": []}

    # 4 ranks, a 3-rank world: world ranks 1, 2, 3 are its ranks 2, 1, 0
    honest = [None, answer("c", 2), answer("b", 1), answer("a", 0)]
    assert checks.run(_Job(honest), _trial, ranks=3) == ["a", "b", "c"]
    lying = [None, answer("c", 0), answer("b", 0), answer("a", 7)]
    assert checks.run(_Job(lying), _trial, ranks=3) == ["a", "b", "c"]
    for out_of_turn in ([*honest[:3], None], [answer("d", 3), *honest[1:]]):
        with pytest.raises(checks.ExerciseError, match="answered out of turn"):
            checks.run(_Job(out_of_turn), _trial, ranks=3)
    failed = [None, answer("c", 2), {"rank": 0, "error": ("ValueError", "no", "")},
              answer("a", 0)]
    with pytest.raises(checks.ExerciseError, match="at 3 ranks, rank 1 raised ValueError: no"):
        checks.run(_Job(failed), _trial, ranks=3)  # said at its place, not its label


def test_a_job_that_fails_to_start_is_a_row_and_the_next_exercise_gets_another(monkeypatch):
    from pcourse.tools.grading import job as jobs

    started = []

    class Flaky:
        def __init__(self, jailed: bool) -> None:
            started.append(jailed)
            if len(started) == 1:
                raise jobs.JobError("the grader's 4 ranks did not start within 120 s")
            self.broken = ""

        def close(self) -> None:
            started.append("closed")

    monkeypatch.setattr(jobs, "Job", Flaky)
    monkeypatch.setattr(runner, "grade_exercise",
                        lambda job, task: runner.Result(passed=1, total=1))
    said = []
    tasks = [runner.Task(k, NAMES[0], [""], 60) for k in range(3)]
    runner.grade_batch(tasks, True, lambda key, result: said.append((key, result)))
    assert [r.status for _, r in said] == ["error", "graded", "graded"]
    assert "did not start" in said[0][1].first_failure
    assert started == [True, True, "closed"]  # one job after the failure, closed at the end


def test_a_class_is_graded_only_in_the_jail(tmp_path, monkeypatch, capsys):
    """Without bubblewrap the class grader refuses, saying how to install it; one
    notebook is graded all the same, each of its rows saying it was not sandboxed."""
    from pcourse.tools.grading import grade as grading

    _mkdir(tmp_path / "ann")
    monkeypatch.setattr(sandbox, "bwrap", lambda: None)
    with pytest.raises(grading.NoJail, match="apt-get install bubblewrap"):
        grade_class(tmp_path)
    with pytest.raises(SystemExit):
        main(["--class", str(tmp_path)])
    assert "apt-get install bubblewrap" in capsys.readouterr().err
    (note,) = grading.isolation_notes()
    assert note.startswith("not sandboxed:") and "bubblewrap" in note


SETUP = "import numpy as np\nfrom mpi4py import MPI\nfrom pcourse.tools.grading.checks import " \
    "run\n" \
        "mc = start()\n"
THEIRS = "def f(comm):\n    pass\n"


@pytest.mark.parametrize("code", [
    "def f(comm):\n    x = np.zeros(3)\n    comm.Allreduce(MPI.IN_PLACE, x, op=MPI.SUM)\n",
    "import numpy as np\nfrom mpi4py import MPI\nimport torch.nn.functional as F\n",
    "def helper(p):\n    p.grad = None\n    p.data[0] = 1\n\ndef f(comm):\n    helper(comm)\n",
    "def f(comm):\n    import os\n    os.environ['MASTER_PORT'] = '1234'\n",
    "class Box:\n    def __init__(self):\n        self.x = 1\n\nbox = Box()\nbox.x = 2\n",
    "def f(comm):\n    sum = 0\n    for i in range(3):\n        sum += i\n    return sum\n",
])
def test_ordinary_learner_code_is_not_called_tampering(code):
    assert submission.tampering([code], [SETUP], [THEIRS]) == []


@pytest.mark.parametrize("code,found", [
    ("def run(*a, **k):\n    return []\n", "rebinds `run`"),
    ("import numpy as MPI\n", "rebinds `MPI`"),
    ("print = lambda *a: None\n", "rebinds `print`"),
    ("def f(comm):\n    global run\n    run = None\n", "global run"),
    ("np.allclose = lambda *a, **k: True\n", "changes `np.allclose`"),
    ("def f(comm):\n    MPI.COMM_WORLD.Allreduce = None\n", "changes `MPI.COMM_WORLD.Allreduce`"),
    ("def f(comm):\n    import pcourse.tools.grading.refs as r\n    r.names = list\n",
     "course's own"),
    ("exec('run = None')\n", "uses `exec`"),
    ("globals()['run'] = None\n", "uses `globals`"),
    ("%time x = 1\n", "IPython magic"),
    ("import sys\nsys.modules['pcourse.tools.grading.checks'].line = print\n", "imports sys"),
    ("x = mc.view\n", "uses `mc`"),
    ("f = (lambda: 0).__globals__\n", "__globals__"),
])
def test_code_that_reaches_for_the_checks_is_tampering(code, found):
    problems = submission.tampering([code], [SETUP], [THEIRS])
    assert any(found in p for p in problems), problems


def test_code_that_does_not_parse_is_rejected_before_running():
    with pytest.raises(submission.Rejected, match="line 1") as info:
        submission.tampering(["def f(:\n    pass"], [SETUP], [THEIRS])
    assert info.value.kind == "syntax"


def test_the_command_line_grades_a_class_and_writes_the_gradebook(tmp_path, capsys):
    """Notebooks the grader rejects unread need no job: this runs in a second."""
    _jailed()
    (tmp_path / "ann").mkdir()
    (tmp_path / "ann" / f"{NAMES[0]}.ipynb").write_text("not json")
    tampered = _solved(NAMES[1])
    wrong.drop_check(0)(tampered, None)
    _write(tampered, tmp_path / "bob" / f"{NAMES[1]}.ipynb")
    assert main(["--class", str(tmp_path), "--out", str(tmp_path / "out")]) == 0
    printed = capsys.readouterr().out
    assert "not valid JSON" in printed and "removed" in printed and "TOTAL" in printed
    with open(tmp_path / "out" / "grades.csv") as f:
        rows = list(csv.DictReader(f))
    assert len(rows) == 2 * len(NAMES)
    assert {r["status"] for r in rows} == {"invalid", "tampered", "missing"}
    with open(tmp_path / "out" / "gradebook.csv") as f:
        book = {r["learner"]: r for r in csv.DictReader(f)}
    assert set(book) == {"ann", "bob"} and book["ann"]["checks_passed"] == "0"
    assert not list((tmp_path / "out").glob(".*"))  # written atomically: no temporary left


def test_rows_are_on_disk_as_soon_as_they_are_decided(tmp_path):
    """A grader that dies halfway leaves every finished row in grades.partial.csv."""
    _jailed()
    from pcourse.tools.grading.grade import RowLog

    tampered = _solved(NAMES[1])
    wrong.drop_check(0)(tampered, None)  # rejected unrun: no job needed
    _write(tampered, tmp_path / "ann" / f"{NAMES[1]}.ipynb")
    log = RowLog(tmp_path / "grades.partial.csv")
    seen = []
    rows = grade_class(tmp_path, progress=lambda g: (log(g), seen.append(
        len(list(csv.DictReader(log.path.read_text().splitlines()))))))
    assert seen == list(range(1, len(NAMES) + 1))  # each row written before the next
    with open(log.path) as f:
        partial = list(csv.DictReader(f))
    assert {(r["learner"], r["exercise"], r["status"]) for r in partial} == {
        (g.learner, g.exercise, g.status) for g in rows}
    log.done()
    assert not log.path.exists()


def test_both_modes_find_a_learners_notebook_by_the_same_names(tmp_path, capsys):
    """NAME__v2 is graded in a class as alone; a copy named for nothing is called renamed."""
    _jailed()
    tampered = _solved(NAMES[1])
    wrong.drop_check(0)(tampered, None)  # rejected unrun: no job needed
    _write(tampered, tmp_path / "ann" / f"{NAMES[1]}__v2.ipynb")
    _write(tampered, tmp_path / "bob" / f"{NAMES[1]}.ipynb")
    _write(_exercise(NAMES[1]), tmp_path / "bob" / f"{NAMES[1]}__old.ipynb")
    _write(_exercise(NAMES[2]), tmp_path / "cat" / "my ring.ipynb")
    _write(tampered, tmp_path / "cat" / f"{NAMES[1]}__a.ipynb")
    _write(tampered, tmp_path / "cat" / f"{NAMES[1]}__b.ipynb")
    rows = {(g.learner, g.exercise): g for g in grade_class(tmp_path)}
    assert rows["ann", NAMES[1]].status == "tampered"  # found, read and judged
    assert rows["bob", NAMES[1]].status == "tampered"
    assert rows["bob", NAMES[1]].notes[0] == f"graded {NAMES[1]}.ipynb, not {NAMES[1]}__old.ipynb"
    several = rows["cat", NAMES[1]]
    assert several.status == "invalid" and "several versions" in several.first_failure
    assert rows["cat", NAMES[2]].status == "renamed"
    assert "my ring.ipynb" in rows["cat", NAMES[2]].first_failure
    assert rows["cat", NAMES[2]].total > 0 and rows["ann", NAMES[2]].status == "missing"
    main([str(tmp_path / "ann" / f"{NAMES[1]}__v2.ipynb"), str(tmp_path / "cat" / "my ring.ipynb")])
    printed = capsys.readouterr().out
    assert "removed" in printed and f"renamed: my ring.ipynb looks like {NAMES[2]}" in printed


def test_an_unwritable_out_is_refused_before_grading(tmp_path, capsys, monkeypatch):
    _write(_exercise(NAMES[0]), tmp_path / "ann" / f"{NAMES[0]}.ipynb")
    graded = []
    monkeypatch.setattr("pcourse.tools.grading.grade.grade_class", lambda *a: graded.append(a))
    a_file = tmp_path / "a-file"
    a_file.write_text("")
    for out in (a_file, a_file / "grades"):
        with pytest.raises(SystemExit) as exit_:
            main(["--class", str(tmp_path), "--out", str(out)])
        assert exit_.value.code == 2 and "Nothing was graded" in capsys.readouterr().err
    assert graded == []


# ---------------------------------------------------------------- one class, graded once

@pytest.mark.slow
@pytest.mark.mpi
@pytest.mark.timeout(3000)
@pytest.mark.parametrize("name", NAMES)
def test_a_solved_exercise_passes(graded, name):
    g = graded[("solved", name)]
    assert g.ok and g.passed == g.total >= 3, _row(g)


@pytest.mark.slow
@pytest.mark.mpi
@pytest.mark.timeout(3000)
@pytest.mark.parametrize("name", NAMES)
def test_a_shipped_exercise_fails_as_unsolved(graded, name):
    g = graded[("shipped", name)]
    assert not g.ok and g.passed == 0 and g.total >= 3, _row(g)
    assert "not solved yet" in g.first_failure, _row(g)


@pytest.mark.slow
@pytest.mark.mpi
@pytest.mark.timeout(3000)
@pytest.mark.parametrize("name,label", [(n, label) for n in NAMES for label in WRONG[n]])
def test_a_wrong_answer_is_rejected(graded, name, label):
    g = graded[(f"{_wrong_learner(name, label)}-first", name)]
    print(table([g]))
    assert not g.ok, f"the grader passed a wrong answer ({label}): {g}"
    assert g.passed < g.total
    assert WRONG[name][label].mention in g.first_failure, _row(g)


@pytest.mark.slow
@pytest.mark.mpi
@pytest.mark.timeout(3000)
@pytest.mark.parametrize("name,label", sorted(END_TO_END))
def test_grading_to_the_first_failure_reports_what_grading_everything_does(graded, name, label):
    whole, first = (graded[(f"{_wrong_learner(name, label)}{end}", name)] for end in ("", "-first"))
    assert (first.status, first.first_failure) == (whole.status, whole.first_failure), \
        (whole, first)
    assert FIRST_FAILURE_ONLY not in whole.notes and first.passed <= whole.passed
    if whole.first_failure.startswith("check "):  # the checks up to it agree, none ran after
        k = next(i for i, c in enumerate(whole.checks) if not c.passed)
        assert first.checks[:k + 1] == whole.checks[:k + 1], (whole.checks, first.checks)
        assert all(c.output.startswith("did not run") for c in first.checks[k + 1:]), first.checks
        assert (FIRST_FAILURE_ONLY in first.notes) == (k + 1 < len(whole.checks)), first


@pytest.mark.slow
@pytest.mark.mpi
@pytest.mark.timeout(3000)
def test_broken_notebooks_get_rows_of_their_own_and_the_rest_is_graded(graded):
    row = {name: graded[("broken", name)] for name in NAMES}
    assert row[NAMES[0]].status == "invalid" and "JSON" in row[NAMES[0]].first_failure
    assert row[NAMES[1]].status == "renamed" and "(1).ipynb" in row[NAMES[1]].first_failure
    assert row[NAMES[2]].status == "missing"
    # a learner's cell runs in the learner processes only: a hang or an exit there is theirs
    assert row[NAMES[3]].passed == 0 and "your code" in row[NAMES[3]].first_failure
    assert "did not finish" in row[NAMES[3]].first_failure
    assert row[NAMES[4]].passed == 0 and "died" in row[NAMES[4]].first_failure
    assert row[NAMES[5]].passed == 0 and "died" in row[NAMES[5]].first_failure
    assert row[NAMES[6]].ok, _row(row[NAMES[6]])  # graded after all that


@pytest.mark.slow
@pytest.mark.mpi
@pytest.mark.timeout(3000)
def test_a_learner_cannot_write_into_the_solutions_or_the_course(graded):
    g = graded[("planter", NAMES[1])]
    try:
        assert not any(p.exists() for p in PLANTED), "the learner's code wrote into the course"
    finally:
        for p in PLANTED:
            p.unlink(missing_ok=True)
    assert g.passed == 0 and "Read-only file system" in g.first_failure, _row(g)


@pytest.mark.slow
@pytest.mark.mpi
@pytest.mark.timeout(3000)
def test_a_learner_who_kills_everything_it_can_reach_hurts_only_itself(graded):
    g = graded[("killer", NAMES[0])]
    assert g.status != "error" and g.passed == 0, g  # its own row, its own failure
    assert "died" in g.first_failure or "did not finish" in g.first_failure, _row(g)
    others = [h for key, h in graded.items()
              if isinstance(key, tuple) and key[0] in ("solved", "shipped")]
    assert all(h.status == "graded" for h in others), \
        [_row(h) for h in others if h.status != "graded"]


@pytest.mark.slow
@pytest.mark.mpi
@pytest.mark.timeout(3000)
def test_the_gradebook_has_a_row_per_learner_and_exercise(graded):
    folder = graded["folder"]
    with open(folder / "grades.csv") as f:
        rows = list(csv.DictReader(f))
    learners = {r["learner"] for r in rows}
    assert len(rows) == len(learners) * len(NAMES)
    with open(folder / "gradebook.csv") as f:
        book = {r["learner"]: r for r in csv.DictReader(f)}
    assert book["solved"]["exercises_passed"] == str(len(NAMES))
    assert book["solved"]["checks_passed"] == book["solved"]["checks_total"]
    assert book["shipped"]["checks_passed"] == "0"
    assert book["broken"]["exercises_passed"] == "1"


# ---------------------------------------------------------------- hostile learners

def _jailed() -> None:
    from pcourse.tools.grading import sandbox

    ok, why = sandbox.available()
    if not ok:
        if os.environ.get("PCOURSE_REQUIRE_SANDBOX"):  # CI: a missing jail fails, never skips
            pytest.fail(f"PCOURSE_REQUIRE_SANDBOX is set but there is no jail here: {why}")
        pytest.skip(f"no jail here ({why}): every row says so instead")


@pytest.mark.slow
@pytest.mark.mpi
@pytest.mark.timeout(3000)
def test_learner_code_runs_as_nobody_without_privileges_network_or_the_course(graded):
    """Graded as root, learner code is nobody, can undo nothing and read nothing of ours,
    and nothing in its environment says it is graded."""
    _jailed()
    g = graded[("hostile", NAMES[0])]
    assert g.passed == 0, _row(g)
    _assert_jailed(g.first_failure)


ORDINARY = 4242  # the id an ordinary user's grader runs as, below


@pytest.mark.slow
@pytest.mark.mpi
@pytest.mark.timeout(600)
def test_graded_by_an_ordinary_user_learner_code_is_jailed_the_same(tmp_path):
    """The grader run by an ordinary user (uid 4242 in a user namespace of its own: not
    root, no capabilities) takes the jail's other path, a user namespace of bubblewrap's,
    and the learner's code meets the same walls."""
    import subprocess

    _jailed()
    if subprocess.run(["unshare", "--user", "true"], capture_output=True).returncode:
        if os.environ.get("PCOURSE_REQUIRE_SANDBOX"):
            pytest.fail("PCOURSE_REQUIRE_SANDBOX is set but this machine has no user namespaces")
        pytest.skip("this machine refuses user namespaces: no ordinary user can jail here")
    prober = _solved(NAMES[0])
    wrong.learner_adds(hostile.probe(_secrets(tmp_path)))(prober, None)
    _write(prober, tmp_path / "ann" / f"{NAMES[0]}.ipynb")
    grader = (f"import os; assert os.geteuid() == {ORDINARY}\n"
              "from pcourse.tools.grading.grade import main; raise SystemExit(main())")
    done = subprocess.run(
        ["unshare", "--user", f"--map-user={ORDINARY}", f"--map-group={ORDINARY}", sys.executable,
         "-c", grader, "--class", str(tmp_path), "--timeout", str(CLASS_TIMEOUT)],
        capture_output=True, text=True, timeout=500, cwd=REPO)
    assert done.returncode in (0, 1), done  # 1: not every exercise passed
    with open(tmp_path / "grades.csv", newline="") as f:
        row = next(r for r in csv.DictReader(f) if r["exercise"] == NAMES[0])
    assert row["checks_passed"] == "0" and "sandbox" not in row["notes"], row
    _assert_jailed(row["first_failure"])


def _assert_jailed(first_failure: str) -> None:
    """What hostile.probe found, raised as the notebook's first failure: nobody, no
    capabilities, a seccomp filter, no way out, a network of its own, nothing of ours."""
    assert "HOSTILE" in first_failure, first_failure
    seen = hostile.report(first_failure)
    assert seen["uid"] == "65534" and seen["caps"] == "0000000000000000", seen
    assert seen["nnp"] == "1" and seen["seccomp"] == "2", seen  # 2: a filter
    assert all(seen[k] != "0" for k in ("umount", "remount", "unshare")), seen
    assert seen["ifaces"] == "lo", seen  # a network of its own: its rank is a unix socket
    assert seen["others"] == "0", seen  # alone: no rank, no mpiexec, no other learner in sight
    assert seen["seen"] == "-", f"learner code read {seen['seen']}"
    assert seen["env"] == "-", f"the grader's variables in its environment: {seen['env']}"


@pytest.mark.slow
@pytest.mark.mpi
@pytest.mark.timeout(3000)
def test_a_process_left_behind_dies_with_its_learner_and_writes_no_grade(graded):
    _jailed()
    g = graded[("hostile", NAMES[2])]
    assert g.ok, g  # the code was right: only what it left behind is hostile
    time.sleep(1.0)  # it wrote every 0.1 s, had it lived
    left = [p for p in os.listdir("/proc") if p.isdigit()
            and hostile.DAEMON_MARK.encode() in _cmdline(p)]
    assert left == [], f"processes {left} outlived the grading"
    files = _grades_files(graded["folder"])
    assert not any(p.exists() and b"pwned" in p.read_bytes() for p in files), files


def _cmdline(pid: str) -> bytes:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return b""


@pytest.mark.slow
@pytest.mark.mpi
@pytest.mark.timeout(3000)
def test_what_one_exercise_patches_the_learners_next_exercise_never_meets(graded):
    """Each exercise runs in a fresh child of the learner processes: a module or a builtin
    patched in one is as imported in the next."""
    assert graded[("hostile", NAMES[4])].ok, _row(graded[("hostile", NAMES[4])])
    found = graded[("hostile", NAMES[5])]
    assert "HOSTILE found=|" in found.first_failure, _row(found)


@pytest.mark.slow
@pytest.mark.mpi
@pytest.mark.timeout(3000)
def test_the_solution_handed_in_is_noted_in_its_row(graded):
    g = graded[("hostile", NAMES[3])]
    assert "byte for byte the course's own solution file" in g.notes, _row(g)


@pytest.mark.slow
@pytest.mark.mpi
@pytest.mark.timeout(600)
def test_what_one_learner_leaves_behind_the_next_never_meets(tmp_path):
    """One worker, two learners in turn: the second gets a fresh job, not the first's."""
    _jailed()
    first, second = _solved(NAMES[0]), _solved(NAMES[0])  # (one worker: -j 1)
    wrong.learner_adds(hostile.PATCH)(first, None)
    wrong.learner_adds(hostile.FIND_PATCH)(second, None)
    _write(first, tmp_path / "a-patcher" / f"{NAMES[0]}.ipynb")
    _write(second, tmp_path / "b-next" / f"{NAMES[0]}.ipynb")
    rows = {g.learner: g for g in grade_class(tmp_path, jobs=1, timeout=CLASS_TIMEOUT)
            if g.exercise == NAMES[0]}
    assert rows["a-patcher"].ok, rows["a-patcher"]  # planting broke nothing of its own
    assert "HOSTILE found=|" in rows["b-next"].first_failure, rows["b-next"]


def test_every_file_in_a_learners_folder_gets_its_own_row(tmp_path):
    """Folders, FIFOs, links (to /dev/zero, to the solution), deep JSON, huge files,
    names that are not UTF-8, a grades.csv of a learner's: rows, not a crash or a hang.
    All are refused unrun: no job needed."""
    _jailed()
    ann = _mkdir(tmp_path / "ann")
    (ann / f"{NAMES[0]}.ipynb").mkdir()
    os.mkfifo(ann / f"{NAMES[1]}.ipynb")
    (ann / f"{NAMES[2]}.ipynb").symlink_to("/dev/zero")
    (ann / f"{NAMES[3]}.ipynb").write_text("[" * 100_000 + "]" * 100_000)
    (ann / f"{NAMES[4]}.ipynb").symlink_to(SOLUTIONS / f"{NAMES[4]}.ipynb")
    with open(ann / f"{NAMES[5]}.ipynb", "wb") as f:
        f.truncate(submission.MAX_BYTES + 1)  # sparse: costs no disk
    deep = _solved(NAMES[6], [*ex.solution_regions(_solution(NAMES[6]))])
    wrong.learner_adds("x = " + "(" * 150 + "1" + ")" * 150 + "\ny = " + "-" * 100_000 + "1")(
        deep, None)
    _write(deep, ann / f"{NAMES[6]}.ipynb")
    odd = _mkdir(Path(os.fsdecode(bytes(tmp_path) + b"/caf\xe9")))
    (odd / f"{NAMES[0]}.ipynb").write_text("not json")
    (odd / os.fsdecode(b"\xff\n.ipynb")).write_text("{}")
    gamer = _mkdir(tmp_path / "gamer")
    for f in ("grades.csv", "grades.partial.csv"):
        (gamer / f).write_text("learner,exercise\n")
    (gamer / f"{NAMES[0]}.ipynb").write_text("not json")
    assert main(["--class", str(tmp_path), "--out", str(tmp_path / "out")]) == 0
    with open(tmp_path / "out" / "grades.csv", encoding="utf-8") as f:
        rows = {(r["learner"], r["exercise"]): r for r in csv.DictReader(f)}
    assert {learner for learner, _ in rows} == {"ann", "caf\ufffd", "gamer"}
    assert len(rows) == 3 * len(NAMES)
    why = {k: rows["ann", n]["first_failure"] for k, n in enumerate(NAMES)}
    assert "a folder" in why[0] and "not a regular file" in why[1], why
    assert "symbolic link (to /dev/zero)" in why[2] and "nested too deeply" in why[3], why
    assert "symbolic link" in why[4] and "course's own solution" in rows["ann", NAMES[4]]["notes"]
    assert "MiB" in why[5] and "nested too deeply" in why[6], why
    assert all(rows["ann", n]["status"] in ("invalid", "syntax") for n in NAMES[:7])
    assert rows["gamer", NAMES[0]]["status"] == "invalid"  # still a learner of the class
    assert "?" in rows["caf\ufffd", NAMES[1]]["first_failure"] or \
        rows["caf\ufffd", NAMES[1]]["status"] == "missing"


def _prefix(folder: Path, groups: bool = False) -> list[str]:
    """The jail of a job in ``folder`` (what Job gives its MPI ranks), for a command."""
    sockets = _mkdir(folder / "sockets")
    return sandbox.prefix(folder, sockets, folder / "seccomp.bpf",
                          groups=sandbox.cgroups(folder) if groups else (),
                          relay=_mkdir(folder / "relay"), env={"PATH": "/usr/bin:/bin"})


def test_the_jail_holds_without_a_job(tmp_path):
    """What any process in the jail is and may do (a second: no ranks, no MPI)."""
    import subprocess

    _jailed()
    prefix = _prefix(_mkdir(tmp_path / "job"))
    sockets = tmp_path / "job" / "sockets"
    os.chmod(sockets, 0o777)
    script = (
        'id -u; grep -E "^(CapEff|NoNewPrivs|Seccomp):" /proc/self/status; '
        f'ls {SOLUTIONS} {REPO / "tests"} /etc/shadow {Path.home()} >/dev/null 2>&1; echo ls=$?; '
        f'touch {sysconfig.get_paths()["purelib"]}/zz.pth 2>/dev/null; echo venv=$?; '
        f'touch {REPO / "pcourse" / "zz"} 2>/dev/null; echo package=$?; '
        'umount -l /tmp 2>/dev/null; echo umount=$?; unshare -U true 2>/dev/null; '
        'echo unshare=$?; touch /tmp/x /dev/shm/x && echo scratch=0; '
        f'touch {sockets}/x && echo sockets=0; '
        'tail -n +3 /proc/net/dev | cut -d: -f1 | tr -d " " | tr "\\n" ,; echo')
    done = subprocess.run([*prefix, "sh", "-c", script], capture_output=True, text=True,
                          timeout=60)
    out = done.stdout.split()
    assert out[0] == "65534" and out[1:7] == ["CapEff:", "0000000000000000", "NoNewPrivs:",
                                              "1", "Seccomp:", "2"], done
    said = dict(w.split("=") for w in out if "=" in w)
    assert said.pop("umount") != "0", done
    assert said == {"ls": "2", "venv": "1", "package": "1", "unshare": "1", "scratch": "0",
                    "sockets": "0"}, done  # 2: none of those paths exists in the jail
    assert out[-1] == "lo,", done  # a network of its own
    assert not (REPO / "pcourse" / "zz").exists()
    sandbox.release(tmp_path / "job")


def test_a_jail_ends_with_every_process_it_held_even_detached_ones(tmp_path):
    """A jail whose code is done (a job that ended) lives on while any of its processes
    does (a detached one, setsid): the grader kills them all, by namespace."""
    import subprocess

    import psutil

    _jailed()
    prefix = _prefix(_mkdir(tmp_path / "job"))
    outer = subprocess.Popen([*prefix, "sh", "-c", "setsid sh -c 'sleep 300' & sleep 300"])
    try:
        deadline = time.monotonic() + 30
        while not (spaces := {os.stat(f"/proc/{c.pid}/ns/pid").st_ino
                              for c in psutil.Process(outer.pid).children()}) \
                or len(sandbox._members(spaces)) < 3:
            assert time.monotonic() < deadline, "the jail did not start"
            time.sleep(0.05)
        sandbox.end(spaces, tmp_path / "job", timeout=20)  # bubblewrap still waits for them
        assert sandbox._members(spaces) == []
        assert outer.wait(timeout=20) is not None  # and ends with its jail
        assert not [parent for parent, _ in sandbox._cgroup_parents()  # its cgroups with it
                    if (parent / sandbox._cgroup_name(tmp_path / "job")).exists()]
    finally:
        outer.kill()
        outer.wait()
        sandbox.release(tmp_path / "job")


def test_a_jail_as_a_whole_is_bounded_in_memory_and_processes(tmp_path, monkeypatch):
    """Where the machine has cgroups the grader may make, one learner's jail shares one
    memory bound and one process bound, however many processes it splits into (rlimits
    bound each process alone); the cgroups go with the jail."""
    import subprocess

    _jailed()
    if not sandbox._cgroup_parents():  # the "where the machine has them"
        pytest.skip("no cgroup this process may make: rlimits alone bound the jail")
    monkeypatch.setattr(sandbox, "CGROUP_LIMITS", {"memory": 256 << 20, "pids": 64})
    folder = _mkdir(tmp_path / "job")
    prefix = _prefix(folder, groups=True)
    assert len(prefix[2].split("cgroup.procs")) > 1, prefix[:3]

    def jailed(code: str) -> subprocess.CompletedProcess:
        return subprocess.run([*prefix, sys.executable, "-c", code],
                              capture_output=True, text=True, timeout=120)

    # four processes of 100 MiB each: any one alone is far below every rlimit. The first
    # waits for the others: the jail ends with it, and under load a child can still be eating
    eat = ("import os, time\nkids = []\nfor _ in range(3):\n    pid = os.fork()\n"
           "    if pid == 0:\n        kids = []\n        break\n    kids.append(pid)\n"
           "x = bytearray(100 << 20)\nfor i in range(0, len(x), 4096):\n    x[i] = 1\n"
           "time.sleep(2)\nprint('fed', flush=True)\nfor pid in kids:\n    os.waitpid(pid, 0)")
    assert jailed(eat.replace("100 << 20", "10 << 20")).stdout.count("fed") == 4  # fits
    assert jailed(eat).stdout.count("fed") < 4  # together past 256 MiB: the kernel kills
    spawn = ("import subprocess\nok = 0\nfor _ in range(100):\n    try:\n"
             "        subprocess.Popen(['sleep', '5'])\n        ok += 1\n"
             "    except OSError:\n        break\nprint(ok)")
    started = jailed(spawn)
    assert 0 < int(started.stdout) < 64, started  # threads and processes, all counted
    sandbox.release(folder)
    # and a dead worker's, found by the process that named its jobs' folders
    dead = _mkdir(tmp_path / "pcourse-grade-999999999-x")
    assert len(sandbox.cgroups(dead)) == len(sandbox._cgroup_parents())
    sandbox.release(owner=999999999)
    assert not any((parent / sandbox._cgroup_name(f)).exists() for f in (folder, dead)
                   for parent, _ in sandbox._cgroup_parents())
