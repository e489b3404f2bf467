"""A mesh of ranks: named dimensions, each rank's coordinates, and a group per dimension.

Data, tensor and pipeline parallelism each talk within their own group of ranks. A
mesh lays the job's p ranks out as a grid with named dimensions whose sizes multiply
to p (``{"dp": 2, "tp": 2}``: two data-parallel copies of a model split over two
ranks each). A rank's coordinates are its place in the grid; the group of a
dimension is the ranks that differ from it in that coordinate alone, numbered by it.

Ranks fill the grid row-major, as ``numpy.reshape`` does: the *last* dimension
varies fastest. With ``{"dp": 2, "tp": 2}`` the tp groups are ranks {0, 1} and
{2, 3}, the dp groups {0, 2} and {1, 3}. Put the dimension that talks most last:
its ranks are then neighbours, on one node where a node's ranks are consecutive.

Every backend works. A group is an MPI sub-communicator (``Split``) and a backend
made on it (``make_backend(name, comm=...)``). Every rank builds the whole mesh's
backend first (``mesh.world``: for torch's backends this makes the default group
span the mesh, for the NCCL ones it picks each rank's GPU), then every dimension's
group, in the order of the dimensions: the construction is collective over the
mesh's ranks and no rank waits for one that builds something else
(:mod:`pcourse.backends.bootstrap` says why torch needs that order).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import numpy as np

from pcourse.backends import Backend, make_backend


class Mesh:
    """``Mesh({"dp": 2, "tp": 2}, "gloo")``: this rank's coordinates and a backend per dimension.

    ``comm``: the MPI communicator whose ranks form the mesh (default: every rank);
    ``device``, ``timeout``: as for :func:`pcourse.backends.make_backend`, for every
    group. Collective over ``comm``. A shape whose sizes do not multiply to the
    number of ranks is refused before any communication.
    """

    def __init__(self, shape: Mapping[str, int], backend: str = "mpi", *, comm: Any = None,
                 device: Any = None, timeout: float | None = None) -> None:
        from mpi4py import MPI

        base = MPI.COMM_WORLD if comm is None else comm
        self.shape = check_shape(shape, base.Get_size())
        self.rank, self.size = base.Get_rank(), base.Get_size()
        sizes = tuple(self.shape.values())
        self.coords = dict(zip(self.shape, map(int, np.unravel_index(self.rank, sizes)),
                               strict=True))
        self._comms: dict[str, Any] = {}
        self._groups: dict[str, Backend] = {}
        self._base = base.Dup()
        self.world: Backend | None = None
        try:
            self.world = make_backend(backend, comm=self._base, device=device, timeout=timeout)
            for dim in self.shape:  # color: the group's first rank; numbered by the coordinate
                self._comms[dim] = self._base.Split(self.ranks(dim)[0], key=self.coords[dim])
                self._groups[dim] = make_backend(backend, comm=self._comms[dim],
                                                 device=self.world.device, timeout=timeout)
        except BaseException:
            self.close()
            raise

    def coord(self, dim: str) -> int:
        """This rank's coordinate along ``dim``: its rank in ``group(dim)``."""
        return self.coords[self._dim(dim)]

    def group(self, dim: str) -> Backend:
        """The backend over this rank's group along ``dim``."""
        return self._groups[self._dim(dim)]

    def comm(self, dim: str) -> Any:
        """The MPI sub-communicator of this rank's group along ``dim`` (the mesh's: do not
        free it)."""
        return self._comms[self._dim(dim)]

    def ranks(self, dim: str) -> list[int]:
        """The mesh ranks of this rank's group along ``dim``, in the group's rank order."""
        dim = self._dim(dim)
        coords = dict(self.coords)
        members = []
        for i in range(self.shape[dim]):
            coords[dim] = i
            members.append(int(np.ravel_multi_index(list(coords.values()),
                                                    list(self.shape.values()))))
        return members

    def _dim(self, dim: str) -> str:
        if dim not in self.shape:
            raise KeyError(f"this mesh has no dimension {dim!r}; it has {', '.join(self.shape)}")
        return dim

    def close(self) -> None:
        """Close every group, then the whole mesh's backend (same order on every rank)."""
        for dim in reversed(list(self._groups)):
            self._groups.pop(dim).close()
        for dim in list(self._comms):
            self._comms.pop(dim).Free()
        if self.world is not None:
            self.world.close()
            self.world = None
        if self._base is not None:
            self._base.Free()
            self._base = None

    def __enter__(self) -> Mesh:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"<Mesh {self.shape} rank {self.rank} at {self.coords}>"


def check_shape(shape: Mapping[str, int], size: int) -> dict[str, int]:
    """``shape`` as a dict, if its sizes are positive integers multiplying to ``size``."""
    if not isinstance(shape, Mapping) or not shape:
        raise ValueError(f"a mesh shape names its dimensions and their sizes, such as "
                         f"{{'dp': 2, 'tp': 2}}; got {shape!r}")
    for dim, n in shape.items():
        if not isinstance(dim, str) or not dim:
            raise ValueError(f"mesh dimensions are named by non-empty strings; got {dim!r}")
        if isinstance(n, bool) or not isinstance(n, int | np.integer) or n < 1:
            raise ValueError(f"mesh dimension {dim!r} must have a positive integer size, "
                             f"got {n!r}")
    total = math.prod(shape.values())
    if total != size:
        raise ValueError(f"mesh shape {dict(shape)} holds {total} ranks, but the communicator "
                         f"has {size}: choose sizes that multiply to {size}")
    return {dim: int(n) for dim, n in shape.items()}
