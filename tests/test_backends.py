"""The backends: real jobs against MPI's own Allreduce, without MPI under torchrun and
torch.multiprocessing, the agreement check, the rendezvous, and the GPU paths."""

from __future__ import annotations

import inspect
import os
import socket
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from pcourse.backends import (
    BACKENDS,
    BackendUnavailable,
    MismatchError,
    backend_class,
    backend_status,
    make_backend,
)
from pcourse.cluster.launch import kill_group
from pcourse.utils.agree import agree

REPO = Path(__file__).resolve().parents[1]
NO_GPU = pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-GPU error path")


# make test-fast runs p = 3, which catches direction and indexing bugs p = 2 hides
@pytest.mark.parametrize("n", [pytest.param(2, marks=pytest.mark.slow), 3])
def test_cpu_backends_match_mpi_allreduce(mpi_run, n):
    """mpi, mpi-pickle, gloo: results, bad input, keywords, rendezvous, listeners (one job)."""
    mpi_run(n, "check_backends.py", expect=f"allreduce cases on {n} ranks: ALL OK")


def _run(cmd: list[str], timeout: float = 240) -> str:
    """Run ``cmd`` in its own process group; kill the whole group at the deadline."""
    proc = subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, start_new_session=True,
                            env={**os.environ, "OMP_NUM_THREADS": "1"})
    try:
        out, _ = proc.communicate(timeout=timeout)
    finally:
        kill_group(proc)
    assert proc.returncode == 0, out[-4000:]
    return out


@pytest.mark.slow
def test_gloo_without_mpi_under_torchrun():
    torchrun = Path(sys.executable).parent / "torchrun"
    out = _run([str(torchrun), "--standalone", "--nproc-per-node", "2",
                "tests/torchrun/check_gloo.py"])
    assert "gloo without MPI OK (torchrun, 2 ranks)" in out


@pytest.mark.slow
def test_gloo_without_mpi_on_groups_torch_multiprocessing_made():
    out = _run([sys.executable, "tests/torchrun/check_gloo.py", "2"])
    assert "gloo without MPI OK (torch.multiprocessing, 2 ranks)" in out


def test_every_backend_takes_the_same_keywords():
    for name in BACKENDS:
        params = inspect.signature(backend_class(name).__init__).parameters
        assert list(params) == ["self", "comm", "device", "timeout"], name
        assert params["device"].kind is params["timeout"].kind is inspect.Parameter.KEYWORD_ONLY


def test_backends_say_where_their_tensors_may_live():
    assert [n for n in BACKENDS if backend_class(n).any_device] == ["mpi", "mpi-pickle"]
    assert [n for n in BACKENDS if backend_class(n).needs_gpu] == ["nccl", "nccl-cupy"]


# ---------------------------------------------------------------- the agreement check
def _two_ranks(mine: dict, theirs: dict, **kwargs) -> None:
    """``agree`` on this rank while another rank contributes ``theirs``."""
    seen = []
    agree(theirs, lambda v: seen.append(v.copy()) or v, subject="s", hint="h")
    agree(mine, lambda v: np.maximum(v, seen[0]), subject="allreduce needs the same x",
          hint="Do it alike.", **kwargs)


def test_agreement_passes_equal_facts_and_names_what_differs():
    _two_ranks({"length": 3, "dtype": "float32"}, {"length": 3, "dtype": "float32"})
    with pytest.raises(MismatchError, match=r"^allreduce needs the same x, but length ranges "
                                            r"from 3 to 5 \(this rank: 3\)\. Do it alike\.$"):
        _two_ranks({"length": 3, "dtype": "f"}, {"length": 5, "dtype": "f"})
    with pytest.raises(MismatchError, match=r"dtype differs between ranks \(this rank: float32\)"):
        _two_ranks({"length": 3, "dtype": "float32"}, {"length": 3, "dtype": "float64"})
    with pytest.raises(MismatchError, match="length ranges from 2 to 3.*; dtype differs"):
        _two_ranks({"length": 3, "dtype": "a"}, {"length": 2, "dtype": "b"})


def test_a_refusing_rank_is_heard_and_raises_nothing_itself():
    seen = []
    agree({"length": 0}, lambda v: seen.append(v.copy()) or v, subject="s", hint="h",
          refused=True)  # the refusing rank returns; it raises its own error
    with pytest.raises(MismatchError, match="another rank refused its input"):
        agree({"length": 3}, lambda v: np.maximum(v, seen[0]), subject="s", hint="h")


def test_a_backend_checks_its_input_on_every_call(one_rank):
    facts = one_rank.facts_of(lambda b: b.allreduce(torch.ones(4)))
    b = one_rank(peer=facts)
    b.allreduce(torch.ones(4))  # agrees with a peer that passed the same
    with pytest.raises(MismatchError, match="length ranges from 4 to 5"):
        b.allreduce(torch.ones(5))
    with pytest.raises(MismatchError, match="dtype differs"):
        b.allreduce(torch.ones(4, dtype=torch.float64))
    with pytest.raises(MismatchError, match="op differs"):
        b.allreduce(torch.ones(4), "max")
    assert len(b.calls) == 1  # nothing was reduced after a mismatch
    b.allreduce(torch.ones(5), check=False)  # the caller vouches for it: no check
    assert len(b.sent) == 4


def test_a_backend_refuses_bad_roots_and_ops_after_telling_the_others(one_rank):
    b = one_rank()
    for root in (1, -1, 0.0, True):
        with pytest.raises(ValueError, match="root must be a rank from 0 to 0"):
            b.broadcast(torch.ones(2), root)
    with pytest.raises(ValueError, match="unknown reduction op"):
        b.allreduce(torch.ones(2), "mean")
    with pytest.raises(TypeError, match="expected a torch.Tensor"):
        b.allreduce([1.0, 2.0])
    assert [v[0] for v in b.sent] == [1] * 6  # every refusal was announced to the peers
    assert b.calls == []


# ---------------------------------------------------------------- rendezvous helpers
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


def test_the_store_listens_on_its_address_only_and_a_bad_master_port_is_explained(monkeypatch):
    from pcourse.backends.torch_dist import _pick_port

    monkeypatch.delenv("MASTER_PORT", raising=False)
    with _pick_port("127.0.0.1") as s:
        assert s.getsockname()[0] == "127.0.0.1" and s.getsockname()[1] not in (0, 29500)
    with socket.socket() as busy:
        busy.bind(("", 0))
        busy.listen()
        monkeypatch.setenv("MASTER_PORT", str(busy.getsockname()[1]))
        with pytest.raises(ValueError, match="already in use.*unset MASTER_PORT"):
            _pick_port("127.0.0.1")
    for bad in ("70000", "0", "-1", "http"):
        monkeypatch.setenv("MASTER_PORT", bad)
        with pytest.raises(ValueError, match=f"MASTER_PORT={bad} is not a port number"):
            _pick_port("127.0.0.1")


def test_one_host_binds_loopback_unless_an_interface_is_named(monkeypatch):
    from pcourse.backends.torch_dist import socket_ifname

    monkeypatch.delenv("GLOO_SOCKET_IFNAME", raising=False)
    with socket_ifname("GLOO_SOCKET_IFNAME", loopback=True):
        assert os.environ["GLOO_SOCKET_IFNAME"] in ("lo", "lo0")
    assert "GLOO_SOCKET_IFNAME" not in os.environ  # only while the sockets open
    with socket_ifname("GLOO_SOCKET_IFNAME", loopback=False):
        assert "GLOO_SOCKET_IFNAME" not in os.environ
    monkeypatch.setenv("GLOO_SOCKET_IFNAME", "eth7")
    with socket_ifname("GLOO_SOCKET_IFNAME", loopback=True):
        assert os.environ["GLOO_SOCKET_IFNAME"] == "eth7"


# ---------------------------------------------------------------- GPUs, and their absence
def test_unknown_backend_is_a_value_error():
    with pytest.raises(ValueError, match="choose one of"):
        make_backend("mpich")


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


def test_backend_status_lists_every_backend_with_a_reason():
    rows = {row.name: row for row in backend_status()}
    assert set(rows) == set(BACKENDS)
    assert rows["mpi"].usable and rows["gloo"].usable
    if torch.cuda.is_available():
        assert rows["nccl"].usable and rows["nccl"].reason == "runs on GPU"
    else:
        assert not rows["nccl"].usable and "CUDA" in rows["nccl"].reason


@pytest.mark.slow
def test_gpu_check_passes_or_says_why_it_cannot_run():
    """On GPUs: both NCCL backends against MPI, one rank per GPU; without: a clean skip."""
    out = subprocess.run([sys.executable, "-m", "pcourse.checks.gpu_check"], capture_output=True,
                         text=True, timeout=600, cwd=REPO)
    assert out.returncode == 0, out.stdout + out.stderr
    last = out.stdout.strip().splitlines()[-1]
    assert last == "PASS" if torch.cuda.is_available() else "SKIPPED: no CUDA device" in last
