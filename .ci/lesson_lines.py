"""Lines a learner reads per lesson idea: what each lesson shows with ``show_source``.

    python .ci/lesson_lines.py

Prints, per idea, the shown functions' lines: all, and code (neither blank, nor a
comment, nor a docstring), beside the anchors the code review compared them with
(issue 22). The figures go in closing notes; nothing here is compared by a test.
"""

from __future__ import annotations

import ast
import inspect
import textwrap
from typing import Any

from pcourse import buckets, collectives, data_parallel
from pcourse.backends import mpi, torch_dist
from pcourse.runtime import agree, bootstrap

# idea -> (the functions the lesson shows, the anchor the review compared with)
IDEAS: dict[str, tuple[list[Any], str]] = {
    "01 average gradients": (
        [data_parallel.average_gradients, data_parallel._gradients, data_parallel._reduce,
         data_parallel.check_same_model, agree.agree],
        "picotron DataParallelNaive 51 / 22"),
    "03 three allreduces (+ helpers)": (
        [collectives.ring_allreduce, collectives.tree_allreduce, collectives._prepare,
         collectives.recursive_doubling_allreduce],
        "mpi4py reductions.py, reduce + allreduce: 36"),
    "04 mpi-pickle backend": ([mpi.MPIPickleBackend.allreduce], "one comm.allreduce line"),
    "04 Gloo bootstrap": ([bootstrap.rendezvous, bootstrap._pick_port],
                          "CS336 _setup_process_group ~20"),
    "04 Gloo backend": ([torch_dist._TorchBackend.__init__,
                         torch_dist._TorchBackend.allreduce_async, torch_dist.GlooBackend],
                        "-"),
    "05 broadcast, consistency": ([data_parallel.broadcast_parameters,
                                   data_parallel.check_consistency], "nanoGPT's loop ~80"),
    "07 buckets": ([buckets.plan_buckets, buckets.Bucket, buckets._make_bucket,
                    buckets.BucketedAllreduce.no_sync], "picotron bucket code 260 / 126"),
}


def count(objects: list[Any]) -> tuple[int, int]:
    """(all lines, code lines) of the objects' source, as ``show_source`` shows it."""
    source = "\n".join(textwrap.dedent(inspect.getsource(o)) for o in objects)
    docstrings = set()
    for node in ast.walk(ast.parse(source)):
        body = getattr(node, "body", None)
        if isinstance(body, list) and body and isinstance(body[0], ast.Expr) \
                and isinstance(getattr(body[0], "value", None), ast.Constant) \
                and isinstance(body[0].value.value, str):
            docstrings.update(range(body[0].lineno, body[0].end_lineno + 1))
    lines = source.splitlines()
    code = [i for i, line in enumerate(lines, 1)
            if line.strip() and not line.strip().startswith("#") and i not in docstrings]
    return len(lines), len(code)


def main() -> None:
    print(f"{'idea':34} {'all':>4} / {'code':<4}  anchor")
    for idea, (objects, anchor) in IDEAS.items():
        everything, code = count(objects)
        print(f"{idea:34} {everything:>4} / {code:<4}  {anchor}")


if __name__ == "__main__":
    main()
