"""How an engine cluster fails, in words: :class:`ClusterError`, and what its processes left.

ipyparallel's launchers keep a process (``mpiexec``, ``ipcontroller``) and a log file;
a start that fails or a cluster that dies is explained from them: :func:`exited` (is it
gone?), :func:`how_it_ended` (its exit status, or the signal that killed it) and
:func:`log_tail` (the last lines it wrote). :mod:`pcourse.tools.cluster.engines` raises
the error; the interrupt view (:mod:`pcourse.tools.cluster.view`) and Slurm's side
(:mod:`pcourse.tools.cluster.slurm`) raise it too.
"""

from __future__ import annotations

import re
import signal
from pathlib import Path


class ClusterError(RuntimeError):
    """The engine cluster could not be started; the message says why and what to do."""


def exited(launcher: object) -> bool:
    """Has a launcher's process (mpiexec or ipcontroller) already exited?"""
    process = getattr(launcher, "process", None)
    if process is None:
        return getattr(launcher, "state", "running") == "after"
    try:
        return not process.is_running() or process.status() == "zombie"
    except Exception:  # noqa: BLE001 - psutil.NoSuchProcess and friends: it is gone
        return True


def how_it_ended(launcher: object, within: float = 5.0) -> str:
    """How a launcher's process ended, in words: its exit status, or the signal that killed it
    (a process killed from outside leaves an empty log; only this tells it apart).

    psutil keeps the status of a child it reaped, whichever thread waited (ipyparallel's
    own waits on it too); a zombie is reaped here, within ``within`` s.
    """
    import psutil

    try:
        code = launcher.process.wait(timeout=within)  # type: ignore[attr-defined]
    except (AttributeError, psutil.Error):
        code = None
    return in_words(code) if isinstance(code, int) else "its exit status is unknown"


def in_words(code: int) -> str:
    """A process's return code as Popen gives it (``-N``: killed by signal N), in words."""
    if code >= 0:
        return f"exit status {code}"
    try:
        return f"killed by {signal.Signals(-code).name}"
    except ValueError:
        return f"killed by signal {-code}"


def log_text(launcher: object) -> str:
    """A launcher's output so far (read afresh: ipyparallel caches its first read)."""
    try:
        return Path(launcher.output_file).read_text(errors="replace")  # type: ignore[attr-defined]
    except (AttributeError, OSError):
        return ""


def log_tail(launcher: object, lines: int = 20) -> str:
    """The last ``lines`` lines of a launcher's output, or "(no output)"."""
    tail = log_text(launcher).strip().splitlines()[-lines:]
    return "\n".join(tail) if tail else "(no output)"


def rank_exits(text: str) -> list[tuple[int | None, str]]:
    """Each rank's exit that a launcher's output reports (:mod:`rank_exit`'s lines), in the
    order they happened: (the rank, or None where the launcher did not say, and how)."""
    from pcourse.tools.cluster.rank_exit import RANK_EXIT  # the marker's one spelling

    found = []
    for match in re.finditer(rf"{RANK_EXIT} (\d+)(?: rank=(\d+))?", text):
        code, rank = int(match.group(1)), match.group(2)
        # the wrapper reports a shell-style code: 128 + N is "killed by" signal N
        found.append((int(rank) if rank is not None else None,
                      in_words(128 - code if code > 128 else code)))
    return found


def who_died(text: str) -> str:
    """One line naming the rank that ended first and how, then how the others ended (in
    the order they did); empty while no rank has exited. The first exit is the failure:
    whatever ends the others (MPICH and Open MPI end a job's ranks once one of them is killed) comes
    after it (lesson 14)."""
    exits = rank_exits(text)
    if not exits:
        return ""
    (rank, how), rest = exits[0], exits[1:]
    name = f"rank {rank}" if rank is not None else "a rank"
    line = f"{name} ended first ({how})"
    if rest:
        line += "; then ended " + ", ".join(
            f"rank {r} ({h})" if r is not None else h for r, h in rest)
    return line
