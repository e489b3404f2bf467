"""``python -m pcourse.bench franke|mnist|steps|comm [options]``: one front door.

``franke`` and ``mnist`` go to :mod:`pcourse.bench.scaling`; ``steps`` and ``comm``
to :mod:`pcourse.bench.steps` and :mod:`pcourse.bench.comm`.
"""

import sys


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["steps"]:
        from pcourse.bench.steps import main as run
    elif argv[:1] == ["comm"]:
        from pcourse.bench.comm import main as run
    else:
        from pcourse.bench.scaling import main as run

        return run(argv) or 0
    return run(argv[1:]) or 0


if __name__ == "__main__":
    sys.exit(main())
