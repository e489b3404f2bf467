"""What the training loop needs from a workload: a model, a sample count, a batch loss.

Franke's regression (:mod:`pcourse.workloads.franke`) and the MNIST VAE
(:mod:`pcourse.workloads.vae`) each build one; :func:`pcourse.loop.train` runs any.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from pcourse.workloads.config import WorkloadConfig

LossSum = Callable[[nn.Module, torch.Tensor, int], torch.Tensor]  # (model, indices, epoch)
MakeOptimizer = Callable[[nn.Module], tuple[torch.optim.Optimizer, Any]]


@dataclass
class Workload:
    """What :func:`train` needs: a model, how many samples, and the summed loss of a batch."""

    name: str
    model: nn.Module
    n_train: int
    loss_sum: LossSum  # summed over the samples ``indices`` (not averaged)
    make_optimizer: MakeOptimizer  # -> (optimizer, scheduler or None)
    evaluate: Callable[[nn.Module], float] | None = None  # held-out loss

    @property
    def device(self) -> torch.device:
        """Where the model (and the data it trains on) lives; move tensors compared
        with it there, or bring it to the CPU with ``.cpu()``."""
        return next(self.model.parameters()).device


def source_adam(net: nn.Module, cfg: WorkloadConfig) -> tuple[torch.optim.Optimizer, Any]:
    """The source's optimiser for both workloads: Adam with ``cfg.lr`` and
    ``cfg.weight_decay``, the rate decayed by ``cfg.gamma`` every epoch.

    Fused: one kernel steps every parameter, the same update up to rounding (a
    departure from the source's loop over the tensors, which on a small network is a
    large share of a step; lesson 05 says so).
    """
    opt = torch.optim.Adam(net.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay,
                           fused=True)
    return opt, torch.optim.lr_scheduler.ExponentialLR(opt, gamma=cfg.gamma)
