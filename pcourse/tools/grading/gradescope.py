"""Gradescope's autograder, one submission: ``python -m pcourse.tools.grading.gradescope``.

``python -m pcourse.tools.grading.gradescope SUBMISSION.ipynb --results results.json``
grades one notebook (:func:`pcourse.tools.grading.grade.grade`) and writes Gradescope's
``results.json`` for it (:mod:`pcourse.tools.grading.lms`, which also writes a whole
class's, under ``python -m pcourse.tools.grading.grade --class DIR``).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from pcourse.tools.grading.grade import NOTEBOOK_TIMEOUT, grade
from pcourse.tools.grading.lms import VISIBILITIES, names_or_counted, results, summary, write
from pcourse.utils.io import course_from


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m pcourse.tools.grading.gradescope",
        description="Grade one submitted notebook and write Gradescope's results.json.")
    parser.add_argument("notebook", type=Path, help="the submission, named as in exercises/")
    parser.add_argument("--results", type=Path, default=Path("results.json"),
                        help="where to write it (Gradescope: /autograder/results/results.json)")
    parser.add_argument("--visibility", choices=VISIBILITIES, default="visible",
                        help="when learners see the tests (Gradescope's setting)")
    parser.add_argument("--timeout", type=float, default=NOTEBOOK_TIMEOUT,
                        help=f"seconds for the notebook (default {NOTEBOOK_TIMEOUT:g})")
    parser.add_argument("--course", type=Path, metavar="DIR",
                        help="the course's folder, with solutions/ (default: the current one)")
    args = parser.parse_args(argv)
    solutions = course_from(parser, args.course) / "solutions"
    if not args.notebook.is_file():
        parser.error(f"no such notebook: {args.notebook}")
    if args.timeout <= 0:
        parser.error(f"--timeout must be positive, got {args.timeout:g}")
    (g,) = grade([args.notebook], jobs=1, timeout=args.timeout, solutions=solutions)
    names = names_or_counted(solutions / f"{g.exercise}.ipynb", g.total)
    write(args.results, json.dumps(results(g, names, args.visibility), indent=1) + "\n")
    print(f"{summary(g)}\nwrote {args.results}")
    return 0 if g.status != "error" else 1


if __name__ == "__main__":
    sys.exit(main())
