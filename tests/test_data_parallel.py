"""Training helpers: real data-parallel runs under MPI, and their bookkeeping in-process."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn

from pcourse.backends import Backend
from pcourse.cluster.launch import mpirun
from pcourse.data_parallel import (
    ConsistencyReport,
    average_gradients,
    broadcast_parameters,
    check_consistency,
    check_same_model,
)

REPO = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("n", [2, 3])
def test_data_parallel_training_under_mpi(n):
    """Broadcast, consistency, N-rank training == serial on the union, mismatch errors."""
    out = mpirun(n, ["-m", "mpi4py", "tests/mpi/check_training.py"], timeout=240, cwd=REPO,
                 check=False)
    print(out.stdout)
    assert out.returncode == 0, out.stdout[-4000:]
    assert f"training checks on {n} ranks: ALL OK" in out.stdout


class Recorder(Backend):
    """A one-rank backend that records which tensors it was given."""

    name, rank, size, device = "recorder", 0, 1, torch.device("cpu")

    def __init__(self, skew: int = 0) -> None:
        self.reduced: list[torch.Tensor] = []
        self.broadcast_: list[torch.Tensor] = []
        self.skew = skew  # pretend other ranks' fingerprints differ by this much

    def allreduce(self, tensor, op="sum"):
        self.reduced.append(tensor)
        if op == "max" and tensor.dtype == torch.int64:
            tensor[0] += self.skew
        return tensor

    def broadcast(self, tensor, root=0):
        self.broadcast_.append(tensor)
        return tensor

    def barrier(self):
        return None


class Tied(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.enc, self.dec = nn.Linear(3, 3), nn.Linear(3, 3)
        self.dec.weight = self.enc.weight
        self.frozen = nn.Linear(3, 1)
        self.frozen.bias.requires_grad_(False)

    def forward(self, x):
        return self.frozen(self.dec(self.enc(x)))


def test_tied_weights_are_reduced_once_and_frozen_ones_skipped():
    model = Tied()
    model(torch.randn(4, 3)).sum().backward()
    rec = Recorder()
    average_gradients(model, rec, check=False)
    per_module = [p for m in model.modules() for p in m.parameters(recurse=False)]
    assert len(per_module) == 6  # a per-module loop would see the tied weight twice
    expected = [p.grad for p in model.parameters() if p.requires_grad]
    assert len(rec.reduced) == len(expected) == 4
    assert all(a is b for a, b in zip(rec.reduced, expected, strict=True))


def test_broadcast_covers_parameters_and_buffers():
    model = nn.Sequential(nn.Linear(2, 2), nn.BatchNorm1d(2))
    rec = Recorder()
    broadcast_parameters(model, rec)
    sent = {t.data_ptr() for t in rec.broadcast_}
    wanted = {t.data_ptr() for t in [*model.parameters(), *model.buffers()]}
    assert sent == wanted and len(rec.broadcast_) == 7  # 4 parameters, 3 buffers


def test_fingerprint_mismatch_names_what_differs():
    tensors = [torch.zeros(3), torch.zeros(2, 2)]
    check_same_model(tensors, Recorder(), "models")  # one rank agrees with itself
    with pytest.raises(ValueError, match="number of tensors ranges from 2 to 3"):
        check_same_model(tensors, Recorder(skew=1), "models")
    with pytest.raises(ValueError, match="different models"):
        broadcast_parameters(nn.Linear(2, 2), Recorder(skew=1))


def test_consistency_on_one_rank_and_the_report():
    report = check_consistency(nn.Linear(3, 2), Recorder())
    assert report.consistent and report.max_deviation == 0.0
    assert set(report.spreads) == {"weight", "bias"}
    bad = ConsistencyReport(0.5, ["fc.bias"], {"fc.bias": 0.5})
    assert not bad.consistent and "fc.bias" in str(bad) and "INCONSISTENT" in str(bad)
