"""What a step really took, for lesson 13 to set beside what was predicted.

Memory by the allocator, never by the course's bookkeeping: the whole run (building the
model, the optimizer, one warm-up step, then the measured step) goes under
``torch.profiler`` with ``profile_memory=True``, whose memory events carry the CPU
allocator's running total of live bytes (``Total Allocated``) at every allocation and
free. The baseline is the total before anything was built (the batch was made before);
the state **at rest** is the total just before the measured step, the **peak** the
largest total during it, both less the baseline; the phase the peak fell in is read from
the step's own markers (:mod:`pcourse.tools.bench.strategies`). The garbage collector
runs before and not during it: memory an earlier run left, freed in the window, would
lower the running total.

Time by the clock: ``repeats`` more steps, each started after a barrier, timed on every
rank; a repeat's time is its slowest rank's.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from pcourse.utils.profiler import chrome_events

MARK = "pcourse:"


@dataclass
class Measured:
    """One rank's figures for one configuration (bytes; seconds per repeat)."""

    rest: int
    peak: int
    when: str
    times: list[float]


def profiled(make: Callable[[], Any], barrier: Callable[[], None]) -> tuple[Any, int, int, str]:
    """``run = make()`` then ``run.step()`` twice, under the profiler: (run, bytes at rest
    before the second step, its peak, the phase of the peak), above the baseline."""
    import gc

    from torch.profiler import ProfilerActivity, profile, record_function

    os.environ.setdefault("KINETO_LOG_LEVEL", "9")  # no start/stop lines on stderr
    gc.collect()  # what earlier runs left is freed now, not while this one is measured
    gc.disable()  # (a free counts against the total the peak is read from)
    try:
        with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
            run = make()
            run.step()
            barrier()
            with record_function(MARK + "measured"):
                run.step()
    finally:
        gc.enable()
    return (run, *read_peak(chrome_events(prof)))


def read_peak(events: list[dict]) -> tuple[int, int, str]:
    """(at rest, peak, phase) of the profile's ``measured`` window, above its first
    allocation's baseline."""
    memory = sorted((e for e in events if e.get("name") == "[memory]"), key=lambda e: e["ts"])
    window = next(e for e in events if e.get("name") == MARK + "measured")
    lo, hi = window["ts"], window["ts"] + window["dur"]
    base = memory[0]["args"]["Total Allocated"] - memory[0]["args"]["Bytes"]
    rest = max((e for e in memory if e["ts"] < lo), key=lambda e: e["ts"])
    inside = [e for e in memory if lo <= e["ts"] <= hi]
    top = max(inside, key=lambda e: e["args"]["Total Allocated"])
    phases = [e for e in events if e.get("name", "").startswith(MARK) and e is not window
              and lo <= e["ts"] <= top["ts"] <= e["ts"] + e.get("dur", 0)]
    when = min(phases, key=lambda e: e["dur"])["name"][len(MARK):] if phases else "step"
    return (rest["args"]["Total Allocated"] - base, top["args"]["Total Allocated"] - base, when)


def kept(fn: Callable[[], Any]) -> tuple[int, Any]:
    """(bytes ``fn()`` allocated and still held when it returned, its result), by the
    allocator: what a forward keeps for its backward, plus its output."""
    from torch.profiler import ProfilerActivity, profile

    os.environ.setdefault("KINETO_LOG_LEVEL", "9")
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        result = fn()
    memory = sorted((e for e in chrome_events(prof) if e.get("name") == "[memory]"),
                    key=lambda e: e["ts"])
    if not memory:
        return 0, result
    start = memory[0]["args"]["Total Allocated"] - memory[0]["args"]["Bytes"]
    return memory[-1]["args"]["Total Allocated"] - start, result


def timed(step: Callable[[], None], comm: Any, repeats: int) -> list[float]:
    """Seconds of each of ``repeats`` steps on the slowest rank of ``comm`` (mpi4py)."""
    from mpi4py import MPI

    times = []
    for _ in range(repeats):
        comm.Barrier()
        start = time.perf_counter()
        step()
        times.append(comm.allreduce(time.perf_counter() - start, op=MPI.MAX))
    return times
