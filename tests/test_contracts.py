"""Every exercise states its contract beside its checks (issue 55), and says why where it
covers less than every exercise should: two dtypes, two shapes the text does not name,
views or shared inputs, two groups in one process, random valid orders, gradients
accumulated into existing ones (``checks.DIMENSIONS``). Exercises 09 and 10 draw their
cases from theirs."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from pcourse.tools.grading import refs
from pcourse.tools.grading.checks import DIMENSIONS, Contract
from pcourse.tools.grading.refs import conjugates
from pcourse.tools.grading.refs import orders as order_refs
from pcourse.tools.grading.refs import pipeline_schedule as pipe
from pcourse.tools.grading.refs import tensor_parallel as tp

NAMES = sorted(p.stem for p in (Path(__file__).resolve().parents[1] / "solutions").glob(
    "*.ipynb"))


@pytest.mark.parametrize("name", NAMES)
def test_every_exercise_states_its_contract_and_why_it_covers_less(name):
    contract = getattr(refs.exercise(name), "CONTRACT", None)
    assert isinstance(contract, Contract), f"{name}: its refs module has no CONTRACT"
    assert contract.missing() == [], (
        f"{name}: its contract covers fewer than {', '.join(contract.missing())} asks "
        f"({'; '.join(DIMENSIONS[d] for d in contract.missing())}) and does not say why")
    assert set(contract.why_not) <= set(DIMENSIONS), set(contract.why_not) - set(DIMENSIONS)
    covered_and_excused = [d for d in contract.why_not if contract.covers(d)]
    assert not covered_and_excused, f"{name}: says why not, yet covers {covered_and_excused}"


def test_a_contract_that_says_nothing_misses_every_dimension():
    assert Contract().missing() == list(DIMENSIONS)
    assert Contract(why_not={"orders": "no"}).missing() == list(DIMENSIONS)  # a word is no why
    full = Contract(dtypes=(torch.float64, torch.float32), shapes=((2,), (3,)),
                    aliasing=("x",), groups=2, orders=("random valid",), accumulation=True)
    assert full.missing() == []


def test_tensor_parallel_checks_draw_every_case_of_its_contract():
    for cases, mlp in ((tp.fg_cases(), False), (tp.mlp_cases(), True)):
        drawn = [cases[k] for size in (2, 3, 4) for k in tp.cases_at(size, mlp)]
        assert {c.dtype for c in drawn} == set(tp.CONTRACT.dtypes)
        assert {c.layout for c in drawn} >= set(tp.CONTRACT.layouts) - {"contiguous"} | (
            set() if mlp else {"contiguous"})
        assert any(c.accumulate for c in drawn) and not all(c.accumulate for c in drawn)
    assert {c.shape for c in tp.mlp_cases()[1:]} == set(tp.CONTRACT.shapes)
    assert (conjugates.TP_D, tp.TP_HIDDEN) not in tp.CONTRACT.shapes  # not the text's
    assert conjugates.two_groups(conjugates.ALL_CASES_AT, 4)  # two groups where every case runs


def test_pipeline_checks_draw_every_case_of_its_contract():
    cases = pipe.stage_cases()
    assert {c.dtype for c in cases} == set(pipe.CONTRACT.dtypes)
    assert set(pipe.CONTRACT.shapes) <= {c.shape for c in cases}
    assert {c.order for c in cases} == {"1F1B", "GPipe", "random"}
    assert any(c.accumulate for c in cases)
    assert any(c.order == "GPipe" and c.m > max(order_refs.PIPE_ORDER_SIZES) for c in cases)
