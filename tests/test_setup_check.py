"""The setup check, as an instructor's participants run it from a terminal."""

from __future__ import annotations

import ast
import re
import subprocess
import sys
from pathlib import Path

import pytest

from pcourse.backends import BACKENDS, backend_status
from pcourse.tools.checks import setup_check
from pcourse.tools.cluster.engines import ClusterError

REPO = Path(__file__).resolve().parents[1]


def test_backend_table_names_every_backend_with_a_reason():
    rows = backend_status()
    assert [r.name for r in rows] == list(BACKENDS)
    for row in rows:
        assert row.reason, f"{row.name}: no reason given"
    by_name = {r.name: r for r in rows}
    assert by_name["mpi"].usable and by_name["gloo"].usable


def test_verdict_needs_mpi_and_gloo(capsys):
    assert setup_check.print_verdict({"mpi": "OK", "gloo": "OK", "nccl": "FAILED: x"})
    assert capsys.readouterr().out.strip() == "READY"
    assert not setup_check.print_verdict({"mpi": "OK", "gloo": "FAILED: boom"})
    assert "NOT READY" in capsys.readouterr().out


@pytest.mark.slow
@pytest.mark.mpi
def test_command_line_check_is_ready_here():
    result = subprocess.run([sys.executable, "-m", "pcourse.tools.checks.setup_check", "-n", "2"],
                            capture_output=True, text=True, timeout=300)
    out = result.stdout
    assert result.returncode == 0, out + result.stderr
    assert out.strip().splitlines()[-1] == "READY"
    assert "allreduce over mpi         OK" in out and "allreduce over gloo        OK" in out


@pytest.mark.slow
@pytest.mark.mpi
def test_setup_notebook_passes_under_nbval_again():
    """The suite runs notebooks/ through nbval once; this is the second run in a row, so a
    first run that left state behind (a cluster, a file, a port) would fail here or there."""
    result = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
         "notebooks/00_setup_check.ipynb"],
        cwd=REPO, capture_output=True, text=True, timeout=600,
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-2000:]
    assert " passed" in result.stdout and "failed" not in result.stdout


# Every NOT READY reason, reached the way a learner's machine would reach it. A reason
# added to REASONS without a scenario here fails test_every_reason_has_a_scenario.
class _Result:
    def __init__(self, value=None, error=None):
        self.value, self.error = value, error

    def get(self, timeout):
        if self.error:
            raise self.error
        return self.value


class _FakeCluster:
    """Two engines whose allreduce answers as told: per backend, a result or an error."""

    n = 2

    def __init__(self, answers):
        self.view = self
        self.answers = answers

    def apply_async(self, fn, name):
        return self.answers[name]


def _smoke(answers):
    return setup_check.smoke_test(_FakeCluster(answers), list(answers))


def _no_mpiexec(monkeypatch):
    def missing():
        raise setup_check.MPINotFound("no mpiexec")

    monkeypatch.setattr(setup_check, "find_mpiexec", missing)
    return setup_check.run(2)


def _cluster_fails(monkeypatch):
    def boom(n):
        raise ClusterError("the engines exited")

    monkeypatch.setattr(setup_check, "start_cluster", boom)
    return setup_check.run(2)


def _unusable(backend):
    def scenario(monkeypatch):
        monkeypatch.setattr(setup_check, "unavailable_reason", lambda name: "not installed")
        return setup_check.print_verdict({b: setup_check.OK for b in setup_check.NEEDED
                                          if b != backend})
    return scenario


def _raises(monkeypatch):
    ok = _Result([[3.0] * 5, [3.0] * 5])
    return setup_check.print_verdict(_smoke({"mpi": ok, "gloo": _Result(
        error=RuntimeError("Connection refused"))}))


def _wrong(monkeypatch):
    ok = _Result([[3.0] * 5, [3.0] * 5])
    return setup_check.print_verdict(_smoke({"mpi": _Result([[2.0] * 5, [2.0] * 5]),
                                             "gloo": ok}))


def _hangs(monkeypatch):
    import ipyparallel as ipp

    ok = _Result([[3.0] * 5, [3.0] * 5])
    return setup_check.print_verdict(_smoke({"mpi": _Result(error=ipp.error.TimeoutError()),
                                             "gloo": ok}))


def _no_mnist(monkeypatch):
    import tempfile

    from pcourse.workloads import mnist

    with tempfile.TemporaryDirectory() as empty:  # offline, and no MNIST there
        monkeypatch.setenv(mnist.ENV_VAR, empty)
        monkeypatch.setenv(mnist.DOWNLOAD_VAR, "0")
        problem = setup_check.mnist_problem()
    return setup_check.print_verdict({b: setup_check.OK for b in setup_check.NEEDED}, problem)


SCENARIOS = {
    "no-mpiexec": (_no_mpiexec, []),
    "cluster-failed": (_cluster_fails, ["the engines exited"]),
    "mpi-unusable": (_unusable("mpi"), ["not installed"]),
    "gloo-unusable": (_unusable("gloo"), ["not installed"]),
    "allreduce-failed": (_raises, ["gloo", "Connection refused"]),
    "allreduce-wrong": (_wrong, ["mpi", "expected 3.0"]),
    "allreduce-hung": (_hangs, ["mpi", f"{setup_check.SMOKE_TIMEOUT:.0f} s"]),
    "not-tested": (_hangs, ["gloo"]),  # hung on mpi: gloo never ran
    "no-mnist": (_no_mnist, ["t10k-images-idx3-ubyte", "not found"]),
}


def test_every_reason_has_a_scenario():
    assert set(SCENARIOS) == set(setup_check.REASONS)


@pytest.mark.parametrize("code", sorted(SCENARIOS))
def test_each_reason_prints_its_line_and_its_fix(code, monkeypatch, capsys):
    scenario, details = SCENARIOS[code]
    assert scenario(monkeypatch) is False
    out = capsys.readouterr().out
    line = next((x for x in out.splitlines() if x.startswith(f"NOT READY [{code}]: ")), None)
    assert line, f"no NOT READY [{code}] line in:\n{out}"
    for detail in details:
        assert detail in line, f"{detail!r} missing from {line!r}"
    assert f"  fix: {setup_check.REASONS[code].fix}" in out
    assert "READY" not in out.replace("NOT READY", "")


def test_not_ready_is_printed_only_through_the_reasons():
    """A NOT READY line written anywhere else would escape the troubleshooting table."""
    tree = ast.parse(Path(setup_check.__file__).read_text())
    owner = {}
    for fn in ast.walk(tree):
        if isinstance(fn, ast.FunctionDef):
            for node in ast.walk(fn):
                owner.setdefault(id(node), fn.name)
    docstrings = {id(n.body[0].value) for n in ast.walk(tree)
                  if isinstance(n, ast.Module | ast.FunctionDef | ast.ClassDef) and n.body
                  and isinstance(n.body[0], ast.Expr)}
    places = {owner.get(id(n), "<module>") for n in ast.walk(tree)
              if isinstance(n, ast.Constant) and isinstance(n.value, str)
              and "NOT READY" in n.value and id(n) not in docstrings}
    assert places == {"not_ready"}, f"NOT READY printed from {places}"


def test_troubleshooting_table_has_every_reason_and_its_fix():
    from pcourse.tools.workshop.render import troubleshooting

    rows = [r for r in troubleshooting().splitlines()[2:]]
    codes = [re.match(r"\| `([\w-]+)` \|", r).group(1) for r in rows]
    assert codes == list(setup_check.REASONS)
    for row, reason in zip(rows, setup_check.REASONS.values(), strict=True):
        assert reason.fix.replace("|", "\\|") in row


# ---------------------------------------------------------------- GPUs, faked
def _fake_gpus(monkeypatch, n: int) -> None:
    """``n`` GPUs, with the NCCL backends' libraries present."""
    import pcourse.backends as backends
    from pcourse.runtime import ranks

    monkeypatch.setattr(backends, "_library_reason", lambda name: "")
    monkeypatch.setattr(ranks, "gpu_count", lambda: n)


def _check_with_engines(monkeypatch, n: int, gpus: int) -> tuple[bool, list[str]]:
    """The whole check on ``n`` fake engines and ``gpus`` fake GPUs: every backend the
    engines are asked to test answers the right sum. Returns (ready, backends tested)."""
    right = _Result([[n * (n + 1) / 2] * 5] * n)
    tested = []

    class Cluster(_FakeCluster):
        def apply_async(self, fn, name):
            tested.append(name)
            return right

        def table(self):
            return ""

    cluster = Cluster({})
    cluster.n = n
    _fake_gpus(monkeypatch, gpus)
    monkeypatch.setattr(setup_check, "find_mpiexec", lambda: "mpiexec")
    monkeypatch.setattr(setup_check, "start_cluster", lambda k: cluster)
    monkeypatch.setattr(setup_check, "stop_cluster", lambda mc: None)
    monkeypatch.setattr(setup_check, "print_versions", lambda: None)
    return setup_check.run(n), tested


@pytest.mark.parametrize("gpus", [1, 2])
def test_gpu_backends_are_tested_only_with_a_gpu_per_engine(monkeypatch, capsys, gpus):
    """One GPU, two engines: NCCL is listed as not usable, with the reason, and not
    tested; never "usable", then "FAILED", then READY. Two GPUs: both are tested."""
    ready, tested = _check_with_engines(monkeypatch, 2, gpus)
    out = capsys.readouterr().out
    assert ready and out.strip().splitlines()[-1] == "READY"
    rows = {line.split()[0]: line for line in out.splitlines()
            if line.split() and line.split()[0] in BACKENDS}
    if gpus < 2:
        assert tested == ["mpi", "mpi-pickle", "gloo"]
        for name in ("nccl", "nccl-cupy"):
            assert rows[name].split()[1] == "no"
            assert "needs one GPU per rank: 2 ranks, 1 GPU(s) here" in rows[name]
            assert f"allreduce over {name}" not in out
    else:
        assert tested == list(BACKENDS)
        assert all(rows[name].split()[1] == "yes" for name in ("nccl", "nccl-cupy"))
    assert "FAILED" not in out


def test_one_engine_tests_the_gpu_backends_on_one_gpu(monkeypatch, capsys):
    ready, tested = _check_with_engines(monkeypatch, 1, 1)
    assert ready and "nccl" in tested and "nccl-cupy" in tested


@pytest.mark.parametrize("installed, shown", [
    ({}, "not installed"),
    ({"cupy-cuda12x": "13.6.0"}, "13.6.0 (cupy-cuda12x)"),
    ({"cupy-cuda13x": "14.2.0"}, "14.2.0 (cupy-cuda13x)"),
    ({"cupy": "14.0.1"}, "14.0.1"),
    ({"cupy-cuda12x": "13.6.0", "cupy-cuda13x": "14.2.0"},
     "13.6.0 (cupy-cuda12x), 14.2.0 (cupy-cuda13x)"),  # two at once: both shown
])
def test_the_versions_name_any_cupy_wheel(monkeypatch, installed, shown):
    import importlib.metadata

    class Dist:
        def __init__(self, name, version):
            self.metadata, self.version = {"Name": name}, version

    others = [Dist("cupyx-extras", "1.0"), Dist("numpy", "2.0"), Dist("Cupy-Cuda", "9")]
    monkeypatch.setattr(importlib.metadata, "distributions",
                        lambda: others + [Dist(n, v) for n, v in installed.items()])
    assert setup_check.cupy_version() == shown


@pytest.mark.gpu
@pytest.mark.slow
@pytest.mark.mpi
def test_one_engine_checks_the_nccl_backends_on_a_gpu():
    result = subprocess.run([sys.executable, "-m", "pcourse.tools.checks.setup_check", "-n", "1"],
                            capture_output=True, text=True, timeout=300)
    out = result.stdout
    assert result.returncode == 0 and out.strip().splitlines()[-1] == "READY", out + result.stderr
    assert "allreduce over nccl        OK" in out, out
