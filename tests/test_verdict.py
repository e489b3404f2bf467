"""A comparison printed to a learner decides only beyond the spread of its repeats."""

import ast
import itertools
import re
from pathlib import Path

import nbformat
import pytest

from pcourse.tools.workshop import course
from pcourse.tools.workshop.outputs import notebook_code
from pcourse.utils.verdict import (
    FALSE_CALL,
    chance_apart,
    differs,
    faster,
    faster_quartiles,
    smaller,
)


def test_decides_only_when_every_repeat_is_on_one_side() -> None:
    a, b = [1.0, 1.1, 1.0, 1.1], [2.0, 2.2, 2.0, 2.2]
    assert faster(a, b, ("A", "B")).startswith("A is faster than B: 0.50×")
    assert faster(b, a, ("A", "B")).startswith("B is faster than A: 0.50×")
    said = faster([1.0, 2.1, 1.1, 1.2], b, ("A", "B"))
    assert said.startswith("not decided between A and B: their repeats overlap"), said
    assert "ratio of the medians 0.55" in said, said


def test_too_few_repeats_decide_nothing() -> None:
    """Equal timings fall apart by chance 2 / C(n + m, n) of the time: 10% at 3 and 3
    (every one of the 20 orders of six values, two of which are apart), a verdict's most
    is 5%; 4 and 4 (2 of 70) decide."""
    orders = list(itertools.permutations(range(6)))
    apart = sum(1 for o in orders if max(o[:3]) < min(o[3:]) or max(o[3:]) < min(o[:3]))
    assert abs(apart / len(orders) - chance_apart(3, 3)) < 1e-12  # counted, not assumed
    assert chance_apart(3, 3) > FALSE_CALL >= chance_apart(4, 4)
    far = ([1.0, 1.1, 1.2], [5.0, 5.1, 5.2])
    assert smaller(*far) == 0
    said = faster(*far, ("A", "B"))
    assert said.startswith("not decided between A and B: 3 and 3 repeats are too few"), said
    assert smaller([1.0, 1.1, 1.2, 1.3], [5.0, 5.1, 5.2, 5.3]) == -1


def test_needs_a_spread() -> None:
    with pytest.raises(ValueError, match="at least two repeats"):
        faster([1.0], [2.0, 3.0])


def test_quartiles_decide_only_when_the_interquartile_ranges_are_apart() -> None:
    said = faster_quartiles((1.0, 1.1, 1.2), (1.5, 1.6, 1.8), ("ours", "DDP"))
    assert said.startswith("ours is faster than DDP: 0.69×") and "every quartile" in said
    said = faster_quartiles((1.0, 1.1, 1.6), (1.5, 1.6, 1.8), ("ours", "DDP"))
    assert said.startswith("not decided between ours and DDP: their quartiles overlap"), said
    with pytest.raises(ValueError, match="p25, median, p75"):
        faster_quartiles((1.2, 1.1, 1.0), (1.5, 1.6, 1.8))


def test_a_stated_tolerance_decides_one_off_values() -> None:
    assert smaller([1, 2, 1, 2], [3, 4, 3, 4]) == -1 and smaller([3, 4, 3, 4], [1, 2, 1, 2]) == 1
    assert smaller([1, 3, 1, 3], [2, 4, 2, 4]) == 0
    assert differs(1.2, 1.0, 0.1, ("k=16", "k=4")).startswith("k=16 is larger than k=4: 1.20×")
    assert differs(0.8, 1.0, 0.1).startswith("A is smaller than B: 0.80×")
    # 1.107 against a 10% threshold: no verdict where the digits sit on the threshold
    assert differs(1.107, 1.0, 0.2) == "A is within the tolerance of 20% of B (1.11×)"
    assert differs(1.3, 1.0, 0.1, ratio=False) == \
        "A is larger than B: beyond the tolerance of 10%"
    with pytest.raises(ValueError, match="positive tolerance"):
        differs(1.0, 1.0, 0.0)


# ---------------------------------------------------------------- verdicts that bypass it
# A lesson's printed comparison is a verdict: it says one measured thing beats another.
# The rule the lessons are read with (their code, not their outputs; nothing is run):
#
# - a ``print`` whose text ranks (RANKING: "faster", "winner", "better", ...) with no
#   comparison that states its margin, or that shows an ordering comparison (<, <=, >,
#   >=) with no stated margin: no number in it but 0 and 1 and no named CONSTANT
#   (``err < 1e-12``, ``x < 1.1 * y`` and ``peak <= BUDGET`` state theirs; ``t < base``
#   and ``ratio > 1`` decide at noise
#   level). The names it shows are followed to their assignments in the notebook, so a
#   verdict computed a cell earlier counts;
# - a lesson's own function that returns a ranking word (a second helper);
#
# is a bypass unless it calls pcourse.utils.verdict, or is an exact claim marked on its
# line (or the line above) ``# exact: why`` (bytes counted, bitwise equality).


REPO = Path(__file__).resolve().parents[1]
# ("slowest" is not one: "the slowest rank's time" names a measurement, not a winner)
RANKING = re.compile(r"\b(?:faster|slower|quicker|fastest|wins?|winner|beats?|better|"
                     r"worse|cheaper|costlier|outperforms?)\b", re.I)
EXACT = re.compile(r"#\s*exact:\s*\S")
HELPER = "pcourse.utils.verdict"
# Bypasses a lesson may still print, while its fixer works (lesson -> count): a new one
# fails, and a fixed one fails until its count is lowered here. None are left.
KNOWN_BYPASSES: dict[str, int] = {}


def _texts(node: ast.AST) -> str:
    return " ".join(n.value for n in ast.walk(node)
                    if isinstance(n, ast.Constant) and isinstance(n.value, str))


def _stated(node: ast.AST) -> bool:
    """A margin is stated: a number other than 0 and 1, or a CONSTANT's name."""
    for n in ast.walk(node):
        if isinstance(n, ast.Constant) and isinstance(n.value, int | float) \
                and not isinstance(n.value, bool) and n.value not in (0, 1):
            return True
        if (isinstance(n, ast.Name) and n.id.isupper() and len(n.id) > 1) or (
                isinstance(n, ast.Attribute) and n.attr.isupper() and len(n.attr) > 1):
            return True
    return False


class _Lesson:
    """A lesson's code, parsed cell by cell, with what each name is assigned."""

    def __init__(self, nb: nbformat.NotebookNode) -> None:
        self.cells = []
        numbers = [i for i, c in enumerate(nb.cells) if c.cell_type == "code"]
        for i, code in zip(numbers, notebook_code(nb), strict=True):
            try:
                self.cells.append((i, code, ast.parse(code)))
            except SyntaxError:
                continue
        self.assigned: dict[str, list[ast.AST]] = {}
        self.helpers: set[str] = set()
        self.own: set[str] = set()  # the lesson's functions that return a ranking word
        for _, _, tree in self.cells:
            for n in ast.walk(tree):
                if isinstance(n, ast.Assign | ast.AugAssign | ast.AnnAssign) and n.value:
                    for t in (n.targets if isinstance(n, ast.Assign) else [n.target]):
                        for name in ast.walk(t):
                            if isinstance(name, ast.Name):
                                self.assigned.setdefault(name.id, []).append(n.value)
                elif isinstance(n, ast.ImportFrom) and n.module == HELPER:
                    self.helpers |= {a.asname or a.name for a in n.names}
                elif isinstance(n, ast.ImportFrom) and n.module == "pcourse.utils" and any(
                        a.name == "verdict" for a in n.names):
                    self.helpers.add("verdict")
                elif isinstance(n, ast.FunctionDef) and any(
                        isinstance(r, ast.Return) and r.value is not None
                        and RANKING.search(_texts(r.value)) for r in ast.walk(n)):
                    self.own.add(n.name)

    def verdict_parts(self, node: ast.AST, seen: set[str] | None = None) -> list[ast.AST]:
        """What in an expression a learner reads as a verdict: the ordering comparisons
        and calls it prints (not those inside other computations: a filter, an index),
        followed through the names it prints to their assignments."""
        seen = set() if seen is None else seen
        parts: list[ast.AST] = []
        if isinstance(node, ast.Compare):
            return [node] + [p for v in [node.left, *node.comparators]
                             for p in self.verdict_parts(v, seen)]
        if isinstance(node, ast.Call):
            f = node.func
            name = f.id if isinstance(f, ast.Name) else f.value.id if isinstance(
                f, ast.Attribute) and isinstance(f.value, ast.Name) else ""
            parts.append(node) if name in self.helpers | self.own else None
            if name in ("all", "any", "print", "str", "bool") or (
                    isinstance(f, ast.Attribute) and f.attr == "join"):  # ", ".join(winners)
                for a in node.args:
                    parts += self.verdict_parts(a, seen)
            return parts
        if isinstance(node, ast.GeneratorExp | ast.ListComp):  # a filter can hold the verdict
            return self.verdict_parts(node.elt, seen) + [
                c for g in node.generators for cond in g.ifs for c in ast.walk(cond)
                if isinstance(c, ast.Call) and self._is_helper(c, self.helpers)]
        if isinstance(node, ast.Name):
            if node.id in seen:
                return []
            seen.add(node.id)
            return [p for v in self.assigned.get(node.id, []) for p in self.verdict_parts(v, seen)]
        for child in ast.iter_child_nodes(node):  # f-strings, if-else, and/or, not, +
            if isinstance(node, ast.JoinedStr | ast.FormattedValue | ast.IfExp | ast.BoolOp
                          | ast.UnaryOp | ast.BinOp):
                parts += self.verdict_parts(child, seen)
        return parts

    def _is_helper(self, call: ast.AST, names: set[str]) -> bool:
        f = call.func
        return (isinstance(f, ast.Name) and f.id in names) or (
            isinstance(f, ast.Attribute) and isinstance(f.value, ast.Name)
            and f.value.id in names)

    def bypasses(self) -> list[str]:
        found = [f"def {name}: a verdict helper of the lesson's own" for name in sorted(self.own)]
        for i, code, tree in self.cells:
            lines = code.splitlines()
            for n in ast.walk(tree):
                if not (isinstance(n, ast.Call) and isinstance(n.func, ast.Name)
                        and n.func.id == "print"):
                    continue
                near = "\n".join(lines[max(0, n.lineno - 2):n.end_lineno])
                if EXACT.search(near):
                    continue
                parts = self.verdict_parts(n)
                calls = [p for p in parts if isinstance(p, ast.Call)]
                through = any(self._is_helper(c, self.helpers) for c in calls)
                own = any(self._is_helper(c, self.own) for c in calls)
                ordering = [p for p in parts if isinstance(p, ast.Compare) and any(
                    isinstance(op, ast.Lt | ast.LtE | ast.Gt | ast.GtE) for op in p.ops)]
                naked = [p for p in ordering if not _stated(p)]
                ranks = RANKING.search(_texts(n)) and not ordering  # a margin says how
                if naked or own or (ranks and not through):
                    found.append(f"cell {i}: "
                                 + ast.get_source_segment(code, n).split("\n")[0][:100])
        return found


def bypasses(path: Path) -> list[str]:
    return _Lesson(nbformat.read(path, as_version=4)).bypasses()


# ---------------------------------------------------------------- timings against a tolerance
# ``differs`` is for one-off values (a loss, a count) against a stated tolerance. A timing
# has repeats, and their spread decides (``faster``, ``faster_quartiles``): a fixed 10% on
# single medians called the same step both "larger" and "smaller" on two ranks (lesson
# 07), and two lessons opposite at 1 MiB (03, 04). A ``differs`` whose values come from a
# clock — the names it is given followed to their assignments in the lesson — is refused.
TIMING = re.compile(r"_ms\b|_us\b|\bms\b|seconds|perf_counter|\btimes?\b|_times?\b|\btime_|"
                    r"per_step|latency|bubble|elapsed|wall", re.I)


def timing_tolerances(path: Path) -> list[str]:
    lesson = _Lesson(nbformat.read(path, as_version=4))
    sources = {k: list(v) for k, v in lesson.assigned.items()}
    for _, _, tree in lesson.cells:  # a loop's variable comes from what it loops over;
        for n in ast.walk(tree):  # a lesson's function's result, from its body
            if isinstance(n, ast.FunctionDef):
                sources.setdefault(n.name, []).append(n)
            if isinstance(n, ast.For | ast.comprehension):
                for name in ast.walk(n.target):
                    if isinstance(name, ast.Name):
                        sources.setdefault(name.id, []).append(n.iter)
    found = []
    for i, code, tree in lesson.cells:
        params = {id(c): {a.arg for a in f.args.args} for f in ast.walk(tree)
                  if isinstance(f, ast.FunctionDef) for c in ast.walk(f)}
        for n in ast.walk(tree):
            if isinstance(n, ast.Call) and (
                    (isinstance(n.func, ast.Name) and n.func.id == "differs")
                    or (isinstance(n.func, ast.Attribute) and n.func.attr == "differs")):
                own = params.get(id(n), set())  # a function's parameters: not the lesson's names
                said = " ".join(_followed(sources, a, set(own)) for a in n.args[:2])
                if TIMING.search(said):
                    found.append(f"cell {i}: {ast.get_source_segment(code, n)[:100]}")
    return found


def _followed(sources: dict[str, list[ast.AST]], node: ast.AST, seen: set[str]) -> str:
    """The expression's source, and that of every name it reads values from (not an index
    into them), followed to where they are assigned or looped over."""
    text = [ast.unparse(node)]
    if isinstance(node, ast.FunctionDef):  # its body says what it returns; not followed on
        return text[0]
    indices = {id(x) for s in ast.walk(node) if isinstance(s, ast.Subscript)
               for x in ast.walk(s.slice)}
    bound = {x.id for c in ast.walk(node) if isinstance(c, ast.comprehension)
             for x in ast.walk(c.target) if isinstance(x, ast.Name)}  # its own loop's
    for name in (n.id for n in ast.walk(node) if isinstance(n, ast.Name)
                 and id(n) not in indices and n.id not in bound):
        if name not in seen:
            seen.add(name)
            text += [_followed(sources, v, seen) for v in sources.get(name, [])]
    return " ".join(text)


@pytest.mark.parametrize("lesson", course.load(REPO).lessons, ids=lambda x: x.number)
def test_no_lesson_decides_a_timing_with_a_fixed_tolerance(lesson):
    found = timing_tolerances(REPO / lesson.path)
    assert not found, (f"{lesson.name} compares timings with differs (a fixed tolerance on "
                       "one value each); decide them with faster or faster_quartiles, beyond "
                       "the spread of their repeats:\n" + "\n".join(found))


@pytest.mark.parametrize("lesson", course.load(REPO).lessons, ids=lambda x: x.number)
def test_every_verdict_a_lesson_prints_goes_through_the_helper(lesson):
    found = bypasses(REPO / lesson.path)
    known = KNOWN_BYPASSES.get(lesson.number, 0)
    assert len(found) <= known, (
        f"{lesson.name} prints {len(found)} verdict(s) that bypass {HELPER} (known: {known}); "
        "decide through it (beyond the spread of repeats, or a stated tolerance), or mark an "
        "exact claim '# exact: why':\n" + "\n".join(found))
    assert len(found) == known, (
        f"{lesson.name} now bypasses {HELPER} {len(found)} time(s): lower KNOWN_BYPASSES"
        f"[{lesson.number!r}] from {known}")


def test_the_verdict_rule_catches_what_it_is_for(tmp_path):
    def found(*cells: str) -> list[str]:
        from nbformat.v4 import new_code_cell, new_notebook

        path = tmp_path / "nb.ipynb"
        nbformat.write(new_notebook(cells=[new_code_cell(c) for c in cells]), path)
        return bypasses(path)

    assert len(found("print('buffer faster than pickle:', t_buf < t_pickle)",
                     "print(f\"{'faster' if a < b else 'slower'}\")",
                     "print('pickle slower:', ratio > 1)",
                     "print('the winner is', best)",
                     "falls = all(m[i] > m[i + 1] for i in range(3))",
                     "print('the bubble falls:', falls)",
                     "def compare(a, b):\n    return 'faster' if a < b - 2 else 'slower'",
                     "print(compare(x, y))")) == 7
    assert found("from pcourse.utils.verdict import faster",
                 "print(faster(mine, theirs, ('ours', 'torch')))",
                 "said = faster(a, b)\nprint('mpi against gloo:', said)",
                 "print('equal to one process:', err < 1e-12)",
                 "print('within 10%:', x < 1.1 * y, 'fits:', peak <= BUDGET)",
                 "print('worse than both by more than 10%:', c > 1.1 * max(ends))",
                 "print('bfloat16 sends fewer bytes:', ratio < 1)  # exact: bytes are counted",
                 "# exact: counted, not timed\nprint('fewer messages:', n < m)",
                 "print('identical:', a == b, 'small:', b < dist._DEFAULT_CAP + c)",
                 "%%px\nprint('ranks', r)") == []


def test_the_timing_rule_catches_what_it_is_for(tmp_path):
    def found(*cells: str) -> list[str]:
        from nbformat.v4 import new_code_cell, new_notebook

        path = tmp_path / "nb.ipynb"
        nbformat.write(new_notebook(cells=[new_code_cell(c) for c in cells]), path)
        return timing_tolerances(path)

    assert len(found("t0 = time.perf_counter()\nrun()\nt = time.perf_counter() - t0",
                     "print(differs(t, base, 0.1))",
                     "for r in rows:\n    print(differs(r['step_ms'], b['step_ms'], 0.1))",
                     "def timed():\n    return time_call(comm, f, 3, 10)\nm = timed()",
                     "print(verdict.differs(m, 1.0, 0.2))")) == 3
    assert found("loss = model(x).item()", "print(differs(loss, ref, 0.01))",
                 "def close(a, b):\n    return differs(a, b, TOL)",
                 "a = step_ms\nprint(close(loss, ref))") == []
