"""How close the training loop runs to this machine's compute limit.

A training step of these models is matrix products (and, for the VAE, little else):
its floating-point operations per sample are counted by torch's own
:class:`torch.utils.flop_counter.FlopCounterMode` on one forward and backward pass,
and the loop's achieved FLOP/s is that count times the samples it processed per
second. The limit beside it is measured, not looked up: every rank multiplies
square float32 matrices at the loop's own threads, all ranks at once (they share the
machine as they do in training), and the ranks' rates are summed. On a GPU the
limit is the GPU's: the matrices live on the model's device, larger ones (a GPU
reaches its peak only on big products), timed after a synchronize.
"""

from __future__ import annotations

import copy
import time
from typing import Any

# torch is imported inside the functions that run on ranks: the launcher prints the
# table without it.

MATMUL_SIZE = 512  # big enough to run near the math library's peak, small enough to be quick
GPU_MATMUL_SIZE = 4096
MATMUL_SECONDS = 0.1  # per rank, split over a few timed rounds (the best one counts)


def flops_per_sample(workload: Any, model: Any, n: int = 64) -> float:
    """Forward + backward FLOPs of ``workload``'s loss per training sample (n samples, a copy)."""
    import torch
    from torch.utils.flop_counter import FlopCounterMode

    probe = copy.deepcopy(model)
    n = min(n, workload.n_train)
    with FlopCounterMode(display=False) as counter:
        workload.loss_sum(probe, torch.arange(n), 0).backward()
    return counter.get_total_flops() / n


def matmul_rate(size: int | None = None, seconds: float = MATMUL_SECONDS,
                device: Any = "cpu") -> float:
    """This process's best float32 matmul FLOP/s on ``device`` (on the CPU: at its current
    torch threads)."""
    import torch

    device = torch.device(device)
    size = size or (GPU_MATMUL_SIZE if device.type == "cuda" else MATMUL_SIZE)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    a, b = torch.randn(size, size, device=device), torch.randn(size, size, device=device)
    torch.mm(a, b)  # the first call pays for the kernel's set-up
    sync()
    best, spent, reps = 0.0, 0.0, 1
    while spent < seconds:
        start = time.perf_counter()
        for _ in range(reps):
            torch.mm(a, b)
        sync()
        took = time.perf_counter() - start
        spent += took
        best = max(best, 2 * size**3 * reps / took)
        reps = reps * 2 if took < seconds / 8 else reps
    return best


def limit_rows(table: list[dict]) -> list[dict]:
    """Per (backend, ranks): achieved training FLOP/s, the measured matmul limit, the ratio."""
    out = []
    for t in table:
        if not t.get("flops_per_sample") or not t.get("matmul_flops"):
            continue
        achieved = t["flops_per_sample"] * t["throughput"]
        out.append({"backend": t["backend"], "ranks": t["ranks"], "threads": t["threads"],
                    "device": t.get("device", "cpu"),
                    "achieved": achieved, "limit": t["matmul_flops"],
                    "fraction": achieved / t["matmul_flops"]})
    return out


def print_limits(table: list[dict]) -> None:
    """The loop's FLOP/s beside the matmul limit at the same threads (GFLOP/s)."""
    rows = limit_rows(table)
    if not rows:
        return
    print("\ntraining loop against this machine's matmul rate (all ranks at once, the loop's "
          "threads per rank)")
    print(f"{'backend':>10} {'device':>6} {'ranks':>5} {'threads':>7} {'loop GFLOP/s':>13} "
          f"{'matmul GFLOP/s':>15} {'loop / matmul':>13}")
    for r in rows:
        print(f"{r['backend']:>10} {r['device']:>6} {r['ranks']:>5} {r['threads']:>7} "
              f"{r['achieved'] / 1e9:>13.2f} "
              f"{r['limit'] / 1e9:>15.2f} {r['fraction']:>13.2f}")
