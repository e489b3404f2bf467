"""Hogwild: several processes update one model in shared memory, without locks.

:func:`hogwild` trains one model whose tensors live in shared memory
(``model.share_memory()``) with ``workers`` processes that each write their SGD
updates straight into it; :func:`serial` is the same number of steps in one process.
Only processes on one machine share memory. Workers are forked from a fork server
(``forkserver``): a fresh process that imported this module and ran no op, so no OpenMP
threads, whose forks cannot deadlock on them as forks of the caller can; each starts at
once, where ``spawn`` imports torch anew for every worker of every run. Workers have a
deadline and are always joined or killed before the function returns.

Lesson 08 explains Hogwild's sparsity condition, which this dense network violates.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from multiprocessing.context import ForkServerContext

import torch
import torch.multiprocessing as mp
from torch import nn

from pcourse.beyond_sgd.weight_averaging import (
    Setup,
    batch_indices,
    make_problem,
    new_model,
    sgd_step,
)
from pcourse.runtime.ranks import threads

JOIN_GRACE = 5.0  # seconds a terminated worker gets before it is killed


class HogwildError(RuntimeError):
    """A worker failed or missed the deadline; the message says which and how."""


@dataclass
class HogwildResult:
    workers: int
    updates: int  # SGD steps taken by all workers together
    initial_loss: float  # test MSE
    final_loss: float
    seconds: float  # wall time, starting the worker processes included
    loop_seconds: float  # from the first worker's first step to the last one's end
    worker_losses: torch.Tensor  # (workers, steps): each worker's training loss per step


def _worker(w: int, workers: int, model: nn.Module, losses: torch.Tensor,
            setup: Setup, spans: torch.Tensor) -> None:
    """One Hogwild worker: SGD on its own shard, writing into the shared weights.

    ``spans[w]``: when its loop began and ended (time.monotonic, one clock for every
    process of the machine), so the updates can be timed without the start-up."""
    torch.set_num_threads(1)  # the workers themselves are the parallelism
    x, y, _, _ = make_problem(setup)
    spans[w, 0] = time.monotonic()
    for step in range(setup.steps):
        idx = batch_indices(step, w, workers, setup)
        # Gradients are private to this process; the update lands in shared memory, unlocked.
        losses[w, step] = sgd_step(model, x[idx], y[idx], setup.lr)
    spans[w, 1] = time.monotonic()


def _context() -> ForkServerContext:
    """The fork server's context; the server imports this module (and torch) when it starts."""
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload([__name__])  # no effect once this process's server runs
    return ctx


def _test_loss(model: nn.Module, setup: Setup) -> float:
    _, _, x_test, y_test = make_problem(setup)
    with torch.no_grad():
        return nn.functional.mse_loss(model(x_test), y_test).item()


def _stop(procs: list) -> None:
    """Terminate, then kill, whatever is still running; reap everything."""
    started = [p for p in procs if p.pid is not None]  # a failed start has nothing to reap
    for p in started:
        if p.is_alive():
            p.terminate()
    for p in started:
        p.join(JOIN_GRACE)
        if p.is_alive():
            p.kill()
            p.join()


def hogwild(workers: int, setup: Setup, timeout: float = 120.0) -> HogwildResult:
    """Train one shared model with ``workers`` lock-free processes, ``setup.steps`` each."""
    if workers < 1:
        raise ValueError(f"workers must be at least 1, got {workers}")
    model = new_model(setup)
    model.share_memory()
    losses = torch.full((workers, setup.steps), float("nan")).share_memory_()
    spans = torch.zeros(workers, 2, dtype=torch.float64).share_memory_()
    initial = _test_loss(model, setup)
    ctx = _context()
    procs = [ctx.Process(target=_worker, args=(w, workers, model, losses, setup, spans),
                         daemon=True) for w in range(workers)]
    start = time.perf_counter()
    try:
        for p in procs:
            p.start()
        deadline = time.monotonic() + timeout
        for p in procs:
            p.join(max(0.0, deadline - time.monotonic()))
        late = [w for w, p in enumerate(procs) if p.is_alive()]
        if late:
            raise HogwildError(f"workers {late} did not finish within {timeout:.0f} s; "
                               "they were stopped. Use fewer steps or a longer timeout.")
    finally:
        _stop(procs)
    seconds = time.perf_counter() - start
    failed = {w: p.exitcode for w, p in enumerate(procs) if p.exitcode != 0}
    if failed:
        raise HogwildError(f"workers exited with codes {failed} (worker: code); "
                           "their tracebacks are on stderr above")
    return HogwildResult(workers, workers * setup.steps, initial, _test_loss(model, setup),
                         seconds, (spans[:, 1].max() - spans[:, 0].min()).item(), losses.clone())


def serial(setup: Setup, steps: int) -> float:
    """Test MSE after ``steps`` plain SGD steps in one process: Hogwild's reference."""
    return serial_timed(setup, steps)[0]


def serial_timed(setup: Setup, steps: int) -> tuple[float, float]:
    """:func:`serial`, and the seconds its loop took (timed as a worker's loop is)."""
    x, y, _, _ = make_problem(setup)
    model = new_model(setup)
    with threads(1):
        start = time.monotonic()
        for step in range(steps):
            idx = batch_indices(step, 0, 1, setup)
            sgd_step(model, x[idx], y[idx], setup.lr)
        seconds = time.monotonic() - start
    return _test_loss(model, setup), seconds
