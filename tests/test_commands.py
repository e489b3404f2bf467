"""Every command the course prints runs: what a doc or a lesson tells a reader to type.

A record outside the lessons' fingerprints goes stale without a notebook noticing: the
GPU run's README named ``python -m pcourse.bench`` and ``pcourse.checks`` a refactor
after they had moved under ``pcourse.tools``. So every ``python -m pcourse...`` in the
README, INSTRUCTORS.md, CONTRIBUTING.md, ``docs/`` (its Markdown) and the notebooks (their
text and their stored outputs) must name a module that exists, and a benchmark's
subcommand that the benchmark has; in ``make test``, each is also run with ``--help``.
A run's own logs (``docs/**/*.log``) are records of what ran then, and are not read.
"""

from __future__ import annotations

import importlib.util
import re
import subprocess
import sys
from pathlib import Path

import nbformat
import pytest

from pcourse.tools.workshop.course import FOLDERS

REPO = Path(__file__).resolve().parents[1]
COMMAND = re.compile(r"python3? -m (pcourse(?:\.\w+)+)(?:\s+([a-z][\w-]*))?")
BENCH = "pcourse.tools.bench"


def texts() -> dict[str, str]:
    """Where a reader finds commands -> its text."""
    found = {p.name: p.read_text() for p in (REPO / n for n in
             ("README.md", "INSTRUCTORS.md", "CONTRIBUTING.md"))}
    found |= {str(p.relative_to(REPO)): p.read_text() for p in (REPO / "docs").rglob("*.md")}
    for folder in FOLDERS:
        for path in sorted((REPO / folder).glob("*.ipynb")):
            nb = nbformat.read(path, as_version=4)
            parts = [c.source for c in nb.cells]
            parts += ["".join(o.get("text", "")) for c in nb.cells if c.cell_type == "code"
                      for o in c.get("outputs", [])]
            found[str(path.relative_to(REPO))] = "\n".join(parts)
    return found


def commands() -> dict[tuple[str, str], list[str]]:
    """(module, the benchmark's subcommand or "") -> where it is printed."""
    out: dict[tuple[str, str], list[str]] = {}
    for where, text in texts().items():
        for m in COMMAND.finditer(text):
            module = m.group(1).rstrip(".")
            sub = m.group(2) if module == BENCH and m.group(2) else ""
            out.setdefault((module, sub), []).append(where)
    return out


def subcommands() -> set[str]:
    """What ``python -m pcourse.tools.bench`` takes first: a benchmark's name, or a
    workload of the scaling benchmark it runs otherwise."""
    from pcourse.tools.bench import scaling
    from pcourse.tools.bench.__main__ import COMMANDS

    workload = next(a for a in scaling.parser()._actions if a.dest == "workload")
    return set(COMMANDS) | set(workload.choices)


def test_every_printed_command_names_a_module_that_exists() -> None:
    found = commands()
    assert (BENCH, "sharding") in found, "the reader finds no command: the search is broken"
    missing = [f"python -m {m} {s}".strip() + f" (in {', '.join(sorted(set(w)))})"
               for (m, s), w in found.items()
               if importlib.util.find_spec(m) is None or (s and s not in subcommands())]
    assert not missing, "commands printed to a reader that do not exist:\n" + "\n".join(missing)


def test_the_search_finds_a_stale_command(tmp_path) -> None:
    text = "run `python -m pcourse.bench steps --quick` and python -m pcourse.tools.bench sharding"
    got = [(m.group(1), m.group(2)) for m in COMMAND.finditer(text)]
    assert got == [("pcourse.bench", "steps"), (BENCH, "sharding")]
    assert importlib.util.find_spec("pcourse.bench") is None


@pytest.mark.slow
@pytest.mark.parametrize("module, sub", sorted(commands()), ids=lambda x: x or "-")
def test_every_printed_command_answers_help(module: str, sub: str) -> None:
    done = subprocess.run([sys.executable, "-m", module, *([sub] if sub else []), "--help"],
                          capture_output=True, text=True, timeout=120, cwd=REPO)
    assert done.returncode == 0, (module, sub, done.stdout[-1500:], done.stderr[-1500:])
    assert "usage" in done.stdout.lower(), (module, sub, done.stdout[-800:])
