"""The troubleshooting table: every NOT READY reason the setup check can print, and the fix.

Generated from :data:`pcourse.checks.setup_check.REASONS`, the one list the check itself
prints from, so the table cannot miss a reason or drift from what learners see.
``python -m pcourse.workshop.troubleshooting`` prints it and rewrites the table in
``INSTRUCTORS.md`` in place.
"""

from __future__ import annotations

import re
import sys

from pcourse.checks.setup_check import REASONS


def _cell(text: str) -> str:
    """Text for a markdown table cell; ``{field}`` placeholders shown as *field*."""
    return re.sub(r"\{(\w+)\}", r"*\1*", text).replace("|", r"\|")


def table() -> str:
    """Markdown: one row per reason, with the line the check prints and what to do."""
    lines = ["| code | the check prints | fix |", "|---|---|---|"]
    for reason in REASONS.values():
        lines.append(f"| `{reason.code}` | NOT READY [{reason.code}]: {_cell(reason.says)} | "
                     f"{_cell(reason.fix)} |")
    return "\n".join(lines)


def main() -> int:
    from pcourse.utils.io import course_folder
    from pcourse.workshop import render, timings

    print(table())
    for path in render.rewrite(timings.load(), course_folder()):
        print(f"rewrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
