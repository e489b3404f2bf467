"""Run under mpiexec: lesson 13's bad input is the same clear error on every rank.

Each rank checks the same specs (a mesh that does not divide, no micro-batch, an unknown
strategy or backend) and the calibration's (an unknown backend), as the measuring
function does first on every rank; the ranks gather what each said and compare.

Prints "cost model errors agree on N ranks" on rank 0.
"""

from __future__ import annotations

from mpi4py import MPI

from pcourse.cost_model.machine import CostModelError
from pcourse.tools.bench import calibrate, predict

WORLD = MPI.COMM_WORLD
BAD = [
    (predict.Spec(ranks=(5,)), "the batch (12) does not divide by 5 ranks"),
    (predict.Spec(ranks=(2,), micro=0), "micro = 0"),
    (predict.Spec(strategies=("ddp", "zero3")), "unknown strategy 'zero3'"),
    (predict.Spec(backend="nccl-cupy"), "unknown backend 'nccl-cupy'"),
    (predict.Spec(ranks=(2,), strategies=("tp",), heads=9, d=189), "heads = 9 does not divide"),
    (calibrate.Spec(backends=("ucx",)), "unknown backend 'ucx'"),
]
said = []
for spec, wanted in BAD:
    try:
        spec.check()
    except CostModelError as exc:
        said.append(str(exc))
        assert wanted in str(exc), (wanted, str(exc))
    else:
        raise AssertionError(f"rank {WORLD.rank}: {spec} was not refused")
every = WORLD.allgather(said)
assert all(s == every[0] for s in every), every
if WORLD.rank == 0:
    print(f"cost model errors agree on {WORLD.size} ranks", flush=True)
