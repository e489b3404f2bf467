"""The suite's leak guard sees the processes it must: otherwise it could never fail."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest
from conftest import cluster_processes

from pcourse.tools.cluster.launch import flavour_env, mpi_flavour


@pytest.mark.mpi
def test_guard_sees_an_orphaned_mpiexec_started_by_this_session():
    # A shell that starts mpiexec in the background and exits at once: the classic
    # orphan, re-parented to init, still carrying this session's marker.
    subprocess.run(["sh", "-c", f"mpiexec -n 1 {sys.executable} -c 'import time; "
                    f"time.sleep(60)' >/dev/null 2>&1 &"], check=True,
                   env={**os.environ, **flavour_env(mpi_flavour())})  # Open MPI: root allowed
    deadline = time.monotonic() + 20
    found = {}
    while not found and time.monotonic() < deadline:
        found = {p: c for p, c in cluster_processes().items() if "time.sleep(60)" in c}
        time.sleep(0.2)
    assert found, "the leak guard did not see an mpiexec this session started"
    for pid in found:
        subprocess.run(["kill", "-9", str(pid)])
