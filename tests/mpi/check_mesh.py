"""Run under mpiexec at an even number of ranks (4: a 2x2 mesh, 6: 2x3): groups and meshes.

The reference is MPI's own collectives on sub-communicators this script splits
itself, from the row-major layout's closed form (tp = rank % T varies fastest, dp =
rank // T), independently of :mod:`pcourse.mesh`. For mpi, mpi-pickle and gloo:

- a Mesh's coordinates, its groups' ranks and sizes, and allreduce, broadcast,
  reduce_scatter and all_gather on each dimension's group, against the reference;
  16-bit ``avg`` of 40000s (whose sum overflows float16) through reduce_scatter;
- two groups of different membership (tp and dp) used interleaved, asynchronous
  ones overlapping, in a Mesh and as two plain backends on Split communicators
  (torch's: after a backend over the whole job, the documented rule; without one,
  the same clear error on every rank);
- a torch part made while the other part never comes: an error after the timeout;
- a shape that does not multiply to the world size, a size below one and an unknown
  dimension are refused with what was wrong.

Failures are collected on every rank and printed by rank 0, with "mesh OK on p ranks".
"""

from __future__ import annotations

import sys

import numpy as np
import torch
from harness import RANK, SIZE, WORLD, expect, raises, verdict
from mpi4py import MPI

from pcourse.backends import Backend, make_backend
from pcourse.mesh import Mesh

GPU = "--gpu" in sys.argv  # the NCCL backends, one rank per GPU: a 1 x p mesh
T = SIZE if GPU else SIZE // 2  # the tp size: the mesh is D x T
D = SIZE // T
SHAPE = {"dp": D, "tp": T}
CPU_BACKENDS = ("mpi", "mpi-pickle", "gloo")
GPU_BACKENDS = ("nccl", "nccl-cupy")


def reference() -> dict[str, MPI.Comm]:
    """The tp and dp sub-communicators of the D x T row-major grid, split here."""
    return {"tp": WORLD.Split(RANK // T, key=RANK % T), "dp": WORLD.Split(RANK % T, key=RANK // T)}


def data(n: int, seed: int, device: torch.device | str = "cpu") -> torch.Tensor:
    rng = np.random.default_rng([seed, RANK])
    return torch.from_numpy(rng.uniform(0.5, 1.5, size=n)).to(device)


def check_group(name: str, dim: str, g: Backend, ref: MPI.Comm) -> None:
    """Every collective of ``g`` against MPI's own on ``ref`` (the same ranks)."""
    what, dev = f"{name} {dim}", g.device
    expect((g.rank, g.size) == (ref.rank, ref.size),
           f"{what}: rank/size {(g.rank, g.size)}, MPI's {(ref.rank, ref.size)}")
    x = data(7, seed=1, device=dev)
    want = x.cpu().numpy().copy()
    ref.Allreduce(MPI.IN_PLACE, want, MPI.SUM)
    g.allreduce(x)
    expect(np.allclose(x.cpu().numpy(), want), f"{what}: allreduce")
    y = data(5, seed=2, device=dev)
    want = ref.bcast(y.cpu(), root=ref.size - 1)
    g.broadcast(y, ref.size - 1)
    expect(torch.equal(y.cpu(), want), f"{what}: broadcast from the last rank")
    n = 3
    big = data(n * ref.size, seed=3, device=dev)
    out = torch.empty(n, dtype=big.dtype, device=dev)
    want = np.empty(n)
    ref.Reduce_scatter_block(big.cpu().numpy(), want, MPI.SUM)
    g.reduce_scatter(out, big)
    expect(np.allclose(out.cpu().numpy(), want), f"{what}: reduce_scatter")
    mine = data(n, seed=4, device=dev)
    full = torch.empty(n * ref.size, dtype=mine.dtype, device=dev)
    want = np.empty(n * ref.size)
    ref.Allgather(mine.cpu().numpy(), want)
    g.all_gather(full, mine)
    expect(np.array_equal(full.cpu().numpy(), want), f"{what}: all_gather")
    halves = torch.full((2 * ref.size,), 40000.0, dtype=torch.float16, device=dev)
    avg = torch.empty(2, dtype=torch.float16, device=dev)
    g.reduce_scatter(avg, halves, "avg")
    expect(bool(torch.isfinite(avg).all()) and abs(avg[0].item() - 40000) <= 400,
           f"{what}: float16 avg of 40000s through reduce_scatter gave {avg.tolist()}")


def interleaved(name: str, tp: Backend, dp: Backend, refs: dict[str, MPI.Comm]) -> None:
    """tp and dp collectives in turn, two started before either is waited for."""
    for step in range(3):
        a, b = data(6, seed=10 + step, device=tp.device), data(6, seed=20 + step, device=dp.device)
        want_a, want_b = a.cpu().numpy().copy(), b.cpu().numpy().copy()
        refs["tp"].Allreduce(MPI.IN_PLACE, want_a, MPI.SUM)
        refs["dp"].Allreduce(MPI.IN_PLACE, want_b, MPI.MAX)
        work_a = tp.allreduce_async(a)
        work_b = dp.allreduce_async(b, "max")
        work_b.wait()
        work_a.wait()
        expect(np.allclose(a.cpu().numpy(), want_a) and np.array_equal(b.cpu().numpy(), want_b),
               f"{name}: tp and dp interleaved, step {step}")


def check_mesh(name: str, refs: dict[str, MPI.Comm]) -> None:
    with Mesh(SHAPE, name, timeout=60) as mesh:
        want = {"dp": RANK // T, "tp": RANK % T}
        expect(mesh.coords == want, f"{name}: coordinates {mesh.coords}, want {want}")
        expect(mesh.coord("tp") == want["tp"], f"{name}: coord('tp')")
        for dim, ref in refs.items():
            expect(mesh.ranks(dim) == ref.allgather(RANK),
                   f"{name} {dim}: ranks {mesh.ranks(dim)}, MPI's {ref.allgather(RANK)}")
            other = mesh.comm(dim)
            expect(other.allgather(RANK) == ref.allgather(RANK), f"{name} {dim}: comm")
            check_group(name, dim, mesh.group(dim), ref)
        interleaved(name, mesh.group("tp"), mesh.group("dp"), refs)
        x = torch.ones(2, device=mesh.world.device)
        mesh.world.allreduce(x)
        expect(torch.equal(x.cpu(), torch.full((2,), float(SIZE))), f"{name}: the mesh's world")
        expect(raises(KeyError, mesh.group, "pp", match="no dimension 'pp'"),
               f"{name}: an unknown dimension should be refused")


def check_plain_backends(name: str, refs: dict[str, MPI.Comm]) -> None:
    """Two backends of different membership made by hand, on Split communicators."""
    world = make_backend(name, timeout=60) if name == "gloo" else None  # the rule for torch
    tp = make_backend(name, comm=refs["tp"], timeout=60)
    dp = make_backend(name, comm=refs["dp"], timeout=60)
    for dim, g in (("tp", tp), ("dp", dp)):
        check_group(f"plain {name}", dim, g, refs[dim])
    interleaved(f"plain {name}", tp, dp, refs)
    backwards = WORLD.Split(RANK // T, key=-RANK)  # ranks numbered against the job's order
    rev = make_backend(name, comm=backwards, timeout=60)
    check_group(f"plain {name}", "tp numbered backwards", rev, backwards)
    rev.close()
    backwards.Free()
    for b in (dp, tp, world):
        if b is not None:
            b.close()
    if name == "gloo":  # without a backend over the whole job first: one error everywhere
        tp = make_backend(name, comm=refs["tp"], timeout=60)
        expect(raises(RuntimeError, make_backend, name, comm=refs["dp"], timeout=60,
                      match="first over the whole job"),
               "gloo: dp after tp without a world backend should be refused on every rank")
        tp.close()
        again = make_backend(name, comm=refs["dp"], timeout=60)  # and then it works
        check_group("gloo after the refusal", "dp", again, refs["dp"])
        again.close()


def check_a_rank_that_never_comes(refs: dict[str, MPI.Comm]) -> None:
    """Making a torch group is collective over the default group: where the other tp part
    never comes, the first part's ranks get an error after the timeout, not a hang."""
    import time

    from pcourse.runtime.waits import CollectiveTimeout

    world = make_backend("gloo", timeout=60)
    if RANK < T:
        start = time.monotonic()
        expect(raises(CollectiveTimeout, make_backend, "gloo", comm=refs["tp"], timeout=2,
                      match="collective over all"),
               "gloo: a part made while the other part never comes should time out")
        expect(time.monotonic() - start < 30, "gloo: the timeout took far too long")
        expect(raises(RuntimeError, make_backend, "gloo", comm=refs["tp"], timeout=2,
                      match="out of step"), "gloo: after a timeout, parts are refused")
    WORLD.Barrier()
    world.close()
    again = make_backend("gloo", comm=refs["tp"], timeout=60)  # a fresh default group
    check_group("gloo after a timeout", "tp", again, refs["tp"])
    again.close()


def check_bad_shapes() -> None:
    bad = {"dp": D, "tp": T + 1}
    expect(raises(ValueError, Mesh, bad, "mpi",
                  match=f"holds {D * (T + 1)} ranks, but the communicator has {SIZE}"),
           "a shape that does not multiply to the world size should name both numbers")
    expect(raises(ValueError, Mesh, {"dp": SIZE, "tp": 0}, "mpi", match="positive integer"),
           "a size of 0 should be refused")
    expect(raises(ValueError, Mesh, {}, "mpi", match="names its dimensions"),
           "an empty shape should be refused")


def main_gpu() -> int:
    """The NCCL backends' groups: at one rank per GPU (one GPU: the plumbing)."""
    from pcourse.backends import unavailable_reason

    refs = reference()
    for name in GPU_BACKENDS:
        reason = unavailable_reason(name, SIZE)
        if reason:
            expect(False, f"{name} cannot run here: {reason}")
            continue
        check_mesh(name, refs)
    return verdict(f"mesh on {SIZE} ranks (GPU)")


def main() -> int:
    if GPU:
        return main_gpu()
    if SIZE % 2:
        raise SystemExit("run at an even number of ranks")
    refs = reference()
    check_bad_shapes()
    for name in CPU_BACKENDS:
        check_mesh(name, refs)
        check_plain_backends(name, refs)
    check_a_rank_that_never_comes(refs)
    for ref in refs.values():
        ref.Free()
    return verdict(f"mesh on {SIZE} ranks")


if __name__ == "__main__":
    sys.exit(main())
