"""Check the NCCL backends on this machine's GPUs against MPI's own Allreduce.

``python -m pcourse.tools.checks.gpu_check`` (or ``make gpu-check``) starts itself under
``mpiexec`` with one rank per visible GPU, runs ``nccl`` and ``nccl-cupy`` (and
``mpi`` on GPU tensors, staged through the host) for every op, several dtypes and
sizes, and compares each result with what MPI's ``COMM_WORLD.Allreduce`` computes
from the same inputs on the host: an independent reference, since MPI shares no
code with NCCL. It prints a table and PASS or FAIL.
Without a GPU it prints why it cannot run and exits 0 (SKIPPED). On one GPU it runs
one rank, which checks the plumbing (devices, streams, dtypes, communicators), not a
reduction across GPUs; it says so.

``--which-extra`` prints the pip extra of the GPU libraries that match this torch
(:func:`pcourse.backends.extra_for`): the Makefile's ``gpu-check`` installs that one.

The comparison harness (:func:`check_allreduce`) is also what the tests use for the
CPU backends.
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass

import numpy as np
import torch

from pcourse.backends import OPS, Backend, extra_for

SIZES = (1, 7, 1001, (1 << 20) + 3)
GPU_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64,
              torch.int32, torch.int64, torch.uint8)
# (rtol, atol) for sums, products and averages; max and min must match exactly.
TOLERANCE = {torch.float16: (1e-2, 1e-2), torch.bfloat16: (3e-2, 3e-2),
             torch.float32: (1e-5, 1e-5), torch.float64: (1e-12, 1e-12)}


@dataclass
class CaseResult:
    backend: str
    op: str
    dtype: str
    size: int
    ok: bool
    error: float  # largest absolute difference from the MPI reference


def case_input(dtype: torch.dtype, op: str, size: int, rank: int, seed: int) -> torch.Tensor:
    """This rank's input: small values, so sums and products neither overflow nor lose bits."""
    gen = torch.Generator().manual_seed(seed * 1009 + rank)
    if dtype.is_floating_point:
        lo, hi = (0.5, 1.5) if op == "prod" else (-1.0, 1.0)
        return (torch.rand(size, generator=gen, dtype=torch.float64) * (hi - lo) + lo).to(dtype)
    lo, hi = (-2, 3) if op == "prod" else (-50, 51)
    if dtype == torch.uint8:
        lo = 0
    return torch.randint(lo, hi, (size,), generator=gen).to(dtype)


def mpi_reference(x: torch.Tensor, op: str) -> np.ndarray:
    """What MPI's own Allreduce on COMM_WORLD makes of every rank's ``x`` (on the host)."""
    from mpi4py import MPI

    from pcourse.backends.mpi import mpi_op

    wide = x.dtype == torch.bfloat16  # numpy has no bfloat16: reduce its values in float32
    ref = (x.float() if wide else x).cpu().numpy().copy()
    MPI.COMM_WORLD.Allreduce(MPI.IN_PLACE, ref, op=mpi_op(op))
    if op == "avg":
        ref = ref / MPI.COMM_WORLD.Get_size()
    return ref


def _compare(got: torch.Tensor, ref: np.ndarray, op: str) -> tuple[bool, float]:
    got64 = got.detach().cpu().double().numpy()
    ref64 = ref.astype(np.float64)
    err = float(np.abs(got64 - ref64).max()) if got64.size else 0.0
    if op in ("max", "min") or not got.dtype.is_floating_point:
        return bool(np.array_equal(got64, ref64)), err
    rtol, atol = TOLERANCE[got.dtype]
    return bool(np.allclose(got64, ref64, rtol=rtol, atol=atol)), err


def check_allreduce(
    backend: Backend, dtypes: tuple[torch.dtype, ...], sizes: tuple[int, ...] = SIZES,
    ops: tuple[str, ...] = OPS, seed: int = 0, use_async: bool = False,
) -> list[CaseResult]:
    """Every (op, dtype, size) case on this backend vs MPI's Allreduce; collective.

    With ``use_async`` all sizes of one (op, dtype) are started before any is
    waited for, so several requests are in flight at once.
    """
    results = []
    for dtype in dtypes:
        for op in ops:
            if op == "avg" and not dtype.is_floating_point:
                continue  # avg of integers is refused by design (see check_avg_dtype)
            cases = []
            for size in sizes:
                x = case_input(dtype, op, size, backend.rank, seed + size).to(backend.device)
                cases.append((size, x, mpi_reference(x, op), x.clone()))
            if use_async:  # all started, then all waited for
                works = [backend.allreduce_async(y, op) for _, _, _, y in cases]
                for w in works:
                    w.wait()
            else:
                for _, _, _, y in cases:
                    backend.allreduce(y, op)
            for size, _, ref, y in cases:
                ok, err = _compare(y, ref, op)
                results.append(CaseResult(backend.name, op, str(dtype).removeprefix("torch."),
                                          size, ok, err))
    return results


def all_ranks_ok(results: list[CaseResult]) -> list[CaseResult]:
    """The same results with ``ok`` true only where it holds on every rank."""
    from mpi4py import MPI

    flags = MPI.COMM_WORLD.allgather([r.ok for r in results])
    return [CaseResult(r.backend, r.op, r.dtype, r.size, all(f[i] for f in flags), r.error)
            for i, r in enumerate(results)]


def table(results: list[CaseResult]) -> str:
    """One line per backend and dtype, one column per op: ok, FAIL, or - (not run)."""
    lines = [f"{'backend':10} {'dtype':9} " + " ".join(f"{op:>5}" for op in OPS)]
    for key in dict.fromkeys((r.backend, r.dtype) for r in results):
        cells = []
        for op in OPS:
            rows = [r for r in results if (r.backend, r.dtype, r.op) == (*key, op)]
            cells.append("-" if not rows else "ok" if all(r.ok for r in rows) else "FAIL")
        lines.append(f"{key[0]:10} {key[1]:9} " + " ".join(f"{c:>5}" for c in cells))
    return "\n".join(lines)


def _worker() -> int:
    from pcourse.backends import make_backend, unavailable_reason
    from pcourse.runtime.ranks import init_rank

    me = init_rank()
    results, problems = [], []
    # "mpi" too: on GPU tensors it exercises the staging through host memory.
    for name in ("nccl", "nccl-cupy", "mpi"):
        reason = unavailable_reason(name)
        if reason:
            problems.append(f"{name}: unavailable: {reason}")
            continue
        with make_backend(name) as backend:
            results += check_allreduce(backend, GPU_DTYPES)
            x = torch.full((1001,), float(me.rank), device=backend.device)
            backend.broadcast(x, root=backend.size - 1)
            if not bool((x == backend.size - 1).all()):
                problems.append(f"{name}: broadcast from the last rank gave wrong values")
            backend.barrier()
    results = all_ranks_ok(results)
    if me.rank == 0:
        print(f"{me.size} rank(s), one GPU each; reference: MPI COMM_WORLD.Allreduce")
        if me.size == 1:
            print("one rank: this checks the plumbing (devices, streams, dtypes, "
                  "communicators), not a reduction across GPUs")
        print(table(results))
        problems += [f"{r.backend} {r.op} {r.dtype} n={r.size}: max error {r.error:.3g}"
                     for r in results if not r.ok]
        print("\n".join(problems))
        print("PASS" if not problems else f"FAIL: {len(problems)} problem(s)")
    return 1 if problems else 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds for the MPI job")
    parser.add_argument("--which-extra", action="store_true",
                        help="print the pip extra with the GPU libraries for this torch, exit")
    args = parser.parse_args(argv)
    if args.which_extra:
        try:
            print(extra_for(torch.version.cuda))
        except ValueError as exc:
            print(f"error: {exc}", file=sys.stderr)
            return 2
        return 0
    from pcourse.runtime.ranks import gpu_count, launcher

    if launcher() == "mpi":  # a rank of the job below, or of the user's own mpiexec
        return _worker()

    ngpu = gpu_count()
    if ngpu == 0:
        why = "torch is a CPU-only build" if torch.version.cuda is None else "no GPU visible"
        print(f"SKIPPED: no CUDA device ({why}); run this on a machine with GPUs")
        return 0
    from pcourse.tools.cluster.launch import MPIJobError, mpirun

    try:
        out = mpirun(ngpu, ["-m", "pcourse.tools.checks.gpu_check"], timeout=args.timeout,
                     check=False)
    except MPIJobError as exc:  # the deadline passed
        print(f"FAIL: {exc}")
        return 1
    print(out.stdout, end="")
    return 0 if out.returncode == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
