"""Engines as one Slurm job: submitted, watched, cancelled, and explained in Slurm's words.

ipyparallel's Slurm launcher writes the ``sbatch`` script, submits it and cancels it
with ``scancel``, but it cannot see the job: a job that waits in the queue, a job that
Slurm refused and a job that Slurm ended all look like engines that never came.
:class:`SlurmJobLauncher` is that launcher with eyes: ``sbatch``'s own error becomes
the error, :meth:`SlurmJobLauncher.job` reads the job's state and Slurm's reason for
it (``scontrol show job``), and stopping waits until the job has left the queue.
:class:`Slurm` is the job ``start_cluster(n, slurm=...)`` asks for (or ``$PCOURSE_SLURM``
describes); :func:`check_job` and :func:`ended_job` are what
:mod:`pcourse.tools.cluster.engines` asks of it while the engines start and run.

INSTRUCTORS.md ("A shared cluster under Slurm") is the instructor's side of it.
"""

from __future__ import annotations

import dataclasses
import os
import shutil
import subprocess
import time
from dataclasses import dataclass
from typing import Any

import ipyparallel as ipp
from ipyparallel.cluster.launcher import LauncherError

from pcourse.multinode import SlurmGPUEngineSetLauncher
from pcourse.tools.cluster.failures import ClusterError, log_tail

SLURM_ENV = "PCOURSE_SLURM"  # e.g. "partition=ws time=02:00:00": lessons start Slurm jobs
SLURM_START_TIMEOUT = 600.0  # seconds for engines to start under Slurm: the job may queue first

COMMAND_TIMEOUT = 60.0  # seconds any one Slurm command may take (a busy controller is slow)
GONE_TIMEOUT = 30.0  # seconds stopping waits for a cancelled job to leave the queue
POLL = 0.2
# Job states after which a job never runs again (squeue(1), "JOB STATE CODES").
ENDED = frozenset({"BOOT_FAIL", "CANCELLED", "COMPLETED", "DEADLINE", "FAILED", "NODE_FAIL",
                   "OUT_OF_MEMORY", "PREEMPTED", "REVOKED", "SPECIAL_EXIT", "TIMEOUT"})


class SlurmError(RuntimeError):
    """A Slurm command failed; the message is Slurm's own."""


@dataclass(frozen=True)
class JobState:
    """What Slurm says of a job: its state (PENDING, RUNNING, TIMEOUT, ...) and why."""

    job_id: str
    state: str
    reason: str  # Slurm's Reason field: PartitionDown, Resources, TimeLimit, None, ...

    @property
    def pending(self) -> bool:
        return self.state == "PENDING"

    @property
    def ended(self) -> bool:
        return self.state in ENDED

    def __str__(self) -> str:
        return f"Slurm job {self.job_id}: JobState={self.state} Reason={self.reason}"


def missing() -> str:
    """Why this machine cannot submit Slurm jobs (no ``sbatch`` on PATH); empty if it can."""
    if shutil.which("sbatch") is None:
        return ("there is no `sbatch` on PATH, so no Slurm to submit the engines to. On a "
                "cluster, start JupyterLab on a login node (where `sbatch` works); elsewhere, "
                "unset $PCOURSE_SLURM.")
    return ""


def run(command: list[str], env: dict[str, str] | None = None) -> str:
    """Run a Slurm command; its output, or SlurmError with what it printed on failure."""
    try:
        done = subprocess.run(command, env=env, stdin=subprocess.DEVNULL, capture_output=True,
                              text=True, errors="replace", timeout=COMMAND_TIMEOUT)
    except FileNotFoundError:
        raise SlurmError(f"`{command[0]}` is not on PATH: is this a Slurm login node?") from None
    except subprocess.TimeoutExpired:
        raise SlurmError(f"`{' '.join(command)}` gave no answer within {COMMAND_TIMEOUT:.0f} s "
                         "(is slurmctld up? `sinfo` says)") from None
    if done.returncode != 0:
        said = (done.stderr.strip() or done.stdout.strip() or "no message").splitlines()
        raise SlurmError(f"`{' '.join(command)}` failed: {' / '.join(said[-3:])}")
    return done.stdout


def job_state(job_id: str) -> JobState | None:
    """The job's state and Slurm's reason; None once Slurm has forgotten it (MinJobAge)."""
    try:
        text = run(["scontrol", "show", "job", "--oneliner", job_id])
    except SlurmError as exc:
        if "Invalid job id" in str(exc):
            return None
        raise
    fields = dict(item.partition("=")[::2] for item in text.split())
    return JobState(job_id, fields.get("JobState", "UNKNOWN"), fields.get("Reason", "None"))


def in_queue(job_id: str) -> bool:
    """Does ``squeue`` still list the job (pending, running or completing)?"""
    return bool(run(["squeue", "--noheader", "--jobs", job_id, "--format", "%i"]).strip())


def wait_gone(job_id: str, timeout: float = GONE_TIMEOUT) -> bool:
    """Wait until ``squeue`` no longer lists the job; False if it still does at the deadline."""
    deadline = time.monotonic() + timeout
    while in_queue(job_id):
        if time.monotonic() > deadline:
            return False
        time.sleep(POLL)
    return True


class SlurmJobLauncher(SlurmGPUEngineSetLauncher):
    """ipyparallel's Slurm engine launcher (GPU lines included), able to see its job.

    ``sbatch`` refusing the job raises LauncherError with Slurm's message (ipyparallel's
    would print it on the kernel's stderr and raise a bare exit status); :meth:`job`
    says what Slurm says of the job; :meth:`stop` cancels it and waits until the queue
    no longer lists it, so the allocation is free when ``stop_cluster`` returns.
    """

    def _insert_job_array_in_script(self) -> None:
        """ipyparallel's ``--ntasks``, then ``--no-requeue``: a job that Slurm requeues
        (after a node failure) would bring up fresh engines that know nothing of the
        notebook's work; ended, the notebook says so (:meth:`job`). Added last, since
        ipyparallel looks for ``--ntasks`` with a pattern that ``--no-requeue`` matches."""
        super()._insert_job_array_in_script()
        first, rest = self.batch_template.split("\n", 1)
        self.batch_template = "\n".join([first, "#SBATCH --no-requeue", rest])

    def _run_command(self, command: list[str], **kwargs: Any) -> str:
        try:
            return run(command, env=kwargs.get("env"))
        except SlurmError as exc:
            raise LauncherError(str(exc)) from None

    def job(self) -> JobState | None:
        """Slurm's view of the job; None before it was submitted or once Slurm forgot it."""
        return job_state(self.job_id) if self.job_id else None

    def stop(self) -> str:
        if not self.job_id:  # sbatch refused it: nothing to cancel
            self.notify_stop({"job_id": "", "output": ""})
            return ""
        try:
            output = super().stop()
        except LauncherError:  # scancel refuses a job that has already ended: fine
            if in_queue(self.job_id):
                raise
            output = ""
        if not wait_gone(self.job_id):
            raise LauncherError(f"Slurm job {self.job_id} was cancelled but is still in the "
                                f"queue after {GONE_TIMEOUT:.0f} s (`squeue -j {self.job_id}`)")
        return output


@dataclass(frozen=True)
class Slurm:
    """Engines as one Slurm job: ``sbatch`` submits it, ``srun`` starts them as one MPI job.

    ``time``, ``partition`` and ``account`` are sbatch's options of those names (empty:
    the site's default); ``gpus_per_task`` and ``gres`` ask for GPUs (0 / empty: none;
    see :mod:`pcourse.multinode`). ``folder`` holds the cluster's files (the job script, the
    engines' log); the compute nodes write there, so it must be on a file system they
    share with this machine: the home folder by default, never /tmp. The engines run
    this same Python (``sys.executable``), so the course's folder must be shared too.
    """

    time: str = "01:00:00"
    partition: str = ""
    account: str = ""
    folder: str = "~/.cache/pcourse/clusters"
    gpus_per_task: int = 0
    gres: str = ""

    @classmethod
    def from_env(cls) -> Slurm | None:
        """The job ``$PCOURSE_SLURM`` describes (``"partition=ws time=02:00:00"``); None if unset.

        What lets an instructor run the lessons, unchanged, on a Slurm cluster.
        """
        text = os.environ.get(SLURM_ENV, "").strip()
        if not text:
            return None
        names = [f.name for f in dataclasses.fields(cls)]
        given: dict[str, Any] = {}
        for item in text.split():
            key, eq, value = item.partition("=")
            if not eq or key not in names:
                raise ClusterError(
                    f"${SLURM_ENV} has {item!r}; it takes space-separated "
                    f"{', '.join(f'{k}=...' for k in names)} (for example "
                    f"{SLURM_ENV}='partition=ws time=02:00:00').")
            given[key] = value
        if "gpus_per_task" in given:
            text = given["gpus_per_task"]
            if not text.isdigit():
                raise ClusterError(f"${SLURM_ENV} has gpus_per_task={text}; it must be a "
                                   "whole number of GPUs per engine (gpus_per_task=1)")
            given["gpus_per_task"] = int(text)
        return cls(**given)


def jobs_of(cluster: ipp.Cluster) -> list[JobState]:
    """What Slurm says of the cluster's engine jobs (none: not a Slurm cluster)."""
    found = []
    for launcher in list(cluster.engines.values()):
        if isinstance(launcher, SlurmJobLauncher):
            try:
                state = launcher.job()
            except SlurmError as exc:  # Slurm itself unreachable: say so
                state = JobState(launcher.job_id, "UNKNOWN", str(exc))
            if state is not None:
                found.append(state)
    return found


def ended_job(cluster: ipp.Cluster) -> JobState | None:
    """The cluster's engine job that Slurm has ended, if any."""
    return next((job for job in jobs_of(cluster) if job.ended), None)


def check_job(cluster: ipp.Cluster, registered: int, n: int,
              timeout: float | None = None) -> None:
    """ClusterError, in Slurm's words, if the engines' job has ended; with ``timeout``
    (the start's deadline has passed) also if it is still waiting in the queue."""
    for job in jobs_of(cluster):
        log = "".join(log_tail(lau) for lau in cluster.engines.values())
        if job.ended:
            raise ClusterError(
                f"Slurm ended the engines' job before they registered ({registered} of {n} "
                f"had): {job}. Last lines of its log:\n{log}\n`scontrol show job "
                f"{job.job_id}` has the details.")
        if timeout is not None and job.pending:
            raise ClusterError(
                f"the engines' job waited in Slurm's queue for all of the {timeout:.0f} s "
                f"start timeout and was cancelled: {job}. `sinfo` shows the partitions and "
                "their nodes; ask for one with free nodes, fewer engines, or give "
                "start_cluster a longer timeout=.")
