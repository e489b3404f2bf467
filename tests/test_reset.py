"""Resetting a learner's notebook: the shipped version back, theirs kept, nothing else touched."""

from __future__ import annotations

import datetime
import subprocess
import sys
from pathlib import Path

import pytest

from pcourse.tools.workshop import reset

NOW = datetime.datetime(2026, 1, 2, 3, 4, 5)
SHIPPED = {"notebooks/05_franke.ipynb": b'{"shipped": "lesson"}\n',
           "exercises/01_partitioner.ipynb": b'{"shipped": "exercise"}\n',
           "solutions/01_partitioner.ipynb": b'{"shipped": "solution"}\n'}


def _course(tmp: Path, git: bool) -> Path:
    root = tmp / "course"
    for rel, content in SHIPPED.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_bytes(content)
    (root / "README.md").write_text("course\n")
    if git:
        run = ["git", "-C", str(root), "-c", "user.name=t", "-c", "user.email=t@t.invalid"]
        subprocess.run([*run[:3], "init", "-q"], check=True)
        subprocess.run([*run, "add", "-A"], check=True)
        subprocess.run([*run, "commit", "-qm", "shipped"], check=True)
    else:
        assert reset.snapshot(root) == len(SHIPPED)
    return root


def _learner_edits(root: Path) -> None:
    for rel in SHIPPED:
        (root / rel).write_bytes(b'{"learner": "' + rel.encode() + b'"}\n')
    (root / "notebooks" / "my_notes.ipynb").write_text("mine")


@pytest.mark.parametrize("git", [True, False], ids=["git checkout", "unpacked archive"])
def test_reset_restores_one_notebook_and_keeps_the_learners(tmp_path, git):
    root = _course(tmp_path, git)
    _learner_edits(root)
    lesson = root / "notebooks" / "05_franke.ipynb"
    said = reset.reset(lesson, now=NOW)
    assert lesson.read_bytes() == SHIPPED["notebooks/05_franke.ipynb"]
    backup = root / "backups" / "notebooks" / "05_franke-20260102-030405.ipynb"
    assert backup.read_bytes() == b'{"learner": "notebooks/05_franke.ipynb"}\n'
    assert str(backup.relative_to(root)) in said
    # everything else is as the learner left it
    for rel in SHIPPED:
        if rel != "notebooks/05_franke.ipynb":
            assert (root / rel).read_bytes() == b'{"learner": "' + rel.encode() + b'"}\n'
    assert (root / "notebooks" / "my_notes.ipynb").read_text() == "mine"
    # once more: nothing to do, no second backup
    assert "nothing to do" in reset.reset(lesson, now=NOW.replace(second=6))
    assert len(list((root / "backups").rglob("*.ipynb"))) == 1


def test_a_deleted_notebook_comes_back_without_a_backup(tmp_path):
    root = _course(tmp_path, git=True)
    exercise = root / "exercises" / "01_partitioner.ipynb"
    exercise.unlink()
    reset.reset(exercise, now=NOW)
    assert exercise.read_bytes() == SHIPPED["exercises/01_partitioner.ipynb"]
    assert not (root / "backups").exists()


def test_snapshot_is_taken_once_and_only_outside_git(tmp_path):
    root = _course(tmp_path, git=False)
    _learner_edits(root)
    assert reset.snapshot(root) == 0  # the first-seen copy is never overwritten by edits
    assert (root / reset.SHIPPED / "notebooks" / "05_franke.ipynb").read_bytes() == \
        SHIPPED["notebooks/05_franke.ipynb"]
    in_git = _course(tmp_path / "g", git=True)
    assert reset.snapshot(in_git) == 0 and not (in_git / reset.SHIPPED).exists()


@pytest.mark.parametrize("rel, message", [
    ("README.md", "is not a lesson, exercise or solution"),
    ("notebooks/deeper/x.ipynb", "is not a lesson, exercise or solution"),
    ("notebooks/my_notes.ipynb", "no shipped version"),
])
def test_reset_refuses_what_it_cannot_restore(tmp_path, rel, message):
    root = _course(tmp_path, git=True)
    _learner_edits(root)
    with pytest.raises(reset.ResetError, match=message):
        reset.reset(root / rel)
    assert (root / "notebooks" / "my_notes.ipynb").read_text() == "mine"


def test_reset_refuses_a_file_outside_the_course(tmp_path):
    (tmp_path / "x.ipynb").write_text("{}")
    with pytest.raises(reset.ResetError, match="not inside the course"):
        reset.reset(tmp_path / "x.ipynb")


def test_command_line(tmp_path):
    root = _course(tmp_path, git=False)
    _learner_edits(root)
    cmd = [sys.executable, "-m", "pcourse.tools.workshop.reset"]
    ok = subprocess.run([*cmd, "notebooks/05_franke.ipynb", "exercises/01_partitioner.ipynb"],
                        cwd=root, capture_output=True, text=True, timeout=60)
    assert ok.returncode == 0, ok.stderr
    assert ok.stdout.count("restored as shipped") == 2 and "Reload Notebook from Disk" in ok.stdout
    bad = subprocess.run([*cmd, "README.md"], cwd=root, capture_output=True, text=True,
                         timeout=60)
    assert bad.returncode == 1 and "cannot reset README.md" in bad.stderr
    usage = subprocess.run(cmd, cwd=root, capture_output=True, text=True, timeout=60)
    assert usage.returncode == 2 and "name the notebook" in usage.stderr
