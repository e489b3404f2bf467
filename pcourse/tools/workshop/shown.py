"""What the lessons show: every ``show_source`` target of every notebook, read without running it.

The ``show_source(...)`` cells of the lessons draw the wall between what the course teaches
and its workshop: what a learner reads is taught. :func:`shown` parses the code cells of
every notebook (``ast``, after IPython's own rewriting of magics), follows each argument of
``show_source`` through the notebook's own imports (those of its cells' top level: what
the kernel has, not what a function sends to the engines) to the object, and names the
module that defines it. Nothing of the notebook runs; the modules it names are imported.

:func:`layer` says on which side of the wall a module lies, by prefix: written once, here,
for the test that holds the wall (``tests/test_wing.py``), the import-layering test
(``tests/test_packaging.py``) and the lines a learner reads per lesson
(``.ci/lesson_lines.py``, which counts with :func:`lines`).
"""

from __future__ import annotations

import ast
import importlib
import inspect
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import nbformat

from pcourse.tools.workshop.course import FOLDERS
from pcourse.utils.io import course_folder

# The package's layers, by module prefix. What the lessons teach is everything else in
# pcourse: its top level and the packages beside these (backends, workloads, beyond_sgd and
# whatever a new lesson adds), so a new lesson's module is taught without a line here.
TOOLING = ("pcourse.tools",)
RUNTIME = ("pcourse.runtime", "pcourse.utils")  # what both wings stand on


def _under(module: str, prefixes: tuple[str, ...]) -> bool:
    return any(module == p or module.startswith(p + ".") for p in prefixes)


def layer(module: str) -> str:
    """``"taught"``, ``"runtime"`` or ``"tooling"`` for a pcourse module's dotted name;
    ``"outside"`` for any other (torch, the standard library)."""
    if not _under(module, ("pcourse",)):
        return "outside"
    if _under(module, TOOLING):
        return "tooling"
    return "runtime" if _under(module, RUNTIME) else "taught"


@dataclass(frozen=True)
class Shown:
    """One argument of one ``show_source`` call, resolved."""

    notebook: Path  # relative to the course's folder
    cell: int  # index among the notebook's cells
    expression: str  # as the cell writes it: "buckets.BucketedAllreduce.no_sync"
    target: str  # the dotted path the imports give: "pcourse.buckets.BucketedAllreduce.no_sync"
    name: str  # where it is defined: "pcourse.buckets.BucketedAllreduce.no_sync"
    module: str  # the module that defines it: "pcourse.buckets"
    obj: Any

    @property
    def lesson(self) -> str:
        """``"07"`` for ``notebooks/07_what_ddp_does.ipynb``."""
        return self.notebook.name[:2]


class NotebookError(ValueError):
    """A ``show_source`` argument that cannot be followed to an object."""


def _python(source: str) -> ast.Module:
    """A code cell as Python: magics become the calls IPython makes of them."""
    from IPython.core.inputtransformer2 import TransformerManager

    return ast.parse(TransformerManager().transform_cell(source))


def _dotted(node: ast.expr) -> str | None:
    """``a.b.c`` for a chain of names and attributes; None for anything else."""
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if not isinstance(node, ast.Name):
        return None
    return ".".join([node.id, *reversed(parts)])


class _Cell(ast.NodeVisitor):
    """Walks one cell's kernel-level code in order: imports bind names, calls are noted.
    Function and class bodies run elsewhere (on the engines, or later): not walked."""

    def __init__(self, names: dict[str, str]) -> None:
        self.names = names
        self.calls: list[tuple[list[ast.expr], dict[str, str]]] = []  # (arguments, names then)

    def visit_FunctionDef(self, node: ast.AST) -> None:
        pass

    visit_AsyncFunctionDef = visit_ClassDef = visit_Lambda = visit_FunctionDef

    def visit_Import(self, node: ast.Import) -> None:
        for alias in node.names:
            if alias.asname:
                self.names[alias.asname] = alias.name
            else:
                top = alias.name.split(".")[0]
                self.names[top] = top

    def visit_ImportFrom(self, node: ast.ImportFrom) -> None:
        for alias in node.names:
            self.names[alias.asname or alias.name] = f"{node.module}.{alias.name}"

    def visit_Call(self, node: ast.Call) -> None:
        if (_dotted(node.func) or "").split(".")[-1] == "show_source":
            self.calls.append((node.args, dict(self.names)))
        self.generic_visit(node)


def resolve(target: str) -> Any:
    """The object a dotted path names: the longest module prefix imported, then attributes."""
    parts = target.split(".")
    for cut in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:cut]))
        except ModuleNotFoundError:
            continue
        for attr in parts[cut:]:
            obj = getattr(obj, attr)
        return obj
    raise ModuleNotFoundError(f"no module in {target!r}")


def _defined(obj: Any, target: str) -> tuple[str, str]:
    """(qualified name, defining module) of a shown object."""
    if inspect.ismodule(obj):
        return obj.__name__, obj.__name__
    obj = inspect.unwrap(getattr(obj, "fget", obj))  # a property shows its getter
    module = inspect.getmodule(obj)
    qualname = getattr(obj, "__qualname__", None)
    if module is None or qualname is None:
        raise NotebookError(f"{target}: not a function, class or module; show_source shows "
                            "only those")
    return f"{module.__name__}.{qualname}", module.__name__


def in_notebook(path: Path, root: Path) -> list[Shown]:
    """Every ``show_source`` argument of one notebook, in cell order."""
    nb = nbformat.read(path, as_version=4)
    names: dict[str, str] = {}
    found = []
    for index, cell in enumerate(nb.cells):
        if cell.cell_type != "code":
            continue
        walker = _Cell(names)
        walker.visit(_python(cell.source))
        for args, scope in walker.calls:
            for arg in args:
                found.append(_one(arg, scope, path.relative_to(root), index))
    return found


def _one(arg: ast.expr, scope: dict[str, str], notebook: Path, cell: int) -> Shown:
    where = f"{notebook}, cell {cell}"
    expression = _dotted(arg)
    if expression is None:
        raise NotebookError(f"{where}: show_source({ast.unparse(arg)}): pass a name or an "
                            "attribute (module.function), so that it can be read without "
                            "running the notebook")
    head, _, rest = expression.partition(".")
    if head not in scope:
        raise NotebookError(f"{where}: show_source({expression}): {head!r} is not imported at "
                            "the top level of any cell before it; import it there")
    target = ".".join(filter(None, (scope[head], rest)))
    try:
        obj = resolve(target)
    except (ImportError, AttributeError) as exc:
        raise NotebookError(f"{where}: show_source({expression}) names {target}, which does "
                            f"not exist: {exc}") from exc
    name, module = _defined(obj, target)
    return Shown(notebook, cell, expression, target, name, module, obj)


def shown(root: Path | None = None) -> list[Shown]:
    """Every ``show_source`` argument of every notebook of the course (lessons, exercises,
    solutions), notebook by notebook; ``root``: the course's folder."""
    root = course_folder(root)
    return [s for folder in FOLDERS for path in sorted((root / folder).glob("*.ipynb"))
            for s in in_notebook(path, root)]


def spans(objects: list[Any]) -> list[tuple[str, int, int]]:
    """(file, first line, last line) of each object's source, each once: a span inside
    another (a method of a class also shown whole) is read once, with the other."""
    found: set[tuple[str, int, int]] = set()
    for obj in map(inspect.unwrap, objects):  # a decorated function: its own source
        lines, start = inspect.getsourcelines(obj)
        path = inspect.getsourcefile(obj)
        assert path is not None  # getsourcelines read it
        found.add((path, max(start, 1), max(start, 1) + len(lines) - 1))
    return sorted(s for s in found if not any(o != s and o[0] == s[0] and o[1] <= s[1]
                                              and s[2] <= o[2] for o in found))


_HAS_DOCSTRING = (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)


def lines(span: tuple[str, int, int]) -> tuple[int, int]:
    """(all lines, code lines) of a span of source; code is neither blank, nor a comment,
    nor part of a docstring."""
    path, first, last = span
    text = Path(path).read_text()
    docstrings: set[int] = set()
    for node in ast.walk(ast.parse(text)):  # the whole file: a span may not parse alone
        if isinstance(node, _HAS_DOCSTRING) and ast.get_docstring(node, clean=False):
            first_statement = node.body[0]
            assert first_statement.end_lineno is not None  # ast.parse sets it
            docstrings.update(range(first_statement.lineno, first_statement.end_lineno + 1))
    read = text.splitlines()[first - 1:last]
    code = [n for n, line in enumerate(read, first)
            if line.strip() and not line.strip().startswith("#") and n not in docstrings]
    return len(read), len(code)


def by_lesson(found: list[Shown]) -> Iterator[tuple[Path, list[Shown]]]:
    """The shown objects grouped by notebook, in the order :func:`shown` gives."""
    order: dict[Path, list[Shown]] = {}
    for s in found:
        order.setdefault(s.notebook, []).append(s)
    yield from order.items()
