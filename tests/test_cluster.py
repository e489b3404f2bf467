"""The engine cluster helper: start, run code on engines, stop, restart, bad input."""

from __future__ import annotations

import os
import re
import stat
import textwrap

import psutil
import pytest
from conftest import cluster_processes, launcher_listeners

from pcourse.runtime.ranks import gpu_for
from pcourse.tools.cluster import ClusterError, launch, start_cluster, stop_cluster
from pcourse.tools.cluster import engines as cl

LOOPBACK = {"127.0.0.1", "::1"}


def _alive(pids: list[int]) -> list[int]:
    return [p for p in pids if psutil.pid_exists(p)
            and psutil.Process(p).status() != psutil.STATUS_ZOMBIE]


def _listening(pids: list[int]) -> set[tuple[str, str]]:
    """(command, address) of every TCP listener of these processes."""
    found = set()
    for pid in pids:
        try:
            proc = psutil.Process(pid)
            for conn in proc.net_connections("tcp"):
                if conn.status == psutil.CONN_LISTEN:
                    found.add((proc.name(), conn.laddr.ip))
        except psutil.NoSuchProcess:
            continue
    return found


@pytest.mark.slow
@pytest.mark.mpi
def test_start_run_restart_stop(monkeypatch):
    devices = ["cpu" if gpu_for(r) is None else f"cuda:{gpu_for(r)}" for r in (0, 1)]
    mc = start_cluster(2)
    try:
        assert mc.n == 2
        assert [e.rank for e in mc.engines] == [0, 1]
        assert [e.device for e in mc.engines] == devices and all(e.size == 2 for e in mc.engines)
        # engine id == MPI rank, and the engine namespace knows its rank and device;
        # the ranks really talk to each other over MPI
        mc.view.execute(
            "from mpi4py import MPI\n"
            "answer = (MPI.COMM_WORLD.rank, rank, size, local_rank, str(device))\n"
            "total = MPI.COMM_WORLD.allreduce(rank + 1)"
        )
        assert mc.view.pull("answer") == [(0, 0, 2, 0, devices[0]), (1, 1, 2, 1, devices[1])]
        assert mc.view.pull("total") == [3, 3]
        # Nothing of the cluster (controller, mpiexec, engines) is reachable from
        # another machine: every listener is on loopback.
        listening = _listening(list(cluster_processes()))
        beyond = {ip for name, ip in listening if name not in launcher_listeners()}
        assert listening and beyond <= LOOPBACK, listening
        old_pids = mc.view.apply_sync(os.getpid)
        old_folder = mc.folder

        monkeypatch.setattr(cl, "max_engines", lambda: 2)  # 3 is too many here ...
        with pytest.raises(ClusterError, match="oversubscribe=True"):
            start_cluster(3)
        assert mc.problem() == ""  # ... refused before the running cluster was touched
        mc2 = start_cluster(3, oversubscribe=True)  # ... unless asked; and a re-run
        # start cell replaces the old cluster
        assert cl._current is mc2
        assert _alive(old_pids) == []
        assert not old_folder.exists()  # its connection files and logs went with it
        assert mc2.view.pull("size") == [3, 3, 3]
        new_pids = mc2.view.apply_sync(os.getpid)
    finally:
        stop_cluster()
    assert cl._current is None
    assert _alive(new_pids) == []
    assert not mc2.folder.exists()
    stop_cluster()  # stopping twice is harmless


@pytest.mark.parametrize("n", [0, -1, 10**6, 2.5, "2", True])
def test_bad_engine_count(n):
    with pytest.raises(ClusterError, match=r"^n"):
        start_cluster(n)


def test_missing_mpiexec(monkeypatch, tmp_path):
    monkeypatch.setattr(launch.sys, "executable", str(tmp_path / "python"))
    monkeypatch.setenv("PATH", str(tmp_path))
    with pytest.raises(launch.MPINotFound, match="pip install mpich"):
        launch.find_mpiexec()


@pytest.mark.mpi
def test_engines_that_die_during_start_report_their_log():
    # A Python that cannot find its standard library dies at once, like a broken env.
    with pytest.raises(ClusterError, match="exited during start") as info:
        start_cluster(2, env={"PYTHONHOME": "/nonexistent"}, timeout=60)
    assert "encodings" in str(info.value) or "PYTHONHOME" in str(info.value)
    assert re.search(r"registered; exit status [1-9]", str(info.value)), info.value
    assert cl._current is None


@pytest.mark.mpi
def test_start_timeout_is_an_error_not_a_hang():
    with pytest.raises(ClusterError, match="registered within"):
        start_cluster(2, timeout=0.2)
    assert cl._current is None


def test_several_nodes_are_an_explicit_choice(tmp_path):
    """Loopback by default; a hostfile makes the controller and MPI reachable from other nodes."""
    hosts = tmp_path / "hosts"
    hosts.write_text("localhost:2\n")
    here, there = launch.mpi_launcher(), launch.mpi_launcher(hosts)
    assert there.command == [launch.find_mpiexec(), "-f", str(hosts)] and there.env == {}
    assert "-f" not in here.command
    local = cl._make_cluster(2, tmp_path, here, {}, None)
    multi = cl._make_cluster(2, tmp_path, there, {}, hosts)
    assert local.controller_ip == "127.0.0.1" and multi.controller_ip == "*"
    assert multi.config.MPILauncher.mpi_cmd == there.command


# ---------------------------------------------------------------- engines as a Slurm job

def test_a_slurm_job_is_described_by_the_environment(monkeypatch):
    monkeypatch.delenv(cl.SLURM_ENV, raising=False)
    assert cl.Slurm.from_env() is None
    monkeypatch.setenv(cl.SLURM_ENV, "partition=ws  time=02:00:00 account=course")
    assert cl.Slurm.from_env() == cl.Slurm(time="02:00:00", partition="ws", account="course")
    for bad in ("queue=ws", "partition", "yes"):
        monkeypatch.setenv(cl.SLURM_ENV, bad)
        with pytest.raises(ClusterError, match="partition=..."):
            start_cluster(2)
    with pytest.raises(ClusterError, match="not both"):
        start_cluster(2, hostfile="hosts", slurm=cl.Slurm())
    assert cl._current is None


def _fake_slurm(bin_dir):
    """sbatch, srun and scancel that run the job on this machine: srun is mpiexec."""
    tools = {
        "sbatch": """\
            #!/bin/sh
            n=$(sed -n 's/^#SBATCH --ntasks=//p' "$1")
            out=$(sed -n 's/^#SBATCH --output=//p' "$1")
            SLURM_NTASKS=$n sh "$1" > "$out" 2>&1 < /dev/null &
            echo "Submitted batch job 4242"
            """,
        "srun": f'#!/bin/sh\nexec {launch.find_mpiexec()} -n "$SLURM_NTASKS" "$@"\n',
        "scancel": '#!/bin/sh\necho "$@" >> "$(dirname "$0")/cancelled"\n',
    }
    for name, text in tools.items():
        path = bin_dir / name
        path.write_text(textwrap.dedent(text))
        path.chmod(path.stat().st_mode | stat.S_IXUSR)


@pytest.mark.slow
@pytest.mark.mpi
def test_engines_started_as_a_slurm_job_are_one_mpi_job(tmp_path, monkeypatch):
    """ipyparallel's Slurm launcher, with sbatch and srun played by this machine."""
    _fake_slurm(tmp_path)
    monkeypatch.setenv("PATH", f"{tmp_path}{os.pathsep}{os.environ['PATH']}")
    monkeypatch.setenv(cl.SLURM_ENV, f"partition=ws account=course time=00:05:00 "
                                     f"folder={tmp_path / 'shared'}")
    mc = start_cluster(2, timeout=120)  # as an unchanged lesson would call it
    try:
        script = (mc.folder / "slurm_engine.sbatch").read_text()
        assert mc.folder.parent == tmp_path / "shared"
        for option in ("--ntasks=2", "--partition=ws", "--account=course", "--time=00:05:00",
                       f"--output={mc.folder}"):
            assert f"#SBATCH {option}" in script, script
        srun = next(line for line in script.splitlines() if line.startswith("srun "))
        assert srun.split()[-1] == "--mpi"
        assert mc.n == 2 and [e.size for e in mc.engines] == [2, 2]
        mc.view.execute("from mpi4py import MPI\ntotal = MPI.COMM_WORLD.allreduce(1)")
        assert mc.view.pull("total") == [2, 2]  # the engines really are one MPI job
    finally:
        stop_cluster()
    assert (tmp_path / "cancelled").read_text().split() == ["4242"]  # the job was cancelled
    assert not mc.folder.exists() and not cluster_processes()


def test_a_contained_job_reaches_nothing_outside_and_leaves_nothing_behind():
    """A command line's MPI job runs in a PID namespace: no signal out, no survivor after."""
    import subprocess
    import sys
    import uuid

    prefix, why = launch.containment()
    if not prefix:
        pytest.skip(f"no PID namespace here: {why}")
    mark = uuid.uuid4().hex
    reach = subprocess.run(
        [*prefix, sys.executable, "-c", f"import os; os.kill({os.getpid()}, 0)"],
        capture_output=True, text=True, timeout=30)
    assert reach.returncode != 0 and "ProcessLookupError" in reach.stderr, reach
    left = subprocess.run(  # a daemon in a session of its own, then the job ends
        [*prefix, "sh", "-c", "setsid sleep 300 </dev/null >/dev/null 2>&1 & exit 0"],
        env={**os.environ, "PCOURSE_TEST_MARK": mark}, timeout=30)
    assert left.returncode == 0
    survivors = []
    for proc in psutil.process_iter():
        try:
            if proc.environ().get("PCOURSE_TEST_MARK") == mark:
                survivors.append(proc)
        except psutil.Error:
            continue
    psutil.wait_procs(survivors, timeout=5)  # the namespace's teardown is asynchronous
    assert not [p for p in survivors if p.is_running()], survivors


def test_a_slurm_job_without_slurm_says_so(tmp_path, monkeypatch):
    monkeypatch.setenv("PATH", str(tmp_path))  # no sbatch: not a Slurm login node
    with pytest.raises(ClusterError, match="no `sbatch` on PATH"):
        start_cluster(2, slurm=cl.Slurm(folder=str(tmp_path)))
    assert cl._current is None and not list(tmp_path.iterdir())  # nothing started or written
