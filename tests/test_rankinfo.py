"""Who am I: the one test of running as a rank, the place in the job, the GPU choice."""

from __future__ import annotations

import os

import pytest
import torch

from pcourse.runtime import ranks

LAUNCH_VARS = ranks.MPI_RANK_VARS + ranks.TORCHRUN_VARS + ("LOCAL_WORLD_SIZE",)


@pytest.fixture
def clean_env(monkeypatch):
    for var in LAUNCH_VARS:
        monkeypatch.delenv(var, raising=False)
    return monkeypatch


@pytest.mark.parametrize(("env", "expected"), [
    ({}, ""),
    ({"PMI_RANK": "0"}, "mpi"),  # MPICH / Hydra, Intel MPI, srun
    ({"OMPI_COMM_WORLD_RANK": "1"}, "mpi"),  # Open MPI
    ({"PMIX_RANK": "0"}, "mpi"),
    ({"RANK": "0", "WORLD_SIZE": "2", "LOCAL_RANK": "0"}, "torchrun"),
    ({"RANK": "0", "WORLD_SIZE": "2"}, ""),  # someone's own variables, not torchrun
    ({"RANK": "0", "WORLD_SIZE": "2", "LOCAL_RANK": "0", "PMI_RANK": "0"}, "mpi"),
])
def test_launcher_reads_what_launchers_set(clean_env, env, expected):
    for var, value in env.items():
        clean_env.setenv(var, value)
    assert ranks.launcher() == expected


def test_init_rank_under_torchrun_reads_its_variables(clean_env):
    for var, value in {"RANK": "3", "WORLD_SIZE": "4", "LOCAL_RANK": "1",
                       "LOCAL_WORLD_SIZE": "2"}.items():
        clean_env.setenv(var, value)
    clean_env.setattr(ranks, "_info", None)
    before = torch.get_num_threads()
    try:
        me = ranks.init_rank()
    finally:
        torch.set_num_threads(before)
    assert (me.rank, me.size, me.local_rank, me.local_size) == (3, 4, 1, 2)
    assert me.threads == max(1, (os.cpu_count() or 1) // 2)
    assert me.device == ("cpu" if not torch.cuda.is_available()
                         else f"cuda:{1 % torch.cuda.device_count()}")


def test_local_rank_i_takes_gpu_i_modulo_the_gpus(monkeypatch):
    monkeypatch.setattr(ranks, "gpu_count", lambda: 0)
    assert ranks.gpu_for(3) is None
    monkeypatch.setattr(ranks, "gpu_count", lambda: 2)
    assert [ranks.gpu_for(i) for i in range(5)] == [0, 1, 0, 1, 0]


def test_threads_block_restores_the_count():
    before = torch.get_num_threads()
    with ranks.threads(1):
        assert torch.get_num_threads() == 1
    assert torch.get_num_threads() == before
    with ranks.threads(None):
        assert torch.get_num_threads() == before
