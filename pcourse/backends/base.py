"""The interface every backend implements (lesson 04): allreduce, broadcast, barrier.

Data-parallel training needs very little from a communication library: know your
rank, sum (or average) a tensor across ranks in place, broadcast a tensor from a
root, wait at a barrier. :class:`Backend` is exactly that, so the training code,
the benchmarks and the notebooks never care which library runs underneath.

Every collective first checks, on every rank, that all ranks passed the same length
and dtype (and op, or root), with one tiny allreduce (:func:`pcourse.agree.agree`):
a mismatch is the same clear error on every rank instead of a hang or garbage.
Callers that already know the ranks agree, such as a bucket layout checked once,
pass ``check=False``.

Every backend is built with the same keywords: ``comm`` (what the ranks talk over;
default: the whole job; or any part of it, several parts at once: :mod:`pcourse.mesh`),
``device`` (default: this rank's own) and ``timeout`` (seconds a collective may wait
for the other ranks; default :func:`collective_timeout`).

``avg`` is one rule for every backend, :meth:`Backend.avg_divisors`: 16-bit data is
divided before it is summed, wider data after.

Nothing waits forever, and nothing waits deaf: a rank that waits for its peers does
so where an interrupt (JupyterLab's stop button, Ctrl-C) stops it at once, and after
``timeout`` seconds a peer that never came is an error. A rank that gave up on a
collective either way may be one collective out of step with its peers, so its
backend refuses further use: create a new one on every rank.
"""

from __future__ import annotations

import math
import os
from abc import ABC, abstractmethod
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import numpy as np

if TYPE_CHECKING:  # annotations only: listing the backends loads no torch
    import torch

from pcourse.agree import MismatchError, checked_then_agreed
from pcourse.runtime.ranks import BackendUnavailable

OPS = ("sum", "avg", "max", "min", "prod")
# Long enough for the longest wait the course has for a live peer (a rank that
# imports torch or loads its data while the others already wait, a 64 MiB pickled
# allreduce on an oversubscribed laptop), short enough that an unattended hang ends.
# At a notebook the stop button ends a wait at once.
DEFAULT_TIMEOUT = 120.0
TIMEOUT_ENV = "PCOURSE_COLLECTIVE_TIMEOUT"

__all__ = ["DEFAULT_TIMEOUT", "OPS", "TIMEOUT_ENV", "AsyncBackend", "Backend",
           "BackendUnavailable", "MismatchError", "Pending", "Work", "check_avg_dtype",
           "check_op", "collective_timeout"]


def collective_timeout(timeout: float | None = None) -> float:
    """Seconds a collective may wait for the other ranks: ``timeout`` if given, else
    ``$PCOURSE_COLLECTIVE_TIMEOUT``, else :data:`DEFAULT_TIMEOUT`. Every backend's default."""
    source = "timeout"
    if timeout is None:
        text = os.environ.get(TIMEOUT_ENV, "").strip()
        if not text:
            return DEFAULT_TIMEOUT
        source = f"${TIMEOUT_ENV}"
        try:
            timeout = float(text)
        except ValueError:
            timeout = math.nan
    if isinstance(timeout, bool) or not isinstance(timeout, int | float) \
            or not 0 < timeout < math.inf:
        raise ValueError(f"{source} must be a positive number of seconds, got {timeout!r}"
                         + (f" (from {text!r})" if source != "timeout" else ""))
    return float(timeout)


class Work:
    """Handle of an asynchronous collective; ``wait()`` blocks until it is done."""

    def wait(self) -> None:  # a completed operation: nothing to wait for
        return None

    def test(self) -> bool:
        """Whether the operation has completed, without blocking. On MPI this call is
        also what moves a nonblocking collective along (lesson 07)."""
        return True


class Pending(Work):
    """A started collective: ``wait()`` calls ``wait_for`` once, then ``finish``.

    ``keep`` holds what the library writes into until the operation is done.
    """

    def __init__(self, wait_for: Callable[[], None], finish: Callable[[], None] | None = None,
                 keep: tuple = (), test: Callable[[], bool] | None = None) -> None:
        self._wait_for: Callable[[], None] | None = wait_for  # None once waited for
        self._finish, self._keep = finish, keep
        self._test = test

    def test(self) -> bool:
        if self._wait_for is None:
            return True
        return self._test() if self._test is not None else False

    def wait(self) -> None:
        if self._wait_for is None:
            return
        self._wait_for()
        self._wait_for = None
        if self._finish is not None:
            self._finish()
        self._keep = ()


def check_op(op: str | None) -> str:
    if op not in OPS:
        raise ValueError(f"unknown reduction op {op!r}; use one of {', '.join(OPS)}")
    return op


def check_avg_dtype(tensor: torch.Tensor, op: str) -> None:
    """Refuse ``avg`` of an integer tensor: sum / size does not fit in place.

    Every backend computes avg as a sum and a division (:meth:`Backend.avg_divisors`); an
    integer tensor would need a silent rounding choice, so the caller decides (reduce
    with sum, then divide).
    """
    if op == "avg" and not (tensor.is_floating_point() or tensor.is_complex()):
        raise TypeError(
            f"op 'avg' needs a floating-point tensor, got {tensor.dtype}; "
            "use op='sum' and divide by size yourself"
        )


def private_comm(comm: Any, name: str) -> Any:
    """A duplicate of MPI communicator ``comm`` (default COMM_WORLD) for one backend.

    A duplicate, not ``comm`` itself: the backend's messages never mix with anyone
    else's, and ``close()`` can free it (a re-run cell makes a fresh one).
    """
    from mpi4py import MPI

    comm = MPI.COMM_WORLD if comm is None else comm
    if not isinstance(comm, MPI.Comm):
        raise TypeError(f"backend {name!r} bootstraps from MPI: comm must be an mpi4py "
                        f"communicator, got {type(comm).__name__}")
    return comm.Dup()


class Backend(ABC):
    """What data-parallel training needs from a communication library."""

    name: str
    rank: int
    size: int
    device: torch.device  # where this backend wants the tensors it reduces
    any_device: bool = False  # True: takes tensors on any device (stages them itself)
    needs_gpu: bool = False  # True: runs only with one GPU per rank
    timeout: float  # seconds a collective may wait for the other ranks
    native_avg: bool = False  # True: the library averages itself (NCCL's AVG)
    _gave_up: str = ""  # the collective this rank stopped waiting for (see module docstring)

    @abstractmethod
    def allreduce(self, tensor: torch.Tensor, op: str = "sum", *,
                  check: bool = True) -> torch.Tensor:
        """Reduce ``tensor`` across all ranks, in place; return it.

        ``op`` is one of sum, avg, max, min, prod. ``avg`` is sum divided by size.
        ``check=False`` skips the agreement check (see the module docstring).
        """

    def allreduce_async(self, tensor: torch.Tensor, op: str = "sum", *,
                        check: bool = True) -> Work:
        """Start an in-place allreduce; the result is valid after ``wait()``.

        Backends with non-blocking collectives override this; the default is
        blocking, which is always correct.
        """
        self.allreduce(tensor, op, check=check)
        return Work()

    @abstractmethod
    def broadcast(self, tensor: torch.Tensor, root: int = 0, *,
                  check: bool = True) -> torch.Tensor:
        """Overwrite ``tensor`` on every rank with root's, in place; return it."""

    @abstractmethod
    def barrier(self) -> None:
        """Return only when every rank has called barrier."""

    def close(self) -> None:
        """Release communicators; the backend must not be used afterwards."""
        return None

    # ---------------------------------------------- point to point (lesson 12)
    def send(self, tensor: torch.Tensor, dst: int) -> Work:
        """Start sending ``tensor`` (contiguous, on ``device``; MPI: CPU) to rank ``dst``;
        ``wait()`` on the result, before changing ``tensor``, waits with the deadline.

        Non-blocking, so that two neighbours that send to each other at once do not
        wait for each other (a pipeline's activations go one way, gradients the other).
        Messages from one rank to another arrive in the order they were sent.
        """
        raise NotImplementedError(f"the {self.name} backend has no point-to-point messages; "
                                  "use mpi or gloo")

    def recv(self, tensor: torch.Tensor, src: int) -> torch.Tensor:
        """Receive from rank ``src`` into ``tensor`` (its shape and dtype: what was sent);
        blocks, interruptibly, at most the backend's ``timeout`` seconds."""
        raise NotImplementedError(f"the {self.name} backend has no point-to-point messages; "
                                  "use mpi or gloo")

    def _check_peer(self, tensor: torch.Tensor, peer: int, what: str) -> None:
        self._check_in_step()
        if isinstance(peer, bool) or not isinstance(peer, int) or not 0 <= peer < self.size \
                or peer == self.rank:
            raise ValueError(f"{what}: the peer must be another rank from 0 to {self.size - 1}, "
                             f"got {peer!r} on rank {self.rank}")
        import torch

        want = torch.device("cpu") if self.any_device else self.device  # MPI: host memory
        if tensor.device.type != want.type or not tensor.is_contiguous():
            raise ValueError(f"{what}: pass a contiguous tensor on {want}, got one on "
                             f"{tensor.device}" + ("" if tensor.is_contiguous() else
                                                    ", not contiguous"))

    def _wait_for(self, wait: Callable[[], None], what: str) -> None:
        """Run ``wait``, a wait for the other ranks; if it ends early (an interrupt, the
        deadline, a failure), this backend is out of step and refuses further use."""
        try:
            wait()
        except BaseException:
            self._gave_up = what
            raise

    def _check_in_step(self) -> None:
        if self._gave_up:
            raise RuntimeError(
                f"this {self.name} backend stopped waiting in a {self._gave_up} (interrupted, "
                "or the other ranks never came), so its ranks may be out of step: create a "
                "new backend on every rank (make_backend)")

    def _check_tensor(self, tensor: torch.Tensor, op: str | None) -> None:
        """This backend's local refusals (a device it cannot use, a dtype it lacks)."""
        return None

    def _agree(self, tensor: torch.Tensor, check: bool, *, op: str | None = None,
               root: int | None = None) -> None:
        """Local checks, then (``check``) one tiny allreduce: every rank passed the same
        (:func:`pcourse.agree.checked_then_agreed`)."""
        import torch  # here, not at import: listing the backends loads no torch

        kind, last = ("allreduce", "op") if root is None else ("broadcast", "root")

        def checks() -> tuple[dict[str, int | str], None]:
            if not isinstance(tensor, torch.Tensor):
                raise TypeError(f"expected a torch.Tensor, got {type(tensor).__name__}")
            if root is None:
                checked = check_op(op)
                check_avg_dtype(tensor, checked)
            elif isinstance(root, bool) or not isinstance(root, int) or not 0 <= root < self.size:
                raise ValueError(f"root must be a rank from 0 to {self.size - 1}, got {root!r}")
            self._check_tensor(tensor, op)
            return {"length": tensor.numel(), "dtype": str(tensor.dtype).removeprefix("torch."),
                    last: checked if root is None else root}, None

        checked_then_agreed(checks, ("length", "dtype", last), self.max_over_ranks, check=check,
                            subject=f"{kind} needs the same length, dtype and {last} on every rank",
                            hint="Call it with equally sized tensors of one dtype on every rank.")

    def avg_divisors(self, dtype: torch.dtype, op: str) -> tuple[int, int]:
        """How ``op`` divides by the number of ranks: (before the sum, after it); 1 = not.

        The one rule of every backend's ``avg`` (allreduce and reduce_scatter alike):
        16-bit data is divided first, because its sum over the ranks can overflow
        (float16 tops out at 65504) where the sum of the shares cannot; wider data is
        divided after, one rounding fewer. A library with an AVG of its own (NCCL's,
        ``native_avg``) divides itself. ``dtype``: what the library sums (MPI sums
        bfloat16 widened to float32).
        """
        if op != "avg" or self.native_avg:
            return 1, 1
        if str(dtype) in ("torch.float16", "torch.bfloat16"):
            return self.size, 1
        return 1, self.size

    def max_over_ranks(self, v: np.ndarray) -> np.ndarray:
        """The elementwise max over ranks of a small int64 vector (for agreement checks)."""
        import torch

        t = torch.from_numpy(v).to("cpu" if self.any_device else self.device)
        return self.allreduce(t, "max", check=False).cpu().numpy()

    def __enter__(self) -> Backend:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"<{self.name} backend rank {self.rank}/{self.size} on {self.device}>"

    # ---------------------------------------------------- sharding (lesson 10)
    def reduce_scatter(self, output: torch.Tensor, input: torch.Tensor, op: str = "sum", *,
                       check: bool = True) -> torch.Tensor:
        """Reduce ``input`` across ranks; rank r gets block r of the result in ``output``.

        ``input`` has size·n elements on every rank, ``output`` n (torch's
        ``reduce_scatter_tensor``, MPI's ``Reduce_scatter_block``); padding a length
        that does not divide by size is the caller's job. ``input`` is not changed.
        ``op`` as for allreduce. This default is correct on any backend: it
        allreduces a copy and keeps its own block, which moves twice the bytes of a
        real reduce-scatter; backends whose library has one override it.
        """
        self._agree_blocks("reduce_scatter", output, input, check, op)
        full = input.detach().clone()
        self.allreduce(full, op, check=False)
        n = output.numel()
        output.detach().copy_(full.reshape(-1)[self.rank * n:(self.rank + 1) * n]
                              .view_as(output))
        return output

    def all_gather(self, output: torch.Tensor, input: torch.Tensor, *,
                   check: bool = True) -> torch.Tensor:
        """Every rank's ``input`` (n elements each), in rank order, into ``output`` (size·n).

        torch's ``all_gather_into_tensor``, MPI's ``Allgather``. This default sums
        zeros with each rank's block in its place (exact: x + 0 is x); backends
        whose library has an allgather override it.
        """
        self._agree_blocks("all_gather", output, input, check, None)
        n = input.numel()
        full = input.new_zeros(self.size * n)
        full[self.rank * n:(self.rank + 1) * n] = input.detach().reshape(-1)
        self.allreduce(full, "sum", check=False)
        output.detach().copy_(full.view_as(output))
        return output

    def reduce_scatter_async(self, output: torch.Tensor, input: torch.Tensor, op: str = "sum",
                             *, check: bool = True) -> Work:
        """Start a reduce-scatter; ``output`` holds this rank's block after ``wait()``.

        ``input`` must stay as it is until then. Lesson 10 starts one while backward
        still runs. Backends with non-blocking collectives override this; the
        default is blocking, which is always correct.
        """
        self.reduce_scatter(output, input, op, check=check)
        return Work()

    def all_gather_async(self, output: torch.Tensor, input: torch.Tensor, *,
                         check: bool = True) -> Work:
        """Start an all-gather into ``output``, valid after ``wait()`` (as
        :meth:`reduce_scatter_async`: the default is blocking)."""
        self.all_gather(output, input, check=check)
        return Work()

    def _agree_blocks(self, kind: str, output: torch.Tensor, input: torch.Tensor, check: bool,
                      op: str | None) -> None:
        """Local checks of a reduce-scatter / all-gather, then (``check``) the agreement.

        The big side has size times the elements of the small one; both one dtype.
        """
        import torch

        self._check_in_step()
        small, big = (output, input) if kind == "reduce_scatter" else (input, output)

        def checks() -> tuple[dict[str, int | str], None]:
            for label, t in (("output", output), ("input", input)):
                if not isinstance(t, torch.Tensor):
                    raise TypeError(f"{kind}: {label} must be a torch.Tensor, "
                                    f"got {type(t).__name__}")
                if not t.is_contiguous():
                    raise ValueError(f"{kind}: {label} must be contiguous; use .contiguous()")
            if output.dtype != input.dtype:
                raise TypeError(f"{kind}: output is {output.dtype} but input is {input.dtype}; "
                                "pass one dtype")
            if big.numel() != self.size * small.numel():
                which = "input" if kind == "reduce_scatter" else "output"
                raise ValueError(
                    f"{kind}: {which} must have size x {small.numel()} = "
                    f"{self.size * small.numel()} elements on {self.size} ranks, got "
                    f"{big.numel()}; pad it to a multiple of the number of ranks")
            if op is not None:
                check_op(op)
                check_avg_dtype(input, op)
            self._check_tensor(output, op)
            self._check_tensor(input, op)
            return {"length": small.numel(), "dtype": str(input.dtype).removeprefix("torch."),
                    "op": op or ""}, None

        checked_then_agreed(checks, ("length", "dtype", "op"), self.max_over_ranks, check=check,
                            subject=f"{kind} needs the same length, dtype and op on every rank",
                            hint="Call it with equally sized tensors of one dtype on every rank.")


class AsyncBackend(Backend):
    """A backend whose allreduce is non-blocking underneath: blocking = start, then wait."""

    def allreduce(self, tensor: torch.Tensor, op: str = "sum", *,
                  check: bool = True) -> torch.Tensor:
        self.allreduce_async(tensor, op, check=check).wait()
        return tensor

    @abstractmethod
    def allreduce_async(self, tensor: torch.Tensor, op: str = "sum", *,
                        check: bool = True) -> Work:
        """Start an in-place allreduce; the result is valid after ``wait()``."""
