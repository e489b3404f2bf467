"""Exercise 11's references (pcourse.tools.grading.refs.predict_memory_and_time), without MPI.

The solution's functions, run in this process through the trials, pass every check at the
held-out configurations (the peaks against the allocator too); every wrong answer of
tests/grading/wrong.py fails the check it names, for its reason; the configurations are
the same on every call and none is the notebook's example; and the numbers the learner is
handed add up to lesson 13's counts. The exercise itself is graded in tests/test_grading.py
(its solution and wrong answers, in the grader's jail).
"""

from __future__ import annotations

import importlib.util
import sys
import textwrap
from pathlib import Path

import nbformat
import pytest

from pcourse.cost_model.shapes import Stack
from pcourse.tools.grading.exercises import solution_regions
from pcourse.tools.grading.refs import predict_memory_and_time as refs

REPO = Path(__file__).resolve().parents[1]
NAME = "11_predict_memory_and_time"
SOLUTION = REPO / "solutions" / f"{NAME}.ipynb"
_spec = importlib.util.spec_from_file_location("wrong_answers", REPO / "tests/grading/wrong.py")
wrong = sys.modules.setdefault(_spec.name, importlib.util.module_from_spec(_spec))
if not hasattr(wrong, "WRONG"):
    _spec.loader.exec_module(wrong)
FUNCTIONS = ("collective_time", "predict_dp", "predict_zero1", "predict_tp", "predict_1f1b")


def learner(codes: list | None = None) -> dict:
    """The solution's five functions, regions replaced by ``codes`` (RIGHT keeps one)."""
    nb = nbformat.read(SOLUTION, as_version=4)
    real = solution_regions(nb)
    bodies = iter(real if codes is None else [r if c is wrong.RIGHT else c
                                              for r, c in zip(real, codes, strict=True)])
    namespace: dict = {}
    for cell in nb.cells:
        if "exercise" not in cell.metadata.get("tags", []):
            continue
        out, skipping = [], False
        for line in cell.source.split("\n"):
            if line.strip() == "### BEGIN SOLUTION":
                out.append(textwrap.indent(textwrap.dedent(next(bodies)).strip("\n"), "    "))
                skipping = True
            elif line.strip() == "### END SOLUTION":
                skipping = False
            elif not skipping:
                out.append(line)
        exec("\n".join(out), namespace)  # noqa: S102 - the course's own solution and answers
    return {name: namespace[name] for name in FUNCTIONS}


def problems(fns: dict, measured: bool = False) -> list[str | None]:
    """Each check's problem (None: passes), its trials run here; peaks against the
    allocator only where ``measured``."""
    cases = refs.collective_cases()
    out = [refs.collective_problem(cases, refs.collective_trial(fns["collective_time"], cases))]
    cfgs = refs.configurations()
    for strategy, learner_name in refs.LEARNERS.items():
        asked = [{"p": c["p"], "m": c["m"], "c": c["c"], "model": refs.model_of(c)} for c in cfgs]
        got = refs.strategy_trial(fns[learner_name.name], strategy, asked)
        peak = refs._peak(strategy) if measured else (lambda cfg, rank: None)
        out.append(refs.strategy_problem(strategy, cfgs, got, peak))
    return out


def test_the_solution_passes_every_check():
    assert problems(learner()) == [None] * 5


@pytest.mark.slow  # four configurations of four strategies profiled: ten seconds or more
def test_the_solution_passes_every_check_the_peaks_measured_too():
    assert problems(learner(), measured=True) == [None] * 5


@pytest.mark.parametrize("label", list(wrong.WRONG[NAME]))
def test_each_wrong_answer_fails_for_its_reason(label):
    w = wrong.WRONG[NAME][label]
    found = [p for p in problems(learner(w.codes)) if p]
    assert found and w.mention in found[0], found


def test_the_configurations_are_held_out_and_the_same_every_time():
    cfgs = refs.configurations()
    assert cfgs == refs.configurations() and len(cfgs) >= 12
    assert {c["p"] for c in cfgs} == {2, 3, 4} and {c["shape"]["itemsize"] for c in cfgs} == {2, 4}
    example = refs.example()[0]
    assert all(refs.model_of(c) != example for c in cfgs)
    assert sum(c["shape"]["itemsize"] == 4 for c in cfgs) >= refs.MEASURED


def test_the_numbers_handed_out_add_up_to_lesson_13s_counts():
    for cfg in refs.configurations():
        shape, model, p = Stack(**cfg["shape"]), refs.model_of(cfg), cfg["p"]
        for t in (1, p):
            per_sample = model["act_whole"] + model["act_split"] // t
            assert shape.block_saved(t=t, batch=3) == 3 * per_sample
        assert shape.params(p) == shape.layers * (
            (model["block_params"] - model["block_whole"]) // p + model["block_whole"])
        assert sum(model["buckets"]) == shape.params()
