"""Ranks that stop when asked: deadlines on MPI waits, which an interrupt stops.

MPI has no timeouts: a rank whose peer never joins a collective waits forever. And
a blocking MPI call cannot be interrupted: Python runs its signal handlers (the
KeyboardInterrupt of Ctrl-C, or of JupyterLab's stop button on a ``%%px`` cell)
only between bytecodes, and ``MPI_Wait`` does not return to Python until the
operation completes. Polling closes the gap, for every wait that can poll:

- :func:`wait_request` waits for a nonblocking MPI operation by polling it, so an
  interrupt stops the wait at once and a peer that never joins is an error after
  the collective's timeout. Backends call it where they would call ``Wait()``
  (:func:`wait_until` polls anything else that can say whether it is done;
  :func:`wait_work` and :func:`poll_work` do the same for torch.distributed's work).

An interrupt that lands while a rank is stuck inside a C call is the engines'
watcher's (:mod:`pcourse.tools.cluster.interrupts`).
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from datetime import timedelta
from typing import Any

_SPINS = 64  # Test() calls between yielding the core and looking at the clock
# How long one blocking wait for a Gloo collective lasts: Python runs the handler of an
# interrupt only between two, so this is how late the stop button can be.
SLICE = timedelta(milliseconds=50)
_abandoned: list[Any] = []  # requests given up on: MPI may still write into their buffers


class CollectiveTimeout(TimeoutError):
    """A collective did not complete in time: some rank never joined it."""


def wait_request(request: Any, timeout: float | None = None, what: str = "collective") -> None:
    """Wait for an mpi4py request, interruptibly; CollectiveTimeout after ``timeout`` s.

    Polls ``request.Test()`` as tightly as ``Wait()`` spins inside MPI, so a
    completed operation is seen as soon. A request given up on (interrupt or
    timeout) is kept alive: its buffers must outlive any late completion.
    """
    try:
        wait_until(request.Test, timeout, what)
    except BaseException:
        _abandoned.append(request)
        raise


def wait_until(done: Callable[[], bool], timeout: float | None = None,
               what: str = "collective") -> None:
    """Call ``done()`` until it is true, interruptibly; CollectiveTimeout after ``timeout`` s.

    For any operation that can be asked whether it finished (an MPI request's
    ``Test``, a CUDA event's ``query``): the thread stays in Python, where an
    interrupt lands, and yields the core between rounds of polls.
    """
    deadline = None if timeout is None else time.monotonic() + timeout
    while True:
        for _ in range(_SPINS):
            if done():
                return
        _yield()  # as MPI's own Wait does: a peer on the same core needs it to progress
        if deadline is not None and time.monotonic() > deadline:
            raise CollectiveTimeout(
                f"rank {_rank()}: {what} did not complete within {timeout:g} s: another "
                "rank never joined it (it failed, was interrupted, or runs different code). "
                "The ranks are out of step now: restart the cluster (start_cluster) or the job."
            )


_yield = getattr(os, "sched_yield", lambda: time.sleep(0))


def wait_work(handle: Any, in_slices: bool) -> None:
    """``handle.wait()``; in slices, so that Python can run an interrupt's handler between.

    Only for Gloo: NCCL's wait does not block the CPU, it only orders the CUDA stream.
    """
    if not in_slices:
        handle.wait()
        return
    while True:
        try:
            handle.wait(timeout=SLICE)  # returns as soon as the collective is done
            return
        except RuntimeError:
            if handle.is_completed():
                # The slice ended, and the collective is done: it may have completed
                # just as the slice timed out, so this error may be the slice's. A
                # wait on a completed collective returns, or raises its own error.
                handle.wait()
                return


def wait_p2p(handle: Any, timeout: float, what: str) -> None:
    """``handle.wait()`` for torch's point-to-point work (lesson 12), with a deadline:
    CollectiveTimeout after ``timeout`` s.

    One wait, not slices: Gloo ends a send's or receive's work at the first wait that
    times out (a second wait raises the same error), so a sliced wait would give up on
    a message still on its way. An interrupt therefore lands only when the wait ends;
    :func:`watch_interrupts` ends a rank that does not stop in time.
    """
    try:
        handle.wait(timeout=timedelta(seconds=timeout))
    except RuntimeError as exc:
        if "timed out" not in str(exc).lower() and "timeout" not in str(exc).lower():
            raise
        raise CollectiveTimeout(
            f"rank {_rank()}: {what} did not complete within {timeout:g} s: the peer never "
            "joined it (it failed, was interrupted, or runs different code). The ranks are "
            "out of step now: restart the cluster (start_cluster) or the job.") from None


def poll_work(handle: Any, timeout: float, what: str) -> None:
    """Wait for ``handle`` by asking whether it is done, interruptibly, at most ``timeout`` s.

    For a torch collective whose ``wait()`` blocks the CPU without a way to interrupt
    it (the NCCL barrier); ``is_completed()`` only asks, and is also true once the
    collective failed (timed out, aborted). The final wait returns at once, or raises
    the collective's error: with a timeout, since NCCL's ``wait()`` without one and
    without TORCH_NCCL_BLOCKING_WAIT does not look for an error at all.
    """
    wait_until(handle.is_completed, timeout, what)
    handle.wait(timeout=SLICE)


def _rank() -> int:
    from mpi4py import MPI

    return MPI.COMM_WORLD.Get_rank()
