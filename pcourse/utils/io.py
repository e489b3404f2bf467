"""Write results files atomically: a crash mid-write never leaves a partial file.

Benchmarks run for minutes and may be interrupted; a CSV that half-exists is worse
than none, because a later plot would silently use it. So every results file is
written to a temporary file in the same folder and moved into place with
``os.replace``, which is atomic on POSIX and Windows.

A writer killed mid-write cannot remove its temporary file, so each one is named
after its writer (``.results.csv.<pid>@<host>.<random>.tmp``) and every later write
to the folder removes those whose writer is gone. Files are created as ``open``
creates them, so they get the user's umask, not the 0600 of ``mkstemp``.
"""

from __future__ import annotations

import argparse
import csv
import os
import re
import secrets
import socket
import sys
import tempfile
import time
from collections.abc import Callable, Iterable, Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import IO, Any

# A temporary file older than this is stale even when its writer cannot be checked
# (another host on a shared file system): no results file takes a day to write.
STALE_AFTER = 24 * 3600.0
_TEMP = re.compile(r"^\.(?P<name>.+)\.(?P<pid>\d+)@(?P<host>[^@/]+)\.[0-9a-f]{8}\.tmp$")


@contextmanager
def atomic_write(path: str | os.PathLike[str], mode: str = "w", **kwargs: Any) -> Iterator[IO]:
    """Open a temporary file beside ``path``; on success, move it onto ``path``."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    sweep_temp_files(path.parent)
    tmp, fd = _create_temp(path)
    try:
        with os.fdopen(fd, mode, **kwargs) as f:
            yield f
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def _create_temp(path: Path) -> tuple[Path, int]:
    """A new file beside ``path``, named after this process, mode 0666 less the umask."""
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_BINARY", 0)
    owner = f"{os.getpid()}@{socket.gethostname()}"
    while True:
        tmp = path.with_name(f".{path.name}.{owner}.{secrets.token_hex(4)}.tmp")
        try:
            return tmp, os.open(tmp, flags, 0o666)
        except FileExistsError:  # 32 random bits taken: draw again
            continue


def sweep_temp_files(
    folder: str | os.PathLike[str], stale_after: float = STALE_AFTER
) -> list[Path]:
    """Remove this module's temporary files in ``folder`` that no write will finish.

    Only files named as :func:`atomic_write` names them, and only those whose writer
    (a process on this host) has exited, or that are older than ``stale_after``
    seconds. Returns what was removed.
    """
    here, now = socket.gethostname(), time.time()
    removed: list[Path] = []
    try:
        entries = list(os.scandir(folder))
    except OSError:
        return removed
    for entry in entries:
        match = _TEMP.match(entry.name)
        if match is None or not entry.is_file(follow_symlinks=False):
            continue
        try:
            age = now - entry.stat(follow_symlinks=False).st_mtime
        except OSError:  # removed meanwhile
            continue
        orphaned = match["host"] == here and not _alive(int(match["pid"]))
        if orphaned or age > stale_after:
            try:
                os.unlink(entry.path)
                removed.append(Path(entry.path))
            except OSError:
                pass
    return removed


def _alive(pid: int) -> bool:
    if pid == os.getpid():
        return True  # another thread of ours may be writing it right now
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process
        return True
    return True


def course_folder(path: str | os.PathLike[str] | None = None) -> Path:
    """The course's folder, the one holding ``notebooks/`` and ``solutions/``: ``path``,
    else the current folder. The tools look for the course there, never where pcourse is
    installed, so that a non-editable ``pip install .`` works as well as a checkout."""
    root = Path(path if path is not None else os.getcwd()).resolve()
    if not (root / "notebooks").is_dir() and not (root / "solutions").is_dir():
        raise ValueError(f"{root} is not the course's folder (it has no notebooks/ and no "
                         "solutions/): run this from the course's folder, or pass --course")
    return root


def course_from(parser: argparse.ArgumentParser, path: str | os.PathLike[str] | None) -> Path:
    """:func:`course_folder` for a command line: ``parser.error`` (exit 2) if it is not one."""
    try:
        return course_folder(path)
    except ValueError as exc:
        parser.error(str(exc))  # exits


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


class NotWritable(ValueError):
    """Results could not be written where they were asked for; the message says why."""


def check_writable(path: str | os.PathLike[str], kind: str = "folder") -> None:
    """Make sure results can be written under ``path`` (a folder, or a file's folder).

    Checked before any rank starts, so that hours of measuring are never lost to a
    typo. Creates nothing: it probes the nearest existing folder.
    """
    target = Path(path).expanduser().absolute()
    if kind == "file" and target.is_dir():
        raise NotWritable(f"{path} is a folder; give a file name")
    if kind == "folder" and target.exists() and not target.is_dir():
        raise NotWritable(f"{path} exists and is not a folder")
    folder = target.parent if kind == "file" else target
    while not folder.exists():
        folder = folder.parent
    if not folder.is_dir():
        raise NotWritable(f"cannot write under {path}: {folder} is a file, not a folder")
    try:
        with tempfile.TemporaryFile(dir=folder):
            pass
    except OSError as exc:
        raise NotWritable(f"cannot write results under {path}: {folder} is not writable "
                         f"({exc.strerror}); choose another --out") from None


def save(path: str | os.PathLike[str], write: Callable[[Path], object]) -> Path:
    """``write(path)``; if that fails, the same file in a fresh temp folder, saying so.

    A late error (the disk filled up, the folder went away) must not lose what the
    benchmark measured. Returns where the file went.
    """
    target = Path(path)
    try:
        write(target)
        return target
    except OSError as exc:
        fallback = Path(tempfile.mkdtemp(prefix="pcourse-results-")) / target.name
        write(fallback)
        print(f"could not write {target} ({exc}); wrote {fallback} instead", file=sys.stderr)
        return fallback
