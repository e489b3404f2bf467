"""Franke's function: the source's small regression workload.

Franke's function (R. Franke, "A critical comparison of some methods for
interpolation of scattered data", Naval Postgraduate School, NPS-53-79-003, 1979)
is a classic two-dimensional test surface: two Gaussian peaks, a ridge and a dip.
The source (N. Geneva, "How to Train Neural Networks in Parallel (From Scratch)",
code NickGeneva/blog-code, parallel-nn) fits it with a small fully connected
network, and so do we, with the source's network, optimiser and data sizes:

    f(x, y) = 3/4 exp(-(9x-2)²/4 - (9y-2)²/4) + 3/4 exp(-(9x+1)²/49 - (9y+1)/10)
            + 1/2 exp(-(9x-7)²/4 - (9y-3)²/4) - 1/5 exp(-(9x-4)² - (9y-7)²)

Two departures from the source, both said in lesson 05 and in the README:

- The source's formula (blog and code) squares the (9y+1) of the second term,
  (9y+1)²/10; Franke's original, and the page the source's code links to
  (sfu.ca/~ssurjano/franke2d.html), divide (9y+1) by 10 unsquared. We use the
  original; :func:`franke_as_in_source` is the source's variant, for comparison.
- Franke defined the function on [0, 1]², and so do we. The source samples x and y
  uniformly from [−1, 1]², where the original formula's −(9y+1)/10 term turns
  positive and the surface peaks on the boundary: a hybrid that is neither Franke's
  surface nor the source's. Sample the source's domain with ``DOMAIN_AS_IN_SOURCE``.

Everything is seeded, so every rank builds the same data and the same initial
network without communicating.
"""

from __future__ import annotations

import torch
from torch import nn

from pcourse.workloads.base import Workload, source_adam
from pcourse.workloads.config import FrankeConfig

__all__ = ["DOMAIN", "DOMAIN_AS_IN_SOURCE", "FrankeConfig", "franke", "franke_as_in_source",
           "make_data", "make_model", "make_workload"]

DOMAIN = (0.0, 1.0)  # Franke's interval for both x and y
DOMAIN_AS_IN_SOURCE = (-1.0, 1.0)  # the source's, for comparison


def franke(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """Franke's function, elementwise: Franke's (1979) four-term formula."""
    return _franke(x, y, (9 * y + 1) / 10)


def franke_as_in_source(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """The source's variant: the second term's (9y+1) squared, (9y+1)²/10."""
    return _franke(x, y, (9 * y + 1) ** 2 / 10)


def _franke(x: torch.Tensor, y: torch.Tensor, second_y: torch.Tensor) -> torch.Tensor:
    a = 0.75 * torch.exp(-((9 * x - 2) ** 2) / 4 - ((9 * y - 2) ** 2) / 4)
    b = 0.75 * torch.exp(-((9 * x + 1) ** 2) / 49 - second_y)
    c = 0.5 * torch.exp(-((9 * x - 7) ** 2) / 4 - ((9 * y - 3) ** 2) / 4)
    d = 0.2 * torch.exp(-((9 * x - 4) ** 2) - (9 * y - 7) ** 2)
    return a + b + c - d


def make_data(
    n: int, seed: int, dtype: torch.dtype = torch.float32,
    domain: tuple[float, float] = DOMAIN,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``n`` points uniform on ``domain``² (Franke's [0, 1]²) and their targets, (n, 2), (n, 1).

    A private generator, so the data never depends on what else used torch's RNG.
    """
    gen = torch.Generator().manual_seed(seed)
    lo, hi = domain
    xy = lo + (hi - lo) * torch.rand(n, 2, generator=gen, dtype=torch.float64)
    z = franke(xy[:, 0], xy[:, 1]).unsqueeze(1)
    return xy.to(dtype), z.to(dtype)


def make_model(hidden: int = 100, seed: int = 12345) -> nn.Sequential:
    """The source's network, 2→hidden→hidden→1 with ReLU, seeded identically on every rank."""
    with torch.random.fork_rng(devices=[]):  # leave the caller's RNG stream alone
        torch.manual_seed(seed)
        return nn.Sequential(
            nn.Linear(2, hidden), nn.ReLU(),
            nn.Linear(hidden, hidden), nn.ReLU(),
            nn.Linear(hidden, 1),
        )


def make_workload(config: FrankeConfig | None = None, device: str = "cpu") -> Workload:
    """Data, model, loss and optimiser for :func:`pcourse.loop.train`."""
    cfg = config or FrankeConfig()
    dtype = getattr(torch, cfg.dtype)
    x, y = (t.to(device) for t in make_data(cfg.n_points, cfg.seed, dtype))
    # seed + 1: new points. The source draws its test set with the training seed, so
    # its 1,000 test points are its first 1,000 training points (lesson 05 shows it).
    x_test, y_test = (t.to(device) for t in make_data(cfg.n_test, cfg.seed + 1, dtype))
    model = make_model(cfg.hidden, cfg.seed).to(device=device, dtype=dtype)

    def loss_sum(net: nn.Module, idx: torch.Tensor, epoch: int) -> torch.Tensor:
        # Summed, not averaged: the training loop divides by the batch, so that
        # averaged gradients over ranks equal the serial large-batch gradient.
        return nn.functional.mse_loss(net(x[idx]), y[idx], reduction="sum")

    @torch.no_grad()
    def evaluate(net: nn.Module) -> float:
        return nn.functional.mse_loss(net(x_test), y_test).item()

    return Workload("franke", model, cfg.n_points, loss_sum,
                    lambda net: source_adam(net, cfg), evaluate)
