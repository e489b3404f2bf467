"""Meshes and groups: every CPU backend's groups against MPI's own collectives on the same
sub-communicators (tests/mpi/check_mesh.py), the NCCL backends' on GPUs, and the shape rules."""

from __future__ import annotations

import pytest
import torch

from pcourse.mesh import Mesh, check_shape


# 4 ranks: 2x2; 6 ranks: 2x3, where the tp groups have 3 ranks (p = 2 hides indexing bugs)
@pytest.mark.parametrize("p", [4, pytest.param(6, marks=pytest.mark.slow)])
def test_mesh_groups_equal_mpi_on_the_same_sub_communicators(mpi_run, p: int) -> None:
    mpi_run(p, "check_mesh.py", expect=f"mesh on {p} ranks: ALL OK", timeout=300)


@pytest.mark.gpu
def test_mesh_on_the_nccl_backends(mpi_run) -> None:
    p = min(torch.cuda.device_count(), 2)
    mpi_run(p, "check_mesh.py", "--gpu", expect=f"mesh on {p} ranks (GPU): ALL OK", timeout=300)


def test_a_shape_must_multiply_to_the_number_of_ranks() -> None:
    assert check_shape({"dp": 2, "tp": 3}, 6) == {"dp": 2, "tp": 3}
    with pytest.raises(ValueError, match=r"holds 6 ranks, but the communicator has 4: choose "
                                         r"sizes that multiply to 4"):
        check_shape({"dp": 2, "tp": 3}, 4)
    for bad, said in [({"dp": 0, "tp": 4}, "positive integer size, got 0"),
                      ({"dp": 2.0, "tp": 2}, "positive integer"), ({}, "names its dimensions"),
                      ({"": 4}, "non-empty strings"), ([("dp", 4)], "names its dimensions")]:
        with pytest.raises(ValueError, match=said):
            check_shape(bad, 4)


def test_a_one_rank_mesh_is_refused_before_any_communication_or_runs() -> None:
    with pytest.raises(ValueError, match="holds 4 ranks, but the communicator has 1"):
        Mesh({"dp": 2, "tp": 2}, "mpi")
    with Mesh({"dp": 1, "tp": 1}, "mpi") as mesh:
        assert mesh.coords == {"dp": 0, "tp": 0} and mesh.ranks("tp") == [0]
        x = torch.ones(3)
        mesh.group("tp").allreduce(x, "avg")
        assert torch.equal(x, torch.ones(3))
        with pytest.raises(KeyError, match="no dimension 'pp'; it has dp, tp"):
            mesh.coord("pp")


class _Done:
    def Test(self) -> bool:  # mpi4py's names
        return True


class _Everyone:
    """The default group's communicator, each rank's row already known (what the swap gets)."""

    def __init__(self, rows: list[list[int]]) -> None:
        self.rows = rows

    def Get_size(self) -> int:
        return len(self.rows)

    def Iallgather(self, row, out):
        out[...] = self.rows
        return _Done()


def test_every_rank_makes_every_part_in_one_order_numbered_as_its_communicator() -> None:
    from pcourse.backends.bootstrap import _swap_parts

    # 4 ranks in two parts: {1, 0} (numbered backwards by its communicator) and {2, 3}
    rows = [[2, 1, 0, 0], [2, 1, 0, 0], [0, 0, 1, 2], [0, 0, 1, 2]]
    assert _swap_parts(_Everyone(rows), [1, 0], 1.0) == ([[1, 0], [2, 3]], 0)
    assert _swap_parts(_Everyone(rows), [2, 3], 1.0) == ([[1, 0], [2, 3]], 1)
    overlapping = [[1, 2, 0, 0], [0, 1, 2, 0], [0, 1, 2, 0], [0, 0, 0, 1]]
    with pytest.raises(RuntimeError, match="overlapping communicators"):
        _swap_parts(_Everyone(overlapping), [0, 1], 1.0)
