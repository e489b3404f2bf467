"""Train one configuration on this MPI job; rank 0 saves the outcome for the test.

Usage: check_scaling.py WORKLOAD BACKEND OUT.pt CONFIG_JSON [SYNC]
CONFIG_JSON holds the fields of a FrankeConfig / MNISTConfig, so the test keeps the
one definition of the configuration it compares; SYNC is train's ``sync`` (default
"auto"). Rank 0 writes the per-epoch losses,
the test loss, the largest weight deviation across ranks and the final weights.
"""

from __future__ import annotations

import json
import sys

import torch

from pcourse.backends import make_backend
from pcourse.loop import train
from pcourse.runtime.ranks import init_rank
from pcourse.workloads.franke import FrankeConfig
from pcourse.workloads.vae import MNISTConfig


def main() -> None:
    workload, backend_name, out, fields = sys.argv[1:5]
    sync = sys.argv[5] if len(sys.argv) > 5 else "auto"
    config = (FrankeConfig if workload == "franke" else MNISTConfig)(**json.loads(fields))
    init_rank()
    with make_backend(backend_name) as backend:
        result = train(workload, backend, config, progress=False, sync=sync)
        if backend.rank == 0:
            weights = torch.cat([p.detach().flatten() for p in result.model.parameters()])
            torch.save({"losses": result.losses, "test_loss": result.test_loss,
                        "max_deviation": result.max_deviation, "steps": result.steps_per_epoch,
                        "weights": weights}, out)


if __name__ == "__main__":
    main()
