"""Write results files atomically: a crash mid-write never leaves a partial file.

Benchmarks run for minutes and may be interrupted; a CSV that half-exists is worse
than none, because a later plot would silently use it. So every results file is
written to a temporary file in the same folder and moved into place with
``os.replace``, which is atomic on POSIX and Windows.
"""

from __future__ import annotations

import csv
import os
import tempfile
from collections.abc import Iterable, Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import IO, Any


@contextmanager
def atomic_write(path: str | os.PathLike[str], mode: str = "w", **kwargs: Any):
    """Open a temporary file beside ``path``; on success, move it onto ``path``."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, mode, **kwargs) as f:
            yield f
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def write_csv(
    path: str | os.PathLike[str], rows: Iterable[Mapping[str, Any]], fields: list[str]
) -> Path:
    """Write ``rows`` (dicts) as a CSV with the given columns, atomically."""
    f: IO[str]
    with atomic_write(path, newline="") as f:
        writer = csv.DictWriter(f, fieldnames=fields)
        writer.writeheader()
        for row in rows:
            writer.writerow({k: row.get(k, "") for k in fields})
    return Path(path)


def savefig_atomic(fig: Any, path: str | os.PathLike[str], **kwargs: Any) -> Path:
    """Save a matplotlib figure atomically (format from the path's suffix)."""
    path = Path(path)
    kwargs.setdefault("format", path.suffix.lstrip(".") or "png")
    with atomic_write(path, "wb") as f:
        fig.savefig(f, **kwargs)
    return path
