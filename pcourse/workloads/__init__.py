"""The source's two workloads, ready for the training loop (lessons 05 and 06).

``franke``: a small regression net on Franke's function; ``mnist``: a fully
connected variational auto-encoder on MNIST. ``transformer``: a small causal
transformer and a task made on the spot, the model lesson 11 splits (not a
workload of the loop's). :func:`make_workload` builds either of the first two by
name; :class:`~pcourse.workloads.base.Workload` is what the loop needs of one.
Their configurations (:mod:`pcourse.workloads.config`) are plain data: importing
this package or a configuration loads no torch, so a launcher stays light.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from pcourse.workloads.config import CONFIGS, WorkloadConfig, check_config

if TYPE_CHECKING:
    import torch

    from pcourse.workloads.base import Workload

__all__ = ["WORKLOADS", "Workload", "WorkloadConfig", "default_config", "make_workload"]

# name -> module; imported on demand, so naming one workload never loads the other's data.
WORKLOADS = {"franke": "pcourse.workloads.franke", "mnist": "pcourse.workloads.vae"}


def __getattr__(name: str) -> Any:
    if name == "Workload":  # loads torch: only when asked for
        from pcourse.workloads.base import Workload

        return Workload
    raise AttributeError(f"module 'pcourse.workloads' has no attribute {name!r}")


def default_config(name: str | Workload) -> WorkloadConfig:
    """The named workload's full configuration (the source's)."""
    if not isinstance(name, str):
        raise ValueError("pass a config (epochs, batch_size, scaling, seed) with a Workload")
    return CONFIGS[_known(name)]()


def make_workload(name: str, config: WorkloadConfig,
                  device: torch.device | str = "cpu") -> Workload:
    """Build the named workload ("franke" or "mnist") for ``config`` (its own kind of
    configuration, else a TypeError) on ``device``."""
    check_config(_known(name), config)
    return _module(name).make_workload(config, str(device))


def _known(name: str) -> str:
    if name not in WORKLOADS:
        raise ValueError(f"unknown workload {name!r}; choose one of {', '.join(WORKLOADS)}")
    return name


def _module(name: str):
    return importlib.import_module(WORKLOADS[_known(name)])
