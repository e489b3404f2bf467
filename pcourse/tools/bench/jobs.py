"""One measuring function per benchmark, two front doors: the lesson's engines, or mpiexec.

Every benchmark is a function ``measure(comm, spec, progress)`` that runs on every
rank of an MPI communicator. It is reached two ways:

- **on a running cluster** (:func:`on_cluster`): a notebook's ipyparallel engines
  are the ranks of one MPI job, so one ``apply`` runs ``measure`` on all of them,
  already started and imported. Rank 0 publishes its progress (and the rows so
  far), which the kernel shows as a progress bar.
- **in an MPI job of its own** (:func:`launch` in the launcher, :func:`rank_main`
  on the ranks): the command line. The launcher checks the arguments and imports
  nothing heavy, starts one ``mpiexec`` for the largest rank count, and gets the
  rows back from rank 0, with a breakdown of where the job's time went.

A rank count smaller than the job runs on the job's first ranks
(:class:`RankGroups`); the others sit out in a barrier that sleeps instead of
spinning, so they leave the cores to the ranks that measure.
"""

from __future__ import annotations

import dataclasses
import os
import sys
import time
import traceback
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pcourse.utils.io import save

LAUNCHED_AT = "PCOURSE_LAUNCHED_AT"  # the launcher's clock when it started mpiexec


class BenchError(RuntimeError):
    """A benchmark cannot run, or a run failed; the message says which and why.

    ``rows`` holds what was measured before the failure (nothing is thrown away).
    """

    def __init__(self, message: str, rows: Sequence[dict] = ()) -> None:
        super().__init__(message)
        self.rows = list(rows)


@dataclass
class Outcome:
    """What a benchmark hands back: its rows, the notes it made (skipped
    configurations and why), and on the command line the job's time by phase."""

    rows: list[dict] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    phases: dict[str, float] = field(default_factory=dict)


# ---- on every rank ------------------------------------------------------------------


class Progress:
    """How rank 0 tells its front door what is done; a no-op on the other ranks.

    ``send(progress, line)`` gets the whole state after each step (so a late failure
    loses nothing) and a line to show: the command line prints the line and hands
    the rows to the launcher, an engine publishes both to the notebook.
    """

    def __init__(self, send: Callable[[Progress, str], None] | None) -> None:
        self._send = send
        self.total = 0  # steps; the measuring function sets it once it has a plan
        self.count = 0
        self.outcome = Outcome()

    def note(self, text: str) -> None:
        """Something the reader must know (a configuration skipped, and why)."""
        if self._send is not None:
            self.outcome.notes.append(text)
            self._send(self, text)

    def done(self, text: str, rows: Sequence[dict]) -> None:
        """One more step done, with the rows it measured (maybe none)."""
        if self._send is not None:
            self.count += 1
            self.outcome.rows.extend(rows)
            self._send(self, f"[{self.count}/{self.total}] {text}")


def first_optimizer() -> None:
    """Create (and drop) one torch optimizer, so that every rank pays for the first one now.

    A process's first torch.optim optimizer makes torch import its compiler,
    torch._dynamo (an optimizer step needs it too, so no process that trains with
    torch.optim avoids it). Paid here by every rank at once, it is not paid inside
    a run by a rank that sat out the runs before while the others wait for it, and
    the start-up breakdown shows it by name.
    """
    import torch

    torch.optim.Adam([torch.zeros(1, requires_grad=True)])


def wait_politely(comm: Any, poll: float = 0.005) -> None:
    """A barrier that sleeps between checks.

    MPI's own Barrier spins a core while it waits; a rank that sits out a run must
    leave its core to the ranks that measure.
    """
    request = comm.Ibarrier()
    while not request.Test():
        time.sleep(poll)


class RankGroups:
    """The first p ranks of ``comm``, for every rank count p asked for.

    ``run(p, fn)`` calls ``fn(sub)`` on those ranks with each rank's fair share of
    its node's cores (as a fresh p-rank job would have); every rank of ``comm``
    then meets in :func:`wait_politely`. If ``fn`` fails on any rank, every rank
    raises (nobody waits for a rank that has given up).
    """

    def __init__(self, comm: Any, counts: Sequence[int]) -> None:
        from mpi4py import MPI

        self.comm = comm
        self.groups: dict[int, Any] = {}
        self.cores: dict[int, int] = {}
        for p in sorted(set(counts)):
            if not 1 <= p <= comm.size:
                raise BenchError(f"{p} ranks asked for, but this job has {comm.size}")
            sub = comm.Split(0 if comm.rank < p else MPI.UNDEFINED, comm.rank)
            self.groups[p] = sub
            if sub != MPI.COMM_NULL:
                node = sub.Split_type(MPI.COMM_TYPE_SHARED, key=sub.rank)
                self.cores[p] = max(1, (os.cpu_count() or 1) // node.size)
                node.Free()

    def run(self, p: int, fn: Callable[[Any], Any]) -> Any:
        """``fn(sub)`` on the first p ranks (their result), None on the others."""
        from pcourse.agree import RankFailure, everyone
        from pcourse.runtime.ranks import threads

        def step() -> Any:
            if p not in self.cores:
                return None  # sits this one out
            try:
                with threads(self.cores[p]):
                    return fn(self.groups[p])
            except Exception:
                traceback.print_exc()  # where it happened, for whoever debugs it
                raise

        try:
            return everyone(self.comm, step, f"a run at {p} rank(s)",
                            before_gather=lambda: wait_politely(self.comm))
        except RankFailure as exc:
            raise BenchError(str(exc)) from None

    def __enter__(self) -> RankGroups:
        return self

    def __exit__(self, *exc: object) -> None:
        from mpi4py import MPI

        for sub in self.groups.values():
            if sub != MPI.COMM_NULL:
                sub.Free()


# ---- front door 1: the lesson's engines -------------------------------------------------


def engine_entry(measure: Callable, spec: Any) -> tuple[int, Outcome | None]:
    """Runs on every engine: ``measure`` on the engines' MPI world; rank 0's outcome."""
    from mpi4py import MPI

    comm = MPI.COMM_WORLD
    send = None
    if comm.rank == 0:
        from ipyparallel.datapub import publish_data

        from pcourse.utils.progress import KEY

        def send(progress: Progress, line: str) -> None:
            publish_data({KEY: (progress.count, progress.total, line,
                                       dataclasses.asdict(progress.outcome))})

    progress = Progress(send)
    first_optimizer()
    measure(comm, spec, progress)
    return comm.rank, progress.outcome if comm.rank == 0 else None


def _world_size() -> int:
    from mpi4py import MPI

    return MPI.COMM_WORLD.size


def cluster_size(view: Any, timeout: float = 60.0) -> int:
    """How many engines ``view`` drives; they must be the whole MPI world.

    A benchmark's collectives involve every rank of the engines' job, so a view
    of only some engines would leave the others out and hang.
    """
    from ipyparallel import error as ipp_error

    try:
        sizes = view.apply_async(_world_size).get(timeout=timeout)
    except ipp_error.TimeoutError:
        raise BenchError(f"the engines did not answer within {timeout:.0f} s: are they still "
                         "busy with an interrupted cell? Wait, or restart the cluster") from None
    if len(set(sizes)) != 1 or sizes[0] != len(sizes):
        raise BenchError(f"the view drives {len(sizes)} engine(s) of an MPI job of "
                         f"{sizes[0]}: benchmark on a view of all engines (mc.view)")
    return len(sizes)


def on_cluster(view: Any, measure: Callable, spec: Any, *, desc: str, timeout: float,
               progress: bool = True) -> Outcome:
    """Run ``measure`` on every engine of ``view``; rank 0's outcome, with a progress bar.

    Notes (skipped configurations) are printed as they arrive. A failure or the
    timeout raises :class:`BenchError` carrying the rows measured so far.
    """
    from ipyparallel import error as ipp_error

    from pcourse.utils.progress import Bar, latest

    result = view.apply_async(engine_entry, measure, spec)
    bar = Bar(0, desc=desc, unit="step") if progress else None
    deadline = time.monotonic() + timeout
    seen, count = Outcome(), 0
    try:
        while not result.ready():
            if time.monotonic() > deadline:
                raise BenchError(f"{desc}: the engines did not finish within {timeout:.0f} s; "
                                 "they may be stuck: restart the cluster", seen.rows)
            state = latest(result.data)
            if state is not None and (state[0], len(state[3]["notes"])) != (
                    count, len(seen.notes)):
                count, total, line, outcome = state
                for note in outcome["notes"][len(seen.notes):]:
                    print(note)
                seen = Outcome(**outcome)
                if bar is not None:
                    bar.update(count, total, line.partition("] ")[2] or line)
            result.wait(0.2)
        answers = result.get()
    except ipp_error.CompositeError as exc:  # the engines' exceptions: the first says why
        raise BenchError(f"{desc} failed on the engines: {exc.elist[0][1]}", seen.rows) from None
    except ipp_error.RemoteError as exc:
        raise BenchError(f"{desc} failed on the engines: {exc}", seen.rows) from None
    except KeyboardInterrupt:
        print(f"{desc} interrupted here; the engines finish it before they take the next "
              "cell's work (or restart the cluster to stop them now)", file=sys.stderr)
        raise
    finally:
        if bar is not None:
            bar.close()
    outcome = next(o for rank, o in answers if rank == 0)
    for note in outcome.notes[len(seen.notes):]:
        print(note)
    return outcome


# ---- front door 2: an MPI job of its own ----------------------------------------------


def rank_main(measure: Callable, spec: Any,
              report: Callable[[Outcome], object] | None = None) -> None:
    """One rank of the command line's job: import, measure, hand the outcome back.

    The time before the first measurement (start-up, imports, MPI) is timed here,
    phase by phase. Rank 0 hands the outcome to :func:`launch` after every step;
    run under the user's own mpiexec, it calls ``report`` at the end instead. Does
    not return: the rank exits through :func:`leave`.
    """
    entered = time.time()
    _leave_with_launcher()
    phases = {"start: mpiexec, Python, argument parsing":
              entered - float(os.environ.get(LAUNCHED_AT, entered))}
    clock = time.perf_counter()
    import torch  # noqa: F401 - every benchmark needs it; timed on its own

    phases["import torch"] = time.perf_counter() - clock
    clock = time.perf_counter()
    from mpi4py import MPI

    from pcourse.runtime.ranks import init_rank
    from pcourse.tools.cluster.launch import report_rows

    init_rank()
    phases["MPI init, rank and cores"] = time.perf_counter() - clock
    clock = time.perf_counter()
    first_optimizer()
    phases["import torch's optimizer machinery (torch._dynamo)"] = time.perf_counter() - clock
    comm = MPI.COMM_WORLD
    handed = False

    def send(progress: Progress, line: str) -> None:
        nonlocal handed
        progress.outcome.phases = {**phases, "reported_at": time.time()}
        handed = report_rows([dataclasses.asdict(progress.outcome)])
        print(line, flush=True)  # after the rows: the launcher looks at them on each line

    progress = Progress(send if comm.rank == 0 else None)
    clock = time.perf_counter()
    try:
        measure(comm, spec, progress)
    except BenchError as exc:  # every rank raises it alike: say why, no traceback
        if comm.rank == 0:
            print(f"error: {exc}", file=sys.stderr)
        leave(MPI, 3)
    if comm.rank == 0:
        phases["measuring"] = time.perf_counter() - clock
        progress.outcome.phases = {**phases, "reported_at": time.time()}
        handed = report_rows([dataclasses.asdict(progress.outcome)])
        if not handed and report is not None:
            report(progress.outcome)
    leave(MPI)


def _leave_with_launcher(poll: float = 0.5) -> None:
    """Exit when the launcher that started this job is gone (killed, even with SIGKILL).

    Only where the launcher asks for it (``$PCOURSE_LAUNCHER_PID``): a job in a PID
    namespace of its own ends with its launcher without help.
    """
    import threading

    from pcourse.tools.cluster.launch import LAUNCHER_PID

    pid = int(os.environ.get(LAUNCHER_PID, "0") or 0)
    if pid <= 0:
        return

    def watch() -> None:
        while True:
            time.sleep(poll)
            try:
                os.kill(pid, 0)
            except ProcessLookupError:
                os._exit(137)  # nobody is left to read what this rank would report
            except PermissionError:
                pass

    threading.Thread(target=watch, daemon=True, name="pcourse-launcher-watch").start()


def leave(MPI: Any, code: int = 0) -> None:
    """End this rank now: flush, finalise MPI, exit without Python's orderly shutdown.

    Everything is written and handed over by now. Tearing down an interpreter that
    holds torch (many modules, many objects) takes long and saves nothing here.
    """
    sys.stdout.flush()
    sys.stderr.flush()
    MPI.Finalize()
    os._exit(code)


def launch(module: str, argv: Sequence[str], ranks: int, *, timeout: float,
           env: dict[str, str] | None = None,
           partial: Callable[[list[dict]], object] | None = None) -> Outcome:
    """Start ``python -m module *argv`` on ``ranks`` ranks; its rank 0's outcome.

    The job's lines are echoed as they come. Adds the phases only the launcher
    sees: the whole job, and the ranks' exit after their last report.
    ``partial(rows)`` gets the rows measured so far whenever there are more, so a
    launcher killed mid-job (even with SIGKILL) leaves them on disk; the job itself
    dies with the launcher (``mpirun(contain=True)``): no rank is left behind.
    """
    from pcourse.tools.cluster.launch import MPIJobError, mpirun_rows

    start = time.time()
    env = {**(env or {}), LAUNCHED_AT: repr(start)}
    counted = [0]

    def more(found: list[dict]) -> None:
        rows = Outcome(**found[0]).rows if found else []
        if partial is not None and len(rows) > counted[0]:
            counted[0] = len(rows)
            partial(rows)

    try:
        found, _ = mpirun_rows(ranks, ["-m", module, *argv], timeout=timeout,
                               env=env, echo=print, contain=True, on_rows=more)
    except MPIJobError as exc:
        got = Outcome(**exc.rows[0]) if exc.rows else Outcome()
        said = str(exc).split(" Output tail:")[0]  # the output itself was echoed as it came
        raise BenchError(said, got.rows) from None
    end = time.time()
    outcome = Outcome(**found[0])
    # Most of this is the launcher's, not the ranks': MPICH's gforker (the loopback-only
    # launcher, see pcourse.tools.cluster.launch) usually waits out its fixed bound of 2 s for the
    # ranks' exit statuses even when every rank has gone.
    outcome.phases["exit: report, MPI shutdown, mpiexec's wait"] = end - outcome.phases.pop(
        "reported_at")
    outcome.phases["rank job"] = end - start
    return outcome


def run_command(module: str, argv: Sequence[str], measure: Callable, spec: Any,
                report: Callable[[Outcome], object], *, ranks: int, timeout: float,
                prepare: Callable[[], str], error: Callable[[str], object],
                refused: tuple[type[Exception], ...] = (),
                partial: str | os.PathLike[str] | None = None,
                write: Callable[[Path, list[dict]], object] | None = None,
                what: str = "benchmark", env: dict[str, str] | None = None) -> int:
    """Every benchmark's ``main`` once its arguments are read: one tail, so that each
    command line refuses, launches and reports alike; an exit code.

    On a rank (of our job, or of the user's own mpiexec): :func:`rank_main`, which does
    not return. In the launcher: ``prepare()`` refuses what cannot run before anything
    starts, raising :class:`BenchError`, NotWritable or one of ``refused`` (``error``,
    argparse's, says it and exits), and returns the note :func:`check_ranks` made; then
    :func:`launch` on ``ranks`` ranks and ``report`` of its outcome. With ``partial`` and
    ``write``, the rows measured so far are kept in ``partial`` as they come
    (``write(path, rows)``), so a failure, even a SIGKILL of this launcher, loses none: a
    failure says where they are. After the report the whole run is in its own files, and
    ``partial`` goes (an earlier run's goes at the start: it is not this run's).
    """
    from pcourse.runtime.ranks import launcher
    from pcourse.utils.io import NotWritable

    if launcher() == "mpi":
        rank_main(measure, spec, report)
    refusals: tuple[type[Exception], ...] = (BenchError, NotWritable, *refused)
    try:
        note = prepare()
    except refusals as exc:
        error(f"{exc}\nNothing was started.")
        raise  # error exits; for one that returns
    if note:
        print(note)
    keep = None
    if partial is not None and write is not None:
        kept, writer = Path(partial), write
        kept.unlink(missing_ok=True)

        def keep(rows: list[dict]) -> Path:
            return save(kept, lambda path: writer(path, rows))

    try:
        outcome = launch(module, argv, ranks, timeout=timeout, env=env, partial=keep)
    except BenchError as exc:
        if keep is None:
            print(f"error: the {what} failed: {exc}", file=sys.stderr)
        else:
            print(f"error: the {what} job failed: {exc}", file=sys.stderr)
            print(f"the {len(exc.rows)} row(s) measured before the failure are in "
                  f"{keep(exc.rows)}" if exc.rows else "No results written.", file=sys.stderr)
        return 1
    report(outcome)
    if keep is not None:
        kept.unlink(missing_ok=True)
    return 0


# ---- the command line's checks and results files --------------------------------------


# ---- the command lines' argument types (argparse ``type=``): refused as they are read ----


def whole(least: int = 1, most: int | None = None, what: str = "") -> Callable[[str], int]:
    """An argparse type: a whole number in [least, most], or an error naming the value.

    Refused while the command line is read, so nothing starts (no MPI job, no file)
    on a value that cannot work; ``what`` says why there is an upper limit.
    """
    def parse(text: str) -> int:
        try:
            value = int(text.replace("_", ""))
        except ValueError:
            raise _bad(f"{text!r} is not a whole number (write it out: 1000000, not 10**6)"
                       ) from None
        if value < least:
            raise _bad(f"{value} is too small: it must be at least {least}")
        if most is not None and value > most:
            raise _bad(f"{value:,} is too large: at most {most:,}{what}")
        return value
    parse.__name__ = "whole number"
    return parse


def seconds(text: str) -> float:
    """An argparse type: a time limit, in seconds, above zero."""
    try:
        value = float(text)
    except ValueError:
        raise _bad(f"{text!r} is not a number of seconds") from None
    if not 0 < value < float("inf"):
        raise _bad(f"{text} seconds: a time limit must be above 0 (e.g. 600)")
    return value


seconds.__name__ = "seconds"


def _bad(message: str) -> Exception:
    import argparse

    return argparse.ArgumentTypeError(message)


def check_ranks(counts: Sequence[int], oversubscribe: bool) -> str:
    """Refuse rank counts this machine cannot run sensibly; a note if ranks share cores.

    Up to one rank per core is fine; a few per core runs (the course's laptops
    share cores between ranks) with a note; beyond the project's limit it needs
    ``--oversubscribe``. The GPU count (torch) is consulted only past the cores.
    """
    cores = os.cpu_count() or 1
    n = max(counts)
    if n <= cores:
        return ""
    from pcourse.tools.cluster.launch import max_engines

    limit = max_engines()
    if n > limit and not oversubscribe:
        raise BenchError(
            f"--ranks {n} would oversubscribe this machine: {n} ranks on {cores} CPU "
            f"core(s), more than the {limit} it can run sensibly; every rank would mostly "
            "wait for a core. Use fewer ranks, or pass --oversubscribe to run anyway.")
    return (f"note: {n} ranks on {cores} core(s): ranks share cores, so times at "
            f"{n} ranks include waiting for one")
