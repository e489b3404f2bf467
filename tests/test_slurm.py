"""Engines as a real Slurm job, on a one-node Slurm these tests start (tests/slurm_node.py).

What an instructor does on a cluster (INSTRUCTORS.md, "A shared cluster under Slurm"):
``$PCOURSE_SLURM`` set, the setup check and unchanged lessons start their engines as a
Slurm job, ``stop_cluster`` cancels it; a job that waits in the queue, a partition that
does not exist and a job that Slurm kills are each a clear error with Slurm's reason;
the documented benchmark job script runs under ``sbatch`` and writes its CSV.

Skipped, saying why, where Slurm is not installed or this is not root; with
``PCOURSE_REQUIRE_SLURM=1`` (.ci/run) they fail instead.
"""

from __future__ import annotations

import csv
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import nbformat
import pytest
from conftest import REPO, cluster_processes
from nbclient import NotebookClient
from slurm_node import HELD, PARTITION, REQUIRE, OneNodeSlurm, unavailable

from pcourse.tools.cluster import ClusterError, start_cluster, stop_cluster
from pcourse.tools.cluster import engines as cl
from pcourse.tools.cluster.slurm import job_state

pytestmark = pytest.mark.mpi
DEADLINE = 60.0  # seconds for anything Slurm does here, on a loaded 2-core machine


@pytest.fixture(scope="module")
def slurm(tmp_path_factory):
    """A one-node Slurm for this module's tests; stopped, with every job, at its end."""
    why = unavailable()
    if why:
        if os.environ.get(REQUIRE) == "1":
            pytest.fail(f"{REQUIRE}=1 but {why}")
        pytest.skip(why)
    node = OneNodeSlurm(tmp_path_factory.mktemp("slurm"))
    node.start()
    try:
        yield node
    finally:
        node.stop()


@pytest.fixture
def on_slurm(slurm, tmp_path, monkeypatch):
    """This process talks to the one-node Slurm, and lessons start their engines there."""
    monkeypatch.setenv("SLURM_CONF", str(slurm.conf))
    monkeypatch.setenv(cl.SLURM_ENV, f"partition={PARTITION} time=00:10:00 "
                                     f"folder={tmp_path / 'clusters'}")
    yield slurm
    stop_cluster()
    _wait(lambda: not slurm.queue(), "an empty queue", slurm)
    assert not cluster_processes()


def _wait(condition, what: str, slurm: OneNodeSlurm, timeout: float = DEADLINE):
    deadline = time.monotonic() + timeout
    while not (found := condition()):
        if time.monotonic() > deadline:
            raise AssertionError(f"no {what} within {timeout} s; queue: {slurm.queue()}\n"
                                 + slurm.logs())
        time.sleep(0.2)
    return found


def _job_id(mc: cl.MPICluster) -> str:
    return next(iter(mc.cluster.engines.values())).job_id


@pytest.mark.slow
def test_engines_are_a_slurm_job_and_stop_cancels_it(on_slurm):
    mc = start_cluster(3, timeout=DEADLINE)  # what an unchanged lesson calls
    job = _job_id(mc)
    assert on_slurm.queue() == [f"{job} RUNNING None"]
    assert mc.n == 3 and [e.rank for e in mc.engines] == [0, 1, 2]
    assert all(e.size == 3 for e in mc.engines)
    script = (mc.folder / "slurm_engine.sbatch").read_text()
    for option in (f"--partition={PARTITION}", "--ntasks=3", "--time=00:10:00", "--no-requeue"):
        assert f"#SBATCH {option}" in script, script
    # One MPI job: every engine's sum of rank+1 is MPI's own allreduce's, n(n+1)/2
    mc.view.execute("from mpi4py import MPI\n"
                    "mine = (MPI.COMM_WORLD.rank, MPI.COMM_WORLD.size, "
                    "MPI.COMM_WORLD.allreduce(rank + 1))")
    assert mc.view.pull("mine") == [(r, 3, 6) for r in range(3)]
    assert mc.view.apply_sync(lambda: os.environ["SLURM_JOB_ID"]) == [job] * 3
    stop_cluster(mc)
    assert on_slurm.queue() == []  # stop returns once the job has left the queue
    assert job_state(job).state in ("CANCELLED", "COMPLETED", "FAILED")
    assert not mc.folder.exists()


@pytest.mark.slow
def test_the_setup_check_reads_ready_through_slurm(on_slurm, capsys):
    from pcourse.tools.checks import setup_check

    assert setup_check.run(2)
    out = capsys.readouterr().out
    assert out.rstrip().splitlines()[-1] == "READY", out
    assert "allreduce over mpi" in out and "allreduce over gloo" in out
    assert on_slurm.queue() == []


def test_a_partition_that_does_not_exist_is_slurms_error(on_slurm):
    with pytest.raises(ClusterError, match="Invalid partition name specified"):
        start_cluster(2, slurm=cl.Slurm(partition="nosuchpartition",
                                        folder=str(on_slurm.folder / "clusters")))
    assert cl._current is None and on_slurm.queue() == []


def test_a_job_that_waits_past_the_timeout_says_why_and_is_cancelled(on_slurm):
    with pytest.raises(ClusterError, match=r"waited in Slurm's queue.*Reason=PartitionDown"):
        start_cluster(2, slurm=cl.Slurm(partition=HELD, folder=str(on_slurm.folder / "c")),
                      timeout=3)
    assert on_slurm.queue() == []  # the waiting job was cancelled


@pytest.mark.slow
def test_a_job_that_slurm_kills_is_named_with_slurms_reason(on_slurm):
    mc = start_cluster(2, timeout=DEADLINE)
    job = _job_id(mc)
    on_slurm.run("scontrol", "update", f"NodeName={on_slurm.host}", "State=DOWN",
                 "Reason=pcourse-test-node-lost")
    try:
        problem = _wait(mc.problem, "problem reported", on_slurm)
        assert re.search(rf"Slurm job {job}: JobState=NODE_FAIL", problem), problem
        with pytest.raises(ClusterError, match="NODE_FAIL"):
            mc.view.apply_sync(os.getpid)  # the next cell says so instead of hanging
    finally:
        stop_cluster(mc)
        on_slurm.run("scontrol", "update", f"NodeName={on_slurm.host}", "State=RESUME",
                     check=False)  # refused if the node has come back by itself
        _wait(lambda: on_slurm.node_state() == "idle", "idle node", on_slurm)


def _run_cells(path: Path, keep=lambda i, source: True) -> nbformat.NotebookNode:
    nb = nbformat.read(path, as_version=4)
    nb.cells = [c for i, c in enumerate(nb.cells) if keep(i, c.source)]
    NotebookClient(nb, timeout=300, kernel_name="python3",
                   resources={"metadata": {"path": str(path.parent)}}).execute()
    return nb


@pytest.mark.slow
def test_unchanged_lessons_run_with_pcourse_slurm(on_slurm):
    """Lesson 01 whole, and lesson 04's MPI part (up to pickle against buffers)."""
    _run_cells(REPO / "notebooks/01_parallel_sgd.ipynb")
    assert on_slurm.queue() == []  # its last cell cancelled its job
    lesson = REPO / "notebooks/04_four_backends.ipynb"
    cells = nbformat.read(lesson, as_version=4).cells
    marker = "pickle / buffer ranged from"  # the verdict on pickle against buffers
    ends = [i for i, c in enumerate(cells) if marker in c.source]
    assert ends, f"no cell of {lesson.name} prints {marker!r}: the test's marker moved"
    end = ends[0]
    _run_cells(lesson, lambda i, source: i <= end or source.strip() == "stop_cluster(mc)")
    assert on_slurm.queue() == []


def instructors_job_script() -> str:
    """The benchmark job script INSTRUCTORS.md gives (the bash block after its marker)."""
    text = (REPO / "INSTRUCTORS.md").read_text()
    after = text.split("<!-- the benchmark job script: tests/test_slurm.py runs it -->", 1)[1]
    return re.search(r"```bash\n(.*?)```", after, re.S).group(1)


@pytest.mark.slow
def test_the_documented_benchmark_job_script_writes_its_csv(on_slurm, tmp_path):
    """sbatch of INSTRUCTORS.md's script, from a course folder (its .venv: this Python's)."""
    script = tmp_path / "bench.sbatch"
    script.write_text(instructors_job_script())
    (tmp_path / ".venv").symlink_to(Path(sys.prefix))
    env = {**os.environ, "PYTHONPATH": str(REPO)}  # this checkout's pcourse, as `make` has it
    submitted = subprocess.run(["sbatch", "--parsable", str(script)], cwd=tmp_path, env=env,
                               capture_output=True, text=True, timeout=DEADLINE)
    assert submitted.returncode == 0, submitted.stderr
    job = submitted.stdout.strip().split(";")[0]
    state = _wait(lambda: (s := job_state(job)) and s.ended and s, "ended job", on_slurm,
                  timeout=240)
    log = "\n".join(p.read_text() for p in tmp_path.glob("*.out"))
    assert state.state == "COMPLETED", f"{state}\n{log}"
    [found] = list((tmp_path / "results").glob(f"comm-{job}.csv"))
    with found.open(newline="") as f:
        rows = list(csv.DictReader(f))
    assert {r["method"] for r in rows} >= {"mpi"} and {r["ranks"] for r in rows} == {"2"}
