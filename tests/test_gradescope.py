"""Gradescope's results.json and the learner's feedback file, from the class grader.

The fast tests feed the grader's own judging (`_judge`) results made up here and check
that results.json counts exactly the checks the grader counts, one test per check, each
with its verdict line; then the command line grades a class whose notebooks need no
job (unreadable, tampered with, missing). The slow test grades a real class on MPI
ranks: a solved exercise, a wrong answer and missing notebooks.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import nbformat
import pytest

from pcourse.tools.grading import gradescope, lms
from pcourse.tools.grading.grade import _checks, _judge, grade_class, main
from pcourse.tools.grading.runner import NOT_RUN, Result
from pcourse.tools.grading.verdicts import Check, Grade

REPO = Path(__file__).resolve().parents[1]
SOLUTIONS = REPO / "solutions"
NAMES = sorted(p.stem for p in SOLUTIONS.glob("*.ipynb"))
LINE = "check {k}/3 what it checks: {verdict}"


def _judged(result: Result) -> Grade:
    g = Grade(Path("ann/01_partitioner.ipynb"), "01_partitioner", total=3, learner="ann")
    _judge(g, result)
    return g


def _line(k: int, verdict: str = "PASS") -> tuple[bool, str]:
    return verdict == "PASS", LINE.format(k=k, verdict=verdict)


NAMES3 = [f"check {k}/3 what it checks" for k in (1, 2, 3)]
RUNS = {
    "all pass": Result(passed=3, total=3, checks=[_line(k) for k in (1, 2, 3)]),
    "second fails": Result(passed=2, total=3, checks=[
        _line(1), _line(2, "FAIL: at 3 ranks, rank 1: no"), _line(3)],
        first_failure="check 2/3: at 3 ranks, rank 1: no"),
    "first raises": Result(passed=1, total=3, checks=[
        _line(1, "FAIL: not solved yet (NotImplementedError): write it"), _line(2),
        _line(3, "FAIL: x")], first_failure="check 1/3: not solved yet (NotImplementedError)"),
    "timed out": Result(status="timeout", passed=1, total=3, checks=[
        _line(1), (False, NOT_RUN), (False, NOT_RUN)],
        first_failure="did not finish within 60 s (in check 2/3)"),
}


@pytest.mark.parametrize("case", RUNS)
def test_results_json_counts_exactly_what_the_grader_counts(case):
    g = _judged(RUNS[case])
    result = lms.results(g, NAMES3)
    assert [t["name"] for t in result["tests"]] == NAMES3
    assert result["score"] == g.passed == sum(t["score"] for t in result["tests"])
    assert all(t["max_score"] == 1.0 and t["visibility"] == "visible" for t in result["tests"])
    for t, check in zip(result["tests"], g.checks, strict=True):
        assert t["status"] == ("passed" if check.passed else "failed")
        assert t["output"] == check.output and t["output"]
    assert json.loads(json.dumps(result)) == result  # plain JSON, nothing Python-only


def test_each_test_says_in_plain_words_what_its_check_did():
    tests = lms.results(_judged(RUNS["second fails"]), NAMES3)["tests"]
    assert [t["status"] for t in tests] == ["passed", "failed", "passed"]
    assert tests[1]["output"].endswith("FAIL: at 3 ranks, rank 1: no")
    raised = lms.results(_judged(RUNS["first raises"]), NAMES3)["tests"]
    assert "not solved yet" in raised[0]["output"] and raised[1]["status"] == "passed"
    stopped = lms.results(_judged(RUNS["timed out"]), NAMES3)
    assert [t["score"] for t in stopped["tests"]] == [1.0, 0.0, 0.0]
    assert stopped["tests"][2]["output"].startswith("did not run")
    assert "did not finish within 60 s" in stopped["output"]


def test_a_notebook_not_run_scores_nothing_and_says_why_on_every_test():
    g = Grade(Path("bob/02_average_gradients.ipynb"), "02_average_gradients", total=3,
              status="tampered", learner="bob", passed=0,
              first_failure="a check cell was removed: start again from a fresh copy")
    g.checks = [Check(True, LINE.format(k=k, verdict="PASS")) for k in (1, 2, 3)]
    result = lms.results(g, NAMES3)
    assert result["score"] == 0
    assert all(t["output"] == g.first_failure for t in result["tests"])
    missing = Grade(None, "03_ring_allreduce", total=3, status="missing", learner="bob",
                    first_failure="missing: no 03_ring_allreduce.ipynb")
    assert {t["output"] for t in lms.results(missing, NAMES3)["tests"]} == {
        missing.first_failure}


def test_visibility_is_one_gradescope_knows():
    g = _judged(RUNS["all pass"])
    assert lms.results(g, NAMES3, "after_due_date")["visibility"] == "after_due_date"
    with pytest.raises(ValueError, match="'public'.*visible"):
        lms.results(g, NAMES3, "public")


@pytest.mark.parametrize("name", NAMES)
def test_check_names_are_the_checks_and_what_the_solution_printed(name):
    names = lms.check_names(SOLUTIONS / f"{name}.ipynb")
    n = _checks(SOLUTIONS / f"{name}.ipynb")
    assert len(names) == n and n > 0
    for k, text in enumerate(names, 1):
        assert re.fullmatch(rf"check {k}/{n} \S.*", text), text
    solution = nbformat.read(SOLUTIONS / f"{name}.ipynb", as_version=4)
    printed = ["".join(o.get("text", "") for o in c.outputs).strip()
               for c in solution.cells if "check" in c.metadata.get("tags", [])]
    assert printed == [f"{text}: PASS" for text in names]


def test_the_command_line_writes_results_and_feedback_for_every_learner(tmp_path, capsys):
    """Notebooks the grader rejects unread need no job: this runs in a second."""
    _jail_or_skip()
    (tmp_path / "ann").mkdir()
    (tmp_path / "ann" / f"{NAMES[0]}.ipynb").write_text("not json")
    tampered = nbformat.read(SOLUTIONS / f"{NAMES[1]}.ipynb", as_version=4)
    tampered.cells = [c for c in tampered.cells if "check" not in c.metadata.get("tags", [])]
    (tmp_path / "bob").mkdir()
    nbformat.write(tampered, tmp_path / "bob" / f"{NAMES[1]}.ipynb")
    out = tmp_path / "out"
    assert main(["--class", str(tmp_path), "--out", str(out)]) == 0
    assert "Gradescope results and feedback" in capsys.readouterr().out
    for learner in ("ann", "bob"):
        for name in NAMES:
            result = json.loads(
                (out / "_gradescope" / learner / name / "results.json").read_text())
            assert result["score"] == 0 and result["extra_data"]["learner"] == learner
            assert len(result["tests"]) == _checks(SOLUTIONS / f"{name}.ipynb")
        text = (out / "_feedback" / f"{learner}.md").read_text()
        assert text.startswith(f"# Feedback for {learner}")
        assert f"0 of {len(NAMES)} exercises pass" in text
    ann = json.loads((out / "_gradescope" / "ann" / NAMES[0] / "results.json").read_text())
    assert "not valid JSON" in ann["tests"][0]["output"]
    bob = (out / "_feedback" / "bob.md").read_text()
    assert f"## {NAMES[1]}: 0/" in bob and "removed" in bob
    assert not [p for p in out.rglob(".*") if p.is_file()]  # atomic: no temporary left


def test_a_learner_folder_is_never_taken_for_the_graders_output(tmp_path):
    """`--class DIR` without --out writes into DIR: a second grading must not grade that."""
    _jail_or_skip()
    (tmp_path / "ann").mkdir()
    (tmp_path / "ann" / f"{NAMES[0]}.ipynb").write_text("not json")
    assert main(["--class", str(tmp_path)]) == 0
    assert {g.learner for g in grade_class(tmp_path)} == {"ann"}


@pytest.mark.slow
@pytest.mark.mpi
@pytest.mark.timeout(1200)
def test_a_graded_class_gets_partial_credit_per_check(tmp_path):
    """On real ranks: a solved exercise scores every check; a wrong one, only some."""
    _jail_or_skip()
    import test_grading as tg  # its learners: the solution, and its own wrong answers

    solved, wrong_name = NAMES[0], NAMES[1]
    label, answer = next(iter(tg.WRONG[wrong_name].items()))
    learner = tmp_path / "ann"
    tg._write(tg._solved(solved), learner / f"{solved}.ipynb")
    tg._write(tg._solved(wrong_name, answer.codes), learner / f"{wrong_name}.ipynb")
    rows = {g.exercise: g for g in grade_class(tmp_path, jobs=1, timeout=180)}
    lms.write_class(list(rows.values()), tmp_path / "out", SOLUTIONS)

    def result(name: str) -> dict:
        return json.loads((tmp_path / "out" / "_gradescope" / "ann" / name /
                           "results.json").read_text())

    good = result(solved)
    assert good["score"] == rows[solved].total == len(good["tests"]), good
    assert all(t["output"].endswith(": PASS") for t in good["tests"])
    bad, g = result(wrong_name), rows[wrong_name]
    assert bad["score"] == g.passed < g.total, (label, bad)
    failed = [t for t in bad["tests"] if t["status"] == "failed"]
    assert failed and all(not t["output"].endswith(": PASS") for t in failed), failed
    assert answer.mention in "\n".join(t["output"] for t in failed), (label, failed)
    feedback = (tmp_path / "out" / "_feedback" / "ann.md").read_text()
    assert f"## {solved}: {rows[solved].total}/{rows[solved].total} checks — PASS" in feedback
    assert failed[0]["output"] in feedback


def test_one_submission_as_gradescopes_autograder_grades_it(tmp_path, capsys):
    """`python -m pcourse.tools.grading.gradescope`: one notebook, one results.json (no job
    needed for a notebook the grader rejects unread; no jail needed for one notebook)."""
    notebook = tmp_path / f"{NAMES[0]}.ipynb"
    notebook.write_text("{ not a notebook")
    results = tmp_path / "results" / "results.json"
    assert gradescope.main([str(notebook), "--results", str(results),
                            "--visibility", "after_due_date"]) == 0
    result = json.loads(results.read_text())
    assert result["score"] == 0 and result["visibility"] == "after_due_date"
    assert len(result["tests"]) == _checks(SOLUTIONS / f"{NAMES[0]}.ipynb")
    assert all("not valid JSON" in t["output"] for t in result["tests"])
    assert str(results) in capsys.readouterr().out
    with pytest.raises(SystemExit):
        gradescope.main([str(tmp_path / "missing.ipynb")])


def _jail_or_skip() -> None:
    """A class is graded only in the jail (tests/test_grading.py checks the refusal)."""
    import os

    from pcourse.tools.grading import sandbox

    ok, why = sandbox.available()
    if not ok and not os.environ.get("PCOURSE_REQUIRE_SANDBOX"):
        pytest.skip(f"no jail here ({why}): a class is not graded without one")
