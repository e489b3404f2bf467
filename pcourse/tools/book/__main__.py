"""``python -m pcourse.tools.book [--out DIR]``: build the course's website (``make book``)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from pcourse.tools.book.build import OUT, BookError, build
from pcourse.utils.io import course_folder


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m pcourse.tools.book",
                                     description="Build the course's website from the "
                                     "notebooks' stored outputs (nothing is executed).")
    parser.add_argument("--out", type=Path,
                        help=f"where to build it (default: the course's {OUT}); "
                             "the site is OUT/html/index.html")
    parser.add_argument("--course", type=Path, metavar="DIR",
                        help="the course's folder (default: the current folder)")
    parser.add_argument("-j", "--jobs", default="auto",
                        help="Sphinx's parallel jobs (default: auto, one per core)")
    args = parser.parse_args(argv)
    try:
        book = build(course_folder(args.course), args.out, args.jobs)
    except (BookError, ValueError) as exc:
        print(f"make book: {exc}", file=sys.stderr)
        return 1
    for source, cells in book.missing_figures.items():
        print(f"warning: {source}: cell(s) {', '.join(map(str, cells))} call plt.show() but "
              "stored no image; the page shows no figure there (re-execute the notebook)")
    print(f"{len(book.pages)} pages in {book.seconds:.0f} s: "
          f"{(book.html / 'index.html').resolve()}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
