"""``python -m pcourse.tools.bench tp``: its quick mode runs end to end, and what it counts is the
theory.

The bytes each rank sends and the activations it saves are exact counts, so they are
held to lesson 11's closed forms, written out here again from the block's sizes (not
read from the benchmark's own theory). Timings are figures, never asserted.
"""

from __future__ import annotations

import csv
import subprocess
import sys
from pathlib import Path

import pytest

from pcourse.tools.bench import tp
from pcourse.tools.cluster import launch

QUICK = tp.Spec.quick()


def closed_form(mode: str, t: int) -> tuple[float, float]:
    """(bytes one rank sends, bytes of [T, B, .] activations it saves) for one block step."""
    d, h, T, B, item = QUICK.d, QUICK.hidden, QUICK.seq, QUICK.batch, 4
    ring = 2 * (t - 1) / t  # an allreduce's share of its bytes that each rank sends
    n = T * B * d
    params = 4 * d * d + 4 * d + d * h + h + h * d + d + 4 * d
    sent = {"tp": ring * 4 * n * item, "sp": ring * (4 * n + 6 * d) * item,
            "dp": ring * params * item}[mode]
    u = n * item
    split = (4 * u + 2 * u * h // d) / t  # q, k, v, the heads; the MLP's two hidden
    saved = {"tp": 4 * u + split, "sp": 2 * u / t + 2 * u + split, "dp": 4 * u / t + split}[mode]
    return sent, saved


@pytest.mark.slow
@pytest.mark.mpi  # launches an MPI job
def test_the_quick_mode_runs_and_its_counts_are_the_theory(tmp_path: Path) -> None:
    out = tmp_path / "tp.csv"
    done = subprocess.run([sys.executable, "-m", "pcourse.tools.bench", "tp", "--quick", "--ranks",
                           "2", "3", "--oversubscribe", "--out", str(out)],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    with open(out, newline="") as f:
        rows = list(csv.DictReader(f))
    keys = {(int(r["ranks"]), r["backend"], r["mode"], r["impl"]) for r in rows}
    ours = {(t, b, m, "ours") for t in (2, 3) for b in ("gloo", "mpi") for m in ("tp", "sp", "dp")}
    assert keys == ours | {(t, "gloo", m, "torch's") for t in (2, 3) for m in ("tp", "sp")}
    for r in rows:
        assert int(r["repeats"]) == QUICK.repeats
        assert float(r["min_ms"]) <= float(r["median_ms"]) <= float(r["max_ms"])
        if r["impl"] == "torch's":  # torch's DTensor computed the same outputs as ours
            assert float(r["max_diff_vs_ours"]) < 1e-4, r
            continue
        sent, saved = closed_form(r["mode"], int(r["ranks"]))
        assert int(r["bytes_sent"]) == round(sent), r
        assert int(r["activation_bytes"]) == round(saved), r
        if r["backend"] == "mpi" and r["mode"] != "dp":  # torch's runs on Gloo only: not beside it
            assert not r["verdict"] and not r["compared_with"], r
            continue
        assert r["verdict"] and float(r["ratio"]) > 0
    printed = done.stdout
    assert "bytes sent = theory on every row of ours: True" in printed, printed
    assert "activations of shape [T, B, .] = theory on every row of ours: True" in printed
    for r in rows:  # the printed table shows the counted bytes beside the theory
        if r["impl"] == "ours":
            sent = str(round(closed_form(r["mode"], int(r["ranks"]))[0]))
            assert f"{r['bytes_sent']:>10} {sent:>10}" in printed, (r, printed)
    assert not out.with_suffix(".partial.csv").exists()


def test_the_theory_is_the_lessons() -> None:
    for mode in tp.MODES:
        for t in (2, 3, 4):
            sent, saved = closed_form(mode, t)
            assert tp.theory_bytes(mode, t, QUICK) == pytest.approx(sent, rel=1e-12)
            assert tp.theory_activations(mode, t, QUICK) == pytest.approx(saved, rel=1e-12)


def test_a_block_that_does_not_split_is_refused_before_any_rank_starts(
        tmp_path: Path, capsys, monkeypatch) -> None:
    from pcourse.tools.bench.__main__ import main

    started: list[int] = []

    def mpirun(n, args, **kw):
        started.append(n)
        raise launch.MPIJobError("stopped before any rank started")

    monkeypatch.setattr(launch, "mpirun", mpirun)
    for argv, says in [(["--ranks", "5"], "12 heads do not divide by 5"),
                       (["--ranks", "1"], "argument --ranks: 1 is too small"),
                       (["--repeats", "1"], "argument --repeats: 1 is too small"),
                       (["--backends", "nccl"], "invalid choice: 'nccl'")]:
        with pytest.raises(SystemExit) as exit_:
            main(["tp", "--quick", *argv, "--out", str(tmp_path / "tp.csv")])
        assert exit_.value.code == 2
        err = capsys.readouterr().err
        assert says in err and "Traceback" not in err, err
    assert started == []
    assert not list(tmp_path.iterdir())
