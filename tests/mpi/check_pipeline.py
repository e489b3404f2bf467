"""Run under mpiexec: pipeline parallelism equals one process, in float64.

    python -m mpi4py check_pipeline.py [BACKEND]

The world is one pipeline of SIZE stages. For m = 1, 2, 3, 4 and 8 micro-batches
(fewer than the stages, and not a multiple of them, among them) and both schedules
(GPipe and 1F1B), one step's loss and every parameter's gradient equal one process's
on the whole batch; the most micro-batches each stage held at once equals the
prediction (GPipe: m, 1F1B: min(m, p - rank)). Wrong schedules are caught: an
off-by-one warm-up and GPipe passed off as 1F1B hold more than 1F1B's prediction,
and an order with a backward before its forward is refused. A receive whose sender
never sends is a CollectiveTimeout at the deadline. Prints "pipeline OK on N ranks".
"""

from __future__ import annotations

import sys
import time

import torch
from harness import RANK, SIZE, WORLD, expect, raises, verdict
from torch import nn

from pcourse.backends import make_backend
from pcourse.pipeline import (
    Stage,
    check_order,
    gpipe_order,
    in_flight_prediction,
    one_f_one_b_order,
    run_step,
    split_model,
)
from pcourse.runtime.waits import CollectiveTimeout

BACKEND = sys.argv[1] if len(sys.argv) > 1 else "mpi"
MS = (1, 2, 3, 4, 8) if BACKEND == "mpi" else (3, 8)
N, D, LAYERS = 22, 6, 8  # 22 into 3, 4, 8: unequal micro-batches; 8 layers into 3 stages: too
torch.set_default_dtype(torch.float64)
ORDERS = {"gpipe": gpipe_order, "1f1b": one_f_one_b_order}


def model() -> list[nn.Module]:
    torch.manual_seed(0)  # the same model on every rank
    return [nn.Sequential(nn.Linear(D, D), nn.Tanh()) for _ in range(LAYERS)]


def off_by_one(p: int, rank: int, m: int) -> list[tuple[str, int]]:
    """1F1B with one warm-up forward too many: still exact, but holds one more."""
    warm = min(p - rank, m)
    order = [("F", i) for i in range(warm)]
    for i in range(m - warm):
        order += [("F", warm + i), ("B", i)]
    return order + [("B", i) for i in range(m - warm, m)]


def main() -> int:
    torch.manual_seed(1)
    x, y = torch.randn(N, D), torch.randn(N, D)
    whole = nn.Sequential(*model())
    loss = nn.functional.mse_loss(whole(x), y)
    loss.backward()
    want_loss = loss.item()
    with make_backend(BACKEND) as group:
        layers = model()
        mine = split_model(layers, SIZE, RANK)
        first = sum(len(split_model(layers, SIZE, r)) for r in range(RANK))
        ref = [p.grad for layer in whole[first:first + len(mine)] for p in layer.parameters()]
        stage = Stage(mine, group, (D,), nn.functional.mse_loss, torch.float64)
        for m in MS:
            for name, order_of in {**ORDERS, "off-by-one": off_by_one}.items():
                mine.zero_grad()
                got, tl = run_step(stage, order_of(SIZE, RANK, m), m, N, x, y)
                err = max((p.grad - r).abs().max().item()
                          for p, r in zip(mine.parameters(), ref, strict=True))
                expect(err < 1e-12, f"{name} m={m}: gradients differ by {err:.2e}")
                if got is not None:
                    expect(abs(got.item() - want_loss) < 1e-12, f"{name} m={m}: loss {got.item()}"
                           f" != {want_loss}")
                peak = max(tl.held)
                if name in ORDERS:
                    pred = in_flight_prediction(name, SIZE, RANK, m)
                    expect(peak == pred, f"{name} m={m}: held {peak} micro-batches, "
                           f"predicted {pred}")
                elif m > SIZE - RANK:  # the wrong schedule must break the prediction
                    expect(peak != in_flight_prediction("1f1b", SIZE, RANK, m),
                           f"off-by-one warm-up m={m} not caught by the in-flight count")
                expect(tl.held[-1] == 0, f"{name} m={m}: {tl.held[-1]} micro-batches left held")
            if m > SIZE - RANK:  # GPipe's order called 1F1B holds m, not min(m, p - rank)
                expect(m != in_flight_prediction("1f1b", SIZE, RANK, m),
                       "GPipe passed off as 1F1B not caught")
        expect(raises(ValueError, check_order, [("B", 0), ("F", 0)], 1, match="before its forward"),
               "a backward before its forward was not refused")
        expect(raises(ValueError, check_order, [("F", 0)], 1, match="once"),
               "a missing backward was not refused")
    with make_backend(BACKEND, timeout=1.0) as group:  # a receive nobody sends to
        if RANK == 0:
            start = time.monotonic()
            late = raises(CollectiveTimeout, group.recv, torch.empty(3), 1,
                          match="did not complete")
            took = time.monotonic() - start
            expect(late and took < 10, f"recv without a sender: timeout {late}, after {took:.1f} s")
        WORLD.Barrier()
    return verdict(f"pipeline OK on {SIZE} ranks" + ("" if BACKEND == "mpi" else f" ({BACKEND})"))


if __name__ == "__main__":
    sys.exit(main())
