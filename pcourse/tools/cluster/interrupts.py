"""Interrupts that always land on an ipyparallel engine: the engines' watcher.

A blocking MPI call cannot be interrupted: Python runs its signal handlers (the
KeyboardInterrupt of Ctrl-C, or of JupyterLab's stop button on a ``%%px`` cell) only
between bytecodes, and ``MPI_Wait`` does not return to Python until the operation
completes. :func:`watch_interrupts`, run once on every engine by ``start_cluster``,
makes an interrupt final: a rank still running its cell ``grace`` seconds after SIGINT
is blocked inside a C call (an MPI call of code that does not poll, most often), and
its peers are already out of step with it. It then ends the MPI job, the only way to
free it, and says so; the notebook tells the learner to restart. (The waits that poll,
so that an interrupt stops them at once, are the runtime's: :mod:`pcourse.runtime.waits`.)
"""

from __future__ import annotations

import signal
import socket
import sys
import threading
import time

INTERRUPT_GRACE = 3.0  # seconds a rank has to stop after SIGINT before the job is ended


class _Cells:
    """Whether the engine is running a request (a cell, an apply) and how many it finished."""

    def __init__(self) -> None:
        self.running = False
        self.finished = 0


def watch_interrupts(grace: float = INTERRUPT_GRACE) -> bool:
    """On an ipyparallel engine: end the MPI job if an interrupt cannot stop this rank.

    The engine's kernel marks the start and end of every request it handles; the C
    part of Python's signal handling writes each signal to a socket the moment it
    arrives, even while the main thread is stuck in C, and a watcher thread reads
    it. Returns False where it cannot watch (not an engine, or the wake-up socket is
    taken); idempotent.
    """
    try:
        from IPython import get_ipython
    except ImportError:
        return False
    kernel = getattr(get_ipython(), "kernel", None)
    if kernel is None or threading.current_thread() is not threading.main_thread():
        return False
    if getattr(kernel, "_pcourse_cells", None) is not None:
        return True
    reader, writer = socket.socketpair()
    writer.setblocking(False)
    previous = signal.set_wakeup_fd(writer.fileno(), warn_on_full_buffer=False)
    if previous != -1:  # someone else listens there (an asyncio loop): leave it to them
        signal.set_wakeup_fd(previous)
        reader.close()
        writer.close()
        return False
    cells = kernel._pcourse_cells = _Cells()
    before, after = kernel.pre_handler_hook, kernel.post_handler_hook  # private.KERNEL_HOOKS

    def pre_handler_hook() -> None:
        before()
        cells.running = True

    def post_handler_hook() -> None:
        cells.running = False
        cells.finished += 1
        after()

    kernel.pre_handler_hook, kernel.post_handler_hook = pre_handler_hook, post_handler_hook
    kernel._pcourse_wakeup = (reader, writer)  # the fd must stay open as long as it is set
    threading.Thread(target=_watch, args=(reader, cells, grace), daemon=True,
                     name="pcourse-interrupt-watch").start()
    return True


def _watch(reader: socket.socket, cells: _Cells, grace: float) -> None:
    while True:
        signals = reader.recv(64)
        if not signals:
            return
        if signal.SIGINT not in signals or not cells.running:
            continue
        cell, deadline = cells.finished, time.monotonic() + grace
        while time.monotonic() < deadline and cells.running and cells.finished == cell:
            time.sleep(0.05)
        if cells.running and cells.finished == cell:
            _end_job(grace)


def _end_job(grace: float) -> None:
    from mpi4py import MPI

    comm = MPI.COMM_WORLD
    message = (f"rank {comm.Get_rank()} did not stop within {grace:g} s of the interrupt: it is "
               "blocked in a C call (MPI, most likely) and the ranks are out of step, so the "
               "MPI job is ended. Restart the cluster: start_cluster().")
    for stream in (sys.stderr, sys.__stderr__):  # the cell's output, and the engine's log
        try:
            print(message, file=stream, flush=True)
        except Exception:  # noqa: BLE001 - a closed stream must not keep the rank alive
            pass
    time.sleep(0.2)  # let the message leave before the process does
    comm.Abort(1)
