"""Compressed gradient averaging (lesson 08) at 3 and 4 ranks: tests/mpi/check_compression.py."""

from __future__ import annotations

import pytest


@pytest.mark.slow
@pytest.mark.parametrize("ranks", [3, 4])
def test_compressed_averages_against_exact_sums(mpi_run, ranks: int) -> None:
    mpi_run(ranks, "check_compression.py", expect=f"compression on {ranks} ranks: ALL OK",
            timeout=300, env={"OMP_NUM_THREADS": "1"})
