"""Run under mpiexec (2 or 3 ranks): every CPU backend against MPI's own Allreduce.

One launch checks many things, because each launch costs seconds. Failures are
collected on every rank, gathered to rank 0 and printed; the exit code is 1 if any.
"""

from __future__ import annotations

import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

import torch
from mpi4py import MPI

from pcourse.backends import Backend, BackendUnavailable, make_backend
from pcourse.backends.torch_dist import _pick_port
from pcourse.checks.gpu_check import all_ranks_ok, check_allreduce, table

WORLD = MPI.COMM_WORLD
RANK, SIZE = WORLD.Get_rank(), WORLD.Get_size()
BASIC = (torch.float32, torch.float64, torch.int32, torch.int64)
HALF = (torch.float16, torch.bfloat16)
SIZES = (1, 7, 1001, (1 << 19) + 1)  # the last: 2 MB in float32, 4 MB in float64
failures: list[str] = []


def expect(cond: bool, what: str) -> None:
    if not cond:
        failures.append(f"rank {RANK}: {what}")


def raises(exc: type[BaseException], fn, *args, match: str = "") -> bool:
    try:
        fn(*args)
    except exc as e:
        return match in str(e)
    return False


def check_allreduce_cases(b: Backend) -> list:
    results = check_allreduce(b, BASIC + HALF, SIZES)
    results += check_allreduce(b, (torch.float32, torch.int64), (1, 1001, 4099),
                               seed=7, use_async=True)
    # A non-contiguous view must be reduced (and written back) like its copy.
    x = torch.arange(12.0).reshape(3, 4).mul(RANK + 1).t()
    ref = x.contiguous().numpy().copy()
    WORLD.Allreduce(MPI.IN_PLACE, ref, MPI.SUM)
    b.allreduce(x, "sum")
    expect(torch.equal(x, torch.from_numpy(ref)), f"{b.name}: non-contiguous allreduce")
    expect(raises(TypeError, b.allreduce, torch.ones(3, dtype=torch.int64), "avg"),
           f"{b.name}: avg of an int tensor should raise TypeError")
    expect(raises(ValueError, b.allreduce, torch.ones(3), "mean"),
           f"{b.name}: unknown op should raise ValueError")
    return results


def check_broadcast(b: Backend) -> None:
    for root in range(SIZE):
        for dtype in (torch.float32, torch.float64, torch.int64, torch.bfloat16):
            x = (torch.arange(1001) * (RANK + 1)).to(dtype)
            b.broadcast(x, root)
            want = (torch.arange(1001) * (root + 1)).to(dtype)
            expect(torch.equal(x, want), f"{b.name}: broadcast {dtype} from {root}")
        y = torch.full((4, 5), float(RANK)).t()  # non-contiguous
        b.broadcast(y, root)
        expect(bool((y == root).all()), f"{b.name}: non-contiguous broadcast from {root}")
    w = torch.nn.Parameter(torch.full((3,), float(RANK)))  # a leaf that requires grad
    b.broadcast(w, 0)
    expect(bool((w.detach() == 0).all()), f"{b.name}: broadcast into a Parameter")


def check_barrier(b: Backend, folder: str) -> None:
    """Rank 0 writes a file late; after the barrier every rank must see it."""
    flag = Path(folder) / f"{b.name}.flag"
    if RANK == 0:
        time.sleep(0.3)
        flag.write_text("done")
    b.barrier()
    expect(flag.exists(), f"{b.name}: a rank left the barrier before rank 0 reached it")
    b.barrier()  # nobody deletes the folder while others still look


def check_recreate(name: str) -> None:
    """A re-run notebook cell: make the backend again, without closing the first."""
    first = make_backend(name)
    second = make_backend(name)
    x = torch.ones(5)
    second.allreduce(x)
    expect(torch.equal(x, torch.full((5,), float(SIZE))), f"{name}: re-created backend")
    z = torch.ones(4)
    first.allreduce(z)  # the old one still works (each has its own group)
    expect(torch.equal(z, torch.full((4,), float(SIZE))), f"{name}: first of two backends")
    first.close()
    second.allreduce(x)
    expect(torch.equal(x, torch.full((5,), float(SIZE * SIZE))), f"{name}: after closing one")
    second.close()
    expect(raises(RuntimeError, second.allreduce, x, match="closed"),
           f"{name}: a closed backend should refuse to run")
    third = make_backend(name)  # and once more after close
    y = torch.ones(2)
    third.allreduce(y)
    expect(torch.equal(y, torch.full((2,), float(SIZE))), f"{name}: backend after close")
    third.close()


def check_master_port() -> None:
    """MASTER_PORT honoured (twice on the same port), and a busy one a clear error."""
    import socket

    os.environ.pop("MASTER_PORT", None)
    port = WORLD.bcast(_pick_port() if RANK == 0 else None)  # a free one
    os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"] = "127.0.0.1", str(port)
    for _ in range(2):
        b = make_backend("gloo")
        expect(b.address == f"127.0.0.1:{port}", f"gloo: MASTER_PORT ignored ({b.address})")
        b.allreduce(torch.ones(1))
        b.close()
    busy = socket.socket() if RANK == 0 else None
    if busy is not None:
        busy.bind(("", 0))
        busy.listen()
    port = WORLD.bcast(busy.getsockname()[1] if busy else None)
    os.environ["MASTER_PORT"] = str(port)
    expect(raises(RuntimeError, make_backend, "gloo", match="MASTER_PORT"),
           "gloo: a busy MASTER_PORT should raise an error naming it")
    if busy is not None:
        busy.close()
    del os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"]


def check_timeout() -> None:
    """A collective that rank 0 never joins ends in an error after `timeout`, not a hang."""
    b = make_backend("gloo", timeout=3.0)
    if RANK != 0:
        start = time.monotonic()
        expect(raises(RuntimeError, b.allreduce, torch.ones(4)),
               "gloo: a collective missing a rank did not time out")
        expect(time.monotonic() - start < 60, "gloo: the timeout took far too long")
    WORLD.Barrier()
    b.close()
    b = make_backend("gloo")  # and the next backend works again
    x = torch.ones(3)
    b.allreduce(x)
    expect(torch.equal(x, torch.full((3,), float(SIZE))), "gloo: backend after a timeout")
    b.close()


def check_gpu_refusal() -> None:
    """Without GPUs every rank refuses NCCL together (a collective decision)."""
    if torch.cuda.is_available():
        return
    from pcourse.backends.torch_dist import local_gpu

    expect(raises(BackendUnavailable, local_gpu, WORLD, "nccl", match="one GPU per rank"),
           "local_gpu should refuse ranks without a GPU")


class _Broken(Backend):
    """Returns its input unchanged: the harness must notice."""

    name, device = "broken", torch.device("cpu")

    def __init__(self) -> None:
        self.rank, self.size = RANK, SIZE

    def allreduce(self, tensor, op="sum"):
        return tensor

    def broadcast(self, tensor, root=0):
        return tensor

    def barrier(self):
        return None


def main() -> int:
    folder = WORLD.bcast(tempfile.mkdtemp() if RANK == 0 else None)
    results = []
    for name in ("mpi", "mpi-pickle", "gloo"):
        b = make_backend(name)
        results += check_allreduce_cases(b)
        check_broadcast(b)
        check_barrier(b, folder)
        b.close()
        check_recreate(name)
    check_master_port()
    check_timeout()
    check_gpu_refusal()
    broken = check_allreduce(_Broken(), (torch.float32,), (7,), ops=("sum",))
    expect(not any(r.ok for r in broken), "harness: a do-nothing backend passed")
    results = all_ranks_ok(results)
    failures.extend(f"{r.backend} {r.op} {r.dtype} n={r.size}: max error {r.error:.3g}"
                    for r in results if not r.ok and RANK == 0)
    problems = [f for fs in WORLD.allgather(failures) for f in fs]
    if RANK == 0:
        print(table(results))
        print("\n".join(problems))
        print(f"{len(results)} allreduce cases on {SIZE} ranks; "
              + ("ALL OK" if not problems else f"{len(problems)} FAILURES"))
        shutil.rmtree(folder)
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
