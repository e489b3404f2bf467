"""Results files: atomic, with the user's umask, and temp files of dead writers swept."""

from __future__ import annotations

import csv
import os
import signal
import socket
import stat
import subprocess
import sys
import time
from pathlib import Path

import pytest

from pcourse.utils import io
from pcourse.utils.io import atomic_write, write_csv

ROWS = [{"a": 1, "b": 2.5}, {"a": 3, "b": -1.0}]


def _read(path: Path) -> list[dict]:
    with open(path, newline="") as f:
        return list(csv.DictReader(f))


@pytest.mark.parametrize("umask", [0o022, 0o027, 0o077])
def test_new_and_rewritten_files_get_the_users_umask(tmp_path: Path, umask: int) -> None:
    out = tmp_path / "results" / "run.csv"
    old = os.umask(umask)
    try:
        modes = []
        for _ in range(2):  # written, then rewritten
            write_csv(out, ROWS, ["a", "b"])
            modes.append(stat.S_IMODE(out.stat().st_mode))
    finally:
        os.umask(old)
    assert modes == [0o666 & ~umask] * 2  # what `open(path, "w")` would have made


WRITER = """
import sys, time
from pcourse.utils.io import atomic_write
with atomic_write(sys.argv[1]) as f:
    f.write("half a result")
    f.flush()
    print("writing", flush=True)
    time.sleep(600)
"""


def test_a_killed_write_leaves_a_temp_file_that_the_next_write_removes(tmp_path: Path) -> None:
    out = tmp_path / "run.csv"
    writer = subprocess.Popen([sys.executable, "-c", WRITER, str(out)], stdout=subprocess.PIPE,
                              text=True)
    assert writer.stdout.readline() == "writing\n"
    still_writing = _temps(tmp_path)
    assert len(still_writing) == 1 and not out.exists()
    write_csv(tmp_path / "other.csv", ROWS, ["a", "b"])  # a live writer's file is left alone
    assert _temps(tmp_path) == still_writing
    writer.send_signal(signal.SIGKILL)
    writer.wait()
    # Files that are not ours, or whose writer may still be at work, are kept too.
    keep = [tmp_path / ".notes.tmp", tmp_path / "run.csv.tmp",
            tmp_path / f".other.csv.{os.getppid()}@{socket.gethostname()}.0123abcd.tmp",
            tmp_path / ".other.csv.1@elsewhere.0123abcd.tmp"]
    for path in keep:
        path.write_text("not ours to delete")
    write_csv(out, ROWS, ["a", "b"])  # the next write to the folder sweeps
    assert _temps(tmp_path) == sorted(p.name for p in keep if p.name.startswith("."))
    assert all(p.exists() for p in keep)
    old = keep[3]
    os.utime(old, (time.time() - 3 * 86400,) * 2)  # three days old: stale wherever it came from
    assert io.sweep_temp_files(tmp_path) == [old]
    assert _read(out) == [{"a": "1", "b": "2.5"}, {"a": "3", "b": "-1.0"}]


def _temps(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.iterdir() if p.name.startswith("."))


def test_a_failed_write_leaves_the_old_file_and_no_temp(tmp_path: Path) -> None:
    out = tmp_path / "run.txt"
    out.write_text("old")
    with pytest.raises(RuntimeError), atomic_write(out) as f:
        f.write("new, half")
        raise RuntimeError("the benchmark crashed mid-write")
    assert out.read_text() == "old" and _temps(tmp_path) == []
