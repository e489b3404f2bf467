"""BatchNorm with local or synchronised batch statistics.

:class:`SyncBatchNorm1d` normalises with the statistics of the *global* batch, as
``torch.nn.SyncBatchNorm`` does: each rank's count, mean and variance are gathered
in one allreduce and combined with Chan, Golub and LeVeque's parallel-variance
formula (:func:`combine_stats`), and the backward pass allreduces their gradients.
With ``backend=None`` the same layer uses this rank's statistics only, so an
experiment that swaps the two changes nothing else. :func:`naive_stats` is the
E[x²] - E[x]² shortcut, kept to show how it loses the variance.

Lesson 08 explains why per-rank statistics break small batches and why the
shortcut cancels.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from pcourse.backends import Backend
from pcourse.data_parallel import average_gradients


class _AllreduceSum(torch.autograd.Function):
    """Sum across ranks, differentiable: the gradient of a sum is the sum of gradients.

    Each rank's loss depends on every rank's samples through the shared statistics,
    so the backward pass must add up what every rank's loss says about them.
    """

    @staticmethod
    def forward(ctx, tensor: torch.Tensor, backend: Backend) -> torch.Tensor:
        ctx.backend = backend
        return backend.allreduce(tensor.detach().clone(), "sum")

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return ctx.backend.allreduce(grad.detach().clone().contiguous(), "sum"), None


def gather_stats(count: torch.Tensor, mean: torch.Tensor, var: torch.Tensor,
                 backend: Backend) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Every rank's (count, mean, variance), stacked in rank order; differentiable.

    An allgather built from one allreduce: each rank fills its own row of a zero
    table and the sum is everybody's rows. The backward pass sums the gradients
    the same way, so each rank receives what every rank's loss says about its row.
    """
    row = torch.cat([count.reshape(1), mean, var])
    mine = torch.zeros(backend.size, 1, dtype=row.dtype, device=row.device)
    mine[backend.rank] = 1.0
    table = _AllreduceSum.apply(mine * row, backend)
    c = mean.numel()
    return table[:, 0], table[:, 1:c + 1], table[:, c + 1:]


def combine_stats(counts: torch.Tensor, means: torch.Tensor, variances: torch.Tensor
                  ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Mean, biased variance and count of the union of groups (Chan et al.'s formula).

    ``counts`` (groups,), ``means`` and ``variances`` (groups, features), biased.
    """
    total = counts.sum()
    w = (counts / total).unsqueeze(1)
    mean = (w * means).sum(0)
    var = (w * (variances + (means - mean) ** 2)).sum(0)
    return mean, var, total


def naive_stats(x: torch.Tensor, backend: Backend | None = None
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The shortcut: one allreduce of [Σx, Σx², n], variance E[x²] - E[x]².

    Exact in real numbers, unstable in floating point when |mean| >> std: kept to
    show the difference, not used by :class:`SyncBatchNorm1d`.
    """
    c = x.shape[1]
    stats = torch.cat([x.sum(0), (x * x).sum(0), x.new_tensor([x.shape[0]])])
    if backend is not None:
        stats = _AllreduceSum.apply(stats, backend)
    count = stats[2 * c]
    mean = stats[:c] / count
    return mean, stats[c:2 * c] / count - mean * mean, count


class SyncBatchNorm1d(nn.Module):
    """BatchNorm over features of (batch, features) input; global statistics if ``backend``.

    Matches ``nn.BatchNorm1d`` on the concatenation of all ranks' batches, whatever
    each rank's share: biased variance to normalise, unbiased variance in the
    running estimate.
    """

    running_mean: torch.Tensor  # buffers (register_buffer), declared for the type checker
    running_var: torch.Tensor

    def __init__(self, num_features: int, backend: Backend | None = None,
                 eps: float = 1e-5, momentum: float = 0.1) -> None:
        super().__init__()
        self.backend, self.eps, self.momentum = backend, eps, momentum
        self.weight = nn.Parameter(torch.ones(num_features))
        self.bias = nn.Parameter(torch.zeros(num_features))
        self.register_buffer("running_mean", torch.zeros(num_features))
        self.register_buffer("running_var", torch.ones(num_features))

    def batch_stats(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Mean, biased variance and sample count of the (global, if synced) batch."""
        count = x.new_tensor(float(x.shape[0]))
        if x.shape[0]:
            mean, var = x.mean(0), x.var(0, unbiased=False)
        else:  # an empty slice adds nothing (its mean would be NaN)
            mean = var = x.new_zeros(x.shape[1])
        if self.backend is None:
            return mean, var, count
        counts, means, variances = gather_stats(count, mean, var, self.backend)
        return combine_stats(counts, means, variances)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.training:
            mean, var, count = self.batch_stats(x)
            if count < 2:
                raise ValueError("BatchNorm needs at least 2 samples per (global) batch")
            with torch.no_grad():
                m = self.momentum
                self.running_mean.mul_(1 - m).add_(m * mean)
                self.running_var.mul_(1 - m).add_(m * var * count / (count - 1))
        else:
            mean, var = self.running_mean, self.running_var
        return (x - mean) / torch.sqrt(var + self.eps) * self.weight + self.bias


def make_blobs(n: int, seed: int, dim: int = 16, classes: int = 4) -> tuple[torch.Tensor, ...]:
    """Overlapping Gaussian classes with features on very different scales.

    Uneven scales are what BatchNorm is for; the overlap keeps accuracy below 100 %
    so that a worse method shows. Class means come from a fixed seed, the samples
    from ``seed``, so training and test sets share their classes.
    """
    means = torch.randn(classes, dim, generator=torch.Generator().manual_seed(7)) * 1.2
    scales = 10 ** torch.linspace(-1.5, 1.5, dim)
    gen = torch.Generator().manual_seed(seed)
    labels = torch.randint(classes, (n,), generator=gen)
    x = (means[labels] + torch.randn(n, dim, generator=gen)) * scales + 3.0
    return x, labels


def bn_model(backend: Backend | None, dim: int = 16, classes: int = 4, hidden: int = 64,
             seed: int = 0) -> nn.Sequential:
    """A small classifier with two BatchNorm layers, seeded identically on every rank."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return nn.Sequential(
            nn.Linear(dim, hidden), SyncBatchNorm1d(hidden, backend), nn.ReLU(),
            nn.Linear(hidden, hidden), SyncBatchNorm1d(hidden, backend), nn.ReLU(),
            nn.Linear(hidden, classes),
        )


@dataclass
class BNResult:
    """One run of the BatchNorm experiment, as seen by one rank."""

    sync: bool
    batch: int  # per rank
    test_accuracy: float  # this rank's model, eval mode (running statistics)
    test_loss: float
    stats_spread: float  # largest difference of running_var between ranks


def bn_experiment(backend: Backend, batch: int, sync: bool, steps: int = 300,
                  lr: float = 0.05, seed: int = 0) -> BNResult:
    """Train the classifier with exact gradient averaging; BatchNorm local or synced.

    Collective: call on every rank. Everything but the statistics is identical.
    """
    rank, size = backend.rank, backend.size
    x, y = make_blobs(4096, seed)
    x_test, y_test = make_blobs(2048, seed + 1)
    model = bn_model(backend if sync else None, seed=seed)
    opt = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9)
    gen = torch.Generator().manual_seed(seed + 100)  # same draw on every rank
    for _ in range(steps):
        idx = torch.randint(len(x), (size * batch,), generator=gen)[rank::size]
        opt.zero_grad(set_to_none=True)
        nn.functional.cross_entropy(model(x[idx]), y[idx]).backward()
        average_gradients(model, backend, check=False)
        opt.step()
    model.eval()
    with torch.no_grad():
        logits = model(x_test)
        acc = (logits.argmax(1) == y_test).double().mean().item()
        loss = nn.functional.cross_entropy(logits, y_test).item()
        var = torch.cat([m.running_var for m in model if isinstance(m, SyncBatchNorm1d)])
        hi, lo = backend.allreduce(var.clone(), "max"), backend.allreduce(var.clone(), "min")
    return BNResult(sync, batch, acc, loss, float((hi - lo).max()))
