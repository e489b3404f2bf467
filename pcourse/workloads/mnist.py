"""MNIST from its IDX files, gzipped or raw, with checks that catch damaged files.

Where the data lives, the first of (:func:`resolve_dir`): the ``data_dir`` argument,
the ``PCOURSE_MNIST_DIR`` environment variable (``make lab`` and ``make test`` point it
at a ``shared/data/mnist`` folder beside the course, a workshop's or offline machine's
copy, where there is one), then ``~/.cache/pcourse/mnist``. The repository holds no
MNIST files. Files missing from that folder are downloaded into it the ordinary way
where a network is there (``PCOURSE_MNIST_DOWNLOAD=0`` forbids it, for offline CI);
where not, the error names
the files, the folder and how to fix it. A truncated or foreign file is refused with
a clear error rather than turned into a few thousand silently wrong images.

The VAE (:func:`train_and_held_out`) always evaluates on the first 1,000 test images,
the source's validation set, and never trains on them. Full mode trains on the
source's first 10,000 images of the 60,000-image training split; quick mode on test
images after the held-out ones (the test split is the smaller download, and the only
split an offline copy may hold).
"""

from __future__ import annotations

import gzip
import os
import struct
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from pcourse.utils.io import atomic_write

if TYPE_CHECKING:  # torch only where tensors are made: a launcher checks the files without it
    import torch

ENV_VAR = "PCOURSE_MNIST_DIR"
DOWNLOAD_VAR = "PCOURSE_MNIST_DOWNLOAD"  # "0": never try the network
DEFAULT_DIR = Path.home() / ".cache" / "pcourse" / "mnist"
# The usual mirrors (torchvision's list); the original site now often refuses robots.
MIRRORS = (
    "https://ossci-datasets.s3.amazonaws.com/mnist/",
    "https://yann.lecun.com/exdb/mnist/",
)
FILES = {
    "train": ("train-images-idx3-ubyte", "train-labels-idx1-ubyte"),
    "test": ("t10k-images-idx3-ubyte", "t10k-labels-idx1-ubyte"),
}
COUNTS = {"train": 60_000, "test": 10_000}
IMAGE_MAGIC, LABEL_MAGIC = 2051, 2049  # IDX: 0x0803 = uint8, 3 dims; 0x0801 = uint8, 1 dim


class MNISTError(RuntimeError):
    """The MNIST files are missing, damaged or cannot be downloaded; says what to do."""


def resolve_dir(path: str | os.PathLike[str] | None = None) -> Path:
    """The folder MNIST is read from.

    The argument, then $PCOURSE_MNIST_DIR, then the download cache
    (~/.cache/pcourse/mnist). Never a path found from where the package is installed.
    """
    if path is not None:
        return Path(path).expanduser()
    env = os.environ.get(ENV_VAR)
    if env:
        return Path(env).expanduser()
    return DEFAULT_DIR


def _find(folder: Path, name: str) -> Path | None:
    for candidate in (folder / f"{name}.gz", folder / name):
        if candidate.is_file():
            return candidate
    return None


def _read_bytes(path: Path) -> bytes:
    try:
        if path.suffix == ".gz":
            with gzip.open(path, "rb") as f:
                return f.read()
        return path.read_bytes()
    except (EOFError, OSError, gzip.BadGzipFile) as exc:
        raise MNISTError(
            f"{path} cannot be read ({exc}); it is probably truncated or not gzip. "
            "Delete it and download it again (or copy an intact file there)."
        ) from exc


def parse_idx(raw: bytes, magic: int, count: int, where: Path) -> np.ndarray:
    """Check an IDX file's magic number and lengths; return its uint8 array."""
    ndim = magic & 0xFF
    if len(raw) < 4 + 4 * ndim:
        raise MNISTError(f"{where} is too short ({len(raw)} bytes) to be an IDX file")
    got_magic, *dims = struct.unpack(f">{1 + ndim}I", raw[: 4 + 4 * ndim])
    if got_magic != magic:
        raise MNISTError(f"{where}: magic number {got_magic}, expected {magic} (not this IDX file)")
    if dims[0] != count:
        raise MNISTError(f"{where}: header says {dims[0]} items, expected {count}")
    body = raw[4 + 4 * ndim :]
    expected = int(np.prod(dims))
    if len(body) != expected:
        raise MNISTError(
            f"{where} is truncated or padded: {len(body)} data bytes, expected {expected}. "
            "Delete it and download it again."
        )
    return np.frombuffer(body, dtype=np.uint8).reshape(dims)


def download(
    name: str, folder: Path, mirrors: tuple[str, ...] = MIRRORS, timeout: float = 30.0
) -> Path:
    """Fetch ``name``.gz from the first mirror that answers; write it atomically."""
    import urllib.request

    errors = []
    for base in mirrors:
        url = f"{base}{name}.gz"
        try:
            with urllib.request.urlopen(url, timeout=timeout) as response:
                payload = response.read()
            gzip.decompress(payload)  # refuse an HTML error page or a cut-off download
        except Exception as exc:  # noqa: BLE001 - any failure means: try the next mirror
            errors.append(f"{url}: {exc}")
            continue
        target = folder / f"{name}.gz"
        with atomic_write(target, "wb") as f:
            f.write(payload)
        return target
    raise MNISTError("download failed:\n  " + "\n  ".join(errors))


def _locate(name: str, folder: Path, allow_download: bool, **kw: object) -> Path:
    found = _find(folder, name)
    if found:
        return found
    how = (
        f"Put {name}.gz (or {name}) in {folder}, or point ${ENV_VAR} (or data_dir=) at "
        "a folder that has it; with a network, it is downloaded automatically."
    )
    if not allow_download:
        raise MNISTError(f"MNIST file {name}(.gz) not found in {folder}. {how}")
    try:
        return download(name, folder, **kw)  # type: ignore[arg-type]
    except (MNISTError, OSError) as exc:
        raise MNISTError(
            f"MNIST file {name}(.gz) not found in {folder} and could not be downloaded "
            f"({exc}). {how}"
        ) from exc


def read_mnist(
    split: str = "test",
    data_dir: str | os.PathLike[str] | None = None,
    *,
    allow_download: bool | None = None,
    limit: int | None = None,
    **download_kw: object,
) -> tuple[np.ndarray, np.ndarray]:
    """The checked IDX arrays: images uint8 (N, 28, 28) and labels uint8 (N,).

    What :func:`load_mnist` reads, without torch: a launcher checks the files with
    it before starting any rank. Arguments as for :func:`load_mnist`.
    """
    if allow_download is None:
        allow_download = os.environ.get(DOWNLOAD_VAR, "1") != "0"
    if split not in FILES:
        raise ValueError(f"unknown MNIST split {split!r}; use 'train' or 'test'")
    folder = resolve_dir(data_dir)
    img_name, lbl_name = FILES[split]
    img_path = _locate(img_name, folder, allow_download, **download_kw)
    lbl_path = _locate(lbl_name, folder, allow_download, **download_kw)
    images = parse_idx(_read_bytes(img_path), IMAGE_MAGIC, COUNTS[split], img_path)
    labels = parse_idx(_read_bytes(lbl_path), LABEL_MAGIC, COUNTS[split], lbl_path)
    if images.shape[1:] != (28, 28):
        raise MNISTError(f"{img_path}: images are {images.shape[1:]}, expected 28×28")
    if limit is not None:
        images, labels = images[:limit], labels[:limit]
    return images, labels


def load_mnist(
    split: str = "test",
    data_dir: str | os.PathLike[str] | None = None,
    *,
    allow_download: bool | None = None,
    limit: int | None = None,
    **download_kw: object,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Images as float32 (N, 784) in [0, 1] and labels as int64 (N,).

    ``split`` is "test" (10,000 images) or "train" (60,000); ``limit`` keeps the
    first ``limit`` images (quick runs). ``allow_download`` None follows
    $PCOURSE_MNIST_DOWNLOAD (default: yes). ``download_kw``: ``mirrors``, ``timeout``.
    """
    import torch

    images, labels = read_mnist(split, data_dir, allow_download=allow_download, limit=limit,
                                **download_kw)
    x = torch.from_numpy(images.reshape(len(images), -1).astype(np.float32) / 255.0)
    return x, torch.from_numpy(labels.astype(np.int64))


def train_and_held_out(
    split: str, data_dir: str | os.PathLike[str] | None = None, *,
    limit: int | None = None, n_eval: int = 1_000, allow_download: bool | None = None,
) -> tuple[tuple[torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]:
    """((training images, labels), (held-out images, labels)), disjoint, as :func:`load_mnist`.

    Held out: the first ``n_eval`` test images (the source's validation set). Training:
    the first ``limit`` images of ``split``; from the test split, the ``limit`` after
    the held-out ones, so that no image is both trained on and evaluated on.
    """
    if n_eval < 1:
        raise ValueError(f"n_eval must be at least 1 held-out image, got {n_eval}")
    if n_eval >= COUNTS["test"]:
        raise ValueError(f"n_eval={n_eval} holds out the whole test split of {COUNTS['test']}; "
                         "hold out fewer images")
    test_x, test_y = load_mnist("test", data_dir, allow_download=allow_download)
    held = (test_x[:n_eval], test_y[:n_eval])
    if split == "test":
        stop = None if limit is None else n_eval + limit
        return (test_x[n_eval:stop], test_y[n_eval:stop]), held
    return load_mnist(split, data_dir, allow_download=allow_download, limit=limit), held
