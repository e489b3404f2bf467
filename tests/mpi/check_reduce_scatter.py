"""Run under mpiexec: the ring's two halves equal MPI's own, and so does every backend's.

From scratch: :func:`ring_reduce_scatter` against ``Reduce_scatter`` (chunk counts as
``np.array_split`` cuts) and ``Reduce_scatter_block`` (lengths divisible by p), and
:func:`ring_allgather` against ``Allgatherv``, for lengths that do and do not divide by
p (and shorter than p), every op, float and int dtypes; then reduce-scatter followed by
allgather equals MPI's ``Allreduce``. Backends: ``reduce_scatter`` / ``all_gather`` of
mpi, mpi-pickle and gloo against the same references, ``avg`` included (16-bit 40000s,
whose sum overflows float16, average without overflowing), and a length
mismatch is the same MismatchError on every rank. Prints "reduce-scatter OK on p ranks".
"""

from __future__ import annotations

import numpy as np
import torch
from mpi4py import MPI

from pcourse.backends import MismatchError, make_backend
from pcourse.collectives import (
    LengthMismatchError,
    chunk_bounds,
    ring_allgather,
    ring_reduce_scatter,
)

COMM = MPI.COMM_WORLD
P, RANK = COMM.size, COMM.rank
MPI_OPS = {"sum": MPI.SUM, "max": MPI.MAX, "min": MPI.MIN, "prod": MPI.PROD}


def data(n: int, dtype: str, seed: int) -> np.ndarray:
    rng = np.random.default_rng([seed, RANK])
    if dtype.startswith("int"):
        return rng.integers(-50, 50, size=n).astype(dtype)
    return rng.uniform(0.5, 1.5, size=n).astype(dtype)


def from_scratch() -> None:
    for n in (0, 1, P - 1, P, 3 * P, 3 * P + 1, 3 * P + P - 1, 1001):
        counts = [b - a for a, b in chunk_bounds(n, P)]
        assert counts == [c.size for c in np.array_split(np.empty(n), P)]
        for dtype in ("float64", "float32", "int64"):
            for op in MPI_OPS:
                x = data(n, dtype, seed=n)
                before = x.copy()
                ref = np.empty(counts[RANK], dtype=dtype)
                COMM.Reduce_scatter(x, ref, recvcounts=counts, op=MPI_OPS[op])
                got = ring_reduce_scatter(x, op)
                assert np.array_equal(x, before), "reduce-scatter changed its input"
                if dtype.startswith("int") or op in ("max", "min"):
                    assert np.array_equal(got, ref), (n, dtype, op)
                else:  # the ring adds in another order than MPI
                    assert np.allclose(got, ref, rtol=1e-5 if dtype == "float32" else 1e-12)
                if n % P == 0:
                    block = np.empty(n // P, dtype=dtype)
                    COMM.Reduce_scatter_block(x, block, op=MPI_OPS[op])
                    assert np.allclose(got, block), (n, dtype, op, "block")
            mine = data(counts[RANK], dtype, seed=7 + n)
            ref = np.empty(n, dtype=dtype)
            COMM.Allgatherv(mine, [ref, counts])
            out = np.full(n, -1, dtype=dtype)
            assert ring_allgather(mine, out=out) is out
            assert np.array_equal(out, ref), (n, dtype, "allgather")
            # the two halves make an allreduce
            x = data(n, dtype, seed=11)
            full = ring_allgather(ring_reduce_scatter(x, "max"))
            want = np.empty_like(x)
            COMM.Allreduce(x, want, op=MPI.MAX)
            assert np.array_equal(full, want)
    # uneven allgather lengths, as Allgatherv allows
    mine = np.arange(RANK + 2, dtype=np.float64) + 10 * RANK
    ref = np.empty(sum(r + 2 for r in range(P)))
    COMM.Allgatherv(mine, [ref, [r + 2 for r in range(P)]])
    assert np.array_equal(ring_allgather(mine), ref)
    # a length mismatch: the same error on every rank, nothing hangs
    if P > 1:
        try:
            ring_reduce_scatter(np.ones(5 + (RANK == P - 1)))
        except LengthMismatchError as exc:
            assert "length ranges from 5 to 6" in str(exc), exc
        else:
            raise AssertionError("a length mismatch was not refused")


def backends() -> None:
    for name in ("mpi", "mpi-pickle", "gloo"):
        with make_backend(name, timeout=60) as b:
            for n_each in (0, 1, 5):
                n = n_each * P
                for dtype in (torch.float64, torch.float32, torch.int64):
                    x = torch.from_numpy(data(n, "int64" if dtype == torch.int64 else "float64",
                                              seed=n)).to(dtype)
                    ref = np.empty(n_each, dtype=x.numpy().dtype)
                    COMM.Reduce_scatter_block(x.numpy(), ref, op=MPI.SUM)
                    out = torch.full((n_each,), -1, dtype=dtype)
                    assert b.reduce_scatter(out, x) is out
                    assert np.allclose(out.numpy(), ref), (name, n, dtype)
                    if dtype.is_floating_point:
                        b.reduce_scatter(out, x, "avg")
                        assert np.allclose(out.numpy(), ref / P), (name, n, dtype, "avg")
                    mine = x[:n_each].clone() + RANK
                    full = torch.empty(n, dtype=dtype)
                    assert b.all_gather(full, mine) is full
                    want = np.empty(n, dtype=x.numpy().dtype)
                    COMM.Allgather(mine.numpy(), want)
                    assert np.array_equal(full.numpy(), want), (name, n, dtype, "gather")
            # 16 bits: every rank 40000, whose sum overflows float16 (65504) but whose
            # average does not: avg divides first, as allreduce does; the gather is exact
            for dtype in (torch.float16, torch.bfloat16):
                x = torch.full((2 * P,), 40000.0, dtype=dtype)
                out = torch.empty(2, dtype=dtype)
                b.reduce_scatter(out, x, "avg")
                assert bool(torch.isfinite(out).all()) and abs(out[0].item() - 40000) <= 400, \
                    (name, dtype, out.tolist(), "avg summed before it divided")
                assert torch.equal(x, torch.full_like(x, 40000.0)), (name, dtype, "input changed")
                full = torch.empty(2 * P, dtype=dtype)
                b.all_gather(full, x[:2])
                assert torch.equal(full, x), (name, dtype, full.tolist())
            # bfloat16 moves and reduces too (staged where the library lacks it)
            mine = torch.full((3,), RANK + 1, dtype=torch.bfloat16)
            full = torch.empty(3 * P, dtype=torch.bfloat16)
            b.all_gather(full, mine)
            assert full.tolist() == [float(r + 1) for r in range(P) for _ in range(3)]
            def wrong_length():
                n_each = 2 + (RANK == 0)
                b.reduce_scatter(torch.empty(n_each), torch.empty(P * n_each))

            def wrong_dtype():
                dtype = torch.float64 if RANK else torch.float32
                b.all_gather(torch.empty(P * 2, dtype=dtype), torch.empty(2, dtype=dtype))

            for bad, what in ((wrong_length, "length"), (wrong_dtype, "dtype")):
                if P == 1:
                    continue
                try:
                    bad()
                except MismatchError as exc:
                    assert what in str(exc), exc
                else:
                    raise AssertionError(f"{name}: a {what} mismatch was not refused")
            # a rank's own bad input: its ValueError, the others a MismatchError
            try:
                b.reduce_scatter(torch.empty(2), torch.empty(2 * P + (RANK == 0)))
            except ValueError as exc:
                assert RANK == 0 or isinstance(exc, MismatchError), exc
                assert RANK != 0 or "size" in str(exc), exc
            else:
                raise AssertionError(f"{name}: an input of the wrong size was accepted")


if __name__ == "__main__":
    from_scratch()
    backends()
    COMM.Barrier()
    if RANK == 0:
        print(f"reduce-scatter OK on {P} ranks", flush=True)
