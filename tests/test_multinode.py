"""Hostfiles and the launch commands lesson 09 shows: generated, never submitted."""

from __future__ import annotations

from pathlib import Path

import pytest

from pcourse import multinode


def test_hostfiles_in_both_dialects():
    hosts = {"node01": 4, "node02": 2}
    assert multinode.hostfile_text(hosts, "mpich") == "node01:4\nnode02:2\n"
    assert multinode.hostfile_text(hosts, "openmpi") == "node01 slots=4\nnode02 slots=2\n"
    with pytest.raises(ValueError, match="flavour"):
        multinode.hostfile_text(hosts, "slurm")
    with pytest.raises(ValueError, match="at least one slot"):
        multinode.hostfile_text({"node01": 0})


def test_mpi_engines_get_the_hostfile_and_the_mpi_flag():
    cmd = multinode.mpi_engine_command(8, "hosts")
    assert cmd[:5] == ["mpiexec", "-n", "8", "-f", "hosts"]
    assert cmd[-1] == "--mpi"


@pytest.mark.parametrize("mpi", [True, False])
def test_the_slurm_script_starts_mpi_engines_only_when_asked(mpi):
    script = multinode.slurm_engine_script(8, timelimit="00:10:00", queue="cpu", mpi=mpi)
    srun = [line for line in script.splitlines() if line.startswith("srun ")]
    assert len(srun) == 1
    assert srun[0].split()[-1] == "--mpi" if mpi else "--mpi" not in srun[0]
    for option in ("--ntasks=8", "--time=00:10:00", "--partition=cpu"):
        assert f"#SBATCH {option}" in script
    assert "<pid>" in script  # the same text on every run


def _sbatch(script: str) -> list[str]:
    return [line for line in script.splitlines() if line.startswith("#SBATCH ")]


@pytest.mark.parametrize("gpus_per_task, gres, wanted", [
    (1, "", ["--gpus-per-task=1"]),
    (2, "", ["--gpus-per-task=2"]),
    (0, "gpu:4", ["--gres=gpu:4"]),
    (1, "gpu:a100:4", ["--gpus-per-task=1", "--gres=gpu:a100:4"]),
])
def test_the_slurm_script_asks_for_the_gpus_it_is_given(gpus_per_task, gres, wanted):
    plain = multinode.slurm_engine_script(4, queue="gpu")
    script = multinode.slurm_engine_script(4, queue="gpu", gpus_per_task=gpus_per_task,
                                           gres=gres)
    added = [line for line in _sbatch(script) if line not in _sbatch(plain)]
    assert added == [f"#SBATCH {w}" for w in wanted]
    for option in ("--ntasks=4", "--partition=gpu", "--time=00:30:00"):  # kept
        assert f"#SBATCH {option}" in script
    lines = script.splitlines()
    srun = next(i for i, line in enumerate(lines) if line.startswith("srun "))
    assert all(lines.index(a) < srun for a in added)  # options before the first command


def test_no_gpu_request_without_gpus():
    script = multinode.slurm_engine_script(4)
    assert "gpu" not in script and "gres" not in script


@pytest.mark.parametrize("gpus_per_task, gres, says", [
    (-1, "", "gpus_per_task must be a whole number >= 0.*-1"),
    (1.5, "", "gpus_per_task.*1.5"),
    (True, "", "gpus_per_task.*True"),
    (0, "gpu 2", "gres must be .*'gpu 2'"),
])
def test_a_bad_gpu_request_is_refused_naming_it(gpus_per_task, gres, says):
    with pytest.raises(ValueError, match=says):
        multinode.slurm_engine_script(2, gpus_per_task=gpus_per_task, gres=gres)


def test_a_slurm_cluster_asks_for_the_gpus_its_job_is_given(monkeypatch, tmp_path):
    """start_cluster(n, slurm=Slurm(gpus_per_task=1)) and $PCOURSE_SLURM pass the request
    to the job script the cluster's launcher writes."""
    from pcourse.tools.cluster import engines

    monkeypatch.setenv(engines.SLURM_ENV, "partition=gpu gpus_per_task=1 gres=gpu:2")
    slurm = engines.Slurm.from_env()
    assert (slurm.gpus_per_task, slurm.gres) == (1, "gpu:2")
    cluster = engines._make_slurm_cluster(2, tmp_path, {}, slurm)
    launcher = cluster.engine_launcher_class(
        work_dir=str(tmp_path), config=cluster.config, cluster_id="t",
        profile_dir=str(tmp_path / "profile"), log=cluster.log)
    launcher.write_batch_script(2)
    sbatch = _sbatch(Path(launcher.batch_file).read_text())
    assert "#SBATCH --gpus-per-task=1" in sbatch and "#SBATCH --gres=gpu:2" in sbatch
    assert "#SBATCH --partition=gpu" in sbatch
    monkeypatch.setenv(engines.SLURM_ENV, "gpus_per_task=one")
    with pytest.raises(engines.ClusterError, match="gpus_per_task=one"):
        engines.Slurm.from_env()



@pytest.mark.slow
def test_the_node_aware_allreduce_sums_as_gloos_own_at_every_node_size():
    """multinode.node_aware_allreduce (lesson 09) against dist.all_reduce, 6 ranks in nodes
    of 1, 2, 3 and 6 (tests/torchrun/check_node_aware.py)."""
    import os
    import subprocess
    import sys

    from pcourse.tools.cluster.launch import kill_group

    proc = subprocess.Popen([sys.executable, "tests/torchrun/check_node_aware.py", "6"],
                            cwd=Path(__file__).resolve().parents[1], stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True,
                            env={**os.environ, "OMP_NUM_THREADS": "1"})
    try:
        out, _ = proc.communicate(timeout=240)
    finally:
        kill_group(proc)
    assert proc.returncode == 0, out[-3000:]
    assert "node-aware allreduce OK (6 ranks, nodes of [1, 2, 3, 6])" in out
