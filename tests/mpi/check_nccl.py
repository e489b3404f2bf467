"""Run under mpiexec with at most one rank per GPU: both NCCL backends on this machine's GPUs.

``check_nccl.py``: every op of a few dtypes and sizes against MPI's own Allreduce
(:func:`pcourse.tools.checks.gpu_check.check_allreduce`), broadcasts from the last rank of
0-dim tensors (dtypes NCCL has, and for nccl-cupy dtypes it lacks, which travel as
bytes), a barrier, and a close; at one rank that checks the plumbing, not a reduction,
and it says so. ``check_nccl.py --timeout-raises`` (2 ranks or more): rank 0 waits at a
barrier the others never join; the wait must end, after the backend's timeout, with an
error in the rank's own process (torch's default NCCL error handling would end the
process instead), and the rank must go on.
"""

from __future__ import annotations

import os
import sys
import time

import torch
from harness import RANK, SIZE, WORLD, expect, verdict
from mpi4py import MPI

from pcourse.backends import make_backend, unavailable_reason
from pcourse.tools.checks.gpu_check import all_ranks_ok, check_allreduce, table

GPU_BACKENDS = ("nccl", "nccl-cupy")
DTYPES = (torch.float32, torch.float16, torch.int64)
SIZES = (1, 7, 1001)
FAULT_TIMEOUT = 3.0  # seconds the faulty barrier may wait before it must raise


def _usable() -> list[str]:
    names = []
    for name in GPU_BACKENDS:
        reason = unavailable_reason(name, SIZE)
        if reason and RANK == 0:
            print(f"skip {name}: {reason}")
        names += [] if reason else [name]
    return names


def check_broadcasts(backend) -> None:
    root = SIZE - 1
    dtypes = [torch.float32, torch.bool, torch.int64]
    if backend.name == "nccl-cupy":
        dtypes += [torch.int16, torch.complex64]  # not NCCL's: they travel as bytes
    for dtype in dtypes:
        want = torch.tensor(7, dtype=torch.float64).to(dtype)
        for shape in ((), (5,)):
            x = (want if RANK == root else torch.zeros((), dtype=dtype)).expand(shape).clone()
            x = x.to(backend.device)
            backend.broadcast(x, root=root)
            expect(bool((x.cpu() == want).all()),
                   f"{backend.name}: broadcast of {dtype} shape {shape} gave {x.cpu()}")


def check_backends() -> int:
    results, names = [], _usable()
    expect("nccl" in names or not torch.cuda.is_available(), "nccl not usable on a GPU")
    for name in names:
        with make_backend(name) as backend:
            expect(backend.device.type == "cuda", f"{name} on {backend.device}")
            results += check_allreduce(backend, DTYPES, SIZES)
            results += check_allreduce(backend, (torch.float32,), SIZES, use_async=True)
            check_broadcasts(backend)
            backend.barrier()
    results = all_ranks_ok(results)
    expect(all(r.ok for r in results), "some allreduce differed from MPI's:\n" + table(results))
    note = ("one rank: this checks the plumbing (devices, streams, dtypes, communicators), "
            "not a reduction across GPUs" if SIZE == 1 else f"{SIZE} ranks, one GPU each")
    return verdict("NCCL", before=f"{note}\n{table(results)}" if results else note)


def check_timeout_raises() -> int:
    expect(SIZE >= 2, "--timeout-raises needs 2 ranks or more")
    for name in _usable():
        backend = make_backend(name, timeout=FAULT_TIMEOUT)
        if RANK == 0:
            start, error = time.monotonic(), None
            try:
                backend.barrier()
            except Exception as exc:  # noqa: BLE001 - which error is torch's choice; any is fine
                error = exc
            waited = time.monotonic() - start
            expect(error is not None, f"{name}: a barrier no peer joined returned")
            expect(waited < FAULT_TIMEOUT + 30, f"{name}: the barrier waited {waited:.0f} s")
            print(f"{name}: the lone barrier raised {type(error).__name__} after "
                  f"{waited:.1f} s; the rank lives on", flush=True)
            if name == "nccl-cupy":
                backend.close()  # out of step: aborts the communicator, ending its kernel
                done = torch.cuda.Event()
                done.record()
                deadline = time.monotonic() + 30
                while not done.query() and time.monotonic() < deadline:
                    time.sleep(0.01)
                expect(done.query(), "nccl-cupy: the aborted communicator's kernel still runs")
        WORLD.Barrier()  # the others wait here, outside the backend, until rank 0 is done
    code = verdict("NCCL timeout")
    # The groups are out of step: tearing them down could wait for the peer's half of the
    # barrier. The process ends here, as an engine's restart would end it.
    sys.stdout.flush()
    MPI.Finalize()
    os._exit(code)


def main() -> int:
    if "--timeout-raises" in sys.argv[1:]:
        return check_timeout_raises()
    return check_backends()


if __name__ == "__main__":
    sys.exit(main())
