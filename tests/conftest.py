"""Suite-wide guard: no engine, controller or mpiexec started by the tests outlives them."""

from __future__ import annotations

import os
import time
import uuid
from pathlib import Path

import psutil
import pytest

REPO = Path(__file__).resolve().parents[1]
# Launching engines needs the venv's mpiexec; tests may be started without activating it.
os.environ["PATH"] = f"{Path(os.sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}"

# Every process this test session starts inherits this variable, even once orphaned,
# so the leak check finds exactly ours and never touches anyone else's MPI jobs.
SESSION_MARK = "PCOURSE_TEST_SESSION"
os.environ[SESSION_MARK] = uuid.uuid4().hex

_CLUSTER_MARKERS = ("ipyparallel.engine", "ipyparallel.controller", "ipengine", "ipcontroller",
                    "pcourse.cluster.reaper",
                    "mpiexec", "hydra_pmi_proxy")


def cluster_processes() -> dict[int, str]:
    """pid -> command line of every engine, controller and MPI launcher this session started."""
    found = {}
    for proc in psutil.process_iter(["pid", "cmdline", "status"]):
        try:
            cmd = " ".join(proc.info["cmdline"] or [])
            if proc.info["status"] == psutil.STATUS_ZOMBIE:
                continue
            if proc.environ().get(SESSION_MARK) != os.environ[SESSION_MARK]:
                continue
        except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
            continue
        if any(marker in cmd for marker in _CLUSTER_MARKERS):
            found[proc.info["pid"]] = cmd
    return found


@pytest.fixture(scope="session", autouse=True)
def no_leftover_cluster_processes():
    yield
    deadline = time.monotonic() + 15  # processes being reaped right now get a moment
    while True:
        left = cluster_processes()
        if not left or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    for pid in left:  # leave the machine clean even when failing
        try:
            psutil.Process(pid).kill()
        except psutil.NoSuchProcess:
            pass
    assert not left, "the tests left cluster processes running:\n" + "\n".join(
        f"{pid}: {cmd[:160]}" for pid, cmd in left.items()
    )
