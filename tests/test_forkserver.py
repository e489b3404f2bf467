"""The grader's kernels, forked from a warm server: each still a process of its own."""

from __future__ import annotations

import os
import signal
import time

import nbformat
import pytest

from pcourse.tools.grading import forkserver, runner

PROBE = """import json, os, sys, numpy as np, mpi4py.MPI as MPI
print(json.dumps({"pid": os.getpid(), "ppid": os.getppid(), "pgid": os.getpgid(0),
                  "sid": os.getsid(0), "cwd": os.getcwd(), "size": MPI.COMM_WORLD.Get_size(),
                  "parent": os.environ.get("JPY_PARENT_PID"), "mark": os.environ.get("PROBE_MARK"),
                  "seed": int(np.random.randint(2**31)), "left": "left_behind" in globals(),
                  "cmdline": open("/proc/self/cmdline").read()}))
left_behind = 1"""


def _notebook(*sources: str) -> dict:
    return nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(s) for s in sources])


def _probe(notebook: dict | None = None) -> dict:
    import json

    out = runner.execute(notebook or _notebook(PROBE), 120, runner.Kernel())
    assert not out.errors and out.stopped is None, (out.errors, out.stopped)
    return json.loads(out.stdout[0])


def _gone(pid: int, within: float = 60.0) -> bool:
    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return True
        time.sleep(0.1)
    return False


@pytest.fixture
def server(monkeypatch):
    server = forkserver.Server()
    monkeypatch.setenv("PROBE_MARK", "set after the server started")  # so from the request
    monkeypatch.setattr(runner, "_server", server)
    yield server
    for kernel in list(runner._kernels):  # those a failed test left running
        kernel.close()
    server.close()


def test_each_kernel_is_a_fresh_process_of_its_own_forked_from_the_server(server):
    first, second = _probe(), _probe()
    for seen in (first, second):
        assert seen["ppid"] == server.process.pid and "forkserver" in seen["cmdline"]
        assert seen["pgid"] == seen["sid"] == seen["pid"]  # a session of its own, as jupyter's
        assert seen["parent"] == str(server.process.pid)  # it ends when the server does
        assert seen["mark"] == "set after the server started" and seen["size"] == 1
        assert os.path.basename(seen["cwd"]).startswith("pcourse-grade-")
        assert not seen["left"]  # nothing of the notebook before
        assert _gone(seen["pid"])  # ended with its notebook
    assert first["pid"] != second["pid"] and first["cwd"] != second["cwd"]
    assert first["seed"] != second["seed"]  # numpy seeded afresh, not the server's copy


@pytest.mark.slow
def test_a_killed_kernel_is_seen_dead_and_a_stuck_one_is_stopped(server):
    kernel = runner.Kernel()
    assert kernel.alive()
    os.kill(kernel.km.provisioner.pid, signal.SIGKILL)
    deadline = time.monotonic() + 60
    while kernel.alive() and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not kernel.alive()
    kernel.close()
    out = runner.execute(_notebook("import time\ntime.sleep(1000)"), 20, runner.Kernel())
    assert out.stopped == ("timeout", 0)
    out = runner.execute(_notebook("import os\nos._exit(1)", "print(1)"), 60, runner.Kernel())
    assert out.stopped == ("died", 0)


def test_kernels_end_when_their_server_does(server):
    kernel = runner.Kernel()
    kernel.warm(120)
    pid = kernel.km.provisioner.pid
    server.process.kill()  # as when its worker is killed: the kernel must not be left
    server.process.wait()
    assert _gone(pid)
    kernel.close()


def test_with_its_server_gone_kernels_start_as_fresh_pythons(server):
    server.process.kill()
    server.process.wait()
    seen = _probe()
    assert seen["ppid"] == os.getpid() and "ipykernel_launcher" in seen["cmdline"]


@pytest.mark.mpi
@pytest.mark.slow
@pytest.mark.parametrize("fork", ["1", "0"])
def test_the_grader_forks_its_kernels_unless_told_not_to(monkeypatch, fork):
    import json

    monkeypatch.setenv(runner.FORK_ENV, fork)
    jobs = [runner.Job(k, _notebook(PROBE), 120) for k in range(2)]
    seen = [json.loads(e.stdout[0]) for e in runner.run_jobs(jobs, workers=1, engines=1).values()]
    assert len(seen) == 2 and not any(s["left"] for s in seen)
    assert all(("forkserver" in s["cmdline"]) == (fork == "1") for s in seen)


def test_a_server_that_does_not_answer_is_killed_and_kernels_start_as_fresh_pythons(
        server, monkeypatch):
    import subprocess

    server.process.kill()
    server.process.wait()
    server.process = subprocess.Popen(["sleep", "600"], stdin=subprocess.PIPE,
                                      stdout=subprocess.PIPE, text=True)  # never says ready
    monkeypatch.setattr(forkserver.Provisioner, "timeout", 2.0)
    seen = _probe()
    assert seen["ppid"] == os.getpid() and "ipykernel_launcher" in seen["cmdline"]
    assert server.process.wait(timeout=10) == -signal.SIGKILL  # never asked again
