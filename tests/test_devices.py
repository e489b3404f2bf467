"""Results say which device they were computed on, so comparisons move them explicitly
(``.cpu()``), and the scaling benchmark never mixes devices without saying so."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from pcourse.loop import train
from pcourse.tools.bench import scaling
from pcourse.workloads import make_workload
from pcourse.workloads.config import FrankeConfig

SMALL = dataclasses.replace(FrankeConfig(), n_points=64, n_test=16, batch_size=16, epochs=1)


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda:0", marks=pytest.mark.gpu)])
def test_a_workload_says_where_its_model_lives(device):
    wl = make_workload("franke", SMALL, device)
    assert wl.device == torch.device(device)
    assert all(p.device == wl.device for p in wl.model.parameters())


def test_a_training_result_names_its_device_and_compares_after_cpu(one_rank):
    """Serial and one-rank runs train the same updates; the comparison is made on the CPU,
    whatever device each trained on, so it works on a CUDA machine too."""
    serial = train("franke", None, SMALL, progress=False)
    ranked = train("franke", one_rank(), SMALL, progress=False)
    assert serial.device == "cpu"
    assert ranked.device == str(one_rank().device)
    assert ranked.summary()["device"] == ranked.device  # a column of the benchmark's rows
    for a, b in zip(serial.model.parameters(), ranked.model.parameters(), strict=True):
        assert a.device.type == serial.device.split(":")[0]
        assert torch.allclose(a.detach().cpu(), b.detach().cpu())


def _row(backend: str, ranks: int, device: str, time: float) -> dict:
    return {"backend": backend, "ranks": ranks, "device": device, "scaling": "strong",
            "train_time": time, "wall_time": time + 1, "time_per_step": time / 10,
            "samples_per_s": 100 / time, "final_loss": 0.5, "epochs": 1,
            "steps_per_epoch": 10, "global_batch": 16}


def test_the_benchmark_says_so_when_its_backends_ran_on_different_devices(capsys):
    mixed = [_row("mpi", 1, "cuda:0", 2.0), _row("mpi", 2, "cuda:0", 1.0),
             _row("gloo", 1, "cpu", 3.0), _row("gloo", 2, "cpu", 2.0)]
    table = scaling.aggregate(mixed)
    assert {(t["backend"], t["device"]) for t in table} == {("mpi", "cuda"), ("gloo", "cpu")}
    note = scaling.mixed_devices(table)
    assert "gloo on cpu" in note and "mpi on cuda" in note
    scaling.print_table(table)
    out = capsys.readouterr().out
    assert out.splitlines()[0].split()[:3] == ["backend", "device", "ranks"]
    assert out.strip().splitlines()[-1] == f"note: {note}"
    labels = [t.get_text() for t in scaling.plot(table, "t").axes[0].get_legend().get_texts()]
    assert sorted(labels) == ["gloo (cpu)", "mpi (cuda)"]


@pytest.mark.parametrize("device", ["cpu", "cuda:0"])
def test_one_device_for_every_backend_needs_no_note(capsys, device):
    rows = [_row(b, p, device, 1.0 + p) for b in ("mpi", "gloo") for p in (1, 2)]
    table = scaling.aggregate(rows)
    assert scaling.mixed_devices(table) == ""
    scaling.print_table(table)
    assert "note:" not in capsys.readouterr().out
    labels = [t.get_text() for t in scaling.plot(table, "t").axes[0].get_legend().get_texts()]
    assert sorted(labels) == ["gloo", "mpi"]


def test_the_csv_has_a_device_column_and_older_rows_say_unknown():
    assert "device" in scaling.FIELDS
    old = [{k: v for k, v in _row("mpi", 1, "cpu", 1.0).items() if k != "device"}]
    assert scaling.aggregate(old)[0]["device"] == "?"
