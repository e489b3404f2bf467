"""The backends: real MPI jobs against MPI's own Allreduce, and the GPU error paths on CPU."""

from __future__ import annotations

import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from pcourse.backends import BACKENDS, BackendUnavailable, backend_status, make_backend
from pcourse.cluster.launch import mpirun

REPO = Path(__file__).resolve().parents[1]
NO_GPU = pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-GPU error path")


@pytest.mark.parametrize("n", [2, 3])
def test_cpu_backends_match_mpi_allreduce(n):
    """mpi, mpi-pickle, gloo: every op and dtype, sizes 1..4 MB, broadcast, barrier, re-creation."""
    out = mpirun(n, ["-m", "mpi4py", "tests/mpi/check_backends.py"], timeout=240, cwd=REPO,
                 check=False)
    print(out.stdout)
    assert out.returncode == 0, out.stdout[-4000:]
    assert f"allreduce cases on {n} ranks; ALL OK" in out.stdout


@NO_GPU
@pytest.mark.parametrize("name", ["nccl", "nccl-cupy"])
def test_gpu_backends_say_why_they_cannot_run(name):
    with pytest.raises(BackendUnavailable, match=f"backend '{name}' cannot run here: .+"):
        make_backend(name)


@NO_GPU
def test_direct_construction_also_refuses_without_a_gpu():
    from pcourse.backends.cupy_nccl import CupyNCCLBackend  # importing needs neither CuPy nor CUDA
    from pcourse.backends.torch_dist import NCCLBackend

    for cls in (NCCLBackend, CupyNCCLBackend):
        with pytest.raises(BackendUnavailable, match="cannot run here"):
            cls()


@NO_GPU
def test_backend_status_lists_every_backend_with_a_reason():
    rows = {row.name: row for row in backend_status()}
    assert set(rows) == set(BACKENDS)
    assert rows["mpi"].usable and rows["gloo"].usable
    assert not rows["nccl"].usable and "CUDA" in rows["nccl"].reason


def test_unknown_backend_is_a_value_error():
    with pytest.raises(ValueError, match="choose one of"):
        make_backend("mpich")


def test_interface_address_reads_the_loopback():
    from pcourse.backends.torch_dist import interface_address

    assert interface_address("lo") == "127.0.0.1"
    assert interface_address("=lo") == "127.0.0.1"
    assert interface_address("nosuchif0,lo") == "127.0.0.1"
    assert interface_address("^lo") == "" and interface_address("nosuchif0") == ""


def test_address_choice_honours_the_environment(monkeypatch):
    from pcourse.backends.torch_dist import _pick_address

    for var in ("MASTER_ADDR", "GLOO_SOCKET_IFNAME"):
        monkeypatch.delenv(var, raising=False)
    assert _pick_address(True, "GLOO_SOCKET_IFNAME") == "127.0.0.1"
    monkeypatch.setenv("GLOO_SOCKET_IFNAME", "lo")
    assert _pick_address(False, "GLOO_SOCKET_IFNAME") == "127.0.0.1"
    monkeypatch.setenv("MASTER_ADDR", "10.1.2.3")
    assert _pick_address(False, "GLOO_SOCKET_IFNAME") == "10.1.2.3"


def test_port_choice_is_free_and_a_busy_master_port_is_explained(monkeypatch):
    from pcourse.backends.torch_dist import _pick_port

    monkeypatch.delenv("MASTER_PORT", raising=False)
    ports = {_pick_port() for _ in range(3)}
    assert 29500 not in ports and all(p > 0 for p in ports)
    with socket.socket() as busy:
        busy.bind(("", 0))
        busy.listen()
        monkeypatch.setenv("MASTER_PORT", str(busy.getsockname()[1]))
        with pytest.raises(ValueError, match="unset MASTER_PORT"):
            _pick_port()


@NO_GPU
def test_gpu_check_skips_cleanly_without_a_gpu():
    out = subprocess.run([sys.executable, "-m", "pcourse.checks.gpu_check"], capture_output=True,
                         text=True, timeout=120, cwd=REPO)
    assert out.returncode == 0, out.stderr
    assert "SKIPPED: no CUDA device" in out.stdout
