"""The source's MNIST variational auto-encoder, its loss, and pictures of what it learnt.

Fully connected, 784→512→256→latent for the encoder (two heads: mean and log
variance) and the mirror image for the decoder, as the source's (``src_mnist/nn.py``);
the decoder returns logits and the loss uses ``binary_cross_entropy_with_logits``,
the source's sigmoid + binary cross-entropy computed without overflow. The loss is
summed per sample, and each sample's reparameterisation noise is looked up by its
index in a seeded table, so that any number of ranks makes the serial run's updates
(the source's ``randn_like`` on ranks that all seed 12345 draws the same noise on every
rank instead). The held-out loss is computed on test images the model never trains on
(:func:`pcourse.workloads.mnist.train_and_held_out`).

Lesson 06 trains it and explains both choices.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import nn
from torch.nn import functional as F

from pcourse.workloads.base import Workload, source_adam
from pcourse.workloads.config import MNISTConfig
from pcourse.workloads.mnist import train_and_held_out

if TYPE_CHECKING:  # matplotlib loads only where a picture is drawn, never on a training rank
    from matplotlib.figure import Figure

__all__ = ["VAE", "MNISTConfig", "latent_walk_figure", "make_model", "make_workload",
           "reconstruction_figure", "vae_loss"]


class VAE(nn.Module):
    def __init__(self, latent: int = 2, hidden: tuple[int, int] = (512, 256)) -> None:
        super().__init__()
        h1, h2 = hidden
        self.latent = latent
        self.encoder = nn.Sequential(nn.Linear(784, h1), nn.ReLU(), nn.Linear(h1, h2), nn.ReLU())
        self.mu = nn.Linear(h2, latent)
        self.logvar = nn.Linear(h2, latent)
        self.decoder = nn.Sequential(
            nn.Linear(latent, h2), nn.ReLU(), nn.Linear(h2, h1), nn.ReLU(), nn.Linear(h1, 784)
        )

    def encode(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        h = self.encoder(x)
        return self.mu(h), self.logvar(h)

    def decode_logits(self, z: torch.Tensor) -> torch.Tensor:
        return self.decoder(z)

    def forward(
        self, x: torch.Tensor, eps: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Reconstruction logits, mu, logvar; ``eps`` is the noise (drawn if None)."""
        mu, logvar = self.encode(x)
        if eps is None:
            eps = torch.randn_like(mu)
        z = mu + eps * torch.exp(0.5 * logvar)
        return self.decode_logits(z), mu, logvar


def vae_loss(
    logits: torch.Tensor, x: torch.Tensor, mu: torch.Tensor, logvar: torch.Tensor,
    reduction: str = "mean",
) -> torch.Tensor:
    """BCE reconstruction + KL divergence, summed per sample; "mean" or "sum" over the batch.

    Logits rather than probabilities: ``binary_cross_entropy_with_logits`` is the
    numerically stable form of the same loss.
    """
    bce = F.binary_cross_entropy_with_logits(logits, x, reduction="none").sum(dim=1)
    kl = -0.5 * torch.sum(1 + logvar - mu.pow(2) - logvar.exp(), dim=1)
    per_sample = bce + kl
    return per_sample.sum() if reduction == "sum" else per_sample.mean()


def make_model(latent: int = 2, seed: int = 12345) -> VAE:
    with torch.random.fork_rng(devices=[]):  # identical on every rank, caller's RNG untouched
        torch.manual_seed(seed)
        return VAE(latent)


def make_workload(config: MNISTConfig | None = None, device: str = "cpu") -> Workload:
    """Data, model, loss and optimiser for :func:`pcourse.loop.train`."""
    cfg = config or MNISTConfig()
    dtype = getattr(torch, cfg.dtype)
    (images, _), (held_out, _) = train_and_held_out(cfg.split, cfg.data_dir, limit=cfg.limit,
                                                    n_eval=cfg.n_eval)
    x = images.to(device=device, dtype=dtype)
    x_eval = held_out.to(device=device, dtype=dtype)
    model = make_model(cfg.latent, cfg.seed).to(device=device, dtype=dtype)
    noise: dict[int, torch.Tensor] = {}

    def epoch_noise(epoch: int) -> torch.Tensor:
        if epoch not in noise:  # one table per epoch, the same on every rank
            noise.clear()
            gen = torch.Generator().manual_seed(cfg.seed * 1000 + epoch)
            table = torch.randn(len(x), cfg.latent, generator=gen, dtype=dtype)
            noise[epoch] = table.to(device)
        return noise[epoch]

    def loss_sum(net: nn.Module, idx: torch.Tensor, epoch: int) -> torch.Tensor:
        batch = x[idx]
        logits, mu, logvar = net(batch, epoch_noise(epoch)[idx])
        return vae_loss(logits, batch, mu, logvar, reduction="sum")

    @torch.no_grad()
    def evaluate(net: nn.Module) -> float:
        """Mean loss per held-out image, at the mean code (no noise: deterministic)."""
        zeros = torch.zeros(len(x_eval), cfg.latent, dtype=dtype, device=device)
        logits, mu, logvar = net(x_eval, zeros)
        return vae_loss(logits, x_eval, mu, logvar).item()

    return Workload("mnist", model, len(x), loss_sum,
                    lambda net: source_adam(net, cfg), evaluate)


@torch.no_grad()
def reconstruction_figure(model: VAE, images: torch.Tensor, n: int = 10) -> Figure:
    """Originals (top row) above their reconstructions from the mean latent code."""
    from pcourse.utils.show import new_figure  # shows once in a notebook, leaks none

    model.eval()
    x = images[:n]
    mu, _ = model.encode(x)
    recon = torch.sigmoid(model.decode_logits(mu))
    fig = new_figure(figsize=(n * 0.9, 2.0))
    axes = fig.subplots(2, n, squeeze=False)
    for col in range(n):
        for row, picture in enumerate((x[col], recon[col])):
            ax = axes[row][col]
            ax.imshow(picture.reshape(28, 28).float().cpu().numpy(), cmap="gray", vmin=0, vmax=1)
            ax.set_axis_off()
    fig.suptitle("MNIST: originals (top) and VAE reconstructions (bottom)")
    return fig


@torch.no_grad()
def latent_walk_figure(model: VAE, n: int = 15, span: float = 3.0) -> Figure:
    """Decode an n×n grid over [−span, span]² of the first two latent dimensions."""
    from pcourse.utils.show import new_figure

    model.eval()
    param = next(model.parameters())
    steps = torch.linspace(-span, span, n, dtype=param.dtype, device=param.device)
    z = torch.zeros(n * n, model.latent, dtype=param.dtype, device=param.device)
    z[:, 0] = steps.repeat(n)  # x varies along a row
    z[:, 1] = steps.flip(0).repeat_interleave(n)  # y grows upwards
    tiles = torch.sigmoid(model.decode_logits(z)).reshape(n, n, 28, 28)
    canvas = tiles.permute(0, 2, 1, 3).reshape(n * 28, n * 28).float().cpu().numpy()
    fig = new_figure(figsize=(6, 6))
    ax = fig.subplots()
    ax.imshow(canvas, cmap="gray", extent=(-span, span, -span, span))
    ax.set_xlabel("z[0]")
    ax.set_ylabel("z[1]")
    ax.set_title("Walk through the VAE's latent space")
    return fig
