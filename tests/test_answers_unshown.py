"""No lesson shows the code an exercise asks for, before the learner has written it.

An exercise asks the learner to write a piece of the course; a lesson done before it that
shows that piece (``show_source``) turns the exercise into transcription (lesson 10 showed
``shard_range``, exercise 08's ``my_slice``; lesson 03 the ring, exercise 03's answer).
Two rules, for every exercise and every lesson up to the one it follows (course.toml's
``after``):

- :data:`ANSWERS` names, per exercise, the package's own code that answers it; no such
  lesson shows it. A new exercise gets its entry (the test asks for one);
- what the lessons show is compared with the solution's code line by line, names
  abstracted: a shown function holding most of a solution's lines, in order, is refused,
  so an answer the list misses is found too.
"""

from __future__ import annotations

import builtins
import difflib
import inspect
import io
import keyword
import re
import textwrap
import tokenize
from pathlib import Path

import nbformat
import pytest

from pcourse.tools.workshop import course, shown

REPO = Path(__file__).resolve().parents[1]

# exercise -> the package's code that answers it (none: the course has no such piece)
ANSWERS: dict[str, tuple[str, ...]] = {
    "01_partitioner": (),  # lesson 02's partition_indices has the remainder policies too
    "02_average_gradients": (),  # the source's per-parameter loop, lesson 01 shows its own
    "03_ring_allreduce": ("pcourse.collectives.ring_allreduce",),
    "04_gloo_bootstrap": (),  # backends.bootstrap meets through MPI differently
    "05_broadcast_consistency": (),
    "06_bucketed_allreduce": (),  # lesson 07's buckets are classes with hooks, not one bucket
    "07_parameter_averaging": (),
    "08_sharded_optimizer": ("pcourse.sharding.zero.shard_range",),
    "09_tensor_parallel": ("pcourse.tensor_parallel._CopyToGroup",
                           "pcourse.tensor_parallel._ReduceFromGroup",
                           "pcourse.tensor_parallel.block_of",
                           "pcourse.tensor_parallel.ColumnParallelLinear",
                           "pcourse.tensor_parallel.RowParallelLinear"),
    "10_pipeline_schedule": ("pcourse.pipeline.one_f_one_b_order",),
    # lesson 13's cost model works on a Stack and imports each formula from its lesson; the
    # exercise asks for the same accounting as arithmetic on given numbers, and the line
    # comparison below still refuses a shown function that holds it
    "11_predict_memory_and_time": (),
    # lesson 14 shows pcourse.resume's save and load: a model and its optimizer, a manifest
    # rank 0 writes last. The exercise asks for a ZeRO-1 run's own state (its slice, sampler,
    # one generator) and for what the manifest does there, the ranks agreeing on the newest
    # step every rank holds; the line comparison below refuses a shown function that holds it
    "12_resume_exactly": (),
}
# A shown function gives an exercise away when it holds at least this share of the
# solution's lines (and at least MIN_LINES of them), in the solution's order.
SHARE, MIN_LINES = 0.6, 3
_KEEP = set(keyword.kwlist) | set(dir(builtins))
_REGION = re.compile(r"### BEGIN SOLUTION\n(.*?)### END SOLUTION", re.S)


def normalised(code: str) -> list[str]:
    """The code's lines as tokens, comments and strings dropped and every name of its own
    (not an attribute, keyword or builtin) written ``_``: a renamed copy reads the same."""
    out, line, prev = [], [], None
    try:
        tokens = list(tokenize.generate_tokens(io.StringIO(code).readline))
    except (tokenize.TokenError, IndentationError):
        return out
    for t in tokens:
        if t.type in (tokenize.NEWLINE, tokenize.NL):
            if line and line != ["S"]:  # a docstring alone is no line of code
                out.append(" ".join(line))
            line, prev = [], None
        elif t.type not in (tokenize.COMMENT, tokenize.INDENT, tokenize.DEDENT,
                            tokenize.ENDMARKER):
            own = t.type == tokenize.NAME and t.string not in _KEEP and prev != "."
            line.append("_" if own else "S" if t.type == tokenize.STRING else t.string)
            prev = t.string
    return out


def shared_lines(mine: list[str], theirs: list[str]) -> int:
    """How many of ``mine`` appear in ``theirs`` in order, each line alike to 80%."""
    def alike(a: str, b: str) -> bool:
        return difflib.SequenceMatcher(None, a.split(), b.split()).ratio() >= 0.8

    best = [[0] * (len(theirs) + 1) for _ in range(len(mine) + 1)]
    for i, a in enumerate(mine):
        for j, b in enumerate(theirs):
            best[i + 1][j + 1] = best[i][j] + 1 if alike(a, b) else max(best[i][j + 1],
                                                                        best[i + 1][j])
    return best[-1][-1]


def solution_regions(path: Path) -> list[tuple[int, list[str]]]:
    """(cell, normalised lines) of every region a learner writes, hints left out."""
    out = []
    for i, cell in enumerate(nbformat.read(path, as_version=4).cells):
        for m in _REGION.finditer(cell.source):
            body = "\n".join(x for x in m.group(1).splitlines()
                             if not x.strip().startswith("### HINT"))
            out.append((i, normalised(textwrap.dedent(body))))
    return out


@pytest.fixture(scope="module")
def before() -> dict[str, list[shown.Shown]]:
    """Per exercise, what the lessons up to the one it follows show."""
    registry = course.load(REPO)
    found = [s for s in shown.shown(REPO) if s.notebook.parts[0] == "notebooks"]
    return {e.name: [s for s in found if s.lesson <= e.after] for e in registry.exercises}


def test_every_exercise_names_its_answers() -> None:
    names = {e.name for e in course.load(REPO).exercises}
    assert names == set(ANSWERS), (
        f"ANSWERS must name the package code that answers each exercise (an empty tuple: "
        f"none); missing {sorted(names - set(ANSWERS))}, stale {sorted(set(ANSWERS) - names)}")
    for answers in ANSWERS.values():
        for name in answers:
            shown.resolve(name)  # exists


@pytest.mark.parametrize("exercise", sorted(ANSWERS))
def test_no_lesson_before_an_exercise_shows_its_answer(exercise, before) -> None:
    given = [f"{s.notebook}, cell {s.cell}: {s.name}" for s in before[exercise]
             if s.name in ANSWERS[exercise]]
    assert not given, f"{exercise}'s answer is shown before it:\n" + "\n".join(given)
    regions = solution_regions(REPO / "solutions" / f"{exercise}.ipynb")
    for s in before[exercise]:
        theirs = normalised(textwrap.dedent(inspect.getsource(inspect.unwrap(s.obj))))
        for cell, mine in regions:
            k = shared_lines(mine, theirs)
            assert not (k >= MIN_LINES and k >= SHARE * len(mine)), (
                f"{s.notebook}, cell {s.cell} shows {s.name}, which holds {k} of the {len(mine)} "
                f"lines of {exercise}'s solution (cell {cell}): show the idea, not the answer")


def test_the_line_rule_finds_a_renamed_copy() -> None:
    answer = "chunks = np.array_split(x, p)\nfor s in range(p - 1):\n" \
             "    send = chunks[(rank - s) % p]\n    comm.Send(send, dest=right)\n"
    renamed = "def ring(buf, size, me, to):\n    \"\"\"Doc.\"\"\"\n" \
              "    parts = np.array_split(buf, size)  # views\n" \
              "    for k in range(size - 1):\n        out = parts[(me - k) % size]\n" \
              "        comm.Send(out, dest=to)\n"
    mine, theirs = normalised(answer), normalised(textwrap.dedent(renamed))
    assert shared_lines(mine, theirs) == 4 == len(mine)
    other = normalised("total = sum(x)\nreturn total / len(x)\n")
    assert shared_lines(mine, other) == 0
