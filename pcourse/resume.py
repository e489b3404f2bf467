"""A checkpoint every rank writes, that resumes a run exactly (lesson 14).

A run resumes *exactly* when everything the next step reads comes back: the weights, the
optimizer's state and the schedule's rate, every generator the step draws from (torch's,
numpy's, Python's), and the data's position (epoch, batch, and the partitioner's seed:
epoch e reshuffles with ``seed + e``, lesson 02). Each rank writes what it holds, its own
shard (a ZeRO-1 rank its slice of the optimizer's state, lesson 10): nobody gathers it all.

A checkpoint is a folder ``step-00000042/``: one file per rank (``rank00000.pt``), then
``manifest.json``, written by rank 0 once every rank's file is on disk. Each file goes
under a temporary name, is fsynced and renamed (:func:`pcourse.utils.io.atomic_write`),
the manifest last: a folder without one is a write that never finished, and is skipped.
The manifest holds each file's length and SHA-256, the world size and the model's shapes,
so a truncated file, another model or another world size is refused, naming the file.

Loading reads and checks everything, the ranks agree, and only then is the state applied:
an error on one rank is the same error on every rank, and nothing is half loaded. Nothing
is unpickled: shards are read with ``torch.load(weights_only=True)``, the manifest is JSON.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import random
import re
import shutil
from collections.abc import Iterable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from pcourse.backends.base import Backend
from pcourse.reshard import recut
from pcourse.utils.io import atomic_write

__all__ = ["PARTS", "CheckpointError", "Progress", "latest", "load", "rng_state", "save",
           "set_rng_state"]

FORMAT = 1
MANIFEST = "manifest.json"
PARTS = ("model", "optimizer", "rng", "position")  # what load restores; `forget` drops some
_FOLDER = re.compile(r"^step-(\d{8})$")
_MESSAGE = 1024  # bytes of an error message sent to every rank


class CheckpointError(RuntimeError):
    """A checkpoint cannot be saved or loaded; raised on every rank, naming the file."""


@dataclass
class Progress:
    """Where the run is: updates done, the next batch, and the losses so far."""

    step: int = 0
    epoch: int = 0
    batch: int = 0  # the next batch of ``epoch``
    seed: int = 0  # the partitioner's: epoch e reshuffles with seed + e
    losses: list[float] = field(default_factory=list)  # one per step, all ranks' mean


def rng_state() -> dict[str, Any]:
    """torch's, numpy's and Python's global generators, as tensors and plain numbers
    (what ``torch.load(weights_only=True)`` reads back: no numpy objects, no pickle)."""
    _, keys, pos, has_gauss, gauss = np.random.get_state(legacy=True)  # MT19937's tuple
    assert isinstance(keys, np.ndarray)  # legacy=True: the key is an array, never a str
    version, words, gauss_next = random.getstate()
    return {"torch": torch.get_rng_state(),
            "numpy": {"keys": torch.from_numpy(keys.astype(np.int64)), "pos": int(pos),
                      "has_gauss": int(has_gauss), "gauss": float(gauss)},
            "python": {"version": version, "words": torch.tensor(words, dtype=torch.int64),
                       "gauss": gauss_next}}


def set_rng_state(state: dict[str, Any]) -> None:
    """Put the three generators back where :func:`rng_state` found them."""
    torch.set_rng_state(state["torch"])
    n = state["numpy"]
    np.random.set_state(("MT19937", n["keys"].numpy().astype(np.uint32), n["pos"],
                         n["has_gauss"], n["gauss"]))
    p = state["python"]
    random.setstate((p["version"], tuple(p["words"].tolist()), p["gauss"]))


def _signature(model: nn.Module) -> dict[str, list]:
    """Each tensor of the model's state: its shape and dtype (what "the same model" means)."""
    return {k: [list(v.shape), str(v.dtype)] for k, v in model.state_dict().items()}


def _hyper(optimizer: torch.optim.Optimizer) -> list[dict[str, Any]]:
    """The optimizer's param groups less the parameters: the rate a schedule set. Saved
    apart, because a ZeRO-1 optimizer's ``state_dict`` holds only its local shard's."""
    return [{k: v for k, v in g.items() if k != "params"} for g in optimizer.param_groups]


def _fsync_folder(folder: Path) -> None:
    """A rename is durable once its folder is: fsync the folder too."""
    fd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _agree(backend: Backend, error: str | None, what: str) -> None:
    """Collective: if ``error`` is set on any rank, raise it on every rank (the lowest
    failing rank's message, and how many failed), so that no rank goes on alone."""
    failed = torch.zeros(backend.size, dtype=torch.int64)
    failed[backend.rank] = error is not None
    backend.allreduce(failed, "sum", check=False)
    if not failed.any():
        return
    first = int(failed.nonzero()[0])
    text = torch.zeros(_MESSAGE, dtype=torch.uint8)
    if backend.rank == first:
        raw = (error or "").encode()[:_MESSAGE]
        text[:len(raw)] = torch.frombuffer(bytearray(raw), dtype=torch.uint8)
    backend.broadcast(text, first, check=False)
    message = bytes(text.tolist()).rstrip(b"\0").decode(errors="replace")
    others = int(failed.sum()) - 1
    raise CheckpointError(f"{what} failed on rank {first}: {message}"
                          + (f" (and on {others} more rank(s))" if others else ""))


def save(root: str | os.PathLike[str], backend: Backend, model: nn.Module,
         optimizer: torch.optim.Optimizer, progress: Progress, scheduler: Any = None,
         *, keep: int | None = 2) -> Path:
    """Collective: every rank writes its shard of step ``progress.step`` under ``root``,
    then rank 0 the manifest. Returns the checkpoint's folder. ``keep``: how many
    complete checkpoints to leave (older ones are removed after the new one is whole)."""
    folder = Path(root) / f"step-{progress.step:08d}"
    name = f"rank{backend.rank:05d}.pt"
    buffer = io.BytesIO()
    torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict(),
                "hyper": _hyper(optimizer),
                "scheduler": scheduler.state_dict() if scheduler is not None else None,
                "rng": rng_state(), "progress": asdict(progress)}, buffer)
    data = buffer.getvalue()
    error = None
    try:
        with atomic_write(folder / name, "wb") as f:  # temporary name, fsync, rename
            f.write(data)
        _fsync_folder(folder)
    except OSError as exc:
        error = f"{folder / name}: {exc.strerror or exc}"
    _agree(backend, error, f"saving {folder}")
    # Every rank's length and hash, to rank 0: row r is rank r's (8 words of SHA-256, bytes).
    table = torch.zeros(backend.size, 9, dtype=torch.int64)
    digest = np.frombuffer(hashlib.sha256(data).digest(), dtype=">u4").astype(np.int64)
    table[backend.rank, :8], table[backend.rank, 8] = torch.from_numpy(digest), len(data)
    backend.allreduce(table, "sum", check=False)
    error = None
    if backend.rank == 0:
        files = {f"rank{r:05d}.pt": {"bytes": int(row[8]), "sha256": b"".join(
            int(w).to_bytes(4, "big") for w in row[:8]).hex()} for r, row in enumerate(table)}
        manifest = {"format": FORMAT, "step": progress.step, "world_size": backend.size,
                    "optimizer": type(optimizer).__name__, "model": _signature(model),
                    "files": files}
        try:
            with atomic_write(folder / MANIFEST, "w") as f:  # last: now the folder is whole
                json.dump(manifest, f, indent=1)
            _fsync_folder(folder)
            for old in _complete(Path(root))[keep:] if keep is not None else []:
                (old / MANIFEST).unlink()  # first: from now on the folder is ignored
                shutil.rmtree(old)
        except OSError as exc:
            error = f"{folder / MANIFEST}: {exc.strerror or exc}"
    _agree(backend, error, f"saving {folder}")
    return folder


def _complete(root: Path) -> list[Path]:
    """The checkpoint folders under ``root`` that hold a manifest, newest first."""
    return [f for f in _folders(root) if (f / MANIFEST).is_file()]


def _folders(root: Path) -> list[Path]:
    found = [p for p in root.iterdir() if _FOLDER.match(p.name) and p.is_dir()]
    return sorted(found, key=lambda p: p.name, reverse=True)


def latest(root: str | os.PathLike[str]) -> tuple[Path, list[str]]:
    """The newest complete checkpoint under ``root``, and why each newer folder was
    skipped. CheckpointError if the folder is missing or holds no complete checkpoint."""
    root = Path(root)
    if not root.is_dir():
        raise CheckpointError(f"{root}: no such folder, so no checkpoint to resume from")
    skipped: list[str] = []
    for folder in _folders(root):
        if (folder / MANIFEST).is_file():
            return folder, skipped
        skipped.append(f"{folder.name}: no {MANIFEST} (a write that did not finish)")
    raise CheckpointError(f"{root}: no complete checkpoint"
                          + (f" ({'; '.join(skipped)})" if skipped else " (the folder is empty)"))


def _manifest(folder: Path, size: int, model: nn.Module, optimizer: torch.optim.Optimizer,
              reshard: bool) -> dict[str, Any]:
    """``folder``'s manifest, checked against this job; ValueError naming the file where
    anything disagrees."""
    path = folder / MANIFEST
    try:
        manifest = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise ValueError(f"{path}: not a manifest this course wrote ({exc})") from None
    if manifest.get("format") != FORMAT:
        raise ValueError(f"{path}: format {manifest.get('format')!r}, expected {FORMAT}")
    if manifest["world_size"] != size and not reshard:
        raise ValueError(f"{path}: written by {manifest['world_size']} ranks, this job has "
                         f"{size}; resuming at another world size needs resharding "
                         "(load(..., reshard=True))")
    theirs, ours = manifest["model"], _signature(model)
    if theirs != ours:
        diff = sorted(set(theirs) ^ set(ours)) or [k for k in ours if theirs[k] != ours[k]]
        raise ValueError(f"{path}: another model (first difference: {diff[0]!r}, "
                         f"{theirs.get(diff[0])} there, {ours.get(diff[0])} here)")
    if manifest["optimizer"] != type(optimizer).__name__:
        raise ValueError(f"{path}: saved from a {manifest['optimizer']}, "
                         f"not a {type(optimizer).__name__}")
    return manifest


def _shard(folder: Path, rank: int, manifest: dict[str, Any]) -> dict[str, Any]:
    """Rank ``rank``'s file of ``folder``, checked against the manifest (its length and
    hash) and read as data only; ValueError naming the file."""
    name = f"rank{rank:05d}.pt"
    want, shard = manifest["files"][name], folder / name
    try:
        data = shard.read_bytes()
    except OSError as exc:
        raise ValueError(f"{shard}: {exc.strerror or exc}") from None
    if len(data) != want["bytes"]:
        raise ValueError(f"{shard}: {len(data)} bytes, the manifest says {want['bytes']} "
                         "(truncated or overwritten)")
    if hashlib.sha256(data).hexdigest() != want["sha256"]:
        raise ValueError(f"{shard}: its SHA-256 differs from the manifest's (changed since)")
    try:
        return torch.load(io.BytesIO(data), weights_only=True)
    except Exception as exc:  # noqa: BLE001 - any refusal (pickle's too) names the file
        raise ValueError(f"{shard}: not a shard torch reads as data only "
                         f"({type(exc).__name__}: {str(exc).splitlines()[0][:200]})") from None


def _read(folder: Path, rank: int, size: int, model: nn.Module,
          optimizer: torch.optim.Optimizer, reshard: bool = False
          ) -> tuple[dict[str, Any], int]:
    """This rank's shard of ``folder``, checked against the manifest; ValueError naming
    the file where anything disagrees, and the number of ranks that wrote it. Reads only:
    nothing is applied here. Written by another number of ranks (``reshard``): every old
    rank's file, re-cut for this rank (:func:`pcourse.reshard.recut`)."""
    manifest = _manifest(folder, size, model, optimizer, reshard)
    if manifest["world_size"] == size:
        return _shard(folder, rank, manifest), size
    old = [_shard(folder, r, manifest) for r in range(manifest["world_size"])]
    return recut(old, rank, size, optimizer), len(old)


def load(root: str | os.PathLike[str], backend: Backend, model: nn.Module,
         optimizer: torch.optim.Optimizer, scheduler: Any = None, *,
         forget: Iterable[str] = (), check: bool = True,
         reshard: bool = False) -> tuple[Progress, str]:
    """Collective: restore the newest complete checkpoint under ``root``; returns the
    run's :class:`Progress` and a line saying which checkpoint, and what was skipped.

    ``forget`` (some of :data:`PARTS`) leaves those parts as they are (the position:
    the run starts its data over, at epoch 0), to show what each is for. ``check=False``
    is the loader a torn write fools: the newest folder, manifest or not, each rank's
    file unchecked, the position read from rank 0's file. ``reshard=True`` resumes a
    checkpoint written by another number of ranks (:mod:`pcourse.reshard`); without it,
    that is an error naming the manifest.
    """
    forget = set(forget)
    if forget - set(PARTS):
        raise ValueError(f"forget takes some of {PARTS}, got {sorted(forget)}")
    root = Path(root)
    error, shard, said = None, None, ""
    try:
        if check:
            folder, skipped = latest(root)
            shard, wrote = _read(folder, backend.rank, backend.size, model, optimizer, reshard)
            said = f"resumed from {folder.name}" + (
                f" (written by {wrote} ranks, re-cut for {backend.size})"
                if wrote != backend.size else "") + "".join(f"; skipped {s}" for s in skipped)
        else:
            folder = _folders(root)[0]
            shard = torch.load(folder / f"rank{backend.rank:05d}.pt", weights_only=True)
            shard["progress"] = torch.load(folder / "rank00000.pt",
                                           weights_only=True)["progress"]
            said = f"resumed from {folder.name}, unchecked"
    except (OSError, ValueError, RuntimeError, IndexError, KeyError, TypeError) as exc:
        error = str(exc) if isinstance(exc, ValueError | CheckpointError) else \
            f"{root}: {type(exc).__name__}: {exc}"
    _agree(backend, error, f"loading a checkpoint from {root}")
    assert shard is not None
    if "model" not in forget:
        model.load_state_dict(shard["model"])
    if "optimizer" not in forget:
        optimizer.load_state_dict(shard["optimizer"])
        for group, saved in zip(optimizer.param_groups, shard["hyper"], strict=True):
            group.update(saved)
        if scheduler is not None and shard["scheduler"] is not None:
            scheduler.load_state_dict(shard["scheduler"])
    if "rng" not in forget and shard["rng"] is not None:  # None: a rank new to the job
        set_rng_state(shard["rng"])
    progress = Progress(**shard["progress"])
    if "position" in forget:
        progress.epoch = progress.batch = 0
    return progress, said
