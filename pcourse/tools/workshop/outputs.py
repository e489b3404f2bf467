"""The lessons' stored outputs: made by the code as it is, and holding only what a learner needs.

A lesson's outputs are stored in its notebook (the website, a learner opening it, the
prose written about them all read them). They go stale silently: a change to the loop
at one rank, merged after the lesson ran, leaves rows no run of today's code can
reproduce. So the tool that executes a lesson writes, beside its outputs, a
**fingerprint** of the code it ran (``metadata.pcourse.fingerprint`` of the notebook):
a hash of every package module its code imports, transitively, found by reading the
code (:func:`dependencies`), not by running it. ``tests/test_outputs.py`` recomputes it
for every lesson and solution and names the notebook and the modules changed since.

What "the code it ran" covers, and why:

- every ``import``/``from ... import`` of a notebook's code cells, ``%%px`` cells and
  functions shipped to engines included (magics are read past, not run), and of every
  package module reached from them: the tooling too (``pcourse.tools.cluster`` starts
  the engines, ``pcourse.tools.bench`` prints the tables);
- a string constant that names a package module (``"pcourse.tools.bench.steps"``:
  ``python -m`` commands, ``importlib.import_module`` tables); for a package named so,
  its ``__main__`` too, which ``python -m`` runs;
- the notebook's own code cells (their source; not the markdown, not the outputs);
- a module's text, but not its own docstring: a docstring says what the module is
  for and no lesson prints it (``show_source`` shows functions and classes, whose
  docstrings do count), so rewording one does not make every lesson stale.

Third-party libraries and data are not covered: their versions are the venv's, pinned
in ``pyproject.toml`` and the Makefile.

Commands (``python -m pcourse.tools.workshop.outputs``):

- (no flag; ``make lessons``) executes every stale lesson and solution with nbclient,
  in quick mode, and stores its outputs in place, cleaned and stamped; ``NB ...`` only
  those; ``--force`` executes them even if current (what a fingerprint cannot see
  changed: the data, torch, the machine);
- ``--check``: names the stale notebooks and their changed modules; exits 1 if any;
- ``--stamp [NB ...]``: writes the fingerprint without executing, for whoever knows
  the outputs are current (after a merge that changed only what no output shows);
- ``--strip``: removes the outputs no learner needs that a run can leave (see
  :func:`strip`) from every notebook; idempotent.

The other half, outputs that hold only what a learner needs, is :func:`problems`: the
rules ``tests/test_outputs.py`` applies to every committed notebook.
"""

from __future__ import annotations

import argparse
import ast
import hashlib
import os
import re
import sys
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

import nbformat

from pcourse.tools.workshop.course import CELL_TIMEOUT, add_execution_options, entries
from pcourse.utils.io import atomic_write, course_from

PACKAGE = "pcourse"
KEY = "pcourse"  # the notebook metadata's namespace: metadata.pcourse.fingerprint
STAMPED = ("notebooks", "solutions")  # what runs; exercises are saved unrun, the index
#                                       holds no code
CELLS = "(its code cells)"  # the notebook's own code, beside the modules it imports
_NAMED = re.compile(rf"\b{PACKAGE}(?:\.\w+)+")  # a module named in code a parser cannot read


# ---------------------------------------------------------------- what a notebook runs

@dataclass(frozen=True)
class Fingerprint:
    """The package modules a notebook's code reaches, each with the hash of its text."""

    modules: dict[str, str]  # "pcourse/loop.py" -> first 12 hex digits of its sha256;
    #                          CELLS -> the same of the notebook's own code cells

    @property
    def digest(self) -> str:
        lines = "".join(f"{path} {h}\n" for path, h in sorted(self.modules.items()))
        return hashlib.sha256(lines.encode()).hexdigest()[:16]

    def as_metadata(self) -> dict:
        return {"digest": self.digest, "modules": dict(sorted(self.modules.items()))}

    def changed_since(self, stored: dict | None) -> list[str]:
        """What differs from a stored fingerprint (:meth:`as_metadata`): each changed,
        added or removed module; ``["never stamped"]`` when there is none. Empty: current."""
        if not stored or "modules" not in stored:
            return ["never stamped"]
        old: dict[str, str] = stored["modules"]
        said = [f"{p} changed" for p in sorted(self.modules)
                if p in old and old[p] != self.modules[p]]
        said += [f"{p} now imported" for p in sorted(set(self.modules) - set(old))]
        said += [f"{p} no longer imported" for p in sorted(set(old) - set(self.modules))]
        return said


def _modules(root: Path) -> dict[str, Path]:
    """Every module of the package under ``root``: dotted name -> file."""
    found = {}
    for path in sorted((root / PACKAGE).rglob("*.py")):
        parts = path.relative_to(root).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        found[name] = path
    return found


def _read(path: Path) -> tuple[str, tuple[str, ...]]:
    """A module's hash (its text without its docstring) and the names it refers to."""
    return _parse(path.read_text(encoding="utf-8"), _package_of(path), str(path))


@lru_cache(maxsize=1024)
def _parse(text: str, package: str, filename: str) -> tuple[str, tuple[str, ...]]:
    """:func:`_read`'s work, cached by the text itself: one run parses each module once,
    and a file rewritten within the clock's resolution is still read anew."""
    tree = ast.parse(text, filename=filename)
    body = text
    doc = tree.body[0] if tree.body else None
    if isinstance(doc, ast.Expr) and isinstance(doc.value, ast.Constant) \
            and isinstance(doc.value.value, str):
        body = "\n".join(text.splitlines()[doc.end_lineno:])
    return (hashlib.sha256(body.encode()).hexdigest()[:12],
            tuple(_references(tree, package)))


def _package_of(path: Path) -> str:
    """The dotted package a module file lives in (for its relative imports)."""
    parts = list(path.with_suffix("").parts)
    start = len(parts) - 1 - parts[::-1].index(PACKAGE)
    return ".".join(parts[start:-1])


def _docstrings(tree: ast.AST) -> set[int]:
    """ids of the string constants that are docstrings (they name modules in prose)."""
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Module | ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef) \
                and node.body and isinstance(node.body[0], ast.Expr) \
                and isinstance(node.body[0].value, ast.Constant):
            found.add(id(node.body[0].value))
    return found


def _references(tree: ast.AST, package: str) -> list[str]:
    """The dotted names a piece of code imports or names as a string: candidates, each
    kept by :func:`dependencies` only if it is a module of the package."""
    names: list[str] = []
    docs = _docstrings(tree)
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names += [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                # `from . import x` in pcourse/a/__init__.py is pcourse.a.x; in pcourse/a/b.py too
                parent = package.split(".")
                parent = parent[:len(parent) - node.level + 1]
                base = ".".join(parent + ([base] if base else []))
            names.append(base)
            names += [f"{base}.{a.name}" for a in node.names]
        elif isinstance(node, ast.Constant) and isinstance(node.value, str) \
                and id(node) not in docs and _NAMED.fullmatch(node.value):
            names += [node.value, f"{node.value}.__main__"]  # `python -m pcourse.x`
    return names


def notebook_code(nb: nbformat.NotebookNode) -> list[str]:
    """The Python of each of a notebook's code cells, magics read past: ``%%px`` cells
    keep their body (it runs on the engines), line magics and shell lines become ``pass``."""
    cells = []
    for cell in nb.cells:
        if cell.cell_type != "code":
            continue
        lines = cell.source.splitlines()
        if lines and lines[0].startswith("%%"):
            lines = lines[1:]  # %%px, %%time: the body is Python
        cells.append("\n".join(
            ln[:len(ln) - len(ln.lstrip())] + "pass" if ln.lstrip().startswith(("%", "!"))
            else ln for ln in lines))
    return cells


def _notebook_references(nb: nbformat.NotebookNode) -> list[str]:
    names: list[str] = []
    for code in notebook_code(nb):
        try:
            names += _references(ast.parse(code), PACKAGE)
        except SyntaxError:
            pass  # a cell a parser cannot read: the names it spells out below still count
        names += _NAMED.findall(code)
        for m in re.finditer(rf"from {PACKAGE} import \(?([\w, \n]+)\)?", code):
            names += [f"{PACKAGE}.{n.strip()}" for n in m.group(1).split(",") if n.strip()]
    return names


def dependencies(nb: nbformat.NotebookNode, root: Path) -> Fingerprint:
    """Every package module the notebook's code reaches, transitively, with its hash,
    and the hash of the notebook's own code cells (:data:`CELLS`).

    Importing ``pcourse.a.b`` runs ``pcourse/__init__.py`` and ``pcourse/a/__init__.py``
    too: each dotted name brings its parents."""
    index = _modules(root)
    todo = list(_notebook_references(nb))
    seen = {CELLS: hashlib.sha256("\n\n".join(
        c.source for c in nb.cells if c.cell_type == "code").encode()).hexdigest()[:12]}
    while todo:
        name = todo.pop()
        parts = name.split(".")
        for i in range(1, len(parts) + 1):
            module = ".".join(parts[:i])
            path = index.get(module)
            if path is None:
                continue
            rel = path.relative_to(root).as_posix()
            if rel in seen:
                continue
            digest, refs = _read(path)
            seen[rel] = digest
            todo += refs
    return Fingerprint(seen)


# ---------------------------------------------------------------- stamps

def stored(nb: nbformat.NotebookNode) -> dict | None:
    return nb.metadata.get(KEY, {}).get("fingerprint")


def stamp(nb: nbformat.NotebookNode, root: Path) -> Fingerprint:
    """Write the notebook's fingerprint into its metadata (in memory)."""
    fingerprint = dependencies(nb, root)
    nb.metadata.setdefault(KEY, {})["fingerprint"] = fingerprint.as_metadata()
    return fingerprint


def stamped_notebooks(root: Path) -> list[Path]:
    """What carries a fingerprint: every lesson and solution, relative to ``root``."""
    return [e.path for folder in STAMPED for e in entries(folder, root)]


def staleness(path: Path, root: Path) -> list[str]:
    """Why a notebook's stored outputs may not be today's code's; empty when current."""
    nb = nbformat.read(root / path, as_version=4)
    return dependencies(nb, root).changed_since(stored(nb))


def write(nb: nbformat.NotebookNode, path: Path) -> None:
    with atomic_write(path, encoding="utf-8") as f:
        nbformat.write(nb, f)


# ---------------------------------------------------------------- what a learner needs

def _empty(output: dict) -> bool:
    """A display that shows nothing: what a progress bar (pcourse.utils.progress) leaves
    once it is cleared, for nbclient stores a display's last version."""
    return output.get("output_type") == "display_data" and not any(
        output.get("data", {}).values())


def strip(nb: nbformat.NotebookNode) -> int:
    """Remove the empty displays from every cell; how many there were. Idempotent, and
    only outputs change (nbval compares none of them: an empty display has no data)."""
    removed = 0
    for cell in nb.cells:
        if cell.cell_type == "code":
            kept = [o for o in cell.outputs if not _empty(o)]
            removed += len(cell.outputs) - len(kept)
            cell.outputs = kept
    return removed


def _launcher_markers() -> tuple[str, ...]:
    from pcourse.tools.cluster.rank_exit import RANK_EXIT  # the marker's one spelling

    return (RANK_EXIT,)


# What a stored output must not hold, with why. Read in the text a learner sees: streams,
# text/plain and tracebacks (not text/html: show_source's highlighted code may say
# "target" or "/tmp" as code does).
RULES: dict[str, re.Pattern[str]] = {
    "a development target": re.compile(
        r"\btarget\s*(?:<=|>=|==|<|>|≤|≥)|\bNOT met\b|\b(?:TODO|FIXME|XXX)\b"),
    "a launcher marker": re.compile("|".join(re.escape(m) for m in _launcher_markers())),
    "a path of this machine": re.compile(
        r"(?<![\w.])(?:/tmp/|/var/tmp/|/work/|/root\b|/home/\w|/Users/\w|/private/var/)"
        r"|site-packages|dist-packages"),
}


def learner_text(output: dict) -> str:
    """The text of an output a learner reads."""
    kind = output.get("output_type")
    if kind == "stream":
        text = output.get("text", "")
    elif kind == "error":
        text = "\n".join([output.get("evalue", "")] + list(output.get("traceback", [])))
    else:
        text = output.get("data", {}).get("text/plain", "")
    return "".join(text) if isinstance(text, list) else text


def problems(nb: nbformat.NotebookNode) -> list[str]:
    """What in the notebook's stored outputs a learner does not need: ``cell N: what:
    'the text'`` for each. Empty when clean."""
    found = []
    for i, cell in enumerate(nb.cells):
        for output in cell.get("outputs", []):
            if _empty(output):
                found.append(f"cell {i}: an empty display (run `python -m "
                             "pcourse.tools.workshop.outputs --strip`)")
                continue
            text = learner_text(output)
            for what, rule in RULES.items():
                for m in rule.finditer(text):
                    line = text[:m.start()].rpartition("\n")[2] + text[m.start():].partition(
                        "\n")[0]
                    found.append(f"cell {i}: {what}: {line.strip()[:120]!r}")
    return found


# ---------------------------------------------------------------- executing

def execute(path: Path, cell_timeout: float = CELL_TIMEOUT) -> nbformat.NotebookNode:
    """Run a notebook top to bottom in a fresh kernel, in quick mode, as a learner's Run
    All does, and return it with its outputs, stripped and stamped. Raises nbclient's
    error if a cell fails (the file is then left as it was)."""
    from nbclient import NotebookClient

    nb = nbformat.read(path, as_version=4)
    # One stream output per stream: how print's text and its newline reach the kernel's
    # output in chunks depends on the machine's load, and a stored output must not.
    NotebookClient(nb, timeout=cell_timeout, kernel_name="python3", coalesce_streams=True,
                   resources={"metadata": {"path": str(path.parent)}}).execute()
    strip(nb)
    return nb


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    what = parser.add_mutually_exclusive_group()
    what.add_argument("--check", action="store_true", help="name the stale notebooks; exit 1 "
                      "if any")
    what.add_argument("--stamp", action="store_true", help="stamp without executing")
    what.add_argument("--strip", action="store_true", help="remove empty displays from every "
                      "notebook")
    parser.add_argument("--force", action="store_true", help="execute even what is current "
                        "(what the fingerprint cannot see changed: data, torch, the machine)")
    parser.add_argument("notebooks", nargs="*", type=Path, metavar="NB",
                        help="only these (default: every lesson and solution)")
    add_execution_options(parser)
    args = parser.parse_args(argv)
    root = course_from(parser, args.root)
    every = stamped_notebooks(root)
    chosen = [Path(os.path.relpath(root / p, root)) for p in args.notebooks] or every
    unknown = [str(p) for p in chosen if p not in every]
    if unknown and not args.strip:
        parser.error(f"not a lesson or solution of {root}: {', '.join(unknown)}")
    if args.strip:
        return _strip_all(root, args.notebooks)
    if args.stamp:
        for rel in chosen:
            nb = nbformat.read(root / rel, as_version=4)
            stamp(nb, root)
            write(nb, root / rel)
            print(f"stamped {rel}")
        return 0
    stale = {rel: why for rel in chosen
             if (why := staleness(rel, root) or (["--force"] if args.force else []))}
    for rel, why in stale.items():
        print(f"{rel}: stale: {'; '.join(why)}")
    if args.check:
        return 1 if stale else 0
    return _run(root, list(stale), args.cell_timeout)


def _strip_all(root: Path, only: list[Path]) -> int:
    paths = only or [root / "index.ipynb"] + [
        root / e.path for folder in ("notebooks", "solutions", "exercises")
        for e in entries(folder, root)]
    for path in paths:
        if not path.is_file():
            continue
        nb = nbformat.read(path, as_version=4)
        removed = strip(nb)
        if removed:
            write(nb, path)
            print(f"{path.relative_to(root) if path.is_relative_to(root) else path}: "
                  f"{removed} empty display(s) removed")
    return 0


def _run(root: Path, stale: list[Path], cell_timeout: float) -> int:
    from nbclient.exceptions import CellExecutionError

    # Engines are launched with the venv's mpiexec, beside this Python.
    os.environ["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"
    failed = []
    for rel in stale:
        print(f"executing {rel} ...", flush=True)
        try:
            nb = execute(root / rel, cell_timeout)
        except CellExecutionError as exc:
            print(f"{rel}: a cell failed ({exc.ename}: {exc.evalue}); left as it was",
                  file=sys.stderr)
            failed.append(rel)
            continue
        stamp(nb, root)
        write(nb, root / rel)
        print(f"stored {rel}", flush=True)
    if failed:
        print(f"{len(failed)} notebook(s) failed: {', '.join(map(str, failed))}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
