"""Put a lesson or exercise back as the course shipped it, keeping the learner's version.

``python -m pcourse.tools.workshop.reset notebooks/05_franke.ipynb [more ...]`` (also
``pcourse-reset``, and ``make reset NB=...``). A learner who broke a notebook, or wants
an exercise fresh, gets the shipped version back; everything else they wrote stays
as it is, and the version replaced is kept under ``backups/`` with the time of the reset.

Where the shipped version comes from, in order:

1. the course is a git checkout and the notebook is tracked: its version at ``HEAD``;
2. otherwise, the copy ``make lab`` took when it first opened the course
   (``.pcourse/shipped/``, see :func:`snapshot`): a course unpacked from an archive has
   no history, so its first state is kept before anyone edits it.
"""

from __future__ import annotations

import argparse
import datetime
import shutil
import subprocess
import sys
from pathlib import Path

from pcourse.tools.workshop.course import FOLDERS
from pcourse.utils.io import atomic_write

SHIPPED = Path(".pcourse") / "shipped"  # the first-seen copy, for courses outside git
BACKUPS = Path("backups")


class ResetError(RuntimeError):
    """The notebook cannot be reset; the message says why and what to do."""


def course_root(path: Path) -> Path:
    """The course folder holding ``path``: the nearest parent with notebooks/ and exercises/."""
    for parent in path.resolve().parents:
        if (parent / "notebooks").is_dir() and (parent / "exercises").is_dir():
            return parent
    raise ResetError(f"{path} is not inside the course (no notebooks/ and exercises/ above it).")


def _relative(path: Path, root: Path) -> Path:
    rel = path.resolve().relative_to(root)
    if rel.suffix != ".ipynb" or len(rel.parts) != 2 or rel.parts[0] not in FOLDERS:
        raise ResetError(f"{rel} is not a lesson, exercise or solution: only notebooks "
                         f"directly in {', '.join(FOLDERS)} can be reset.")
    return rel


def _git(root: Path, *args: str) -> bytes | None:
    """Output of a git command in ``root``; None when it fails or there is no git."""
    try:
        result = subprocess.run(["git", "-C", str(root), *args], capture_output=True,
                                timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return result.stdout if result.returncode == 0 else None


def _from_git(root: Path, rel: Path) -> bytes | None:
    """The notebook as committed at HEAD, or None when git does not know it."""
    return _git(root, "show", f"HEAD:./{rel.as_posix()}")


def shipped(root: Path, rel: Path) -> bytes:
    """The shipped bytes of notebook ``rel`` (relative to the course root)."""
    content = _from_git(root, rel)
    if content is not None:
        return content
    copy = root / SHIPPED / rel
    if copy.exists():
        return copy.read_bytes()
    raise ResetError(
        f"no shipped version of {rel}: the course is not a git checkout and has no copy "
        f"in {SHIPPED}/ (taken by `make lab` the first time it runs). Download the course "
        "again, or ask your instructor for the notebook.")


def snapshot(root: Path) -> int:
    """Copy every course notebook into .pcourse/shipped/, unless a copy exists already.

    Only for a course outside git (git keeps its own history) and only the first time:
    later, the learner's edits would overwrite what the copy is for. Returns the number
    of notebooks copied.
    """
    if (root / SHIPPED).exists() or _git(root, "rev-parse", "--is-inside-work-tree"):
        return 0
    copied = 0
    for folder in FOLDERS:
        for path in sorted((root / folder).glob("*.ipynb")):
            target = root / SHIPPED / folder / path.name
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(path, target)
            copied += 1
    return copied


def reset(path: Path, now: datetime.datetime | None = None) -> str:
    """Restore one notebook; back up the version it replaces. Returns what it did."""
    root = course_root(path)
    rel = _relative(path, root)
    content = shipped(root, rel)
    target = root / rel
    if target.exists() and target.read_bytes() == content:
        return f"{rel}: already as shipped; nothing to do"
    note = ""
    if target.exists():
        stamp = (now or datetime.datetime.now()).strftime("%Y%m%d-%H%M%S")
        backup = root / BACKUPS / rel.parent / f"{rel.stem}-{stamp}{rel.suffix}"
        backup.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(target, backup)
        note = f"; your version is in {backup.relative_to(root)}"
    with atomic_write(target, "wb") as f:
        f.write(content)
    return f"{rel}: restored as shipped{note}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("notebooks", nargs="*", type=Path,
                        help="notebooks to reset, e.g. notebooks/05_franke.ipynb")
    parser.add_argument("--snapshot", metavar="COURSE", type=Path,
                        help="keep a shipped copy of every notebook of the course in COURSE "
                             "(make lab does this; only outside git, only the first time)")
    args = parser.parse_args(argv)
    if args.snapshot:
        copied = snapshot(args.snapshot.resolve())
        if copied:
            print(f"kept the shipped version of {copied} notebooks in {SHIPPED}/ for "
                  "`make reset`")
    if not args.notebooks and not args.snapshot:
        parser.error("name the notebook to reset, e.g. notebooks/05_franke.ipynb")
    status = 0
    for path in args.notebooks:
        try:
            print(reset(path))
        except ResetError as exc:
            print(f"cannot reset {path}: {exc}", file=sys.stderr)
            status = 1
    if args.notebooks and status == 0:
        print("If the notebook is open in JupyterLab: File > Reload Notebook from Disk "
              "(saving the open tab would write your version back).")
    return status


if __name__ == "__main__":
    sys.exit(main())
