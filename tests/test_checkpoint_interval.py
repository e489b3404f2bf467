"""Young's interval against a simulated run whose failures are drawn (lesson 14)."""

from __future__ import annotations

import math

import pytest

from pcourse import checkpoint_interval as ci


def test_youngs_interval_is_where_the_first_order_waste_is_least():
    c, m = 0.02, 3600.0
    best = ci.young_interval(c, m)
    assert best == pytest.approx(math.sqrt(2 * c * m))
    assert ci.expected_waste(best, c, m) == pytest.approx(math.sqrt(2 * c / m))
    assert all(ci.expected_waste(best * f, c, m) > ci.expected_waste(best, c, m)
               for f in (0.9, 1.1, 0.5, 2))


def test_without_failures_the_run_is_its_work_and_its_saves():
    # a failure drawn a billion years out never comes: ceil(work / interval) saves
    assert ci.simulate(10.0, 0.5, 7.0, 1e16, 95.0) == pytest.approx(95.0 + 10 * 0.5)
    assert ci.simulate(10.0, 0.5, 7.0, 1e16, 100.0) == pytest.approx(100.0 + 10 * 0.5)


def test_the_simulated_waste_follows_youngs_first_order_and_is_least_at_its_interval():
    c, r, m = 0.05, 9.0, 3600.0
    work, best = 2000 * m, ci.young_interval(c, m)
    wasted = {f: ci.simulate(f * best, c, r, m, work, seed=1) / work - 1
              for f in (0.25, 0.5, 1, 2, 4)}
    for f, w in wasted.items():  # the drawn failures' noise, a few percent of the waste
        assert w == pytest.approx(ci.expected_waste(f * best, c, m) + r / m, rel=0.05)
    assert min(wasted, key=wasted.get) == 1


def test_a_failure_loses_the_work_since_the_last_complete_checkpoint():
    # with failures, the run takes longer than its work and saves; with a longer restart,
    # longer still (the same failures: one seed)
    plain = 1000.0 + 100 * 0.1
    quick = ci.simulate(10.0, 0.1, 1.0, 300.0, 1000.0, seed=3)
    slow = ci.simulate(10.0, 0.1, 5.0, 300.0, 1000.0, seed=3)
    assert plain < quick < slow


@pytest.mark.parametrize("args", [(0, 1, 1, 1, 1), (1, -1, 1, 1, 1), (1, 1, 1, 0, 1),
                                  (1, 1, 1, 1, 0)])
def test_bad_input_is_refused(args):
    with pytest.raises(ValueError, match="must be positive"):
        ci.simulate(*args)
