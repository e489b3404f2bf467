"""Lines of the package per folder, against the budget in pyproject.toml: growth is a decision.

    python .ci/package_lines.py

Prints the lines (physical lines of every ``.py`` file) of the taught code, each tools
folder, the tools together and the longest module, beside the budget
``[tool.pcourse.lines]`` holds for each, and exits 1 when one is over: a change that needs
more asks for it there, in the same commit, where a reviewer sees it. ``make test`` runs
it first.
"""

from __future__ import annotations

import sys
import tomllib
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def lines(paths: list[Path]) -> int:
    return sum(len(p.read_text().splitlines()) for p in paths)


def counts(root: Path = REPO) -> dict[str, int]:
    """Lines per part: ``taught`` (pcourse/ but tools/), each ``tools/<folder>``, ``tools``,
    and ``module`` (the longest module anywhere)."""
    package = sorted((root / "pcourse").rglob("*.py"))
    tools = [p for p in package if (root / "pcourse" / "tools") in p.parents]
    found = {"taught": lines([p for p in package if p not in tools]), "tools": lines(tools)}
    for folder in sorted(p for p in (root / "pcourse" / "tools").iterdir() if p.is_dir()):
        found[f"tools/{folder.name}"] = lines([p for p in tools if folder in p.parents])
    found["module"] = max(len(p.read_text().splitlines()) for p in package)
    return found


def over(found: dict[str, int], budget: dict[str, int]) -> list[str]:
    return [f"{part}: {n} lines, over its budget of {budget[part]}"
            for part, n in found.items() if part in budget and n > budget[part]]


def main() -> int:
    budget = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["pcourse"]["lines"]
    found = counts()
    for part, n in found.items():
        print(f"{part:<20} {n:>6}  (budget {budget.get(part, '-')})")
    problems = over(found, budget)
    for p in problems:
        print(f"OVER BUDGET: {p} (pyproject.toml, [tool.pcourse.lines])", file=sys.stderr)
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
