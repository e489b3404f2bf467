"""Tensor parallelism (lesson 11) equals one process: every tp that divides the world."""

from __future__ import annotations

import pytest


@pytest.mark.parametrize("p", [3, 4])
def test_tensor_parallel_blocks_equal_one_process(mpi_run, p: int) -> None:
    # p = 3: tp 1 and 3; p = 4: tp 1, 2 (two groups at once) and 4
    mpi_run(p, "check_tensor_parallel.py", expect=f"tensor parallel OK on {p} ranks",
            timeout=240)


@pytest.mark.slow
def test_tensor_parallel_on_gloo(mpi_run) -> None:
    mpi_run(4, "check_tensor_parallel.py", "gloo",
            expect="tensor parallel OK on 4 ranks (gloo)", timeout=240)
