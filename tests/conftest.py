"""What every test shares: the one fake backend, the one MPI launcher, markers, leak guard.

- ``OneRankBackend`` (fixture ``one_rank``): a one-rank backend that records what it is
  asked to do, and can play a second rank's part in agreement checks.
- ``mpi_run``: runs a script of ``tests/mpi/`` on n ranks; a test that uses it is
  marked ``mpi``. Notebook cells collected by nbval are marked ``notebook``; tests
  marked ``gpu`` are skipped without a CUDA device.
- The session ends by checking that no engine, controller or mpiexec it started
  outlives it.
"""

from __future__ import annotations

import os
import signal
import time
import uuid
from collections.abc import Callable
from pathlib import Path

import numpy as np
import psutil
import pytest
import torch

from pcourse.backends import Backend, Work
from pcourse.tools.cluster.launch import mpirun
from pcourse.tools.cluster.reaping import sweep_mpi_segments

REPO = Path(__file__).resolve().parents[1]
MPI_SCRIPTS = REPO / "tests" / "mpi"
# Launching engines needs the venv's mpiexec; tests may be started without activating it.
os.environ["PATH"] = f"{Path(os.sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}"

# Every process this test session starts inherits this variable, even once orphaned,
# so the leak check finds exactly ours and never touches anyone else's MPI jobs.
SESSION_MARK = "PCOURSE_TEST_SESSION"
os.environ[SESSION_MARK] = uuid.uuid4().hex

_CLUSTER_MARKERS = ("ipyparallel.engine", "ipyparallel.controller", "ipengine", "ipcontroller",
                    "pcourse.tools.cluster.reaping",
                    "mpiexec", "hydra_pmi_proxy",  # MPICH's launcher and proxy
                    "prterun", "prted", "orted")  # Open MPI's (5: PRRTE; 4: ORTE)


# ---------------------------------------------------------------- the fake backend
class OneRankBackend(Backend):
    """One rank: averaging over one rank is the identity, so results are the inputs.

    ``calls`` records every collective as (kind, tensor, op or root), kind one of
    "allreduce", "allreduce_async", "broadcast". ``peer``: the vector a second rank
    would contribute to agreement checks (see :meth:`facts_of`); None: no second rank.
    """

    name, rank, size, device = "one-rank", 0, 1, torch.device("cpu")

    def __init__(self, peer: np.ndarray | None = None) -> None:
        self.calls: list[tuple[str, torch.Tensor, str | int]] = []
        self.sent: list[np.ndarray] = []  # what this rank contributed to agreement checks
        self.peer = peer

    def allreduce(self, tensor, op="sum", *, check=True):
        self._agree(tensor, check, op=op)
        self.calls.append(("allreduce", tensor, op))
        return tensor

    def allreduce_async(self, tensor, op="sum", *, check=True) -> Work:
        self._agree(tensor, check, op=op)
        self.calls.append(("allreduce_async", tensor, op))
        return Work()

    def broadcast(self, tensor, root=0, *, check=True):
        self._agree(tensor, check, root=root)
        self.calls.append(("broadcast", tensor, root))
        return tensor

    def barrier(self):
        return None

    def max_over_ranks(self, v: np.ndarray) -> np.ndarray:
        self.sent.append(v.copy())
        return v if self.peer is None else np.maximum(v, self.peer)

    @classmethod
    def facts_of(cls, collective: Callable[[OneRankBackend], object]) -> np.ndarray:
        """What a rank running ``collective`` contributes to its first agreement check."""
        other = cls()
        collective(other)
        return other.sent[0]


@pytest.fixture
def one_rank() -> type[OneRankBackend]:
    """The fake backend's class: ``one_rank()``, or ``one_rank(peer=...)``."""
    return OneRankBackend


# ---------------------------------------------------------------- MPI jobs
@pytest.fixture
def mpi_run() -> Callable[..., str]:
    """``mpi_run(n, "check_x.py", *args, expect=..., timeout=...)``: run a script of
    tests/mpi/ on n ranks under mpi4py's runner (an uncaught exception on one rank
    aborts them all); return its output. Fails the test, with the output, on a
    non-zero exit or when the ``expect`` line is missing."""

    def run(n: int, script: str, *args: str, expect: str = "", timeout: float = 240,
            env: dict[str, str] | None = None) -> str:
        done = mpirun(n, ["-m", "mpi4py", str(MPI_SCRIPTS / script), *args], timeout=timeout,
                      cwd=REPO, check=False, env=env)
        assert done.returncode == 0, done.stdout[-4000:]
        assert expect in done.stdout, done.stdout[-4000:]
        return done.stdout

    return run


# ---------------------------------------------------------------- markers
# The longest file first: `make test` hands whole files to two processes, and the one that
# takes this file should not start it when the other is nearly done.
FIRST = ("test_grading.py",)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    items.sort(key=lambda item: item.path.name not in FIRST)  # stable: the rest keep their order
    no_gpu = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "mpi_run" in getattr(item, "fixturenames", ()):
            item.add_marker("mpi")
        if item.path.suffix == ".ipynb":
            item.add_marker("notebook")
        if "gpu" in item.keywords and not torch.cuda.is_available():
            item.add_marker(no_gpu)


def launcher_listeners() -> set[str]:
    """Processes allowed to listen beyond loopback on one machine: none under MPICH; under
    Open MPI its launcher, whose PRRTE out-of-band network refuses loopback alone
    (:func:`pcourse.tools.cluster.launch.loopback_env`). The ranks stay on loopback under both."""
    from pcourse.tools.cluster.launch import mpi_flavour

    return {"prterun", "prted"} if mpi_flavour() == "openmpi" else set()


# ---------------------------------------------------------------- leak guard
def cluster_processes() -> dict[int, str]:
    """pid -> command line of every engine, controller and MPI launcher this session started."""
    from pcourse.tools.cluster.reaping import marked

    found = {}
    for proc in marked(os.environ[SESSION_MARK], SESSION_MARK):
        try:
            if proc.status() == psutil.STATUS_ZOMBIE:
                continue
            cmd = " ".join(proc.cmdline())
        except psutil.Error:
            continue
        if any(marker in cmd for marker in _CLUSTER_MARKERS):
            found[proc.pid] = cmd
    return found


@pytest.fixture(scope="session", autouse=True)
def interrupts_raise():
    """Ctrl-C raises KeyboardInterrupt here, as in a terminal or a notebook's kernel.

    A test run started in the background by a non-interactive shell inherits SIGINT
    ignored; the tests of the stop button would then wait for an interrupt that
    never lands.
    """
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    yield
    signal.signal(signal.SIGINT, previous)


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


def pytest_unconfigure(config: pytest.Config) -> None:
    """Leave no MPICH shared memory behind, after every teardown (nbval's included).

    nbval and the grader end their kernels with SIGKILL, and a kernel that imported
    mpi4py.MPI was an MPI process of its own: its segment would wait for the next start.
    """
    time.sleep(1.0)  # past the age at which the sweep spares a segment as a new job's
    sweep_mpi_segments()
