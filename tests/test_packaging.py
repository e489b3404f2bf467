"""The install paths stay in step: pyproject.toml (pip) and environment.yml (conda)."""

from __future__ import annotations

import re
import subprocess
import sys
import tomllib
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
# conda-forge names that differ from PyPI's
CONDA_TO_PIP = {"pytorch": "torch", "cupy": "cupy-cuda12x", "nccl": "nvidia-nccl-cu12"}
CONDA_ONLY = {"python", "pip"}


def _name(requirement: str) -> str:
    return re.split(r"[<>=!~ ;\[]", requirement.strip(), maxsplit=1)[0].lower()


def _pip_names() -> set[str]:
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    reqs = project["dependencies"] + project["optional-dependencies"]["test"]
    return {_name(r) for r in reqs}


def _conda_names() -> set[str]:
    names = set()
    text = (REPO / "environment.yml").read_text()
    for line in text[text.index("dependencies:"):].splitlines():
        m = re.match(r"^\s+- ([A-Za-z0-9_.-]+)", line)  # active entries only, not comments
        if m:
            name = _name(m.group(1))
            names.add(CONDA_TO_PIP.get(name, name))
    return names - CONDA_ONLY


def test_environment_yml_matches_pyproject():
    pip, conda = _pip_names(), _conda_names()
    assert pip == conda, (
        f"only in pyproject.toml: {sorted(pip - conda)}; only in environment.yml: "
        f"{sorted(conda - pip)} -- add the package to both"
    )


def test_gpu_extra_is_listed_for_conda_users():
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    gpu = {_name(r) for r in project["optional-dependencies"]["gpu"]}
    commented = {CONDA_TO_PIP.get(n, n) for n in re.findall(
        r"^\s+# - ([A-Za-z0-9_.-]+)", (REPO / "environment.yml").read_text(), re.M)}
    assert gpu <= commented, f"gpu extra not mentioned in environment.yml: {gpu - commented}"


def test_ruff_clean():
    result = subprocess.run(
        [sys.executable, "-m", "ruff", "check", "pcourse", "tests"],
        cwd=REPO, capture_output=True, text=True,
    )
    assert result.returncode == 0, result.stdout + result.stderr


def test_ci_runs_the_readme_test_command():
    readme = (REPO / "README.md").read_text()
    assert "make test" in readme and "make lab" in readme
    assert "exec make test" in (REPO / ".ci" / "run").read_text()
