"""torch's own estimators beside lesson 13's cost model, on the same steps.

``torch.distributed._tools.mem_tracker.MemTracker`` follows every tensor a step creates
and reports the peak it saw, by kind. Run on the step's real tensors it is a tracker of
what happened; run under ``FakeTensorMode`` (tensors with shapes and no memory, as
torch's estimators are meant to run before the real thing) it is a prediction. Both are
read from MemTracker's own snapshot (:func:`memtracker_peak`). A strategy whose code
cannot run on fake tensors (it reads a value: DDP's flags; or builds its modules from
fake ones in another fake mode) says so with torch's own error.

``torch.distributed._tools.runtime_estimator.RuntimeEstimator`` needs a CUDA device in
both of its modes (:func:`runtime_estimator`: on a CPU, its own error).
"""

from __future__ import annotations

from typing import Any

import torch


def memtracker_peak(strategy: str, p: int, spec: Any, *, fake: bool) -> tuple[int | None, str]:
    """MemTracker's peak (bytes) over one step of ``strategy`` at p ranks, rank 0, the
    other ranks a stand-in group; None and why where it cannot run."""
    import warnings

    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.distributed._tools.mem_tracker import MemTracker

    from pcourse.tools.bench import strategies

    shape = spec.shape()
    try:
        with FakeTensorMode() if fake else _nothing(), warnings.catch_warnings():
            warnings.simplefilter("ignore")  # fake tensors' data pointers: torch's own noise
            group = strategies.Absent(0, p)
            x = torch.randn(shape.seq, shape.batch, shape.d)
            run = strategies.build(strategy, group, shape,
                                   strategies.local_input(strategy, group, x), micro=spec.micro,
                                   bucket_cap=spec.bucket_cap)
            run.step()  # as measured: the optimizer's state exists
            tracker = MemTracker()
            # run.optimizer may be None: torch's MemTracker skips None (its code says so), which
            # its annotation leaves out (hence the ignore)
            tracker.track_external(run.model, run.optimizer)  # type: ignore[arg-type]
            with tracker:
                run.step()
        (peak,) = tracker.get_tracker_snapshot("peak").values()
        return int(peak["Total"]), ""
    except Exception as exc:  # noqa: BLE001 - torch's own reason is the answer
        return None, f"{type(exc).__name__}: {str(exc).splitlines()[0][:120]}"


class _nothing:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: object) -> None:
        return None


_ESTIMATE = """
import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.distributed._tools.runtime_estimator import RuntimeEstimator
with FakeTensorMode():
    model, x = torch.nn.Linear(64, 64), torch.randn(8, 64)
    estimator = RuntimeEstimator()
    with estimator({mode!r}):
        model(x).sum().backward()
print(f"estimate {{estimator.total_runtime:.3f}} ms")
"""


def runtime_estimator(modes: tuple[str, ...] = ("operator-level-benchmark",
                                                "operator-level-cost-model"),
                      timeout: float = 120.0) -> dict[str, str]:
    """What RuntimeEstimator says of a small model's step here, per mode: its estimate,
    or how its process ended (in a process of its own: on a CPU it raises inside the
    autograd engine, which ends the process)."""
    import subprocess
    import sys

    said = {}
    for mode in modes:
        done = subprocess.run([sys.executable, "-c", _ESTIMATE.format(mode=mode)],
                              capture_output=True, text=True, timeout=timeout)
        if done.returncode == 0:
            said[mode] = done.stdout.strip().splitlines()[-1]
        else:
            lines = [line.strip() for line in done.stderr.splitlines() if line.strip()]
            why = next((line for line in lines if "terminate" in line or "Error" in line),
                       lines[-1] if lines else "(nothing on stderr)")
            how = (f"signal {-done.returncode}" if done.returncode < 0 else
                   f"status {done.returncode}")
            said[mode] = f"its process ended with {how}: {why[:120]}"
    return said
