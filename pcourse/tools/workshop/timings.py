"""Measure how long every lesson and exercise runs, and regenerate the tables built on it.

``python -m pcourse.tools.workshop.timings`` executes every notebook of ``notebooks/`` and
``solutions/`` (an exercise, once solved, runs its solution's cells) from top to
bottom with nbclient, in quick mode, and records per notebook:

- the wall time from kernel start to the last cell,
- the most MPI ranks alive at once (what the lesson asks of the cores),
- the peak resident memory of the kernel and everything it started (engines, MPI jobs).

``--full`` does the same in full mode: the ``FULL = False`` cell a lesson starts with is
switched to ``True`` before it runs. Results go to ``docs/lesson_timings.json`` (merged:
``--only`` re-measures some notebooks and keeps the rest), and the generated blocks of
``README.md``, ``index.ipynb`` and ``INSTRUCTORS.md`` are rewritten from it and from the
lesson registry in place (``--render`` does only that). Run it on a quiet machine:
anything else running inflates the times (the load average at the end of each notebook
is stored, and the tables say when it was above the core count).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import re
import signal
import sys
import threading
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import nbformat
import psutil

from pcourse.runtime.ranks import MPI_RANK_VARS, gpu_count
from pcourse.tools.workshop import render
from pcourse.tools.workshop.course import CELL_TIMEOUT, add_execution_options, entries
from pcourse.utils.io import atomic_write, course_folder, course_from

DATA = Path("docs") / "lesson_timings.json"
_FULL_FLAG = re.compile(r"^FULL\s*=\s*False\b", re.M)


@dataclass
class Timing:
    """One notebook's run."""

    seconds: float
    ranks: int  # most MPI ranks alive at once
    peak_mib: float  # peak summed resident memory of the kernel and its descendants
    status: str  # "ok", or what went wrong
    load: float  # the machine's 1-minute load average when it ended: above the core count,
    #              other work shared the machine and the time is inflated
    left_running: list[str]  # processes that outlived the kernel (a lesson's bug), stopped


def switch_to_full(nb: nbformat.NotebookNode) -> bool:
    """Set ``FULL = True`` in the notebook's mode cell; False when it has none."""
    for cell in nb.cells:
        if cell.cell_type == "code" and _FULL_FLAG.search(cell.source):
            cell.source = _FULL_FLAG.sub("FULL = True", cell.source, count=1)
            return True
    return False


class _Sampler(threading.Thread):
    """Watches this process's descendants: peak memory, and peak number of MPI ranks."""

    def __init__(self, interval: float = 0.25) -> None:
        super().__init__(daemon=True)
        self.interval, self.peak_bytes, self.peak_ranks = interval, 0, 0
        self.seen: dict[int, psutil.Process] = {}  # every descendant, to reap leftovers
        self._done = threading.Event()

    def run(self) -> None:
        me = psutil.Process()
        while not self._done.wait(self.interval):
            rss, in_rank = 0, {}  # pid -> parent pid, for processes of an MPI rank
            for proc in me.children(recursive=True):
                self.seen.setdefault(proc.pid, proc)
                try:
                    rss += proc.memory_info().rss
                    if any(v in proc.environ() for v in MPI_RANK_VARS):
                        in_rank[proc.pid] = proc.ppid()
                except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
                    continue
            # A rank's own children (ipyparallel's nanny, DataLoader workers) inherit its
            # variables; only processes whose parent is not in a rank are ranks.
            ranks = sum(parent not in in_rank for parent in in_rank.values())
            self.peak_bytes = max(self.peak_bytes, rss)
            self.peak_ranks = max(self.peak_ranks, ranks)

    def stop(self) -> None:
        self._done.set()
        self.join()

    def reap(self, grace: float = 5.0) -> list[str]:
        """Stop what outlived the notebook's kernel by ``grace`` seconds; say what it was.

        A kernel that died (or a notebook that forgot to stop its cluster) leaves engines
        behind; processes that are merely exiting get the grace period first.
        """
        alive = [p for p in self.seen.values() if _running(p)]
        _, alive = psutil.wait_procs(alive, timeout=grace)
        names = []
        for p in alive:
            try:
                names.append(" ".join(p.cmdline()[:4]))
                p.terminate()
            except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
                continue
        _, stuck = psutil.wait_procs(alive, timeout=grace)
        for p in stuck:
            try:
                p.kill()
            except psutil.NoSuchProcess:
                continue
        return names


def _running(proc: psutil.Process) -> bool:
    try:
        return proc.is_running() and proc.status() != psutil.STATUS_ZOMBIE
    except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
        return False


def measure(path: Path, full: bool = False, cell_timeout: float = CELL_TIMEOUT) -> Timing:
    """Execute one notebook top to bottom in a fresh kernel, as a learner's Run All does."""
    from nbclient import NotebookClient
    from nbclient.exceptions import CellExecutionError, CellTimeoutError

    nb = nbformat.read(path, as_version=4)
    if full:
        switch_to_full(nb)
    client = NotebookClient(nb, timeout=cell_timeout, kernel_name="python3",
                            resources={"metadata": {"path": str(path.parent)}})
    sampler = _Sampler()
    sampler.start()
    start = time.perf_counter()
    try:
        client.execute()
        status = "ok"
    except CellTimeoutError:
        status = f"a cell ran longer than {cell_timeout:.0f} s"
    except CellExecutionError as exc:
        status = f"failed: {exc.ename}"
        print(f"{path.name}: {exc.ename}: {exc.evalue}", file=sys.stderr, flush=True)  # why
    finally:
        seconds = time.perf_counter() - start
        sampler.stop()
    return Timing(round(seconds, 1), sampler.peak_ranks, round(sampler.peak_bytes / 2**20),
                  status, round(os.getloadavg()[0], 2), sampler.reap())


def machine() -> dict[str, str | int | float]:
    """What the times were measured on: they mean little without it."""
    import torch

    return {
        # the cores this process may run on: `taskset -c 0,1` measures "2 cores" anywhere
        "cores": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity")
        else os.cpu_count() or 0,
        "memory_gib": round(psutil.virtual_memory().total / 2**30, 1),
        "gpus": gpu_count(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "date": datetime.date.today().isoformat(),
    }


def load(root: Path | None = None) -> dict:
    """The stored measurements: {mode: {"machine": {...}, "runs": {path: Timing fields}}}."""
    path = course_folder(root) / DATA
    return json.loads(path.read_text()) if path.exists() else {}


def save(data: dict, root: Path | None = None) -> Path:
    path = course_folder(root) / DATA
    with atomic_write(path) as f:
        json.dump(data, f, indent=1, sort_keys=True)
        f.write("\n")
    return path


def notebooks(root: Path | None = None, only: list[str] | None = None) -> list[Path]:
    """The notebooks to time: every lesson and every solution, or those named in ``only``."""
    paths = [e.path for folder in ("notebooks", "solutions") for e in entries(folder, root)]
    if only:
        wanted = {Path(o).stem for o in only}
        unknown = wanted - {p.stem for p in paths}
        if unknown:
            raise SystemExit(f"no lesson or solution called {', '.join(sorted(unknown))}; "
                             f"choose from: {', '.join(p.stem for p in paths)}")
        paths = [p for p in paths if p.stem in wanted]
    return paths


def _interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt(f"signal {signum}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--full", action="store_true", help="full mode (FULL = True)")
    parser.add_argument("--only", nargs="+", metavar="NAME",
                        help="time only these notebooks (e.g. 05_franke 01_partitioner)")
    parser.add_argument("--render", action="store_true",
                        help="only rewrite the tables from the stored measurements")
    add_execution_options(parser)
    args = parser.parse_args(argv)
    root = course_from(parser, args.root)
    # Engines are launched with the venv's mpiexec, beside this Python.
    os.environ["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"

    # A SIGTERM (a CI timeout, kill) then shuts the kernel down and reaps its engines too.
    signal.signal(signal.SIGTERM, _interrupt)
    data = load(root)
    if not args.render:
        mode = "full" if args.full else "quick"
        block = data.setdefault(mode, {"machine": {}, "runs": {}})
        block["machine"] = machine()
        failed = 0
        for rel in notebooks(root, args.only):
            nb = nbformat.read(root / rel, as_version=4)
            if args.full and not switch_to_full(nb):
                print(f"{mode:<5} {rel}: no FULL switch, same as quick mode")
                block["runs"].pop(str(rel), None)
                continue
            timing = measure(root / rel, args.full, args.cell_timeout)
            failed += timing.status != "ok"
            # one line, after the run: the kernel's own messages cannot split it
            print(f"{mode:<5} {rel}: {timing.seconds:.0f} s, {timing.ranks} ranks, "
                  f"{timing.peak_mib:.0f} MiB, load {timing.load}, {timing.status}", flush=True)
            for name in timing.left_running:
                print(f"  still running after the kernel exited, now stopped: {name}")
            block["runs"][str(rel)] = asdict(timing)
            save(data, root)  # after each notebook: an interrupted run keeps what it measured
        if failed:
            print(f"{failed} notebook(s) did not run to the end; their times are partial.")
    for path in render.rewrite(data, root):
        print(f"rewrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
