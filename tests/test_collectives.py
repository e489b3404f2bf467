"""The from-scratch allreduce algorithms against MPI's own, and their cost model."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from pcourse.collectives import (
    cost_model,
    cost_terms,
    fit_alpha_beta,
    recursive_doubling_allreduce,
    ring_allreduce,
    tree_allreduce,
)

SCRIPT = Path(__file__).parent / "mpi" / "check_collectives.py"


@pytest.mark.parametrize("p", [1, 2, 3, *(pytest.param(p, marks=pytest.mark.slow) for p in (4, 5))])
def test_every_algorithm_equals_mpi_allreduce(mpi_run, p: int) -> None:
    """One launch per p: all algorithms, ops, dtypes, lengths, modes, and the mismatch error."""
    mpi_run(p, SCRIPT.name, expect=f"collectives OK on {p} ranks", timeout=180)


@pytest.mark.parametrize("fn", [tree_allreduce, ring_allreduce, recursive_doubling_allreduce])
def test_bad_input_is_refused_before_any_communication(fn) -> None:
    with pytest.raises(ValueError, match="unknown op"):
        fn(np.ones(3), "mean")
    with pytest.raises(ValueError, match="contiguous"):
        fn(np.ones((4, 4))[:, 0])
    with pytest.raises(ValueError, match="out must match"):
        fn(np.ones(3), out=np.ones(4))
    with pytest.raises(TypeError, match="numpy array"):
        fn([1.0, 2.0])


@pytest.mark.parametrize("p", [1, 2, 3, 4, 5, 8, 12])
def test_cost_model_is_the_textbook_formula(p: int) -> None:
    alpha, beta, n = 3e-6, 2e-10, np.array([4.0, 1e6])
    log_p = np.ceil(np.log2(p))
    expected = {
        "tree": 2 * log_p * (alpha + n * beta),
        "ring": 2 * (p - 1) * alpha + 2 * (p - 1) / p * n * beta,
        # non-powers of two pay one fold in and one result out
        "recursive-doubling": (np.floor(np.log2(p)) + 2 * (p & (p - 1) != 0)) * (alpha + n * beta),
    }
    for method, want in expected.items():
        assert np.allclose(cost_model(method, p, n, alpha, beta), want)
    with pytest.raises(ValueError, match="no cost model"):
        cost_terms("mpi", p)


def test_fit_recovers_alpha_beta_from_exact_data() -> None:
    sizes = 4.0 * 2.0 ** np.arange(24)
    a, b = fit_alpha_beta(sizes, 7e-6 + sizes * 3e-10)
    assert a == pytest.approx(7e-6, rel=1e-9)
    assert b == pytest.approx(3e-10, rel=1e-9)


def test_fit_with_two_points_is_the_line_through_them() -> None:
    (n1, t1), (n2, t2) = (1e3, 2e-5), (1e7, 4e-3)
    slope = (t2 - t1) / (n2 - n1)
    a, b = fit_alpha_beta([n1, n2], [t1, t2])
    assert b == pytest.approx(slope, rel=1e-9)
    assert a == pytest.approx(t1 - slope * n1, rel=1e-9)


def test_fit_keeps_the_latency_under_noise() -> None:
    """Relative weighting: 2% noise must not wash out a latency 10^4 times below the top."""
    rng = np.random.default_rng(0)
    sizes = 4.0 * 2.0 ** np.arange(25)
    times = (5e-6 + sizes * 1e-9) * rng.uniform(0.98, 1.02, sizes.size)
    a, b = fit_alpha_beta(sizes, times)
    assert a == pytest.approx(5e-6, rel=0.05)
    assert b == pytest.approx(1e-9, rel=0.05)


def test_fit_never_returns_a_negative_latency() -> None:
    """Data bending below a straight line would give a < 0; the fit pins a at 0 instead."""
    sizes = np.array([1e2, 1e4, 1e6, 1e8])
    times = 1e-9 * sizes * np.array([0.5, 0.9, 1.0, 1.0])
    free_a = np.linalg.lstsq(np.stack([1 / times, sizes / times], 1), np.ones(4), rcond=None)[0][0]
    assert free_a < 0  # the premise: an unconstrained fit goes negative here
    x = sizes / times  # with a = 0: minimise sum (b x - 1)^2, so b = sum x / sum x^2
    a, b = fit_alpha_beta(sizes, times)
    assert a == 0.0
    assert b == pytest.approx(x.sum() / (x**2).sum(), rel=1e-9)


def test_fit_refuses_what_it_cannot_fit() -> None:
    with pytest.raises(ValueError, match="two different sizes"):
        fit_alpha_beta([8, 8], [1e-6, 2e-6])
    with pytest.raises(ValueError, match="equally long"):
        fit_alpha_beta([8, 16], [1e-6])
    with pytest.raises(ValueError, match="positive"):
        fit_alpha_beta([8, 16], [1e-6, 0.0])
