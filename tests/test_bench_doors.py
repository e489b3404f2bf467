"""The benchmarks' two front doors measure alike, and the launcher starts nothing it shouldn't.

- On a running cluster (``run_on(mc.view, ...)``) and under their own mpiexec, the
  benchmarks run the same measuring code: the scaling benchmark ends with the same
  losses, bit for bit; the comm and step benchmarks give rows of the same shape.
- The command line checks every argument before any rank starts (no mpiexec is
  launched for a bad one) and imports no torch before it starts the ranks.
"""

from __future__ import annotations

import csv
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from pcourse.tools.bench import commbench, scaling, steps
from pcourse.tools.cluster import launch, start_cluster, stop_cluster
from pcourse.workloads import mnist
from pcourse.workloads.config import FrankeConfig

FRANKE = FrankeConfig.quick(epochs=1)
COMM = commbench.CommSpec.smoke(methods=("mpi", "ring", "gloo"), max_bytes=1024)
STEPS = steps.StepSpec.smoke(workloads=("franke",))


def cli(*args: str, timeout: float = 300) -> subprocess.CompletedProcess[str]:
    done = subprocess.run([sys.executable, "-m", "pcourse.tools.bench", *args], capture_output=True,
                          text=True, timeout=timeout)
    assert done.returncode == 0, done.stdout + done.stderr
    return done


def read(path: Path) -> list[dict]:
    with open(path, newline="") as f:
        return list(csv.DictReader(f))


@pytest.fixture(scope="module")
def view():
    mc = start_cluster(2)
    try:
        yield mc.view
    finally:
        stop_cluster(mc)


def test_scaling_same_losses_through_both_doors(view, tmp_path: Path, capsys) -> None:
    rows = scaling.run_on(view, "franke", FRANKE, backends=("mpi", "gloo", "nccl"),
                          ranks=(1, 2), progress=False)
    nccl = {p for p in (1, 2) if not scaling.skip_reason("nccl", p)}  # this machine's GPUs
    printed = capsys.readouterr().out
    for p in (1, 2):  # what cannot run is said, not silently dropped
        assert (f"skip nccl at {p} rank(s)" in printed) == (p not in nccl), printed
    cli("franke", "--quick", "--epochs", "1", "--backends", "mpi", "gloo", "--ranks", "1", "2",
        "--repeats", "1", "--out", str(tmp_path))
    by_cli = {(r["backend"], int(r["ranks"])): r for r in read(tmp_path / "franke_strong.csv")}
    cpu = {(b, p) for b in ("mpi", "gloo") for p in (1, 2)}
    assert set(by_cli) == cpu
    assert {(r["backend"], r["ranks"]) for r in rows} == cpu | {("nccl", p) for p in nccl}
    for r in rows:
        assert set(scaling.FIELDS) <= set(r)
        assert r["train_time"] <= r["total_time"] <= r["wall_time"]
        if r["backend"] == "nccl":
            continue  # not run through the command line
        other = by_cli[r["backend"], r["ranks"]]
        for key in ("final_loss", "test_loss", "max_deviation"):  # repr() round-trips floats
            assert float(other[key]) == r[key], (key, r["backend"], r["ranks"])


def test_comm_rows_of_the_same_shape_through_both_doors(view, tmp_path: Path) -> None:
    rows = commbench.run_on(view, COMM, progress=False)
    out = tmp_path / "c.csv"
    cli("comm", "--smoke", "--methods", *COMM.methods, "--max-bytes", "1024", "--out", str(out))
    from_cli = read(out)
    grid = {(2, m, n) for m in COMM.methods for n in COMM.sizes()}
    assert {(r["ranks"], r["method"], r["bytes"]) for r in rows} == grid
    assert {(int(r["ranks"]), r["method"], int(r["bytes"])) for r in from_cli} == grid
    assert set(from_cli[0]) <= set(rows[0])
    for r in rows:
        assert r["p25_us"] <= r["median_us"] == r["latency_us"] <= r["p75_us"]


def test_steps_rows_of_the_same_shape_through_both_doors(view, tmp_path: Path) -> None:
    rows = steps.run_on(view, STEPS, progress=False)
    out = tmp_path / "s.csv"
    cli("steps", "--smoke", "--workloads", "franke", "--out", str(out))
    from_cli = read(out)
    key = [(r["workload"], int(r["ranks"]), r["path"], r["backend"]) for r in from_cli]
    assert [(r["workload"], r["ranks"], r["path"], r["backend"]) for r in rows] == key
    assert len(key) == len(steps.paths("gloo", STEPS.caps))
    assert set(from_cli[0]) == set(steps.FIELDS) <= set(rows[0])


@pytest.mark.parametrize("gpus,ranks,backend", [(0, 2, "gloo"), (1, 1, "nccl"), (1, 2, "gloo"),
                                                (2, 2, "nccl"), (2, 3, "gloo")])
def test_the_step_benchmark_uses_nccl_only_with_a_gpu_per_rank(monkeypatch, gpus, ranks,
                                                               backend) -> None:
    """With fewer GPUs than ranks NCCL cannot run: Gloo instead, and the reason (no GPU needed)."""
    import pcourse.backends
    import pcourse.runtime.ranks

    monkeypatch.setattr(pcourse.runtime.ranks, "gpu_count", lambda: gpus)
    monkeypatch.setattr(pcourse.backends, "unavailable_reason", lambda name: "")
    device = "cuda:0" if gpus else "cpu"
    chosen, why = steps.torch_backend_for(device, ranks)
    assert chosen == backend
    assert bool(why) == (gpus > 0 and backend == "gloo")
    if why:
        assert f"{ranks} ranks, {gpus} GPU(s)" in why


def test_a_rank_count_beyond_the_cluster_is_refused(view) -> None:
    with pytest.raises(scaling.BenchError, match="the cluster has 2 engine"):
        scaling.run_on(view, "franke", FRANKE, ranks=(4,), progress=False)


# ---------------------------------------------------------------- the launcher


LAUNCHER_PROBE = textwrap.dedent("""
    import sys
    import pcourse.tools.cluster.launch as launch

    def mpirun(n, args, **kw):  # stands in for mpiexec: say what was loaded, start nothing
        print("torch loaded" if "torch" in sys.modules else "no torch", n, flush=True)
        raise launch.MPIJobError("stopped before any rank started")

    launch.mpirun = mpirun
    from pcourse.tools.bench.__main__ import main
    main(sys.argv[1:])
""")


@pytest.mark.parametrize("argv", [
    ["franke", "--ranks", "1", "2", "--backends", "mpi", "gloo"],
    ["mnist", "--quick", "--ranks", "2"],
    ["comm", "--ranks", "2"],
    ["steps", "--ranks", "2"],
    ["tp", "--ranks", "2"],
])
def test_the_launcher_starts_the_ranks_without_torch(tmp_path: Path, argv) -> None:
    out = ["--out", str(tmp_path / ("r.csv" if argv[0] in ("comm", "steps", "tp") else "r"))]
    env = {**os.environ, mnist.DOWNLOAD_VAR: "0"}
    done = subprocess.run([sys.executable, "-c", LAUNCHER_PROBE, *argv, *out], env=env,
                          capture_output=True, text=True, timeout=120)
    if argv[0] in ("mnist", "steps") and "not found" in done.stderr + done.stdout:
        pytest.skip("no MNIST files here")
    assert "no torch 2" in done.stdout, done.stdout + done.stderr
    assert "Traceback" not in done.stderr


@pytest.fixture
def no_rank_may_start(monkeypatch):
    started = []

    def mpirun(n, args, **kw):
        started.append(n)
        raise launch.MPIJobError("stopped before any rank started")

    monkeypatch.setattr(launch, "mpirun", mpirun)
    return started


def _refused(capsys, argv: list[str], says: str) -> None:
    from pcourse.tools.bench.__main__ import main

    with pytest.raises(SystemExit) as exit_:
        main(argv)
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert says in err and "Traceback" not in err


def test_bad_arguments_are_refused_before_any_rank_starts(tmp_path, capsys, monkeypatch,
                                                          no_rank_may_start) -> None:
    a_file = tmp_path / "a-file"
    a_file.write_text("not a folder")
    too_many = str(launch.max_engines() + 1)
    monkeypatch.setenv(mnist.ENV_VAR, str(tmp_path / "no-mnist-here"))
    monkeypatch.setenv(mnist.DOWNLOAD_VAR, "0")
    for argv, says in [
        (["franke", "--out", str(a_file / "results")], "is a file"),
        (["franke", "--out", str(a_file)], "not a folder"),
        (["franke", "--ranks", too_many, "--out", str(tmp_path)], "would oversubscribe"),
        (["mnist", "--quick", "--ranks", "2", "--out", str(tmp_path)], "not found"),
        (["comm", "--ranks", too_many, "--out", str(tmp_path / "c.csv")], "--oversubscribe"),
        (["comm", "--out", str(a_file / "c.csv")], "is a file"),
        (["steps", "--ranks", too_many, "--out", str(tmp_path / "s.csv")], "oversubscribe"),
        (["steps", "--out", str(tmp_path)], "is a folder"),
        # values that cannot work, named as they are read (argparse types)
        (["franke", "--points", "10**12", "--out", str(tmp_path)],
         "argument --points: '10**12' is not a whole number"),
        (["franke", "--points", str(10**12), "--out", str(tmp_path)], "is too large"),
        (["franke", "--timeout", "-5", "--out", str(tmp_path)],
         "argument --timeout: -5 seconds"),
        (["franke", "--quick", "--batch-size", "4096", "--out", str(tmp_path)],
         "--batch-size 4096: a step at 1 rank(s) would take 4096 samples, more than the 512"),
        (["comm", "--max-bytes", "1024G", "--out", str(tmp_path / "c.csv")],
         "argument --max-bytes: 1024G is"),
        (["comm", "--timeout", "-1", "--out", str(tmp_path / "c.csv")],
         "argument --timeout: -1 seconds"),
        (["steps", "--steps", "-1", "--out", str(tmp_path / "s.csv")],
         "argument --steps: -1 is too small"),
        (["steps", "--ranks", "-4", "--out", str(tmp_path / "s.csv")],
         "argument --ranks: -4 is too small"),
    ]:
        _refused(capsys, argv, says)
    assert no_rank_may_start == []
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a-file"]  # nothing written


def test_oversubscribing_on_purpose_is_allowed(tmp_path, capsys, no_rank_may_start) -> None:
    from pcourse.tools.bench.__main__ import main

    n = launch.max_engines() + 1
    argv = ["franke", "--ranks", str(n), "--batch-size", str(n), "--points", str(4 * n),
            "--backends", "mpi", "--oversubscribe", "--out", str(tmp_path)]
    assert main(argv) == 1  # the stand-in mpiexec fails the job
    assert no_rank_may_start == [n]
    assert "the benchmark job failed" in capsys.readouterr().err
    assert not list(tmp_path.iterdir())  # no rows, no file


def test_versus_source_needs_the_source(tmp_path, capsys) -> None:
    _refused(capsys, ["versus-source", "--source", str(tmp_path)], "main_franke.py is not in")


@pytest.mark.parametrize("n", [3, 4])
def test_rank_groups_run_on_the_first_ranks_and_a_failure_reaches_every_rank(mpi_run, n):
    mpi_run(n, "check_rank_groups.py", expect=f"rank groups ok on {n} ranks", timeout=120)
