"""A comparison printed to a learner decides only beyond the spread of its repeats."""

import pytest

from pcourse.utils.verdict import differs, faster, faster_quartiles, smaller


def test_decides_only_when_every_repeat_is_on_one_side() -> None:
    assert faster([1.0, 1.1], [2.0, 2.2], ("A", "B")).startswith("A is faster than B: 0.50×")
    assert faster([2.0, 2.2], [1.0, 1.1], ("A", "B")).startswith("B is faster than A: 0.50×")
    said = faster([1.0, 2.1], [2.0, 2.2], ("A", "B"))
    assert said.startswith("no difference was measured between A and B"), said


def test_needs_a_spread() -> None:
    with pytest.raises(ValueError, match="at least two repeats"):
        faster([1.0], [2.0, 3.0])


def test_quartiles_decide_only_when_the_interquartile_ranges_are_apart() -> None:
    said = faster_quartiles((1.0, 1.1, 1.2), (1.5, 1.6, 1.8), ("ours", "DDP"))
    assert said.startswith("ours is faster than DDP: 0.69×") and "every quartile" in said
    said = faster_quartiles((1.0, 1.1, 1.6), (1.5, 1.6, 1.8), ("ours", "DDP"))
    assert said.startswith("no difference was measured between ours and DDP"), said
    with pytest.raises(ValueError, match="p25, median, p75"):
        faster_quartiles((1.2, 1.1, 1.0), (1.5, 1.6, 1.8))


def test_a_stated_tolerance_decides_one_off_values() -> None:
    assert smaller([1, 2], [3, 4]) == -1 and smaller([3, 4], [1, 2]) == 1
    assert smaller([1, 3], [2, 4]) == 0
    assert differs(1.2, 1.0, 0.1, ("k=16", "k=4")).startswith("k=16 is larger than k=4: 1.20×")
    assert differs(0.8, 1.0, 0.1).startswith("A is smaller than B: 0.80×")
    # 1.107 against a 10% threshold: no verdict where the digits sit on the threshold
    assert differs(1.107, 1.0, 0.2).startswith("no difference was measured")
    assert differs(1.3, 1.0, 0.1, ratio=False) == \
        "A is larger than B: beyond the tolerance of 10%"
    with pytest.raises(ValueError, match="positive tolerance"):
        differs(1.0, 1.0, 0.0)
