"""versus-source runs the source as its users run it, and says how each row ran."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from pcourse.tools.bench import versus
from pcourse.tools.cluster import launch


@pytest.fixture
def launched(monkeypatch) -> list[tuple[list[str], dict]]:
    """Every command run_in_session is asked to start, with its environment; nothing runs."""
    calls: list[tuple[list[str], dict]] = []

    def fake(cmd, *, timeout, env=None, cwd=None, echo=None, ranks=None, exits=None):
        calls.append((list(cmd), dict(env or {})))
        return "torch threads 3\nTraining took: 1.5 sec\n", 0

    monkeypatch.setattr(launch, "run_in_session", fake)
    return calls


def _args(*extra: str, source: Path = Path("unused")):
    return versus.parser().parse_args(["--source", str(source), "--ranks", "3", *extra])


def test_the_headline_row_is_hydra_with_the_callers_environment(launched, monkeypatch) -> None:
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    table = versus.rows(_args())
    assert table[0]["name"] == "source, as its users run it"
    assert table[-1]["name"] == "pcourse"
    assert table[0]["threads"]() == "3"  # measured by the probe, under hydra
    cmd, env = launched[-1]
    assert Path(cmd[0]).name == "mpiexec" and cmd[1:3] == ["-n", "3"]
    assert "gforker" not in " ".join(cmd)
    assert "OMP_NUM_THREADS" not in env  # the source's users set nothing
    assert not set(launch.loopback_env()) & (set(env) - set(os.environ))  # nor loopback vars


def test_the_second_row_runs_the_source_at_the_courses_threads(launched, tmp_path) -> None:
    (tmp_path / "main_franke.py").write_text("")
    args = _args(source=tmp_path)
    forker = versus.rows(args)[1]
    assert forker["name"] == "source, course's launcher"
    round_ = forker["round"]()
    assert round_["train"] == 1.5
    cmd, env = launched[-1]
    assert any("gforker" in part for part in cmd)
    assert env["OMP_NUM_THREADS"] == str(versus.course_threads(3))
    assert cmd[-5:] == ["main_franke.py", "--comm", "mpi", "--epochs", str(args.epochs)]


def test_skip_hydra_leaves_out_only_the_headline() -> None:
    names = [r["name"] for r in versus.rows(_args("--skip-hydra"))]
    assert names == ["source, course's launcher", "pcourse"]


@pytest.mark.parametrize("bad", [["--rounds", "0"], ["--ranks", "-2"], ["--timeout", "-1"]])
def test_bad_numbers_are_refused_naming_the_value(bad, capsys) -> None:
    with pytest.raises(SystemExit):
        versus.parser().parse_args(["--source", "x", *bad])
    assert f"must be positive, got {bad[1]}" in capsys.readouterr().err
