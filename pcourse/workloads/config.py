"""The two workloads' configurations, and how a scaling mode splits the batch.

Plain data, no torch: a benchmark's launcher reads and checks a configuration
(is the batch divisible by the ranks? are there enough samples?) before it starts
any rank, without paying for importing torch. :mod:`pcourse.workloads.franke` and
:mod:`pcourse.workloads.vae` re-export their configuration from here.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class FrankeConfig:
    """The source's configuration; ``FrankeConfig.quick()`` is the minutes-scale one.

    The source's ``main_franke.py`` defaults: 10,000 training points (``--ntrain``),
    1,000 test points (``--ntest``), a global batch of 256, 100 epochs, Adam (lr 1e-3,
    weight decay 1e-6) with ExponentialLR(0.98) per epoch, seed 12345.

    ``batch_size`` is the global batch in strong scaling (the source's setting: the
    same updates at every rank count) and the per-rank batch in weak scaling.
    """

    n_points: int = 10_000
    n_test: int = 1_000
    batch_size: int = 256
    epochs: int = 100
    lr: float = 1e-3
    weight_decay: float = 1e-6
    gamma: float = 0.98  # ExponentialLR, stepped once per epoch
    hidden: int = 100
    seed: int = 12345
    scaling: str = "strong"
    dtype: str = "float32"  # "float64" makes rank-count comparisons tighter
    # One torch thread per rank: 100×100 matrices are too small to split, and an
    # extra thread only adds waits, which a busy machine turns into whole scheduler
    # slices. None keeps the rank's share that init_rank set.
    threads: int | None = 1

    @classmethod
    def quick(cls, **changes: Any) -> FrankeConfig:
        """A small run for tests and notebooks: 512 points, 2 epochs."""
        base = cls(n_points=512, n_test=256, batch_size=64, epochs=2)
        return dataclasses.replace(base, **changes)


@dataclass(frozen=True)
class MNISTConfig:
    """The VAE run; the defaults are the source's configuration (``main_mnist.py``).

    The source trains on the first 10,000 images of the training split for 300
    epochs, Adam (lr 1e-3, weight decay 1e-5) with ExponentialLR(0.98) per epoch,
    seed 12345. Its ``--train-batch-size`` (default 256) is the *global* batch,
    divided by the number of ranks; the runs in its README grow it with the GPUs
    (128 on 2, 512 on 8: 64 per GPU), which is the blog's "bigger batch with more
    GPUs". Here ``batch_size`` is per rank in weak scaling and global in strong
    scaling; the default, 64 per rank in weak scaling, is the README's runs, and at
    4 ranks it is the source's default global batch of 256.

    Evaluation is always on images the model never trains on: the first ``n_eval``
    images of the test split (the source's ``--ntest`` validation set, 1,000 images).
    With ``split="train"`` the training images are the training split's first
    ``limit``; with ``split="test"`` they are the ``limit`` test images *after* the
    held-out ones, so the test split serves both without overlap.

    ``quick()`` is the minutes-scale run the tests and notebooks use: the test split
    (the only split an offline machine may have, and a smaller download), fewer images
    and epochs, the same held-out images.
    """

    split: str = "train"
    limit: int | None = 10_000  # the source's --ntrain: the first 10,000 training images
    n_eval: int = 1_000  # held out: the first n_eval test images (the source's --ntest)
    data_dir: str | None = None  # None: the folders pcourse.workloads.mnist.resolve_dir tries
    latent: int = 2
    batch_size: int = 64
    epochs: int = 300
    lr: float = 1e-3
    weight_decay: float = 1e-5
    gamma: float = 0.98  # ExponentialLR, stepped once per epoch
    seed: int = 12345
    scaling: str = "weak"
    dtype: str = "float32"
    threads: int | None = None  # keep init_rank's share of the cores: 784×512 layers use them

    @classmethod
    def quick(cls, **changes: Any) -> MNISTConfig:
        """Test images 1,000 to 3,047 for training (the first 1,000 held out), 2 epochs,
        batch 128."""
        base = cls(split="test", limit=2048, epochs=2, batch_size=128)
        return dataclasses.replace(base, **changes)


# What the training loop takes: one workload's configuration, frozen, every field typed.
WorkloadConfig = FrankeConfig | MNISTConfig
CONFIGS: dict[str, type[WorkloadConfig]] = {"franke": FrankeConfig, "mnist": MNISTConfig}


def check_config(name: str, config: object) -> None:
    """A clear error where ``config`` is not the named workload's configuration."""
    want = CONFIGS[name]
    if not isinstance(config, want):
        raise TypeError(f"workload {name!r} takes a {want.__name__} (e.g. "
                        f"{want.__name__}.quick()), got {type(config).__name__}")


def batch_sizes(scaling: str, batch_size: int, size: int, n_train: int) -> tuple[int, int]:
    """(per-rank batch, global batch) for a scaling mode; a clear error if it cannot work."""
    if scaling == "strong":
        if batch_size % size:
            raise ValueError(
                f"strong scaling splits the global batch of {batch_size} equally over "
                f"{size} ranks; choose a batch size divisible by the number of ranks"
            )
        local, global_ = batch_size // size, batch_size
    elif scaling == "weak":
        local, global_ = batch_size, batch_size * size
    else:
        raise ValueError(f"unknown scaling {scaling!r}; use 'strong' or 'weak'")
    if n_train < size:
        raise ValueError(f"{size} ranks but only {n_train} training samples: use fewer ranks")
    return local, global_
