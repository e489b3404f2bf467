"""Faults learners cause: a hung rank, an interrupted cell, and every way a notebook ends.

Each must end in a clear error or a usable cluster, within the collective's
timeout or seconds, and leave no process and no file behind.
"""

from __future__ import annotations

import inspect
import os
import re
import signal
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from pathlib import Path

import ipyparallel as ipp
import psutil
import pytest
from conftest import launcher_listeners
from IPython.paths import get_ipython_dir

from pcourse.backends import BACKENDS, backend_class
from pcourse.backends.base import DEFAULT_TIMEOUT, TIMEOUT_ENV, collective_timeout
from pcourse.tools.cluster import ClusterError, start_cluster, stop_cluster
from pcourse.tools.cluster.launch import mpirun
from pcourse.tools.cluster.reaping import sweep_mpi_segments

# --- a hung rank ---------------------------------------------------------------------

HUNG = """
import time
import torch
from mpi4py import MPI
from pcourse.backends import make_backend

backend = make_backend("mpi", timeout=2)
if backend.rank == 1:
    start = time.monotonic()
    try:
        backend.allreduce(torch.ones(4))
        print("rank 1: the allreduce returned", flush=True)
    except Exception as exc:
        took = time.monotonic() - start
        print(f"rank 1 gave up after {took:.1f} s: {type(exc).__name__}: {exc}", flush=True)
        MPI.COMM_WORLD.Abort(1)  # ends rank 0's wait too
else:
    time.sleep(60)  # rank 0 never joins the allreduce
"""


@pytest.mark.mpi
def test_a_hung_rank_is_found_within_the_collective_timeout(tmp_path: Path) -> None:
    script = tmp_path / "hung.py"
    script.write_text(HUNG)
    done = mpirun(2, [str(script)], timeout=30, check=False)
    gave_up = re.search(r"rank 1 gave up after ([\d.]+) s: (.*)", done.stdout)
    assert gave_up, done.stdout[-2000:]
    assert float(gave_up.group(1)) >= 2  # not before the timeout the backend was given
    assert gave_up.group(2).startswith("CollectiveTimeout: rank 1: allreduce did not complete "
                                       "within 2 s")
    assert "restart" in gave_up.group(2)  # and says what to do


HUNG_BY_DEFAULT = """
import time
import torch
from mpi4py import MPI
from pcourse.backends import make_backend

CASES = [("mpi", "broadcast"), ("mpi", "barrier"), ("mpi-pickle-deadline", "allreduce"),
         ("mpi-pickle-deadline", "broadcast")]  # mpi-pickle: the source's blocking call
backends = [make_backend(name) for name, _ in CASES]  # no timeout given: the default
if MPI.COMM_WORLD.rank == 1:
    for backend, (name, collective) in zip(backends, CASES):
        call = {"allreduce": lambda: backend.allreduce(torch.ones(4), check=False),
                "broadcast": lambda: backend.broadcast(torch.ones(4), root=0, check=False),
                "barrier": backend.barrier}[collective]
        start = time.monotonic()
        try:
            call()
            print(f"{name} {collective}: returned", flush=True)
        except Exception as exc:
            took = time.monotonic() - start
            print(f"{name} {collective}: gave up after {took:.1f} s: {type(exc).__name__}: {exc}",
                  flush=True)
        try:
            call()
        except RuntimeError as exc:
            print(f"{name} {collective}: then {exc}", flush=True)
    MPI.COMM_WORLD.Abort(1)  # ends rank 0's wait too
else:
    time.sleep(120)  # rank 0 never joins any of them
"""


@pytest.mark.mpi
def test_a_hung_rank_is_found_within_the_default_deadline_in_every_mpi_collective(
        tmp_path: Path) -> None:
    script = tmp_path / "hung.py"
    script.write_text(HUNG_BY_DEFAULT)
    done = mpirun(2, [str(script)], timeout=90, check=False,
                  env={TIMEOUT_ENV: "2"})  # the default deadline, scaled down
    for name, collective in [("mpi", "broadcast"), ("mpi", "barrier"),
                             ("mpi-pickle-deadline", "allreduce"),
                             ("mpi-pickle-deadline", "broadcast")]:
        gave_up = re.search(rf"^{name} {collective}: gave up after ([\d.]+) s: (.*)$",
                            done.stdout, re.MULTILINE)
        assert gave_up, done.stdout[-3000:]
        assert 2 <= float(gave_up.group(1)) < 12  # the deadline, not sooner; shared machine
        assert gave_up.group(2).startswith(f"CollectiveTimeout: rank 1: {collective} did not "
                                           "complete within 2 s")
        # and the backend, now out of step with its peers, says so instead of mixing data
        assert f"{name} {collective}: then this {name} backend stopped waiting in a " \
               f"{collective}" in done.stdout, done.stdout[-3000:]


def test_the_default_deadline_is_one_setting_for_every_backend(monkeypatch) -> None:
    for name in BACKENDS:
        timeout = inspect.signature(backend_class(name).__init__).parameters["timeout"]
        assert timeout.default is None, name  # None: collective_timeout() decides
    monkeypatch.delenv(TIMEOUT_ENV, raising=False)
    assert collective_timeout() == DEFAULT_TIMEOUT
    assert collective_timeout(5) == 5.0
    monkeypatch.setenv(TIMEOUT_ENV, "7.5")
    assert collective_timeout() == 7.5
    assert collective_timeout(3) == 3.0  # an explicit timeout wins
    for bad in ("0", "-1", "soon", "inf", "nan"):
        monkeypatch.setenv(TIMEOUT_ENV, bad)
        with pytest.raises(ValueError, match=f"{TIMEOUT_ENV} must be a positive number"):
            collective_timeout()
    for bad in (0, -2.0, True, "10"):
        with pytest.raises(ValueError, match="timeout must be a positive number"):
            collective_timeout(bad)


# --- every way of ending the notebook or script that owns a cluster --------------------

OWNER = """
import os, signal, sys, time
from pcourse.tools.cluster import start_cluster

signal.signal(signal.SIGINT, signal.default_int_handler)  # as in a terminal
mc = start_cluster(1)
print(mc.view.apply_sync(os.getpid)[0], flush=True)
if sys.argv[1] != "exit":  # a script that forgets stop_cluster just ends here
    time.sleep(600)
"""


def _owned(mark: str, owner: int) -> list[psutil.Process]:
    """Processes started, directly or not, by the owner carrying ``mark`` (not the owner)."""
    from pcourse.tools.cluster.reaping import marked

    found = []
    for proc in marked(mark, "PCOURSE_TEST_OWNER", spare=(owner,)):
        try:
            if proc.status() != psutil.STATUS_ZOMBIE:
                found.append(proc)
        except psutil.Error:
            continue
    return found


def _files_of(owner: int) -> list[Path]:
    """Connection files, logs and folders a cluster of this owner could have left."""
    profile = Path(get_ipython_dir()) / "profile_default"
    return [*Path(tempfile.gettempdir()).glob(f"pcourse-cluster-{owner}-*"),
            *(profile / "security").glob(f"*pcourse-{owner}-*"),
            *(profile / "log").glob(f"*pcourse-{owner}-*")]


def _wait_until(done, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while not done():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.2)
    return True


REAPED_WITHIN = 10.0  # seconds from an owner's end to its last process gone (a busy machine)


@pytest.mark.slow
@pytest.mark.mpi
@pytest.mark.parametrize("ending", ["exit", "SIGINT", "SIGTERM", "SIGKILL"])
def test_every_way_of_ending_the_owner_leaves_nothing_behind(ending: str) -> None:
    mark = uuid.uuid4().hex
    owner = subprocess.Popen([sys.executable, "-c", OWNER, ending], stdout=subprocess.PIPE,
                             text=True, env={**os.environ, "PCOURSE_TEST_OWNER": mark})
    try:
        assert owner.stdout.readline().strip().isdigit(), "the cluster did not start"
        assert _owned(mark, owner.pid)
        if ending != "exit":
            owner.send_signal(getattr(signal, ending))
        owner.wait(timeout=60)
        # SIGKILL runs nothing in the owner: its reaper notices and ends the cluster at once
        assert _wait_until(lambda: not _owned(mark, owner.pid), REAPED_WITHIN), \
            _owned(mark, owner.pid)
        assert _files_of(owner.pid) == []
    finally:
        owner.kill()
        owner.wait()
        for proc in _owned(mark, owner.pid):  # leave the machine clean even when failing
            proc.kill()


@pytest.mark.slow
@pytest.mark.mpi
def test_stop_after_the_controller_was_killed_leaves_nothing_behind() -> None:
    mc = start_cluster(1)
    controller = psutil.Process(mc.cluster.controller.process.pid)
    ours = [controller, *controller.children(recursive=True),
            *(psutil.Process(pid) for pid in mc.view.apply_sync(os.getpid))]
    controller.kill()
    controller.wait(10)
    stop_cluster(mc)
    assert _wait_until(lambda: not any(p.is_running() and p.status() != psutil.STATUS_ZOMBIE
                                       for p in ours), 10)


# --- a benchmark launcher that is told to stop --------------------------------------

FAKE_SOURCE = """
import os, pathlib, time
pathlib.Path(os.environ["FAKE_SOURCE_PIDS"], str(os.getpid())).touch()
time.sleep(600)  # a long training run
"""


@pytest.mark.mpi
def test_versus_source_runs_the_source_on_loopback_and_ends_it_on_sigterm(
        tmp_path: Path) -> None:
    source, pids, mark = tmp_path / "parallel-nn", tmp_path / "pids", uuid.uuid4().hex
    source.mkdir()
    pids.mkdir()
    (source / "main_franke.py").write_text(FAKE_SOURCE)
    versus = subprocess.Popen(
        [sys.executable, "-m", "pcourse.tools.bench", "versus-source", "--source", str(source),
         "--rounds", "1", "--ranks", "2", "--epochs", "1", "--skip-hydra"],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        env={**os.environ, "FAKE_SOURCE_PIDS": str(pids), "PCOURSE_TEST_OWNER": mark})
    try:
        assert _wait_until(lambda: len(list(pids.iterdir())) == 2, 60), "the source never ran"
        listening = {(p.name(), c.laddr.ip) for p in _owned(mark, versus.pid)
                     for c in p.net_connections("tcp") if c.status == psutil.CONN_LISTEN}
        beyond = {(name, ip) for name, ip in listening if name not in launcher_listeners()}
        assert {ip for _, ip in beyond} <= {"127.0.0.1", "::1"}, listening
        versus.send_signal(signal.SIGTERM)  # a closed terminal, a scheduler's stop
        versus.wait(timeout=30)
        assert _wait_until(lambda: not _owned(mark, versus.pid), 15), _owned(mark, versus.pid)
    finally:
        versus.kill()
        versus.wait()
        for proc in _owned(mark, versus.pid):  # leave the machine clean even when failing
            proc.kill()


# --- interrupts ----------------------------------------------------------------------


@pytest.fixture(scope="module")
def mc():
    cluster = start_cluster(2)
    yield cluster
    stop_cluster()
    stop_cluster(cluster)


LOOP = """
import time
import torch
from pcourse.backends import make_backend

backend = make_backend({name!r})
t = torch.ones(1000)
laps = 0
while True:
    {call}
    laps += 1
    if laps == 3:  # the test interrupts only once every rank is well inside the loop
        open({mark!r} + str(rank), "w").close()
    if rank == 0:
        time.sleep(0.001)  # rank 0 lags: an interrupt finds rank 1 waiting in the collective
"""
# check=False: the collective itself, not the agreement check before it, is what waits.
CALLS = {"allreduce": "backend.allreduce(t, check=False)",
         "broadcast": "backend.broadcast(t, root=0, check=False)", "barrier": "backend.barrier()"}


@pytest.mark.slow
@pytest.mark.mpi
@pytest.mark.parametrize("name, collective", [
    ("mpi", "allreduce"), ("mpi", "broadcast"), ("mpi", "barrier"),
    ("mpi-pickle-deadline", "allreduce"), ("mpi-pickle-deadline", "broadcast"),
    ("gloo", "allreduce"),
])
def test_an_interrupt_mid_collective_leaves_the_cluster_usable(mc, name, collective,
                                                                 tmp_path) -> None:
    mark = str(tmp_path / "in-loop-")
    running = mc.view.execute(LOOP.format(name=name, call=CALLS[collective], mark=mark),
                              block=False)
    # Interrupt only once both ranks are well inside the loop: a loaded machine may take
    # seconds to make the backend, and an interrupt before that tests nothing.
    assert _wait_until(lambda: all(Path(mark + str(r)).exists() for r in range(2)), 120), \
        "the loop never got going on both ranks"
    assert not running.done(), running.get() if running.done() else ""
    mc.client.send_signal("SIGINT", block=True)  # what %%px does on the stop button
    assert running.wait(10), f"a rank is still blocked in the {collective}"
    with pytest.raises(ipp.error.CompositeError, match="KeyboardInterrupt"):
        running.get()
    assert mc.problem() == ""  # no rank had to be ended

    def sum_of_ranks(name: str) -> float:  # the lesson's next cell: a new backend, same engines
        import torch

        from pcourse.backends import make_backend

        with make_backend(name) as backend:
            return backend.allreduce(torch.tensor([backend.rank + 1.0])).item()

    assert mc.view.apply_async(sum_of_ranks, name).get(timeout=30) == [3.0, 3.0]


@pytest.mark.slow
@pytest.mark.mpi
def test_interrupting_a_blocking_call_stops_the_engines_too(mc) -> None:
    """The stop button on ``mc.view.apply_sync(...)``: the engines stop with the cell."""

    def slow() -> None:
        import time

        time.sleep(600)

    main = threading.main_thread().ident  # the stop button: SIGINT to the kernel
    threading.Timer(1.0, signal.pthread_kill, (main, signal.SIGINT)).start()
    with pytest.raises(KeyboardInterrupt):
        mc.view.apply_sync(slow)
    assert mc.view.apply_async(os.getpid).get(timeout=15)  # nothing left queued ahead


@pytest.mark.slow
@pytest.mark.mpi
def test_an_interrupt_that_cannot_stop_a_rank_says_restart_and_restart_works(mc, tmp_path) -> None:
    # A raw MPI call that never completes: Python cannot interrupt it.
    mark = tmp_path / "blocking"
    mc.view.execute("from mpi4py import MPI\nimport time\n"
                    f"open({str(mark)!r} + str(rank), 'w').close()\n"
                    "if rank == 1:\n    MPI.COMM_WORLD.Barrier()  # alone: blocks in C\n"
                    "else:\n    time.sleep(600)\n", block=False)
    # Both ranks have reached their blocking call (rank 1's Barrier follows its mark at once).
    assert _wait_until(lambda: all(Path(f"{mark}{r}").exists() for r in range(2)), 120)
    mc.client.send_signal("SIGINT", block=True)
    assert _wait_until(mc.problem, 30), "the blocked rank was never dealt with"
    assert re.fullmatch(r"The cluster's engines stopped \(rank 1 did not stop within [\d.]+ s "
                        r"of the interrupt\)\. Restart it: run start_cluster\(2\) again\.",
                        mc.problem())
    with pytest.raises(ClusterError, match="Restart it"):  # one line, not ipyparallel's errors
        mc.view.apply_sync(os.getpid)
    again = start_cluster(2)
    try:
        assert again.view.pull("size") == [2, 2]
    finally:
        stop_cluster(again)


# --- what killed ranks leave in shared memory ----------------------------------------

# MPICH's segments, or Open MPI's shared-memory transport's (pcourse.tools.cluster.reaping)
SEGMENT = r"/dev/shm/(?:mpich_\w+|sm_segment\.[\w.]+|vader_segment\.[\w.]+)"


def _segments(text: str) -> set[Path]:
    return {Path(p) for p in re.findall(SEGMENT, text)}


def _segments_of(pids: list[int]) -> set[Path]:
    """The MPI shared-memory segments these processes have mapped."""
    return set().union(*(_segments(Path(f"/proc/{pid}/maps").read_text()) for pid in pids))


@pytest.mark.mpi
@pytest.mark.skipif(not Path("/dev/shm").is_dir(), reason="no /dev/shm on this system")
def test_a_stopped_cluster_leaves_no_mpi_shared_memory_and_a_live_one_keeps_its_own() -> None:
    """Killed engines never run MPI_Finalize, which deletes MPICH's segment; a later job
    with the same id would attach to it and fail in MPI_Init."""
    mc = start_cluster(2)
    try:
        segments = _segments_of(mc.view.apply_sync(os.getpid))
        assert segments, "the engines have no MPI segment mapped: nothing to test"
        time.sleep(1.1)  # older than the age at which the sweep spares a starting job's segment
        sweep_mpi_segments()  # the default age: another test process's job may be starting now
        assert all(p.exists() for p in segments), "a live cluster's segment was deleted"
        assert mc.view.apply_sync(lambda: 1) == [1, 1]
    finally:
        stop_cluster(mc)
    assert not [p for p in segments if p.exists()], "the stopped engines' segment is left"


KILLED_RANKS = """
import os, pathlib, re, signal
from mpi4py import MPI
MPI.COMM_WORLD.Barrier()
print(*re.findall(r"@SEGMENT@", pathlib.Path("/proc/self/maps").read_text()), flush=True)
MPI.COMM_WORLD.Barrier()
os.kill(os.getpid(), signal.SIGKILL)
""".replace("@SEGMENT@", SEGMENT)


@pytest.mark.mpi
@pytest.mark.skipif(not Path("/dev/shm").is_dir(), reason="no /dev/shm on this system")
def test_an_mpi_job_whose_ranks_were_killed_leaves_no_shared_memory() -> None:
    result = mpirun(2, ["-c", KILLED_RANKS], timeout=60, check=False)
    segments = _segments(result.stdout)
    assert result.returncode != 0 and segments, result.stdout
    assert not [p for p in segments if p.exists()], "the killed ranks' segment is left"


@pytest.mark.skipif(not Path("/dev/shm").is_dir(), reason="no /dev/shm on this system")
def test_the_sweep_spares_young_and_mapped_segments_and_deletes_a_dead_jobs_at_once() -> None:
    import mmap

    young, mapped = (Path(f"/dev/shm/mpich_shm_test{uuid.uuid4().hex[:8]}_0") for _ in "12")
    for path in (young, mapped):
        path.write_bytes(b"\0" * 4096)
    try:
        with mapped.open("r+b") as f, mmap.mmap(f.fileno(), 4096):
            sweep_mpi_segments()  # a job starting now may not have mapped its segment yet
            assert young.exists() and mapped.exists()
            sweep_mpi_segments(dead={str(young), str(mapped)})  # a killed job's: at once
            assert not young.exists(), "a dead job's segment was kept"
            assert mapped.exists(), "a segment a live process maps was deleted"
        os.utime(mapped, (time.time() - 2, time.time() - 2))
        sweep_mpi_segments()  # unmapped and old: left by a job killed earlier
        assert not mapped.exists()
    finally:
        young.unlink(missing_ok=True)
        mapped.unlink(missing_ok=True)


@pytest.mark.slow
@pytest.mark.mpi
def test_a_benchmark_killed_with_sigkill_leaves_no_rank_and_keeps_its_rows(tmp_path) -> None:
    """The launcher gets SIGKILL mid-job: its ranks die with it, the rows so far are on disk."""
    mark = uuid.uuid4().hex
    out = tmp_path / "comm.csv"
    out.write_text("an earlier run's results\n")
    partial = out.with_suffix(".partial.csv")
    bench = subprocess.Popen(
        [sys.executable, "-m", "pcourse.tools.bench", "comm", "--ranks", "2", "--methods",
         "mpi-pickle",
         "--min-bytes", "4", "--max-bytes", "64M", "--factor", "2", "--target-time", "0.3",
         "--out", str(out)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        env={**os.environ, "PCOURSE_TEST_OWNER": mark})
    try:
        assert _wait_until(lambda: partial.exists(), 120), "no rows were measured"
        assert _owned(mark, bench.pid), "the ranks are not running"
        bench.kill()
        bench.wait(timeout=30)
        assert _wait_until(lambda: not _owned(mark, bench.pid), REAPED_WITHIN), \
            _owned(mark, bench.pid)
        with open(partial) as f:
            rows = f.read().splitlines()
        assert rows[0].split(",")[:3] == ["ranks", "method", "bytes"] and len(rows) >= 2, rows
        assert out.read_text() == "an earlier run's results\n"  # not passed off as this run
    finally:
        bench.kill()
        bench.wait()
        for proc in _owned(mark, bench.pid):  # leave the machine clean even when failing
            proc.kill()


def test_kill_marked_ends_exactly_the_marked_processes_that_are_not_spared() -> None:
    """A process that ignores SIGTERM is killed after the grace; another mark, another
    value and a spared pid live on."""
    from pcourse.tools.cluster.reaping import kill_marked, marked

    value = uuid.uuid4().hex
    stubborn = ("import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); "
                "print('ignoring', flush=True); time.sleep(60)")

    def start(variable: str, val: str, code: str = "import time; time.sleep(60)"):
        env = {**os.environ, variable: val}
        return subprocess.Popen([sys.executable, "-c", code], env=env, stdout=subprocess.PIPE,
                                text=True)

    doomed = [start("PCOURSE_TEST_OWNER", value), start("PCOURSE_TEST_OWNER", value, stubborn)]
    spared = start("PCOURSE_TEST_OWNER", value)
    others = [start("PCOURSE_TEST_OWNER", value + "x"), start("PCOURSE_CLUSTER", value)]
    try:
        deadline = time.monotonic() + 30
        while len(marked(value, "PCOURSE_TEST_OWNER")) < 3 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert doomed[1].stdout.readline() == "ignoring\n"  # its handler is set
        kill_marked(value, grace=0.5, variable="PCOURSE_TEST_OWNER", spare=[spared.pid])
        # psutil reaped them (so Popen sees no exit status): they are gone, SIGTERM or not
        assert not any(psutil.pid_exists(p.pid) for p in doomed)
        assert all(p.poll() is None for p in [spared, *others])
        assert [p.pid for p in marked(value, "PCOURSE_TEST_OWNER")] == [spared.pid]
    finally:
        for p in [*doomed, spared, *others]:
            p.kill()
            p.wait()
