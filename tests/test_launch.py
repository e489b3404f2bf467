"""The MPI launcher: results come back from rank 0, failures and deadlines are explained."""

from __future__ import annotations

import ast
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
from conftest import launcher_listeners

from pcourse.tools.cluster.launch import MPIJobError, mpirun, mpirun_rows

REPORTS = """
from mpi4py import MPI
from pcourse.tools.cluster.launch import report_rows
comm = MPI.COMM_WORLD
print("noise that is not a row", flush=True)
sys.stderr.write("a warning on stderr, mid-line")  # shares the pipe with stdout
rows = comm.gather({"rank": comm.rank, "size": comm.size}, root=0)
if comm.rank == 0:
    report_rows(rows)
"""


def _script(tmp_path: Path, body: str) -> str:
    path = tmp_path / "job.py"
    path.write_text("import sys, time\n" + body)
    return str(path)


@pytest.mark.mpi
def test_rows_come_back_from_rank_zero_whatever_else_is_printed(tmp_path: Path) -> None:
    rows, output = mpirun_rows(3, [_script(tmp_path, REPORTS)], timeout=60)
    assert rows == [{"rank": r, "size": 3} for r in range(3)]
    assert "noise that is not a row" in output
    assert not list(tmp_path.glob(".*"))  # the rows file lives in its own temporary folder


@pytest.mark.mpi
def test_a_job_that_reports_nothing_is_an_error(tmp_path: Path) -> None:
    with pytest.raises(MPIJobError, match="reported no results") as info:
        mpirun_rows(2, [_script(tmp_path, "print('forgot to report')")], timeout=60)
    assert "forgot to report" in str(info.value)  # the output tail says what happened


@pytest.mark.mpi
def test_a_failing_rank_is_an_error_with_its_output(tmp_path: Path) -> None:
    body = "from mpi4py import MPI\nif MPI.COMM_WORLD.rank == 1: raise SystemExit('rank 1 gave up')"
    with pytest.raises(MPIJobError, match="exited with code") as info:
        mpirun(2, [_script(tmp_path, body)], timeout=60)
    assert "rank 1 gave up" in str(info.value)


@pytest.mark.mpi
def test_the_deadline_kills_a_hung_job(tmp_path: Path) -> None:
    with pytest.raises(MPIJobError, match="did not finish within 3 s"):
        mpirun(2, [_script(tmp_path, "time.sleep(600)")], timeout=3)


def test_zero_ranks_is_refused() -> None:
    with pytest.raises(ValueError, match="at least 1"):
        mpirun(0, [sys.executable])


def test_outside_mpirun_rows_the_caller_reports_itself(monkeypatch: pytest.MonkeyPatch,
                                                       tmp_path: Path) -> None:
    from pcourse.tools.cluster.launch import ROWS_ENV, report_rows

    monkeypatch.delenv(ROWS_ENV, raising=False)
    monkeypatch.chdir(tmp_path)
    assert report_rows([{"a": 1}]) is False
    assert not list(tmp_path.iterdir())  # nothing written anywhere


LISTENERS = """
import os, psutil
from mpi4py import MPI
# This rank, and the processes above it up to the launcher (mpiexec, hydra's proxy).
mine, proc = set(), psutil.Process()
while proc is not None and proc.pid != int(os.environ["LAUNCHER_PID"]):
    for conn in proc.net_connections("tcp"):
        if conn.status == psutil.CONN_LISTEN:
            mine.add((proc.name(), conn.laddr.ip))
    proc = proc.parent()
everyone = MPI.COMM_WORLD.gather(sorted(mine), root=0)
if MPI.COMM_WORLD.rank == 0:
    print("LISTENING", sorted({x for rank in everyone for x in rank}))
"""


def _listeners(tmp_path: Path, **kwargs) -> set[str]:
    done = mpirun(2, [_script(tmp_path, LISTENERS)], timeout=120,
                  env={"LAUNCHER_PID": str(os.getpid())}, **kwargs)
    line = next(ln for ln in done.stdout.splitlines() if ln.startswith("LISTENING"))
    return {ip for name, ip in ast.literal_eval(line.split(" ", 1)[1])
            if name not in launcher_listeners()}


@pytest.mark.mpi
def test_a_job_on_this_machine_listens_on_loopback_only(tmp_path: Path) -> None:
    # MPI's own connections (the ranks' netmod, mpiexec's port for its proxies)
    # would otherwise be open to the whole network the laptop is on.
    assert _listeners(tmp_path) <= {"127.0.0.1", "::1"}


@pytest.mark.mpi
def test_several_nodes_are_opted_in_with_a_hostfile(tmp_path: Path) -> None:
    from pcourse.multinode import hostfile_text
    from pcourse.tools.cluster.launch import mpi_flavour

    hosts = tmp_path / "hosts"
    hosts.write_text(hostfile_text({"localhost": 2}, "mpich" if mpi_flavour() == "mpich"
                                   else "openmpi"))
    assert _listeners(tmp_path, hostfile=hosts) - {"127.0.0.1", "::1"}  # reachable from others


@pytest.mark.mpi
def test_ranks_on_one_machine_spin_briefly_unless_told_otherwise(tmp_path: Path,
                                                                   monkeypatch) -> None:
    # A rank's OpenMP threads must not spin away the cores another process needs.
    from pcourse.tools.cluster import launch

    for name, value in launch.ONE_MACHINE_ENV.items():
        show = _script(tmp_path, "import os\n"  # one write a line: the ranks share the pipe
                       f"sys.stdout.write(f\"SPIN {{os.environ.get({name!r})}}\\n\")\n")
        monkeypatch.delenv(name, raising=False)
        assert mpirun(2, [show], timeout=120).stdout.count(f"SPIN {value}\n") == 2
        assert name not in launch.mpi_launcher(tmp_path / "hosts").env  # other nodes: theirs
        monkeypatch.setenv(name, "77")  # the user's own choice wins
        assert name not in launch.mpi_launcher().env
        assert mpirun(2, [show], timeout=120).stdout.count("SPIN 77\n") == 2


@pytest.mark.mpi
@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_a_stopped_launcher_takes_its_job_with_it(tmp_path: Path, sig: int) -> None:
    """A closed terminal or a job scheduler stops the launcher: its ranks must not run on."""
    pids = tmp_path / "pids"
    job = _script(tmp_path, f"import os\nopen({str(pids)!r}, 'a').write(f'{{os.getpid()}}\\n')\n"
                            "time.sleep(600)")
    ranks = None
    launcher = subprocess.Popen([sys.executable, "-c",
                                 "from pcourse.tools.cluster.launch import mpirun; "
                                 f"mpirun(2, [{job!r}], timeout=600)"])
    try:
        ranks = _wait_for(lambda: [int(p) for p in pids.read_text().split()]
                          if pids.exists() and len(pids.read_text().split()) == 2 else None)
        assert ranks, "the job never started"
        launcher.send_signal(sig)
        assert launcher.wait(timeout=30) != 0
        assert _wait_for(lambda: not any(_running(p) for p in ranks) or None), "ranks outlived it"
    finally:
        launcher.kill()
        launcher.wait()
        for pid in ranks or []:  # leave nothing behind even when failing
            if _running(pid):
                os.kill(pid, signal.SIGKILL)


@pytest.mark.mpi
def test_a_rank_killed_by_a_signal_is_a_failure(tmp_path: Path) -> None:
    body = ("import os, signal\nfrom mpi4py import MPI\n"
            "if MPI.COMM_WORLD.rank == 1: os.kill(os.getpid(), signal.SIGKILL)\ntime.sleep(30)")
    with pytest.raises(MPIJobError, match="exited with code"):
        mpirun(2, [_script(tmp_path, body)], timeout=60)


@pytest.mark.mpi
def test_rows_reported_before_a_late_failure_are_not_lost(tmp_path: Path) -> None:
    body = REPORTS + "\ncomm.Barrier()\nif comm.rank == 1: raise SystemExit(3)\n"
    with pytest.raises(MPIJobError, match="exited with code 3") as info:
        mpirun_rows(2, [_script(tmp_path, body)], timeout=60)
    assert info.value.rows == [{"rank": r, "size": 2} for r in range(2)]


def _running(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def _wait_for(probe, timeout: float = 60.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = probe()
        if value:
            return value
        time.sleep(0.1)
    return None


@pytest.mark.mpi
def test_every_character_the_ranks_print_comes_back(tmp_path: Path) -> None:
    # Lessons and benchmarks print ×, α, β; a launcher that chokes on them loses output.
    body = ("from mpi4py import MPI\nprint(f'rank {MPI.COMM_WORLD.rank}: α×β', flush=True)\n"
            "sys.stderr.write('stderr: ü\\n')\nprint('after', flush=True)")
    out = mpirun(2, [_script(tmp_path, body)], timeout=60).stdout
    assert "rank 0: α×β" in out and "rank 1: α×β" in out
    assert out.count("stderr: ü") == 2 and out.count("after") == 2


def test_the_job_ends_when_every_rank_has_reported_its_exit() -> None:
    # A launcher that lingers after its ranks exit (as MPICH's forker does, for up to
    # about two seconds): the job must end on the ranks' reports, with their worst code.
    from pcourse.tools.cluster.launch import run_in_session
    from pcourse.tools.cluster.rank_exit import RANK_EXIT

    lingering = f'echo out; echo "{RANK_EXIT} 0"; echo "{RANK_EXIT} 3"; exec sleep 60'
    out, code = run_in_session(["sh", "-c", lingering], timeout=30, ranks=2)
    assert code == 3 and out == "out\n"
    short = lingering.replace("sleep 60", "sleep 1")  # a rank missing: the launcher decides
    out, code = run_in_session(["sh", "-c", short], timeout=30, ranks=3)
    assert code == 0 and out == "out\n"


def test_a_rank_exit_after_an_unended_line_leaves_the_line_and_counts_the_exit() -> None:
    # A rank that prints with end="" gets the wrapper's marker on the same line: the
    # rank's text must come back alone (lesson 04 compared ports through it), the exit counted.
    from pcourse.tools.cluster.launch import run_in_session
    from pcourse.tools.cluster.rank_exit import RANK_EXIT

    glued = f'printf "127.0.0.1:4631"; echo "{RANK_EXIT} 0"; echo "{RANK_EXIT} 2"; exec sleep 60'
    out, code = run_in_session(["sh", "-c", glued], timeout=30, ranks=2)
    assert out == "127.0.0.1:4631\n" and code == 2, (out, code)


@pytest.mark.mpi
def test_a_rank_wrapper_passes_on_exit_codes_and_signals(tmp_path: Path) -> None:
    body = ("import os, signal\nfrom mpi4py import MPI\nr = MPI.COMM_WORLD.rank\n"
            "os.write(1, b'rank %d\\n' % r)\nMPI.COMM_WORLD.Barrier()\n"
            "raise SystemExit(5 if r == 2 else 0)")
    result = mpirun(3, [_script(tmp_path, body)], timeout=60, check=False)
    assert result.returncode == 5, result.stdout
    said = [line for line in result.stdout.split("\n") if line.startswith("rank ")]
    assert sorted(said) == ["rank 0", "rank 1", "rank 2"], result.stdout
    assert "pcourse-rank-exited" not in result.stdout


# ---------------------------------------------------------------- MPICH and Open MPI

def _fake_mpiexec(folder: Path, says: str) -> str:
    path = folder / "mpiexec"
    path.write_text(f"#!/bin/sh\necho '{says}'\n")
    path.chmod(0o755)
    return str(path)


def test_the_mpiexec_here_is_named_by_the_library_mpi4py_loads() -> None:
    """mpi_flavour reads mpiexec; mpi4py's library, asked without starting MPI, agrees."""
    from pcourse.tools.cluster import launch

    library = subprocess.run(
        [sys.executable, "-c", "import mpi4py; mpi4py.rc.initialize = False\n"
         "from mpi4py import MPI; print(MPI.Get_library_version())"],
        capture_output=True, text=True, timeout=60, check=True).stdout
    expected = "openmpi" if "Open MPI" in library else "mpich" if "MPICH" in library else "other"
    assert launch.mpi_flavour() == expected, library


@pytest.mark.parametrize("says, flavour", [
    ("mpiexec (Open MPI) 5.0.11", "openmpi"), ("mpiexec (OpenRTE) 4.1.8", "openmpi"),
    ("HYDRA build details:\n    Version: 4.2.0", "mpich"),
    ("Intel(R) MPI Library for Linux* OS, Version 2021.10", "other")])
def test_each_mpi_speaks_its_own_dialect(tmp_path: Path, monkeypatch, says, flavour) -> None:
    from pcourse.tools.bench import mpich, trace
    from pcourse.tools.cluster import launch

    mpiexec = _fake_mpiexec(tmp_path, says)
    monkeypatch.setattr(launch, "find_mpiexec", lambda: mpiexec)
    assert launch.mpi_flavour() == flavour
    there = launch.mpi_launcher(tmp_path / "hosts")
    here = launch.mpi_launcher()
    if flavour == "openmpi":  # --hostfile; root and more ranks than cores allowed
        assert there.command == [mpiexec, "--hostfile", str(tmp_path / "hosts")]
        assert launch.OPENMPI_ENV.items() <= here.env.items()
        assert (os.geteuid() == 0) == (launch.OPENMPI_ROOT_ENV.items() <= here.env.items())
    else:
        assert there.command == [mpiexec, "-f", str(tmp_path / "hosts")]
        assert not set(launch.OPENMPI_ENV) & set(here.env)
    # MPICH's own settings say so, clearly, under any other MPI, before anything runs
    why = mpich.unavailable()
    assert (why == "") == (flavour == "mpich")
    if flavour != "mpich":
        assert "MPICH's own" in why and mpiexec in why
        assert mpich.main(["--ranks", "2"]) == 2
        with pytest.raises(launch.MPICHOnly, match="MPIR_CVAR_ASYNC_PROGRESS"):
            trace.record_progress(2)
