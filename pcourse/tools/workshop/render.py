"""The generated blocks of ``README.md``, ``index.ipynb`` and ``INSTRUCTORS.md``: the course's
table from the lesson registry (:mod:`pcourse.tools.workshop.course`), timing tables from the
measured lesson times, and the setup check's troubleshooting table.

Each table sits between two markers in its file::

    <!-- BEGIN generated: NAME (python -m pcourse.tools.workshop.timings --render) -->
    ...
    <!-- END generated: NAME -->

and is rewritten in place from ``course.toml`` and ``docs/lesson_timings.json``, so no
lesson list and no duration is ever typed by hand, and the README, the index, the guide,
the registry and the measurements cannot drift apart (``tests/test_workshop.py`` checks
that they agree).

A workshop plan adds to each lesson's measured run time the time to read and explain
it (its narrative's words at :data:`READING_WPM`) and, for an exercise, the time to
write the code (:data:`EXERCISE_MINUTES`): the two assumptions, stated in the table.
The same minutes are each notebook's **Estimated time**, a generated line in its first
cell (block :data:`ESTIMATE`), so a lesson and the instructor's plan cannot disagree.
"""

from __future__ import annotations

import ast
import math
import re
from dataclasses import dataclass
from pathlib import Path

import nbformat

from pcourse.tools.workshop import course
from pcourse.tools.workshop.course import Entry, entries
from pcourse.utils.io import atomic_write

READING_WPM = 100  # words per minute, read and explained aloud in a room
EXERCISE_MINUTES = 20  # to write the code of one exercise, on top of reading and running it
SESSION_MINUTES = 90  # one teaching block between breaks
BREAK_MINUTES = 15
PLANS = {"half day": 2, "full day": 4}  # sessions of SESSION_MINUTES
TARGETS = {"README.md": ("course-table",), "index.ipynb": ("course-index",),
           "INSTRUCTORS.md": ("lesson-needs", "workshop-plans", "troubleshooting")}
ESTIMATE = "estimated-time"  # the block in each notebook's first cell
# A cell that can use a GPU names an NCCL backend (and checks unavailable_reason for it,
# as CONTRIBUTING asks), or runs a tool that picks NCCL by itself where every rank has
# a GPU. Words in names, comments or sentences about the source do not count.
_GPU_CELL = re.compile(r"""["']nccl(?:-cupy)?["']|stepbench\.run_on\(|trace\.record_step\(""")
_BLOCK = re.compile(r"<!-- BEGIN generated: .*?<!-- END generated: [^>]*-->", re.S)


def begin(name: str) -> str:
    return f"<!-- BEGIN generated: {name} (python -m pcourse.tools.workshop.timings --render) -->"


def end(name: str) -> str:
    return f"<!-- END generated: {name} -->"


def replace_block(text: str, name: str, body: str) -> str:
    """``text`` with what lies between block ``name``'s markers replaced by ``body``."""
    b, e = begin(name), end(name)
    if text.count(b) != 1 or text.count(e) != 1 or text.index(b) > text.index(e):
        raise ValueError(f"expected one pair of markers for {name!r}:\n{b}\n...\n{e}")
    head, rest = text.split(b)
    _, tail = rest.split(e)
    return f"{head}{b}\n{body.strip()}\n{e}{tail}"


def duration(seconds: float | None) -> str:
    """Seconds as a person reads them: "45 s", "3 min", "1 h 05 min"."""
    if seconds is None:
        return "not measured"
    if seconds < 90:
        return f"{seconds:.0f} s"
    minutes = round(seconds / 60)
    return f"{minutes} min" if minutes < 60 else f"{minutes // 60} h {minutes % 60:02d} min"


def _run(data: dict, mode: str, path: Path) -> dict | None:
    return data.get(mode, {}).get("runs", {}).get(str(path))


def _seconds(data: dict, mode: str, path: Path) -> float | None:
    run = _run(data, mode, path)
    return None if run is None else run["seconds"]


def _cell(data: dict, mode: str, path: Path, has_full: bool) -> str:
    """One time cell of a table: the duration, or why there is none."""
    if mode == "full" and not has_full:
        return "same as quick"
    run = _run(data, mode, path)
    if run is None:
        return "not measured"
    text = duration(run["seconds"])
    return text if run["status"] == "ok" else f"{text} ({run['status']})"


def _has_full(root: Path, path: Path) -> bool:
    nb = nbformat.read(root / path, as_version=4)
    return any(c.cell_type == "code" and re.search(r"^FULL\s*=", c.source, re.M)
               for c in nb.cells)


def _words(root: Path, path: Path) -> int:
    """The narrative's words, generated blocks left out (they say how long it takes)."""
    nb = nbformat.read(root / path, as_version=4)
    return sum(len(_BLOCK.sub("", c.source).split()) for c in nb.cells
               if c.cell_type == "markdown")


def _needs_gpu(root: Path, path: Path) -> str:
    nb = nbformat.read(root / path, as_version=4)
    code = "\n".join(c.source for c in nb.cells if c.cell_type == "code")
    return "optional: its NCCL / GPU cells" if _GPU_CELL.search(code) else "no"


def engines_started(root: Path, path: Path, full: bool) -> list[int | None]:
    """The engine counts a notebook's ``start_cluster`` calls ask for, in order.

    Read from its code, not measured: a literal count, or a name assigned one, as in
    ``N_ENGINES = 4 if FULL else 2``, with ``FULL`` set to the mode. None for a call
    without a count (one engine per GPU, else 2) or one this reading cannot follow.
    """
    nb = nbformat.read(root / path, as_version=4)
    names: dict[str, object] = {"FULL": full}
    counts: list[int | None] = []
    for cell in nb.cells:
        try:
            tree = ast.parse(cell.source) if cell.cell_type == "code" else None
        except SyntaxError:  # a cell of magics (%%px)
            tree = None
        nodes = sorted((n for n in ast.walk(tree) if isinstance(n, ast.Assign | ast.Call)),
                       key=lambda n: (n.lineno, n.col_offset)) if tree else []
        for node in nodes:
            if isinstance(node, ast.Assign) and len(node.targets) == 1 \
                    and isinstance(node.targets[0], ast.Name) and node.targets[0].id != "FULL":
                names[node.targets[0].id] = _value(node.value, names)
            elif isinstance(node, ast.Call) and _called(node) == "start_cluster":
                count = _value(node.args[0], names) if node.args else None
                counts.append(count if isinstance(count, int) else None)
    return counts


def _called(call: ast.Call) -> str:
    f = call.func
    return f.id if isinstance(f, ast.Name) else f.attr if isinstance(f, ast.Attribute) else ""


def _value(node: ast.expr, names: dict[str, object]) -> object:
    """A constant, a known name, or ``a if cond else b`` of those; None otherwise."""
    if isinstance(node, ast.Constant):
        return node.value
    if isinstance(node, ast.Name):
        return names.get(node.id)
    if isinstance(node, ast.IfExp):
        test = _value(node.test, names)
        return None if test is None else _value(node.body if test else node.orelse, names)
    return None


def _engines(root: Path, path: Path, has_full: bool) -> str:
    """The engines column: "2", "2 → 4" (a second cluster), "2 / 4" (quick / full)."""
    modes = [engines_started(root, path, full) for full in ((False, True) if has_full
                                                            else (False,))]
    shown = [" → ".join("one per GPU, else 2" if c is None else str(c) for c in counts)
             or "none" for counts in modes]
    return shown[0] if len(set(shown)) == 1 else " / ".join(shown)


def _machine(data: dict, mode: str) -> str:
    m = data.get(mode, {}).get("machine")
    if not m:
        return f"{mode} mode: not measured yet"
    loads = [r["load"] for r in data[mode].get("runs", {}).values()]
    busy = (f"; other work shared the machine (load average up to {max(loads):.1f} on "
            f"{m['cores']} cores), so these times are high" if loads and max(loads) > m["cores"]
            else "")
    return (f"{mode} mode measured on {m['cores']} cores, {m['memory_gib']} GiB, "
            f"{m['gpus']} GPUs, torch {m['torch']}, on {m['date']}{busy}")


def _link(e: Entry) -> str:
    return f"[{e.number} · {e.title}]({e.path.as_posix()})"


def course_table(data: dict, root: Path) -> str:
    """README's table: the lessons in order, what each teaches, the exercises after it."""
    registry = course.load(root)
    exercises = {x.name: x for x in entries("exercises", root)}
    lines = ["| lesson | what you learn | then the exercise |", "|---|---|---|"]
    for e, lesson in zip(entries("notebooks", root), registry.lessons, strict=True):
        after = ", ".join(_link(exercises[x.name]) for x in registry.practising(lesson.number))
        lines.append(f"| {_link(e)} | {lesson.teaches} | {after or '—'} |")
    return "\n".join(lines)


def course_index(data: dict, root: Path) -> str:
    """The learner's table of lessons and exercises, with how long each runs."""
    registry = course.load(root)
    lines = ["| lesson | what you learn | runs in (quick mode) | full mode |",
             "|---|---|---|---|"]
    for e, lesson in zip(entries("notebooks", root), registry.lessons, strict=True):
        full = _has_full(root, e.path)
        lines.append(f"| {_link(e)} | {lesson.teaches} | "
                     f"{_cell(data, 'quick', e.path, full)} | "
                     f"{_cell(data, 'full', e.path, full)} |")
    lines += ["", "| exercise | after lesson | runs in, once solved | solution |",
              "|---|---|---|---|"]
    for e in entries("exercises", root):
        solution = Path("solutions") / e.path.name
        lines.append(f"| {_link(e)} | {registry.after(e.name)} | "
                     f"{_cell(data, 'quick', solution, False)} | "
                     f"[{e.name}]({solution.as_posix()}) |")
    lines += ["", f"Run times: {_machine(data, 'quick')}; {_machine(data, 'full')}."]
    return "\n".join(lines)


def lesson_needs(data: dict, root: Path) -> str:
    """The instructor's table: time, ranks, memory and GPUs per notebook, both modes."""
    lines = ["| notebook | quick mode | full mode | engines (quick / full) "
             "| MPI ranks at once (quick / full) | peak memory (quick / full) | GPU |",
             "|---|---|---|---|---|---|---|"]
    for e in entries("notebooks", root) + entries("solutions", root):
        full = _has_full(root, e.path)
        quick = _run(data, "quick", e.path)
        big = _run(data, "full", e.path) if full else quick
        ranks = " / ".join(str(r["ranks"]) if r else "?" for r in (quick, big))
        memory = " / ".join(f"{r['peak_mib'] / 1024:.1f} GiB" if r else "?"
                            for r in (quick, big))
        lines.append(f"| {e.path.as_posix()} | {_cell(data, 'quick', e.path, full)} | "
                     f"{_cell(data, 'full', e.path, full)} | {_engines(root, e.path, full)} | "
                     f"{ranks} | {memory} | {_needs_gpu(root, e.path)} |")
    lines += ["", f"{_machine(data, 'quick')}.", "", f"{_machine(data, 'full')}.", "",
              "Engines: what each notebook's `start_cluster` calls ask for, read from its "
              "code (→: a cell replaces the cluster with a larger one). "
              "Ranks: the most MPI processes alive at once (engines and the MPI jobs a cell "
              "launches); fewer cores than ranks still works, only slower. Memory: the "
              "peak of the kernel's and all its processes' resident memory added up "
              "(shared pages counted once per process, so an upper bound)."]
    return "\n".join(lines)


@dataclass
class _Item:
    kind: str  # "lesson" or "exercise"
    entry: Entry
    run_s: float | None
    minutes: int
    words: int = 0


def _items(data: dict, root: Path) -> list[_Item]:
    """Lessons in order, each followed by the exercises that practise it."""
    registry = course.load(root)
    exercises = entries("exercises", root)
    items = []
    for lesson in entries("notebooks", root):
        run, words = _seconds(data, "quick", lesson.path), _words(root, lesson.path)
        items.append(_Item("lesson", lesson, run,
                           math.ceil(words / READING_WPM + (run or 0) / 60), words))
        for ex in (x for x in exercises if registry.after(x.name) == lesson.number):
            run, words = (_seconds(data, "quick", Path("solutions") / ex.path.name),
                          _words(root, ex.path))
            talk = words / READING_WPM + EXERCISE_MINUTES
            items.append(_Item("exercise", ex, run, math.ceil(talk + (run or 0) / 60), words))
    return items


def estimated_time(item: _Item, machine: str) -> str:
    """A notebook's **Estimated time** line: the plan's minutes, what they are made of, and
    where the run time was measured (a planning figure, not the learner's own run)."""
    parts = [f"{item.words:,} words to read and discuss at {READING_WPM} a minute"]
    if item.kind == "exercise":
        parts.append(f"{EXERCISE_MINUTES} min to write the code")
    solved = ", once solved" if item.kind == "exercise" else ""
    parts.append(f"{duration(item.run_s)} to run in quick mode{solved}")
    return (f"**Estimated time:** {item.minutes} min — {', '.join(parts[:-1])} and {parts[-1]}. "
            f"A planning figure, not this machine's: {machine}. The instructor's workshop "
            "plans use the same figure ([INSTRUCTORS.md](../INSTRUCTORS.md)).")


def estimate_paths(item: _Item) -> list[Path]:
    """The notebooks that carry ``item``'s line: a lesson, or an exercise and its solution."""
    if item.kind == "lesson":
        return [item.entry.path]
    return [item.entry.path, Path("solutions") / item.entry.path.name]


def _clock(minutes: int) -> str:
    return f"{minutes // 60}:{minutes % 60:02d}"


def plan(items: list[_Item], sessions: int) -> tuple[list[str], list[_Item]]:
    """Table rows for a day of ``sessions`` blocks, and the items that did not fit.

    Items keep the course order; one that does not fit in what is left of a block
    starts the next block; the plan ends at the first item that fits in no block.
    """
    rows: list[str] = []
    now, used, session = 0, 0, 1
    for i, item in enumerate(items):
        if used + item.minutes > SESSION_MINUTES and used > 0:
            if session == sessions:
                return rows, items[i:]
            now, used, session = now + BREAK_MINUTES, 0, session + 1
            rows.append(f"| {_clock(now - BREAK_MINUTES)} | break | | {BREAK_MINUTES} |")
        run = duration(item.run_s)
        rows.append(f"| {_clock(now)} | {item.kind} | {_link(item.entry)} | "
                    f"{item.minutes} (runs in {run}) |")
        now, used = now + item.minutes, used + item.minutes
    return rows, []


def workshop_plans(data: dict, root: Path) -> str:
    """A half-day and a full-day plan, in course order, from the measured quick-mode times."""
    items = _items(data, root)
    out = [f"Minutes per item = the measured quick-mode run time + its narrative's words "
           f"read and explained at {READING_WPM} words a minute + {EXERCISE_MINUTES} min "
           f"to write each exercise's code. Blocks of {SESSION_MINUTES} min, "
           f"{BREAK_MINUTES} min breaks. Each notebook's **Estimated time** line gives the "
           f"same minutes. {_machine(data, 'quick')}."]
    for name, sessions in PLANS.items():
        rows, left = plan(items, sessions)
        out += ["", f"**{name.capitalize()}** ({sessions} blocks of {SESSION_MINUTES} min)", "",
                "| start | | notebook | minutes |", "|---|---|---|---|", *rows]
        if left:
            out += ["", "Not in this plan (homework, or the next day): "
                    + ", ".join(_link(i.entry) for i in left) + "."]
    return "\n".join(out)


def _md_cell(text: str) -> str:
    """Text for a markdown table cell; ``{field}`` placeholders shown as *field*."""
    return re.sub(r"\{(\w+)\}", r"*\1*", text).replace("|", r"\|")


def troubleshooting(data: dict | None = None, root: Path | None = None) -> str:
    """Markdown: every NOT READY reason the setup check can print, with its fix.

    From :data:`pcourse.tools.checks.setup_check.REASONS`, the one list the check itself
    prints from, so the table cannot miss a reason or drift from what learners see.
    """
    from pcourse.tools.checks.setup_check import REASONS  # the check imports the cluster's tools

    lines = ["| code | the check prints | fix |", "|---|---|---|"]
    for reason in REASONS.values():
        lines.append(f"| `{reason.code}` | NOT READY [{reason.code}]: {_md_cell(reason.says)} | "
                     f"{_md_cell(reason.fix)} |")
    return "\n".join(lines)


BLOCKS = {"course-table": course_table, "course-index": course_index, "lesson-needs": lesson_needs,
          "workshop-plans": workshop_plans, "troubleshooting": troubleshooting}


def updated(data: dict, root: Path) -> dict[Path, str]:
    """Each target file's text as it should be, from ``data``.

    Every block of :data:`TARGETS` must be in its file, and every lesson, exercise and
    solution must carry its :data:`ESTIMATE` block in its first markdown cell: a lost
    marker is an error, not a figure that silently stops being updated.
    """
    out = {}
    for rel, names in TARGETS.items():
        path = root / rel
        nb = nbformat.read(path, as_version=4) if rel.endswith(".ipynb") else None
        parts = [c for c in nb.cells if c.cell_type == "markdown"] if nb else []
        text = path.read_text()
        for name in names:
            body = BLOCKS[name](data, root)
            if nb is None:
                text = replace_block(text, name, body)
                continue
            cell = next((c for c in parts if begin(name) in c.source), None)
            if cell is None:
                raise ValueError(f"{rel}: no markdown cell with the markers of {name!r}")
            cell.source = replace_block(cell.source, name, body)
        out[path] = text if nb is None else nbformat.writes(nb) + "\n"
    machine = _machine(data, "quick")
    for item in _items(data, root):
        for notebook in estimate_paths(item):
            nb = nbformat.read(root / notebook, as_version=4)
            cell = next((c for c in nb.cells if c.cell_type == "markdown"), None)
            if cell is None or begin(ESTIMATE) not in cell.source:
                raise ValueError(f"{notebook}: its first markdown cell has no {ESTIMATE!r} "
                                 "markers")
            cell.source = replace_block(cell.source, ESTIMATE, estimated_time(item, machine))
            out[root / notebook] = nbformat.writes(nb) + "\n"
    return out


def rewrite(data: dict, root: Path) -> list[Path]:
    """Rewrite the generated blocks in place; return the files that changed."""
    changed = []
    for path, text in updated(data, root).items():
        if path.read_text() != text:
            with atomic_write(path) as f:
                f.write(text)
            changed.append(path)
    return changed
