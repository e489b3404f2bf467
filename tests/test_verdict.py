"""A comparison printed to a learner decides only beyond the spread of its repeats."""

import pytest

from pcourse.utils.verdict import faster


def test_decides_only_when_every_repeat_is_on_one_side() -> None:
    assert faster([1.0, 1.1], [2.0, 2.2], ("A", "B")).startswith("A is faster than B: 0.50×")
    assert faster([2.0, 2.2], [1.0, 1.1], ("A", "B")).startswith("B is faster than A: 0.50×")
    said = faster([1.0, 2.1], [2.0, 2.2], ("A", "B"))
    assert said.startswith("no difference was measured between A and B"), said


def test_needs_a_spread() -> None:
    with pytest.raises(ValueError, match="at least two repeats"):
        faster([1.0], [2.0, 3.0])
