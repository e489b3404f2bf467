"""Hostfiles and the launch commands lesson 09 shows: generated, never submitted."""

from __future__ import annotations

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
