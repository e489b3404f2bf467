"""Timing a collective the way lesson 04 reads it: the slowest rank, the median call.

Lesson 04 shows :func:`time_call` and times the backends with it; lesson 05 and the
exercises time their allreduces with it too, and the communication benchmark
(``pcourse.tools.bench.commbench``) builds its sweeps on it.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import numpy as np


def time_call(comm: Any, fn: Callable[[], Any], warmup: int, iters: int) -> np.ndarray:
    """Seconds of each timed call on the slowest rank, barriers around the loop.

    Their median is the latency a learner should read: the mean (what OSU and
    nccl-tests print) also carries every hiccup of a busy machine.
    """
    from mpi4py import MPI

    for _ in range(warmup):
        fn()
    times = np.empty(iters)
    comm.Barrier()
    for i in range(iters):
        start = time.perf_counter()
        fn()
        times[i] = time.perf_counter() - start
    comm.Barrier()
    comm.Allreduce(MPI.IN_PLACE, times, op=MPI.MAX)
    return times
