"""Parameter averaging, federated averaging, SyncBatchNorm1d and Hogwild.

The MPI checks (tests/mpi/check_averaging.py) compare 2 and 3 ranks with serial
references; the rest runs in this process.
"""

from __future__ import annotations

import re
from pathlib import Path

import psutil
import pytest
import torch

from pcourse.beyond_sgd.hogwild import HogwildError, hogwild
from pcourse.beyond_sgd.weight_averaging import Setup, average_parameters, select_ranks

CHECK = Path(__file__).parent / "mpi" / "check_averaging.py"
EXPECTED = {
    "local_k1_equals_serial_large_batch", "momentum_local_k1_equals_serial_momentum",
    "exact_equals_serial_large_batch",
    "local_k5_differs_from_serial", "fedavg_all_selected_equals_local",
    "fedavg_unselected_contribute_nothing", "syncbn_matches_full_batch",
    "local_bn_differs_from_full_batch", "syncbn_variance_is_stable_in_float32",
    "different_models_refused",
}


@pytest.mark.parametrize("backend, ranks", [("mpi", 2), ("gloo", 2), ("mpi", 3)])
def test_mpi_checks_pass(mpi_run, backend, ranks):
    out = mpi_run(ranks, CHECK.name, backend)
    expected = EXPECTED | ({"fedavg_round_averages_the_selected_ranks"} if ranks >= 3 else set())
    # stdout and stderr share the pipe: a warning can land right after an OK line
    assert set(re.findall(r"^OK (\w+)", out, re.M)) == expected, out


def test_rank_selection_is_a_pure_function_of_seed_and_round():
    picks = [select_ranks(8, 0.5, seed=1, round_=r) for r in range(20)]
    assert picks == [select_ranks(8, 0.5, seed=1, round_=r) for r in range(20)]
    assert all(len(p) == 4 and p == sorted(set(p)) and 0 <= min(p) and max(p) < 8 for p in picks)
    assert len({tuple(p) for p in picks}) > 1  # rounds differ
    assert select_ranks(2, 0.01, seed=1, round_=0) != []  # at least one rank
    with pytest.raises(ValueError, match="fraction"):
        select_ranks(4, 0.0, seed=1, round_=0)


def test_average_parameters_refuses_zero_total_weight(one_rank):
    model = torch.nn.Linear(2, 1)
    with pytest.raises(ValueError, match="at least one rank"):
        average_parameters(model, one_rank(), weight=0.0)
    before = torch.nn.utils.parameters_to_vector(model.parameters()).clone()
    assert average_parameters(model, one_rank(), weight=3.0) == 3.0
    after = torch.nn.utils.parameters_to_vector(model.parameters())
    assert torch.allclose(after, before, rtol=1e-6, atol=0)  # (3 w) / 3 on one rank is w


def _workers_alive() -> list[psutil.Process]:
    """Descendants other than multiprocessing's resource tracker and fork server, our own
    children that live as long as we do. A worker forked by the server carries the server's
    command line, but it is the server's child, not ours: it counts."""
    me = psutil.Process()
    return [p for p in me.children(recursive=True)
            if not (p.ppid() == me.pid and any(helper in " ".join(p.cmdline())
                                               for helper in ("resource_tracker", "forkserver")))]


def test_hogwild_reduces_loss_and_leaves_no_processes():
    result = hogwild(2, Setup.quick(steps=150), timeout=120)
    assert result.updates == 300
    assert not torch.isnan(result.worker_losses).any()  # every worker did every step
    assert result.final_loss < 0.5 * result.initial_loss
    # the loops, timed from inside, lie within the wall time that includes starting them
    assert 0 < result.loop_seconds < result.seconds
    assert _workers_alive() == []


def test_hogwild_deadline_stops_workers():
    with pytest.raises(HogwildError, match="did not finish"):
        hogwild(2, Setup.quick(steps=10**7), timeout=0.5)
    assert _workers_alive() == []
