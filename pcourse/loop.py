"""The one training loop: notebooks, the benchmark and the tests all call :func:`train`.

Each step, every rank: forward on its share of the global batch, its summed loss
divided by that share, backward, gradients averaged across ranks
(:func:`gradient_sync`: per parameter, flat, or bucketed), optimiser step. Every
rank starts from rank 0's weights and takes the strided share of one seeded shuffle
(:func:`local_batches`), so a global batch is the same samples at any rank count
and training is the serial large-batch run, number for number: the tests check it
at 1, 2 and 4 ranks. ``config.scaling`` "strong" keeps the global batch fixed,
"weak" the per-rank batch. Batches are sliced from tensors in memory: a DataLoader
worker per rank costs more than the work on 2-core machines.

Lesson 05 assembles this loop step by step and explains each detail.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field, fields
from typing import Any

import torch
from torch import nn

from pcourse.backends import Backend
from pcourse.buckets import BucketedAllreduce
from pcourse.data_parallel import (
    average_gradients,
    average_gradients_flat,
    broadcast_parameters,
    check_consistency,
)
from pcourse.partition import partition_indices
from pcourse.runtime.ranks import threads
from pcourse.utils.progress import Bar
from pcourse.workloads import Workload, default_config, make_workload
from pcourse.workloads.config import WorkloadConfig, batch_sizes


@dataclass
class TrainResult:
    workload: str
    backend: str
    ranks: int
    scaling: str
    global_batch: int
    local_batch: int
    steps_per_epoch: int
    losses: list[float]  # mean training loss of each epoch, over all ranks' samples
    epoch_times: list[float]  # seconds, rank 0
    total_time: float  # seconds: broadcast + epochs + consistency check
    test_loss: float | None
    max_deviation: float | None  # largest weight difference across ranks (None: serial)
    model: nn.Module | None = field(default=None, repr=False)  # the trained model
    # Where the model trained and lives (the backend's device: "cuda:0" for the MPI and
    # NCCL backends on a CUDA machine). Compare it with CPU tensors after ``.cpu()``.
    device: str = "cpu"

    @property
    def final_loss(self) -> float:
        return self.losses[-1] if self.losses else float("nan")

    @property
    def train_time(self) -> float:
        return sum(self.epoch_times)

    def summary(self) -> dict[str, Any]:
        """Flat, JSON- and CSV-friendly view (no per-epoch lists)."""
        skip = ("losses", "epoch_times", "model")
        row = {f.name: getattr(self, f.name) for f in fields(self) if f.name not in skip}
        row.update(final_loss=self.final_loss, train_time=self.train_time, epochs=len(self.losses))
        return row


def local_batches(n: int, rank: int, size: int, local_batch: int, seed: int, epoch: int):
    """This rank's batches for one epoch: its strided share of the seeded shuffle, cut up.

    With the strided layout, rank r's k-th batch is every size-th index of the k-th
    run of ``size * local_batch`` shuffled indices, so the ranks' k-th batches
    together are the serial run's k-th batch, whatever the rank count. A partial last
    batch is kept (the source's DataLoader drops it, ``drop_last=True``): every sample
    is used each epoch, and an epoch has ceil(n / global batch) updates.
    """
    mine = partition_indices(n, rank, size, seed=seed, epoch=epoch, layout="strided")
    return torch.split(mine, local_batch)


SYNC_MODES = ("auto", "flat", "per-parameter", "bucketed")


@contextmanager
def gradient_sync(model: nn.Module, backend: Backend | None,
                  mode: str = "auto") -> Iterator[Callable[[], None] | None]:
    """While training runs, ``sync()`` averages the gradients after each backward.

    - "per-parameter": one allreduce per gradient, the source's way. "auto" keeps it
      for ``mpi-pickle``, which *is* the source's way, kept for comparison.
    - "flat": every gradient copied into one buffer, one allreduce (lesson 05).
    - "bucketed": the gradients live in flat buckets (views, so no copies), one
      allreduce per bucket (lesson 07's BucketedAllreduce); "auto" elsewhere. It
      overlaps communication with backward only on GPUs: on CPUs both compete for
      the same cores.

    The ranks' gradients are compared once, at the first step. Yields None without
    a backend (a serial run), and for "auto" at one rank: there the average is the
    gradient itself, so the step is the serial one, on the backend's device.
    """
    if mode not in SYNC_MODES:
        raise ValueError(f"unknown gradient sync {mode!r}; use one of {', '.join(SYNC_MODES)}")
    if backend is None or (mode == "auto" and backend.size == 1):
        yield None
        return
    if mode == "auto":
        mode = "per-parameter" if backend.name == "mpi-pickle" else "bucketed"
    if mode == "bucketed":
        reducer = BucketedAllreduce(model, backend, overlap=backend.device.type == "cuda")
        try:
            yield reducer.finish
        finally:
            reducer.remove()  # the trained model keeps no hooks
        return
    average = average_gradients_flat if mode == "flat" else average_gradients
    steps = itertools.count()
    yield lambda: average(model, backend, check=next(steps) == 0)


def _epoch(wl: Workload, opt, backend, sync, batches, epoch: int, device) -> float:
    """One pass over the data; returns the mean loss over all ranks' samples."""
    total = torch.zeros(2, dtype=torch.float64, device=device)  # (loss sum, samples)
    for batch in batches:
        idx = batch.to(device)
        # Kept allocated while a sync runs: bucketed gradients are views into the buckets.
        opt.zero_grad(set_to_none=sync is None)
        loss = wl.loss_sum(wl.model, idx, epoch)
        (loss / len(idx)).backward()  # mean over my share; averaged over ranks below
        if sync is not None:
            sync()
        opt.step()
        total[0] += loss.detach()
        total[1] += len(idx)
    if backend is not None:
        backend.allreduce(total, "sum")
    return (total[0] / total[1]).item()


def _place(backend: Backend | None) -> tuple[int, int, torch.device]:
    """(rank, size, device); the serial reference is rank 0 of 1, on the CPU."""
    if backend is None:
        return 0, 1, torch.device("cpu")
    return backend.rank, backend.size, backend.device


def _fit(wl: Workload, backend: Backend | None, sync: Any, optimizer: tuple[Any, Any],
         config: WorkloadConfig, local: int,
         progress: bool) -> tuple[list[float], list[float], int]:
    """All epochs; returns (per-epoch losses, per-epoch seconds, steps per epoch)."""
    rank, size, device = _place(backend)
    opt, scheduler = optimizer
    losses, times, steps = [], [], 0
    bar = Bar(config.epochs, f"{wl.name} ×{size}", "epoch") if progress and rank == 0 else None
    for epoch in range(config.epochs):
        t0 = time.perf_counter()
        batches = local_batches(wl.n_train, rank, size, local, config.seed, epoch)
        wl.model.train()
        losses.append(_epoch(wl, opt, backend, sync, batches, epoch, device))
        if scheduler is not None:
            scheduler.step()
        times.append(time.perf_counter() - t0)
        steps = len(batches)
        if bar is not None:
            bar.update(epoch + 1, postfix=f"loss {losses[-1]:.4g}, {times[-1]:.2f} s")
    if bar is not None:
        bar.close()
    return losses, times, steps


def train(
    workload: str | Workload,
    backend: Backend | None = None,
    config: WorkloadConfig | None = None,
    *,
    progress: bool = True,
    sync: str = "auto",
) -> TrainResult:
    """Train ``workload`` ("franke", "mnist" or a :class:`Workload`) data-parallel.

    ``backend`` None is the serial, one-process reference. ``config`` is a
    :data:`~pcourse.workloads.config.WorkloadConfig`, a FrankeConfig or an MNISTConfig
    (default: the workload's full configuration); a named workload takes its own kind,
    else a TypeError. Its epochs, batch, seed, scaling and threads drive the loop. A named workload
    is built on the backend's device (the CPU when serial). ``progress`` shows rank
    0's epochs, in a notebook also when it runs on the engines, without leaving an
    output behind (:mod:`pcourse.utils.progress`). ``sync`` chooses how gradients are
    averaged (see :func:`gradient_sync`). The final weights are compared across ranks.
    """
    _, size, device = _place(backend)
    config = config if config is not None else default_config(workload)
    wl = workload if isinstance(workload, Workload) else make_workload(workload, config, device)
    local, global_ = batch_sizes(config.scaling, config.batch_size, size, wl.n_train)

    # Setup, not training: torch's first optimiser imports torch._dynamo.
    optimizer = wl.make_optimizer(wl.model)
    start = time.perf_counter()
    if backend is not None:
        broadcast_parameters(wl.model, backend, root=0)
    with (gradient_sync(wl.model, backend, sync) as grad_sync,
          threads(config.threads)):
        losses, times, steps = _fit(wl, backend, grad_sync, optimizer, config, local, progress)
    deviation = None
    if backend is not None:
        deviation = check_consistency(wl.model, backend).max_deviation
    total = time.perf_counter() - start
    wl.model.eval()
    test = wl.evaluate(wl.model) if wl.evaluate else None
    name = backend.name if backend is not None else "serial"
    return TrainResult(wl.name, name, size, config.scaling, global_, local, steps,
                       losses, times, total, test, deviation, wl.model, str(device))
