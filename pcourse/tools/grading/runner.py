"""Grade batches of exercises in worker processes, each learner's on a job of their own.

A *batch* is one learner's exercises (the test suite's trusted wrong answers come in a
few batches of many). Each batch runs in a worker process of its own
(``python -m pcourse.tools.grading.runner``), at most ``workers`` at a time: the worker
starts a :class:`~pcourse.tools.grading.job.Job` (the learner's ranks and learner
processes, jailed where there is bubblewrap), opens each exercise's code there and runs
its checks (:mod:`pcourse.tools.grading.refs`), computing every reference itself, and
writes each exercise's result as a line of JSON as soon as it is decided. A job that
broke (a learner process or a rank died, a trial never finished) is closed and the next
exercise gets a fresh one; at the end of the batch the job is closed, so nothing of one
learner's meets the next. No learner code runs in a worker or in the process that
collects the rows: they read only what the ranks send, as wire data.

What can go wrong is contained at three levels: a trial past its deadline breaks the
job (the worker closes it); an exercise past its time limit stops after the check that
ran over; a worker past the limit of its whole batch (or that dies) is stopped by the
parent, and every exercise it had not finished gets a row saying so.
"""

from __future__ import annotations

import json
import os
import selectors
import signal
import subprocess
import sys
import time
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass, field
from typing import Any

START_ALLOWANCE = 180.0  # seconds a worker may spend starting (and restarting) jobs
STOP_GRACE = 10.0  # seconds an overdue worker gets to close its job before it is killed
NOT_RUN = "did not run: grading stopped before this check"


@dataclass
class Task:
    """One exercise to grade: its name and the code to run (the setup's imports, then the
    learner's cells), within ``limit`` seconds."""

    key: Any
    exercise: str
    codes: list[str]
    limit: float
    first_failure_only: bool = False  # stop at the first failing check (the suite's)


@dataclass
class Result:
    """What grading one exercise gave."""

    status: str = "graded"  # or timeout, crashed, error
    passed: int = 0
    total: int = 0
    first_failure: str | None = None
    checks: list[tuple[bool, str]] = field(default_factory=list)  # (passed, its line)
    stopped_early: bool = False  # first_failure_only stopped it before its last check
    seconds: float = 0.0


# ---------------------------------------------------------------- in the worker

def explain(text: str) -> str:
    """A failure in plain words; an unsolved exercise says so."""
    if "NotImplementedError" in text:
        return "not solved yet (NotImplementedError): fill in the cells marked YOUR CODE HERE"
    return text.strip().splitlines()[0] if text.strip() else "failed"


def _opening_failure(answer: tuple) -> tuple[str, str]:
    """(status, why) of learner code that could not even be defined."""
    from pcourse.tools.grading.checks import CELL_TIMEOUT
    from pcourse.tools.grading.relay import ENGINE_DIED

    if answer[0] == "timeout":
        return "graded", (f"your code did not finish within {CELL_TIMEOUT:g} s: a cell should "
                          "only define functions")
    if answer[0] == "error" and len(answer) == 3:
        return "graded", explain(f"your code raised {answer[1]}: {answer[2]}")
    return "crashed", ENGINE_DIED


def grade_exercise(job: Any, task: Task) -> Result:
    """Open ``task``'s code on ``job`` and run its checks, each to its verdict."""
    from pcourse.tools.grading import checks, refs

    start = time.monotonic()
    module = refs.exercise(task.exercise)
    n = len(module.CHECKS)
    result = Result(total=n)
    answer = job.open(task.codes, getattr(module, "NETWORKED", False), checks.CELL_TIMEOUT)
    if answer != ("ok",):
        result.status, why = _opening_failure(answer)
        result.first_failure = f"your code: {why}"
        result.checks = [(False, f"did not run: your code failed ({why})")] * n
        result.seconds = time.monotonic() - start
        return result
    for i, check in enumerate(module.CHECKS, 1):
        if time.monotonic() > start + task.limit:
            result.status = "timeout"
            result.first_failure = result.first_failure or \
                f"did not finish within {task.limit:g} s (in check {i - 1}/{n})"
            break
        problem = checks.outcome(check, job)
        result.checks.append((problem is None, checks.line(i, n, check.what, problem)))
        if problem is None:
            result.passed += 1
            continue
        result.first_failure = result.first_failure or f"check {i}/{n}: {explain(problem)}"
        if task.first_failure_only:
            result.stopped_early = i < n
            break
    result.checks += [(False, NOT_RUN)] * (n - len(result.checks))
    result.seconds = time.monotonic() - start
    return result


def grade_batch(tasks: list[Task], jailed: bool, say: Callable[[Any, Result], None]) -> None:
    """Grade ``tasks`` in order on one job (a fresh one after a job broke); ``say`` hears
    of each result as it is decided."""
    from pcourse.tools.grading.job import Job, JobError
    from pcourse.tools.grading.learner import warm_up

    job = None
    try:
        for task in tasks:
            start = time.monotonic()
            try:
                if job is None:
                    job = Job(jailed)
                    warm_up()  # the references' first steps, while the learner processes import
                result = grade_exercise(job, task)
            except JobError as exc:
                result = Result(status="error", first_failure=f"the grader could not run it: "
                                f"{exc}", seconds=time.monotonic() - start)
            if job is not None and job.broken:
                job.close()
                job = None
            say(task.key, result)
    finally:
        if job is not None:
            job.close()


def _worker() -> None:
    """The worker process: a batch as JSON on stdin, a line of JSON per result on stdout."""
    from pcourse.tools.grading.job import adopt_orphans, leftovers

    out = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)  # what anything prints goes to stderr: stdout carries the results
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # closes the job on the way out
    adopt_orphans()
    batch = json.load(sys.stdin)
    tasks = [Task(**t) for t in batch["tasks"]]

    def say(key: Any, result: Result) -> None:
        out.write(json.dumps({"key": key, "result": asdict(result)}) + "\n")
        out.flush()

    try:
        grade_batch(tasks, batch["jailed"], say)
    finally:
        for p in leftovers():  # unjailed learner code that left a process behind
            p.kill()


# ---------------------------------------------------------------- in the parent

class _Worker:
    def __init__(self, tasks: list[Task], jailed: bool) -> None:
        self.tasks, self.left = tasks, {json.dumps(t.key): t for t in tasks}
        self.deadline = time.monotonic() + START_ALLOWANCE + sum(t.limit for t in tasks)
        self.process = subprocess.Popen(
            [sys.executable, "-m", "pcourse.tools.grading.runner"], stdin=subprocess.PIPE,
            stdout=subprocess.PIPE, start_new_session=True)
        assert self.process.stdin is not None and self.process.stdout is not None  # PIPEs
        self.stdout = self.process.stdout  # a line of JSON per result
        self.process.stdin.write(json.dumps(
            {"jailed": jailed, "tasks": [asdict(t) for t in tasks]}).encode())
        self.process.stdin.close()
        self.buffer = b""

    def stop(self) -> None:
        """SIGTERM (the worker closes its job), then SIGKILL for whatever is left."""
        try:
            os.killpg(self.process.pid, signal.SIGTERM)
            self.process.wait(STOP_GRACE)
        except (OSError, subprocess.TimeoutExpired):
            pass
        try:
            os.killpg(self.process.pid, signal.SIGKILL)
        except OSError:
            pass
        self.process.wait()
        from pcourse.tools.grading import sandbox

        sandbox.release(owner=self.process.pid)  # a worker killed leaves its cgroups behind


def run_batches(batches: Iterable[list[Task]], workers: int, jailed: bool,
                on_result: Callable[[Any, Result], None]) -> None:
    """Grade every batch in a worker process of its own, ``workers`` at a time;
    ``on_result(key, result)`` hears of each exercise as soon as it is decided."""
    todo = deque(b for b in batches if b)
    running: list[_Worker] = []
    selector = selectors.DefaultSelector()
    try:
        while todo or running:
            while todo and len(running) < workers:
                w = _Worker(todo.popleft(), jailed)
                selector.register(w.stdout, selectors.EVENT_READ, w)
                running.append(w)
            for key, _ in selector.select(timeout=1.0):
                w = key.data
                chunk = os.read(w.stdout.fileno(), 1 << 16)
                if chunk:
                    w.buffer += chunk
                    *lines, w.buffer = w.buffer.split(b"\n")
                    for text in lines:
                        _heard(w, json.loads(text), on_result)
                    continue
                selector.unregister(w.stdout)
                running.remove(w)
                w.process.wait()
                _end(w, "error", "the grader's worker process died", on_result)
            for w in [w for w in running if time.monotonic() > w.deadline]:
                selector.unregister(w.stdout)
                running.remove(w)
                w.stop()
                _end(w, "timeout", "did not finish within its time limit", on_result)
    finally:
        for w in running:
            w.stop()
        selector.close()


def _heard(w: _Worker, said: dict, on_result: Callable[[Any, Result], None]) -> None:
    task = w.left.pop(json.dumps(said["key"]), None)
    if task is not None:
        result = Result(**said["result"])
        result.checks = [(passed, line) for passed, line in result.checks]  # JSON's lists
        on_result(task.key, result)


def _end(w: _Worker, status: str, why: str, on_result: Callable[[Any, Result], None]) -> None:
    """A row for every exercise the worker never finished."""
    for task in w.left.values():
        on_result(task.key, Result(status=status, first_failure=why))
    w.left.clear()


if __name__ == "__main__":
    _worker()
