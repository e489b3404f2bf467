"""Run under mpiexec: every from-scratch allreduce equals MPI's own Allreduce.

One launch per rank count checks all algorithms, ops, dtypes, lengths, in place
and out of place, and that a length mismatch across ranks raises instead of hanging.
Exits non-zero with a message on the first failure.
"""

from __future__ import annotations

import sys

import numpy as np
from mpi4py import MPI

from pcourse.collectives import (
    LengthMismatchError,
    recursive_doubling_allreduce,
    ring_allreduce,
    tree_allreduce,
)

COMM = MPI.COMM_WORLD
ALGORITHMS = {
    "tree": tree_allreduce,
    "ring": ring_allreduce,
    "recursive-doubling": recursive_doubling_allreduce,
}
MPI_OPS = {"sum": MPI.SUM, "max": MPI.MAX, "min": MPI.MIN, "prod": MPI.PROD}
BIG = 1 << 19  # 4 MiB of float64


def data(n: int, dtype: str, op: str, seed: int) -> np.ndarray:
    """Rank-dependent values; products stay small enough not to overflow floats."""
    rng = np.random.default_rng([seed, COMM.rank])
    if dtype.startswith("int"):
        low, high = (-3, 4) if op == "prod" else (-1000, 1000)
        return rng.integers(low, high, size=n).astype(dtype)
    if op == "prod":
        return rng.uniform(0.5, 1.5, size=n).astype(dtype)
    return rng.standard_normal(n).astype(dtype)


def reference(x: np.ndarray, op: str) -> np.ndarray:
    ref = np.empty_like(x)
    COMM.Allreduce(x, ref, op=MPI_OPS[op])
    return ref


def same_everywhere(y: np.ndarray) -> bool:
    """Every rank must hold bitwise the same result, not just a close one."""
    return all(np.array_equal(y, other) for other in COMM.allgather(y))


def check(name: str, n: int, dtype: str, op: str, in_place: bool, seed: int) -> None:
    x = data(n, dtype, op, seed)
    ref = reference(x, op)
    original = x.copy()
    if in_place:
        y = ALGORITHMS[name](x, op)
        assert y is x, "in place must return the input"
    else:
        out = np.full_like(x, 7)
        y = ALGORITHMS[name](x, op, out=out)
        assert y is out, "out of place must return out"
        assert np.array_equal(x, original), "out of place must leave the input alone"
    where = f"{name} p={COMM.size} n={n} {dtype} {op} in_place={in_place} rank={COMM.rank}"
    if dtype.startswith("int"):
        assert np.array_equal(y, ref), f"{where}: differs from MPI Allreduce"
    else:
        assert np.allclose(y, ref, rtol=1e-5 if dtype == "float32" else 1e-12), (
            f"{where}: max error {np.max(np.abs(y - ref))}")
    if n <= 1024:
        assert same_everywhere(y), f"{where}: ranks hold different results"


def check_torch(name: str) -> None:
    """CPU tensors are reduced through a numpy view, in their own memory."""
    import torch  # only here: importing torch on 5 oversubscribed ranks takes seconds

    t = torch.arange(10, dtype=torch.float32) * (COMM.rank + 1)
    ref = reference(t.numpy().copy(), "sum")
    assert ALGORITHMS[name](t, "sum") is t
    assert np.allclose(t.numpy(), ref), f"{name}: torch tensor result wrong"


def check_mismatch(name: str) -> None:
    n = 5 + (COMM.rank == 0)  # rank 0 has one element more
    try:
        ALGORITHMS[name](np.ones(n))
    except LengthMismatchError as exc:
        assert "same length" in str(exc)
    else:
        raise AssertionError(f"{name}: mismatched lengths were not refused")


def check_one_rank_refuses(name: str) -> None:
    """Bad input on rank 0 only: rank 0 says why, the others learn of it; nobody hangs."""
    op = "bogus" if COMM.rank == 0 else "sum"
    try:
        ALGORITHMS[name](np.ones(4), op)
    except LengthMismatchError as exc:
        assert COMM.rank != 0 and "refused" in str(exc), f"{name}: {exc}"
    except ValueError as exc:
        assert COMM.rank == 0 and "unknown op" in str(exc), f"{name}: {exc}"
    else:
        raise AssertionError(f"{name}: rank {COMM.rank} did not raise")


def main() -> int:
    p = COMM.size
    lengths = sorted({0, 1, max(p - 1, 0), p + 1})
    count = 0
    for seed, name in enumerate(ALGORITHMS):
        for op in MPI_OPS:
            for dtype in ("int64", "float64"):
                for n in lengths:
                    for in_place in (True, False):
                        check(name, n, dtype, op, in_place, seed)
                        count += 1
        check(name, BIG, "float64", "sum", True, seed)  # a few MB: every chunk path
        check(name, BIG + p - 1, "int32", "max", False, seed)
        check(name, 2 * p + 1, "float32", "prod", False, seed)
        if p == 2:  # the tensor view does not depend on p
            check_torch(name)
        if p > 1:
            check_mismatch(name)
            check_one_rank_refuses(name)
        count += 4
    COMM.Barrier()
    if COMM.rank == 0:
        print(f"collectives OK on {p} ranks: {count} checks")
    return 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except Exception as exc:  # noqa: BLE001 - any failure must end every rank, not hang
        print(f"FAILED on rank {COMM.rank}: {exc!r}", flush=True)
        COMM.Abort(1)
