"""The backends: real jobs against MPI's own Allreduce, without MPI under torchrun and
torch.multiprocessing, the agreement check, the rendezvous, and the GPU paths."""

from __future__ import annotations

import inspect
import os
import re
import socket
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from pcourse.agree import agree
from pcourse.backends import (
    BACKENDS,
    BackendUnavailable,
    MismatchError,
    backend_class,
    backend_status,
    make_backend,
)
from pcourse.tools.cluster.launch import kill_group

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


@pytest.mark.parametrize("errors", [["", "", ""], ["", "OSError: busy", ""],
                                    ["ValueError: a", "", "KeyError: 'b'"]])
def test_a_step_that_fails_on_any_rank_raises_on_every_rank_naming_them(errors):
    """``everyone`` on rank 1 of three, whose own step succeeds: the others' errors decide."""
    from pcourse.agree import RankFailure, everyone

    class ThreeRanks:
        def allgather(self, mine):
            assert mine == ""  # this rank's step succeeded
            return errors

    waited = []
    if not any(errors):
        assert everyone(ThreeRanks(), lambda: 42, "x", lambda: waited.append(1)) == 42
    else:
        named = "; ".join(f"rank {r}: {e}" for r, e in enumerate(errors) if e)
        with pytest.raises(RankFailure, match=f"^x failed on {re.escape(named)}$"):
            everyone(ThreeRanks(), lambda: 42, "x", lambda: waited.append(1))
    assert waited == [1]  # the slowest rank is waited for before the exchange


def test_this_ranks_own_failure_is_reported_to_the_others():
    from pcourse.agree import RankFailure, everyone

    class Echo:
        def allgather(self, mine):
            return ["", mine]

    with pytest.raises(RankFailure,
                       match=r"^x failed on rank 1: ZeroDivisionError: division by zero$"):
        everyone(Echo(), lambda: 1 / 0, "x")


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
    from pcourse.backends.bootstrap import interface_address

    assert interface_address("lo") == "127.0.0.1"
    assert interface_address("=lo") == "127.0.0.1"
    assert interface_address("nosuchif0,lo") == "127.0.0.1"
    assert interface_address("^lo") == "" and interface_address("nosuchif0") == ""


def test_address_choice_honours_the_environment(monkeypatch):
    from pcourse.backends.bootstrap import _pick_address

    for var in ("MASTER_ADDR", "GLOO_SOCKET_IFNAME"):
        monkeypatch.delenv(var, raising=False)
    assert _pick_address(True, "GLOO_SOCKET_IFNAME") == "127.0.0.1"
    monkeypatch.setenv("GLOO_SOCKET_IFNAME", "lo")
    assert _pick_address(False, "GLOO_SOCKET_IFNAME") == "127.0.0.1"
    monkeypatch.setenv("MASTER_ADDR", "10.1.2.3")
    assert _pick_address(False, "GLOO_SOCKET_IFNAME") == "10.1.2.3"


def test_the_store_listens_on_its_address_only_and_a_bad_master_port_is_explained(monkeypatch):
    from pcourse.backends.bootstrap import _pick_port

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
    from pcourse.backends.bootstrap import socket_ifname

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
    out = subprocess.run([sys.executable, "-m", "pcourse.tools.checks.gpu_check"],
                         capture_output=True,
                         text=True, timeout=600, cwd=REPO)
    assert out.returncode == 0, out.stdout + out.stderr
    last = out.stdout.strip().splitlines()[-1]
    assert last == "PASS" if torch.cuda.is_available() else "SKIPPED: no CUDA device" in last


# ------------------------------------------------ waits that tell a slice from a failure
class FakeGlooWork:
    """A torch Work whose slices time out ``slices`` times; then it is done.

    ``completes_at_boundary``: the collective completes during the last slice's timeout,
    as a collective does that ends just as the slice does: that wait still raises
    "Operation timed out!", but ``is_completed()`` is then true. ``error``: the
    collective's own failure, raised by every wait once it is done.
    """

    def __init__(self, slices: int, completes_at_boundary: bool = True,
                 error: str = "") -> None:
        self.slices, self.at_boundary, self.error = slices, completes_at_boundary, error
        self.done, self.waits = False, []

    def wait(self, timeout=None):
        self.waits.append(timeout)
        if not self.done and timeout is None:  # an unbounded wait on a running collective
            raise AssertionError("waited without a bound on a collective still running")
        if len(self.waits) > self.slices:
            self.done = True  # completed during this wait, which then returns
        if self.done:
            if self.error:
                raise RuntimeError(self.error)
            return True
        if len(self.waits) == self.slices and self.at_boundary:
            self.done = True  # completed just as the slice timed out
        raise RuntimeError("Operation timed out!")

    def is_completed(self):
        return self.done


@pytest.mark.parametrize("slices", [1, 3])
def test_a_collective_done_as_its_slice_times_out_succeeded(slices):
    from pcourse.runtime.waits import wait_work

    work = FakeGlooWork(slices, completes_at_boundary=True)
    wait_work(work, in_slices=True)  # the slice's "Operation timed out!" is no error
    assert work.done and len(work.waits) == slices + 1 and work.waits[-1] is None


def test_a_collective_done_after_some_slices_succeeded():
    from pcourse.runtime.waits import SLICE, wait_work

    work = FakeGlooWork(3, completes_at_boundary=False)
    wait_work(work, in_slices=True)
    assert work.waits == [SLICE] * 4  # three slices ran out, the fourth saw it done


@pytest.mark.parametrize("at_boundary", [True, False])
def test_a_failed_collective_raises_its_own_error_not_the_slices(at_boundary):
    from pcourse.runtime.waits import wait_work

    work = FakeGlooWork(2, completes_at_boundary=at_boundary, error="Connection closed by peer")
    with pytest.raises(RuntimeError, match="Connection closed by peer"):
        wait_work(work, in_slices=True)


class FakePolledWork:
    """A torch Work that is done after ``polls`` calls of ``is_completed`` (never: None);
    like NCCL's, its ``wait()`` raises the collective's ``error`` only when given a timeout."""

    def __init__(self, polls: int | None, error: str = "") -> None:
        self.polls, self.error, self.asked, self.waited = polls, error, 0, False

    def is_completed(self):
        self.asked += 1
        return self.polls is not None and self.asked > self.polls

    def wait(self, timeout=None):
        assert self.is_completed(), "wait() on a running collective blocks the CPU: the bug"
        self.waited = True
        if self.error and timeout is not None:  # NCCL looks for errors only with a timeout
            raise RuntimeError(self.error)
        return True


class FakeDist:
    """The part of torch.distributed an NCCL barrier calls; records how it was called."""

    def __init__(self, work: FakePolledWork) -> None:
        self.work, self.calls = work, []

    def barrier(self, **kwargs):
        self.calls.append(kwargs)
        return self.work


def _fake_nccl_backend(work: FakePolledWork, timeout: float = 0.2):
    """An NCCLBackend on a fake torch.distributed, as if on GPU 0 (CUDA faked)."""
    from pcourse.backends.torch_dist import NCCLBackend

    backend = NCCLBackend.__new__(NCCLBackend)  # no CUDA here: skip the real set-up
    backend._dist, backend.group, backend._given_up = FakeDist(work), object(), None
    backend.rank, backend.size, backend.timeout = 0, 2, timeout
    backend.device = torch.device("cuda", 0)
    return backend


def test_the_nccl_barrier_is_polled_and_returns_once_done():
    backend = _fake_nccl_backend(FakePolledWork(polls=200))
    backend.barrier()
    assert backend._dist.calls == [{"group": backend.group, "async_op": True, "device_ids": [0]}]
    assert backend._dist.work.waited


def test_the_nccl_barrier_ends_at_its_deadline_and_the_backend_then_refuses(monkeypatch):
    from pcourse.runtime import waits

    monkeypatch.setattr(waits, "_rank", lambda: 0)  # the message's rank, without MPI
    backend = _fake_nccl_backend(FakePolledWork(polls=None), timeout=0.2)
    with pytest.raises(waits.CollectiveTimeout, match="barrier did not complete within 0.2"):
        backend.barrier()
    assert backend._given_up is backend._dist.work  # close() must know it still runs
    with pytest.raises(RuntimeError, match="out of step"):
        backend.barrier()


def test_the_nccl_barrier_raises_the_collectives_own_error():
    backend = _fake_nccl_backend(FakePolledWork(polls=3, error="NCCL communicator was aborted"))
    with pytest.raises(RuntimeError, match="communicator was aborted"):
        backend.barrier()


# ---------------------------------------------------------------- NCCL's environment
def test_the_default_groups_rendezvous_sets_both_interfaces_and_nccls_error_mode(monkeypatch):
    """With CUDA faked, the default group is cpu:gloo,cuda:nccl: while it is made, both
    interface variables name the loopback and NCCL raises on a timeout instead of ending
    the process; afterwards the environment is as it was."""
    import torch.distributed as dist

    from pcourse.backends import bootstrap

    names = (*bootstrap.IFNAME_VARS, bootstrap.NCCL_ERROR_HANDLING[0])
    for var in names:
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(dist, "is_nccl_available", lambda: True)
    seen = {}

    class Made(Exception):
        pass

    def init_process_group(kind, **kwargs):
        seen.update({var: os.environ.get(var) for var in names}, kind=kind)
        raise Made

    monkeypatch.setattr(dist, "init_process_group", init_process_group)
    monkeypatch.setattr(dist, "is_initialized", lambda: False)

    class OneRank:  # an MPI communicator of one rank, enough for the rendezvous
        def Get_rank(self):
            return 0

        def Get_size(self):
            return 1

        def allgather(self, x):
            return [x]

        def bcast(self, x, root=0):
            return x

    with pytest.raises(RuntimeError, match="Made"):
        bootstrap.ensure_default_group(OneRank(), "NCCL_SOCKET_IFNAME", 10.0)
    lo = "lo0" if sys.platform == "darwin" else "lo"
    assert seen == {"GLOO_SOCKET_IFNAME": lo, "NCCL_SOCKET_IFNAME": lo,
                    "TORCH_NCCL_ASYNC_ERROR_HANDLING": "2", "kind": "cpu:gloo,cuda:nccl"}
    assert not any(var in os.environ for var in names)


def test_a_users_nccl_settings_are_left_alone(monkeypatch):
    from pcourse.backends.bootstrap import _nccl_error_handling, socket_ifname

    monkeypatch.setenv("TORCH_NCCL_ASYNC_ERROR_HANDLING", "1")
    monkeypatch.setenv("NCCL_SOCKET_IFNAME", "ib0")
    monkeypatch.delenv("GLOO_SOCKET_IFNAME", raising=False)
    with _nccl_error_handling(), socket_ifname(("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME"),
                                               loopback=True):
        assert os.environ["TORCH_NCCL_ASYNC_ERROR_HANDLING"] == "1"
        assert os.environ["NCCL_SOCKET_IFNAME"] == "ib0"
        assert os.environ["GLOO_SOCKET_IFNAME"] in ("lo", "lo0")
    assert os.environ["NCCL_SOCKET_IFNAME"] == "ib0" and "GLOO_SOCKET_IFNAME" not in os.environ


# ---------------------------------------------------------------- the CuPy backend, CUDA faked
NCCL_CONSTANTS = {"NCCL_FLOAT32": 7, "NCCL_FLOAT64": 8, "NCCL_INT64": 4, "NCCL_UINT8": 1}


@pytest.mark.parametrize("value", [torch.tensor(-1234, dtype=torch.int16),
                                   torch.tensor(True), torch.tensor(1.5 - 2j),
                                   torch.tensor([[3, -4]], dtype=torch.int16)])
def test_a_dtype_nccl_lacks_travels_as_its_bytes_zero_dim_included(value):
    from types import SimpleNamespace

    from pcourse.backends.cupy_nccl import as_nccl_bytes

    target = torch.zeros_like(value)
    raw = as_nccl_bytes(target, SimpleNamespace(**NCCL_CONSTANTS))
    assert raw.dtype == torch.uint8 and raw.data_ptr() == target.data_ptr()
    assert raw.numel() == value.numel() * value.element_size()
    raw.copy_(value.reshape(-1).view(torch.uint8))  # what a broadcast writes: the root's bytes
    assert torch.equal(target, value)


def test_a_dtype_nccl_has_travels_as_itself():
    from types import SimpleNamespace

    from pcourse.backends.cupy_nccl import as_nccl_bytes

    t = torch.tensor(2.5)
    assert as_nccl_bytes(t, SimpleNamespace(**NCCL_CONSTANTS)) is t


class FakeComm:
    def __init__(self) -> None:
        self.calls = []

    def destroy(self):
        self.calls.append("destroy")

    def abort(self):
        self.calls.append("abort")


def _fake_cupy_backend(monkeypatch, query):
    """A CupyNCCLBackend on a fake communicator, whose stream's work is done when
    ``query()`` says so (torch.cuda's event and stream faked)."""
    from pcourse.backends import cupy_nccl
    from pcourse.runtime import waits

    class Event:
        def record(self, stream):
            pass

        def query(self):
            return query()

    monkeypatch.setattr(torch.cuda, "Event", Event)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: None)
    monkeypatch.setattr(waits, "_rank", lambda: 0)
    backend = cupy_nccl.CupyNCCLBackend.__new__(cupy_nccl.CupyNCCLBackend)
    backend._comm, backend.timeout = FakeComm(), 0.2
    backend.rank, backend.size, backend.device = 0, 2, torch.device("cuda", 0)
    monkeypatch.setattr(cupy_nccl, "_current", backend)
    return backend


def test_cupy_close_destroys_the_communicator_once_the_stream_is_done(monkeypatch):
    backend = _fake_cupy_backend(monkeypatch, lambda: True)
    comm = backend._comm
    backend.close()
    assert comm.calls == ["destroy"] and backend._comm is None


def test_cupy_close_after_a_peer_died_is_bounded_then_aborts(monkeypatch):
    import time

    from pcourse.backends import cupy_nccl

    backend = _fake_cupy_backend(monkeypatch, lambda: False)  # a kernel waits for a dead peer
    comm = backend._comm
    start = time.monotonic()
    with pytest.warns(RuntimeWarning, match="close did not complete within 0.2 s.*aborted"):
        backend.close()
    assert time.monotonic() - start < 5
    assert comm.calls == ["abort"] and backend._comm is None and cupy_nccl._current is None


def test_an_interrupted_cupy_close_aborts_and_the_interrupt_goes_on(monkeypatch):
    def interrupt():
        raise KeyboardInterrupt

    backend = _fake_cupy_backend(monkeypatch, interrupt)
    comm = backend._comm
    with pytest.raises(KeyboardInterrupt):
        backend.close()
    assert comm.calls == ["abort"] and backend._comm is None


# ---------------------------------------------------------------- GPU backends at a rank count
def _fake_gpus(monkeypatch, n: int) -> None:
    """``n`` GPUs here, and the NCCL backends' libraries present (CUDA faked)."""
    import pcourse.backends as backends
    from pcourse.runtime import ranks

    monkeypatch.setattr(backends, "_library_reason", lambda name: "")
    monkeypatch.setattr(ranks, "gpu_count", lambda: n)


@pytest.mark.parametrize("gpus", [0, 1, 2, 3])
def test_gpu_backends_run_at_most_one_rank_per_gpu_and_say_why_not(monkeypatch, gpus):
    from pcourse.backends import unavailable_reason

    _fake_gpus(monkeypatch, gpus)
    for ranks in (1, 2, 4):
        for name in ("nccl", "nccl-cupy"):
            reason = unavailable_reason(name, ranks)
            if ranks <= gpus:
                assert reason == ""
            else:
                assert f"one GPU per rank: {ranks} ranks, {gpus} GPU(s) here" in reason
                assert "one rank checks the plumbing, not the reduction" in reason
        assert unavailable_reason("gloo", ranks) == "" and unavailable_reason("mpi", ranks) == ""
    assert unavailable_reason("nccl") == ""  # no rank count: the libraries only


def test_backend_status_at_a_rank_count_follows_the_gpus(monkeypatch):
    _fake_gpus(monkeypatch, 1)
    one = {row.name: row for row in backend_status(1)}
    two = {row.name: row for row in backend_status(2)}
    assert one["nccl"].usable and one["nccl-cupy"].usable and one["nccl"].reason == "runs on GPU"
    assert not two["nccl"].usable and "2 ranks, 1 GPU(s)" in two["nccl"].reason
    assert two["gloo"].usable and two["mpi"].usable


def test_the_scaling_benchmark_skips_nccl_where_ranks_outnumber_gpus(monkeypatch):
    from pcourse.tools.bench import scaling

    _fake_gpus(monkeypatch, 2)
    assert scaling.skip_reason("nccl", 2) == "" and scaling.skip_reason("nccl-cupy", 1) == ""
    assert "4 ranks, 2 GPU(s)" in scaling.skip_reason("nccl", 4)


# ---------------------------------------------------------------- on GPUs (`pytest -m gpu`)
def _gpus() -> int:
    from pcourse.runtime.ranks import gpu_count

    return gpu_count()


@pytest.mark.gpu
def test_nccl_backends_run_at_one_rank_and_say_it_checks_the_plumbing(mpi_run):
    out = mpi_run(1, "check_nccl.py", expect="NCCL: ALL OK", timeout=300)
    assert "one rank: this checks the plumbing" in out


@pytest.mark.gpu
@pytest.mark.slow
def test_nccl_backends_on_every_gpu_match_mpi(mpi_run):
    if _gpus() < 2:
        pytest.skip(f"a reduction across GPUs needs 2 GPUs or more; {_gpus()} here")
    mpi_run(min(_gpus(), 4), "check_nccl.py", expect="NCCL: ALL OK", timeout=600)


@pytest.mark.gpu
@pytest.mark.slow
def test_an_nccl_timeout_raises_in_the_rank_instead_of_ending_it(mpi_run):
    if _gpus() < 2:
        pytest.skip(f"a peer that never comes needs 2 GPUs; {_gpus()} here")
    out = mpi_run(2, "check_nccl.py", "--timeout-raises", expect="NCCL timeout: ALL OK",
                  timeout=300)
    assert "nccl: the lone barrier raised" in out


@pytest.mark.gpu
@pytest.mark.slow
def test_gpu_check_passes_on_this_machines_gpus():
    out = subprocess.run([sys.executable, "-m", "pcourse.tools.checks.gpu_check"],
                         capture_output=True,
                         text=True, timeout=600, cwd=REPO)
    assert out.returncode == 0 and out.stdout.strip().splitlines()[-1] == "PASS", (
        out.stdout + out.stderr)
    if _gpus() == 1:
        assert "one rank: this checks the plumbing" in out.stdout
