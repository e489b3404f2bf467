"""Lines a learner reads per lesson: everything each lesson shows with ``show_source``.

    python .ci/lesson_lines.py

Reads the notebooks without running them (:mod:`pcourse.tools.workshop.shown`, the parser the
test of the taught wing uses too) and prints, per lesson, the lines of every object it
shows: all, and code (neither blank, nor a comment, nor a docstring), then the same per
module it shows from, beside the anchors the code review compared them with (issue 22).
A source shown twice in a lesson, or a method shown with its class, is counted once.
``tests/test_wing.py`` checks the figures against the notebooks.
"""

from __future__ import annotations

from pathlib import Path

from pcourse.tools.workshop import shown

# lesson -> the anchor the review compared it with (all / code lines)
ANCHORS = {
    "01": "picotron DataParallelNaive 51 / 22",
    "03": "mpi4py reductions.py, reduce + allreduce: 36",
    "04": "CS336 _setup_process_group ~20",
    "05": "nanoGPT's loop 88 / 64",
    "07": "picotron bucket code 269 / 130",
}


def count(objects: list) -> tuple[int, int]:
    """(all lines, code lines) of the objects' sources, each source once."""
    per_span = [shown.lines(span) for span in shown.spans(objects)]
    return sum(a for a, _ in per_span), sum(c for _, c in per_span)


def table(root: Path | None = None) -> list[dict]:
    """One row per notebook that shows anything: its lesson, the names it shows, its
    counts, and the counts per module shown from."""
    rows = []
    for notebook, items in shown.by_lesson(shown.shown(root)):
        modules: dict[str, list] = {}
        for s in items:
            modules.setdefault(s.module, []).append(s.obj)
        rows.append({"notebook": notebook, "lesson": notebook.name[:2],
                     "names": {s.name for s in items},
                     "lines": count([s.obj for s in items]),
                     "modules": {m: count(objs) for m, objs in modules.items()}})
    return rows


def main() -> None:
    print(f"{'lesson':44} {'all':>4} / {'code':<4}  anchor")
    for row in table():
        everything, code = row["lines"]
        name = f"{row['notebook'].parent.name}/{row['notebook'].stem}"
        print(f"{name:44} {everything:>4} / {code:<4}  {ANCHORS.get(row['lesson'], '')}")
        for module, (m_all, m_code) in row["modules"].items():
            print(f"    {module:40} {m_all:>4} / {m_code:<4}  {shown.layer(module)}")


if __name__ == "__main__":
    main()
