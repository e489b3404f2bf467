"""A learner's notebook, read as text: only the learner's cells are theirs, and never run here.

A notebook a learner hands in carries everything a grader must not trust: check
cells they may have edited, outputs they saved (``FAIL`` lines included), tags
that decide which cells count as theirs. So the grader keeps only the source of
the cells the exercise marks as the learner's (tag ``exercise``); the checks are the
course's own (:mod:`pcourse.tools.grading.refs`), and nothing else of the file is read:

- :func:`read` turns a file into a notebook, or says why it is not one;
- :func:`compare` checks that the cells still line up with the exercise (none
  added, removed or moved, no tag changed), ignoring empty cells;
- :func:`tampering` reads the learner's cells (never runs them) for code that
  reaches for the checks: rebinding a name the checks use, patching a module,
  ``exec``, ``globals()``, magics, the course's own solutions;
- :func:`learner_code` does all three and returns the code to run: the setup's imports
  (not the course's), then the learner's cells, which run in the learner's processes
  only (:mod:`pcourse.tools.grading.learner`).
"""

from __future__ import annotations

import ast
import builtins
import json
import os
import stat
from dataclasses import dataclass, field
from pathlib import Path

import nbformat

from pcourse.tools.grading.exercises import generate

EXERCISE_TAG = "exercise"
CHECK_TAG = "check"

# Names and modules that let code reach past the exercise into the checks.
FORBIDDEN_NAMES = {"globals", "locals", "vars", "setattr", "delattr", "exec", "eval", "compile",
                   "__import__", "__builtins__", "get_ipython", "open", "breakpoint"}
FORBIDDEN_MODULES = {"builtins", "importlib", "sys", "gc", "ctypes", "inspect", "pcourse",
                     "IPython", "ipyparallel", "ipykernel", "subprocess", "shutil", "pathlib",
                     "io", "signal", "multiprocessing", "unittest", "types", "runpy"}
FORBIDDEN_ATTRIBUTES = {"__globals__", "__code__", "__dict__", "__builtins__", "__subclasses__",
                        "__closure__", "__defaults__", "__kwdefaults__", "__bases__", "__mro__",
                        "__func__", "__self__", "__setattr__", "__delattr__", "__getattribute__",
                        "__import__", "__loader__", "__spec__", "__class__", "__module__"}
START_AGAIN = ("start again from a fresh copy of the exercise and put your code only in the "
               "cells marked YOUR CODE HERE")


class Rejected(Exception):
    """The notebook cannot be graded as handed in; ``kind`` and the message say why."""

    def __init__(self, kind: str, reason: str) -> None:
        super().__init__(reason)
        self.kind = kind  # "invalid", "tampered" or "syntax"
        self.reason = reason


@dataclass
class Code:
    """What the grader runs of a notebook: the setup's imports, then the learner's cells."""

    codes: list[str]
    notes: list[str] = field(default_factory=list)  # edits the grader undid


MAX_BYTES = 32 << 20  # a notebook larger than this is not read (outputs included: 32 MiB)


def load(path: Path) -> bytes:
    """The bytes of the regular file at ``path``, or Rejected("invalid") saying why not.

    Never through a symbolic link (``O_NOFOLLOW``: a link to ``/dev/zero``, to the
    solution or to another learner's file is refused, not read), never blocking (a
    FIFO), never more than :data:`MAX_BYTES`.
    """
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError as exc:
        if Path(path).is_symlink():
            raise Rejected("invalid", f"a symbolic link (to {_target(path)}), not a notebook: "
                                      "hand in the file itself") from None
        raise Rejected("invalid", f"could not be read: {exc.strerror}") from None
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            kind = "a folder" if stat.S_ISDIR(info.st_mode) else "not a regular file"
            raise Rejected("invalid", f"{kind}, not a notebook: hand in the file itself")
        if info.st_size > MAX_BYTES:
            raise Rejected("invalid", f"{info.st_size / 2**20:.0f} MiB, more than the "
                                      f"{MAX_BYTES >> 20} MiB a notebook may be: clear its "
                                      "outputs")
        with os.fdopen(os.dup(fd), "rb") as f:
            data = f.read(MAX_BYTES + 1)
    except OSError as exc:
        raise Rejected("invalid", f"could not be read: {exc.strerror}") from None
    finally:
        os.close(fd)
    if len(data) > MAX_BYTES:
        raise Rejected("invalid", f"more than the {MAX_BYTES >> 20} MiB a notebook may be")
    return data


def _target(path: Path) -> str:
    try:
        return safe_text(os.readlink(path))
    except OSError:
        return "somewhere unreadable"


def safe_text(text: str) -> str:
    """``text`` as it can be written anywhere: undecodable bytes and control characters as ?."""
    text = text.encode("utf-8", "surrogateescape").decode("utf-8", "replace")
    return "".join("?" if ord(c) < 32 or 127 <= ord(c) < 160 else c for c in text)


def read(path: Path) -> nbformat.NotebookNode:
    """The notebook at ``path``, or Rejected("invalid") saying what is wrong with the file."""
    return parse(load(path))


def parse(data: bytes) -> nbformat.NotebookNode:
    """A notebook from a file's bytes, or Rejected("invalid") saying what is wrong with them."""
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError:
        raise Rejected("invalid", "the file is not text (not a notebook)") from None
    try:
        raw = json.loads(text)
    except json.JSONDecodeError as exc:
        raise Rejected("invalid", f"not valid JSON (line {exc.lineno}: {exc.msg}): the "
                                  "file is damaged or not a notebook") from None
    except RecursionError:
        raise Rejected("invalid", "JSON nested too deeply: not a notebook") from None
    try:
        nb = nbformat.reads(json.dumps(raw), as_version=4)
        nbformat.validate(nb)
    except Exception as exc:  # noqa: BLE001 - nbformat raises several kinds
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise Rejected("invalid", f"not a valid notebook: {first[:200]}") from None
    return nb


def _tags(cell: nbformat.NotebookNode) -> set[str]:
    return set(cell.get("metadata", {}).get("tags", []))


def _describe(cell: nbformat.NotebookNode) -> str:
    tags = sorted(_tags(cell) & {EXERCISE_TAG, CHECK_TAG})
    return f"a {cell.cell_type} cell" + (f" tagged {', '.join(tags)}" if tags else "")


def _meaningful(nb: nbformat.NotebookNode) -> list[nbformat.NotebookNode]:
    """The cells, without empty code cells (Jupyter leaves one at the end; they do nothing)."""
    return [c for c in nb.cells if c.cell_type != "code" or c.source.strip() or _tags(c)]


def compare(submission: nbformat.NotebookNode, exercise: nbformat.NotebookNode) -> list:
    """The submission's cells, one per exercise cell; Rejected("tampered") if they do not match."""
    mine, theirs = _meaningful(submission), exercise.cells
    if len(mine) != len(theirs):
        extra = "added" if len(mine) > len(theirs) else "removed"
        raise Rejected("tampered", f"the notebook has {len(mine)} cells where the exercise has "
                                   f"{len(theirs)}: cells were {extra}. {START_AGAIN}")
    for i, (got, want) in enumerate(zip(mine, theirs, strict=True)):
        if got.cell_type != want.cell_type or _tags(got) != _tags(want):
            raise Rejected("tampered", f"cell {i} is {_describe(got)} where the exercise has "
                                       f"{_describe(want)}: cells were moved or their tags "
                                       f"changed. {START_AGAIN}")
    return mine


def learner_code(submission: nbformat.NotebookNode, solution: nbformat.NotebookNode,
                 name: str = "notebook") -> Code:
    """The code to run: the setup's imports (not the course's), then the learner's cells.

    Rejected("tampered") for cells that do not line up with the exercise's or code that
    reaches for the checks; an edited cell that is not the learner's is noted (and is the
    course's own: the checks never read the file's).
    """
    exercise = generate(solution, name)
    given = compare(submission, exercise)
    setup, learner, edited = [], [], []
    for i, (cell, mine, shipped) in enumerate(zip(solution.cells, given, exercise.cells,
                                                  strict=True)):
        if cell.cell_type != "code":
            continue
        if EXERCISE_TAG in _tags(cell):
            learner.append(i)
        elif mine.source != shipped.source:
            edited.append(i)
        if not learner and EXERCISE_TAG not in _tags(cell):
            setup.append(cell.source)
    notes = [f"{'cell' if len(edited) == 1 else 'cells'} {', '.join(map(str, edited))} "
             "edited; graded with the course's own"] if edited else []
    if not learner:
        raise ValueError(f"{name}: the solution has no cell tagged {EXERCISE_TAG!r}")
    try:
        problems = tampering([given[i].source for i in learner], setup,
                             [solution.cells[i].source for i in learner], learner)
    except (RecursionError, MemoryError):
        raise Rejected("syntax", "your code is nested too deeply to be read") from None
    if problems:
        raise Rejected("tampered", "; ".join(problems[:3]) + ". A YOUR CODE cell may only "
                                   "define the exercise's functions (and helpers of your own)")
    imports = [ast.unparse(n) for source in setup for n in ast.parse(_python(source)).body
               if isinstance(n, ast.Import | ast.ImportFrom) and not _imports_course(n)]
    return Code(["\n".join(imports), *(given[i].source for i in learner)], notes)


def _imports_course(node: ast.Import | ast.ImportFrom) -> bool:
    modules = [node.module or ""] if isinstance(node, ast.ImportFrom) else [a.name for a in
                                                                            node.names]
    return any(m.split(".")[0] == "pcourse" for m in modules)


# ---------------------------------------------------------------- reading code, not running it

def _python(source: str) -> str:
    """Plain Python for a cell: IPython's magics become get_ipython() calls."""
    from IPython.core.inputtransformer2 import TransformerManager

    return TransformerManager().transform_cell(source)


def _bindings(tree: ast.Module) -> dict[str, tuple[str, ...]]:
    """Top-level names a cell binds -> what to (import origin, or ("value",))."""
    found: dict[str, tuple[str, ...]] = {}
    for node in tree.body:
        if isinstance(node, ast.Import):
            for a in node.names:
                found[a.asname or a.name.split(".")[0]] = ("import", a.name if a.asname
                                                           else a.name.split(".")[0])
        elif isinstance(node, ast.ImportFrom):
            for a in node.names:
                found[a.asname or a.name] = ("from", node.module or "", a.name)
        else:
            for name in _stored_names(node):
                found.setdefault(name, ("value",))
    return found


def _stored_names(node: ast.AST) -> list[str]:
    """Names a top-level statement binds in the module's namespace."""
    if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
        return [node.name]
    names = []
    for sub in _walk_scope(node):
        if isinstance(sub, ast.Name) and isinstance(sub.ctx, ast.Store | ast.Del):
            names.append(sub.id)
        elif isinstance(sub, ast.Import | ast.ImportFrom):
            names += [a.asname or a.name.split(".")[0] for a in sub.names]
        elif isinstance(sub, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            names.append(sub.name)
    return names


def _walk_scope(node: ast.AST):
    """Like ast.walk, but not into the bodies of functions, lambdas and classes."""
    todo = [node]
    while todo:
        n = todo.pop()
        yield n
        if n is not node and isinstance(n, ast.FunctionDef | ast.AsyncFunctionDef
                                        | ast.ClassDef | ast.Lambda):
            continue
        todo.extend(ast.iter_child_nodes(n))


def tampering(learner: list[str], setup: list[str], solution: list[str],
              cells: list[int] | None = None) -> list[str]:
    """What in the learner's cells reaches for the checks, one message each; [] if nothing.

    ``setup`` are the code cells before the first learner cell (they bind what the
    checks use: modules, ``mc``, ``run``, ``refs``...), ``solution`` the solution's
    learner cells: the names those define are the learner's to define. Names the
    check cells bind themselves are not protected: the checks bind them again
    before reading them.
    """
    bound: dict[str, tuple[str, ...]] = {}
    for source in setup:
        bound.update(_bindings(ast.parse(_python(source))))
    theirs = set()
    for source in solution:
        theirs |= set(_bindings(ast.parse(_python(source))))
    tools = {n for n, origin in bound.items()
             if origin[0] == "value" or origin[1].split(".")[0] == "pcourse"}
    protected = (set(bound) | set(dir(builtins))) - theirs
    problems: list[str] = []
    for where, source in zip(cells or range(len(learner)), learner, strict=True):
        try:
            tree = ast.parse(_python(source))
        except SyntaxError as exc:
            raise Rejected("syntax", f"your code in cell {where} does not parse: line "
                                     f"{exc.lineno}: {exc.msg}") from None
        reader = _Reader(bound, protected, tools)
        reader.visit(tree)
        problems += [f"cell {where}, line {line}: {what}" for line, what in reader.problems]
    return problems


class _Reader(ast.NodeVisitor):
    """Walks a learner cell, keeping track of function scopes, and notes what is not allowed."""

    def __init__(self, setup: dict, protected: set[str], tools: set[str]) -> None:
        self.setup, self.protected, self.tools = setup, protected, tools
        self.scopes: list[set[str]] = []  # names local to each enclosing function
        self.modules: set[str] = {n for n, o in setup.items() if o[0] != "value"}
        self.problems: list[tuple[int, str]] = []

    def _note(self, node: ast.AST, what: str) -> None:
        self.problems.append((getattr(node, "lineno", 0), what))

    def _local(self, name: str) -> bool:
        return any(name in scope for scope in self.scopes)

    # -- scopes
    def _function(self, node: ast.FunctionDef | ast.AsyncFunctionDef | ast.Lambda) -> None:
        if not isinstance(node, ast.Lambda):
            self._bind(node, node.name)
            for d in node.decorator_list:
                self.visit(d)
        a = node.args
        params = {x.arg for x in a.posonlyargs + a.args + a.kwonlyargs}
        params |= {x.arg for x in (a.vararg, a.kwarg) if x}
        body = node.body if isinstance(node.body, list) else [node.body]
        declared = {n for stmt in body for sub in _walk_scope(stmt)
                    if isinstance(sub, ast.Global | ast.Nonlocal) for n in sub.names}
        local = params | {n for stmt in body for n in _stored_names(stmt)}
        self.scopes.append(local - declared)
        for default in a.defaults + a.kw_defaults:
            if default is not None:
                self.visit(default)
        for stmt in body:
            self.visit(stmt)
        self.scopes.pop()

    visit_FunctionDef = visit_AsyncFunctionDef = visit_Lambda = _function

    def visit_ClassDef(self, node: ast.ClassDef) -> None:
        self._bind(node, node.name)
        self.scopes.append({n for stmt in node.body for n in _stored_names(stmt)})
        self.generic_visit(node)
        self.scopes.pop()

    def visit_Global(self, node: ast.Global) -> None:
        for name in node.names:
            if name in self.protected:
                self._note(node, f"declares `global {name}`, a name the checks use")

    # -- bindings
    def _bind(self, node: ast.AST, name: str, origin: tuple | None = None) -> None:
        if self.scopes and self._local(name):
            return
        if name in self.protected and not (origin and self.setup.get(name) == origin):
            self._note(node, f"rebinds `{name}`, which the checks use")

    def visit_Name(self, node: ast.Name) -> None:
        if isinstance(node.ctx, ast.Store | ast.Del):
            self._bind(node, node.id)
        elif node.id in FORBIDDEN_NAMES and not self._local(node.id):
            self._note(node, f"uses `{node.id}`" + (" (an IPython magic)"
                                                     if node.id == "get_ipython" else ""))
        elif node.id in self.tools and not self._local(node.id):
            self._note(node, f"uses `{node.id}`, which belongs to the checks")

    def _imports(self, node: ast.Import | ast.ImportFrom) -> None:
        for a in node.names:
            module = (node.module or "") if isinstance(node, ast.ImportFrom) else a.name
            top = module.split(".")[0]
            if top in FORBIDDEN_MODULES or (isinstance(node, ast.ImportFrom)
                                            and a.name in FORBIDDEN_NAMES):
                what = "the course's own code" if top == "pcourse" else "the interpreter"
                self._note(node, f"imports {module or a.name} ({what})")
            bound = a.asname or (a.name if isinstance(node, ast.ImportFrom)
                                 else a.name.split(".")[0])
            origin = (("from", module, a.name) if isinstance(node, ast.ImportFrom)
                      else ("import", a.name if a.asname else top))
            self._bind(node, bound, origin)
            if self.scopes:
                self.scopes[-1].discard(bound)  # an imported module is never "just a local"
            self.modules.add(bound)

    visit_Import = visit_ImportFrom = _imports

    def visit_Attribute(self, node: ast.Attribute) -> None:
        if node.attr in FORBIDDEN_ATTRIBUTES:
            self._note(node, f"uses `.{node.attr}`")
        if isinstance(node.ctx, ast.Store | ast.Del):
            self._changes(node)
        self.generic_visit(node)

    def visit_Subscript(self, node: ast.Subscript) -> None:
        if isinstance(node.ctx, ast.Store | ast.Del):
            self._changes(node)
        self.generic_visit(node)

    def _changes(self, node: ast.Attribute | ast.Subscript) -> None:
        """An attribute or item stored: fine on the learner's own objects, not on modules."""
        chain: list[str] = []
        root: ast.expr = node
        while isinstance(root, ast.Attribute | ast.Subscript):
            if isinstance(root, ast.Attribute):
                chain.append(root.attr)
            root = root.value
        if not isinstance(root, ast.Name):
            return
        name = root.id
        if self._local(name) and name not in self.modules:
            return
        if name == "os" and chain[-1:] == ["environ"]:
            return  # os.environ[...] = ...: how torch.distributed's env:// is configured
        if name in self.modules or name in self.protected or name in self.tools:
            dotted = ".".join([name, *reversed(chain)])
            self._note(node, f"changes `{dotted}`: a module or a name the checks use")
