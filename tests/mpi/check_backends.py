"""Run under mpiexec (2 or 3 ranks): every CPU backend against MPI's own Allreduce.

One launch checks many things, because each launch costs seconds: results of every
op and dtype, broadcast, barrier, re-creation; bad input (different lengths, dtypes,
ops, roots; one rank's bad op) as the same error on every rank, after which the
backend still works; the same constructor keywords everywhere; a backend on an
existing process group; the rendezvous (MASTER_PORT, interfaces, timeouts, errors on
every rank) and loopback-only listeners. Failures are collected on every rank,
gathered to rank 0 and printed; the exit code is 1 if any.
"""

from __future__ import annotations

import ipaddress
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

import psutil
import torch
from harness import RANK, SIZE, WORLD, expect, raises, verdict
from mpi4py import MPI

from pcourse.backends import (
    Backend,
    BackendUnavailable,
    MismatchError,
    backend_class,
    make_backend,
)
from pcourse.runtime.ranks import launcher, mpi_local_rank
from pcourse.tools.checks.gpu_check import all_ranks_ok, check_allreduce, table

LAST = SIZE - 1
BASIC = (torch.float32, torch.float64, torch.int32, torch.int64)
HALF = (torch.float16, torch.bfloat16)
SIZES = (1, 7, 1001, (1 << 19) + 1)  # the last: 2 MB in float32, 4 MB in float64
CPU_BACKENDS = ("mpi", "mpi-pickle", "gloo")


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
    for dtype in HALF:  # every rank 40000: the sum overflows float16, the average does not
        x = torch.full((5,), 40000.0, dtype=dtype)
        b.allreduce(x, "avg")
        expect(bool(torch.isfinite(x).all()) and abs(x[0].item() - 40000) <= 400,
               f"{b.name}: {dtype} avg of 40000s gave {x[0].item()}: sum before divide?")
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


def check_bad_input(b: Backend) -> None:
    """Ranks that disagree get the same error on every rank, and nothing moves."""
    n = b.name
    mine = torch.full((3 + (RANK == LAST),), float(RANK))
    expect(raises(MismatchError, b.allreduce, mine, match="length ranges from 3 to 4"),
           f"{n}: different lengths")
    expect(torch.equal(mine, torch.full_like(mine, float(RANK))), f"{n}: data moved anyway")
    dtype = torch.float64 if RANK == LAST else torch.float32
    expect(raises(MismatchError, b.allreduce, torch.ones(5, dtype=dtype),
                  match="dtype differs"), f"{n}: different dtypes")
    expect(raises(MismatchError, b.allreduce_async, torch.ones(5, dtype=dtype),
                  match="dtype differs"), f"{n}: different dtypes, async")
    expect(raises(MismatchError, b.allreduce, torch.ones(5), "max" if RANK == LAST else "sum",
                  match="op differs"), f"{n}: different ops")
    if RANK == 0:  # bad input on one rank: it says why, the others learn of it
        expect(raises(ValueError, b.allreduce, torch.ones(5), "mean", match="unknown"),
               f"{n}: a bad op on rank 0")
    else:
        expect(raises(MismatchError, b.allreduce, torch.ones(5), match="refused"),
               f"{n}: rank 0's bad op did not reach rank {RANK}")
    expect(raises(MismatchError, b.broadcast, torch.ones(5), RANK, match="root ranges"),
           f"{n}: different roots")
    expect(raises(ValueError, b.broadcast, torch.ones(5), SIZE, match="root must be"),
           f"{n}: a root beyond the last rank")
    expect(raises(MismatchError, b.broadcast, torch.ones(4 + RANK), 0, match="length"),
           f"{n}: broadcast of different lengths")
    x = torch.ones(6)
    b.allreduce(x)  # in step after all of the above
    expect(torch.equal(x, torch.full((6,), float(SIZE))), f"{n}: wrong after the errors")


def check_keywords(name: str) -> None:
    """Every backend takes comm, device and timeout; a bad device is refused alike."""
    half = WORLD.Split(RANK % 2, RANK)  # a sub-communicator: the backend must use it
    b = make_backend(name, comm=half, device="cpu", timeout=60.0)
    x = torch.full((2,), float(RANK))
    b.allreduce(x)
    want = half.allreduce(RANK)
    expect(torch.equal(x, torch.full((2,), float(want))), f"{name}: keywords comm, device")
    expect((b.rank, b.size) == (half.rank, half.size), f"{name}: rank and size of comm")
    b.close()
    half.Free()
    if name == "gloo":
        expect(raises(ValueError, make_backend, name, device="cuda:0", match="CPU"),
               "gloo: device='cuda:0' should be refused")
    expect(backend_class(name).any_device == name.startswith("mpi"), f"{name}: any_device")


def check_on_existing_group() -> None:
    """A gloo backend built on a torch.distributed group someone else made."""
    owner = make_backend("gloo")
    guest = make_backend("gloo", comm=owner.group)
    x = torch.full((3,), float(RANK))
    guest.allreduce(x)
    expect(torch.equal(x, torch.full((3,), float(sum(range(SIZE))))), "gloo on a given group")
    guest.broadcast(x.fill_(RANK), LAST)
    expect(bool((x == LAST).all()), "gloo on a given group: broadcast")
    guest.close()
    y = torch.ones(1)
    owner.allreduce(y)  # closing the guest left the owner's group alone
    expect(y.item() == SIZE, "closing a backend closed a group it did not make")
    owner.close()


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


def listening() -> set[tuple[str, int]]:
    return {(c.laddr.ip, c.laddr.port) for c in psutil.Process().net_connections("tcp")
            if c.status == psutil.CONN_LISTEN}


def check_listeners() -> None:
    """With nothing named, a one-host gloo backend listens on loopback only."""
    before = listening()
    b = make_backend("gloo")
    added = listening() - before
    b.close()
    outside = sorted(ip for ip, _ in added if not ipaddress.ip_address(ip).is_loopback)
    expect(not outside, f"gloo listens beyond loopback on {outside}")
    expect(bool(added) or RANK != 0, "rank 0 opened no store (the check cannot see listeners)")


def with_env(var: str, value: str | None):
    if value is None:
        os.environ.pop(var, None)
    else:
        os.environ[var] = value


def check_master_port() -> None:
    """MASTER_PORT honoured (twice on the same port); busy or invalid: one error everywhere."""
    import socket

    with_env("MASTER_ADDR", "127.0.0.1")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = WORLD.bcast(s.getsockname()[1] if RANK == 0 else None)
    with_env("MASTER_PORT", str(port))
    for _ in range(2):
        b = make_backend("gloo")
        expect(b.address == f"127.0.0.1:{port}", f"gloo: MASTER_PORT ignored ({b.address})")
        b.allreduce(torch.ones(1))
        b.close()
    busy = socket.socket() if RANK == 0 else None
    if busy is not None:
        busy.bind(("", 0))
        busy.listen()
    with_env("MASTER_PORT", str(WORLD.bcast(busy.getsockname()[1] if busy else None)))
    expect(raises(RuntimeError, make_backend, "gloo", match="already in use"),
           "gloo: a busy MASTER_PORT should raise an error naming it")
    if busy is not None:
        busy.close()
    for bad in ("70000", "http"):
        with_env("MASTER_PORT", bad)
        start = time.monotonic()
        expect(raises(RuntimeError, make_backend, "gloo", timeout=20, match="not a port"),
               f"gloo: MASTER_PORT={bad} should be refused on every rank")
        expect(time.monotonic() - start < 10, f"gloo: MASTER_PORT={bad} took long")
    with_env("MASTER_ADDR", None)
    with_env("MASTER_PORT", None)


def check_interface_errors() -> None:
    """An interface name that exists nowhere, or on one rank only: an error on all, fast."""
    for who in ("all", "last"):
        start = time.monotonic()
        with_env("GLOO_SOCKET_IFNAME", "nosuchif0" if who == "all" or RANK == LAST else None)
        expect(raises(RuntimeError, make_backend, "gloo", timeout=30,
                      match=f"rank {LAST}: ValueError: GLOO_SOCKET_IFNAME=nosuchif0"),
               f"gloo: a missing interface on {who} rank(s) is not reported on every rank")
        expect(time.monotonic() - start < 15, f"gloo: a missing interface ({who}) took long")
    with_env("GLOO_SOCKET_IFNAME", None)


def check_timeout() -> None:
    """A collective that rank 0 never joins ends in an error after `timeout`, not a hang."""
    b = make_backend("gloo", timeout=3.0)
    if RANK != 0:
        start = time.monotonic()
        expect(raises(RuntimeError, b.allreduce, torch.ones(4), check=False),
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
    from pcourse.runtime.ranks import local_gpu

    local_rank = mpi_local_rank(WORLD)[0]
    expect(raises(BackendUnavailable, local_gpu, WORLD.allgather, local_rank, "nccl",
                  match="one GPU per rank"), "local_gpu should refuse ranks without a GPU")


class _Broken(Backend):
    """Returns its input unchanged: the harness must notice."""

    name, device = "broken", torch.device("cpu")

    def __init__(self) -> None:
        self.rank, self.size = RANK, SIZE

    def allreduce(self, tensor, op="sum", *, check=True):
        return tensor

    def broadcast(self, tensor, root=0, *, check=True):
        return tensor

    def barrier(self):
        return None


def main() -> int:
    expect(launcher() == "mpi", f"launcher() under mpiexec says {launcher()!r}")
    folder = WORLD.bcast(tempfile.mkdtemp() if RANK == 0 else None)
    results = []
    for name in CPU_BACKENDS:
        b = make_backend(name)
        results += check_allreduce_cases(b)
        check_broadcast(b)
        check_barrier(b, folder)
        check_bad_input(b)
        b.close()
        check_keywords(name)
        check_recreate(name)
    check_on_existing_group()
    check_listeners()
    check_master_port()
    check_interface_errors()
    check_timeout()
    check_gpu_refusal()
    broken = check_allreduce(_Broken(), (torch.float32,), (7,), ops=("sum",))
    expect(not any(r.ok for r in broken), "harness: a do-nothing backend passed")
    results = all_ranks_ok(results)
    for r in results:
        expect(r.ok or RANK != 0, f"{r.backend} {r.op} {r.dtype} n={r.size}: "
                                  f"max error {r.error:.3g}")
    if RANK == 0:
        shutil.rmtree(folder)
    return verdict(f"{len(results)} allreduce cases on {SIZE} ranks", before=table(results))


if __name__ == "__main__":
    sys.exit(main())
