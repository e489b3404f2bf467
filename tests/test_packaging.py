"""The install paths stay in step: pyproject.toml (pip), environment.yml (conda), the
Makefile; every package the code imports is declared."""

from __future__ import annotations

import ast
import os
import re
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

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


# import name -> distribution that provides it, for every third-party import we use
DISTRIBUTIONS = {"torch": "torch", "numpy": "numpy", "mpi4py": "mpi4py", "ipyparallel":
                 "ipyparallel", "matplotlib": "matplotlib", "tqdm": "tqdm", "IPython": "ipython",
                 "nbformat": "nbformat", "nbclient": "nbclient", "psutil": "psutil",
                 "pytest": "pytest",
                 "cupy": "cupy-cuda12x", "playwright": "playwright",
                 "myst_nb": "myst-nb", "sphinx_book_theme": "sphinx-book-theme",
                 "jupyter_client": "jupyter_client",
                 "jupyter_core": "jupyter_core"}


def _imported_modules(folder: Path) -> set[str]:
    names = set()
    for path in folder.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                names.update(alias.name.split(".")[0] for alias in node.names)
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names.add(node.module.split(".")[0])
    local = {path.stem for path in folder.rglob("*.py")}  # conftest, tests/mpi/harness
    return names - set(sys.stdlib_module_names) - local - {"pcourse", "__future__"}


def test_every_imported_package_is_declared():
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    declared = {"package": {_name(r) for r in project["dependencies"]}}
    declared["tests"] = declared["package"] | {
        _name(r) for extra in project["optional-dependencies"].values() for r in extra}
    for folder, allowed in (("pcourse", "package"), ("tests", "tests")):
        for module in _imported_modules(REPO / folder):
            assert module in DISTRIBUTIONS, f"{folder} imports {module}: add it to DISTRIBUTIONS"
            wanted = DISTRIBUTIONS[module]
            optional = module == "cupy"  # the gpu extra, imported only where CUDA is asked for
            where = declared["tests"] if optional else declared[allowed]
            assert wanted in where, f"{folder} imports {module}, but {wanted} is not declared"


def test_requires_python_covers_what_the_code_uses():
    spec = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["requires-python"]
    assert spec.replace(" ", "").startswith(">=3.11"), spec  # tests import tomllib
    assert "python=3.11" in (REPO / "environment.yml").read_text()
    assert "(3, 11)" in (REPO / "Makefile").read_text()  # the setup refuses older Pythons


# ---------------------------------------------------------------- which torch `make setup` installs

CPU_INDEX = "https://download.pytorch.org/whl/cpu"


def _planned(target: str, tmp_path: Path, *variables: str, **environ: str) -> list[str]:
    """The pip commands `make TARGET` would run on a fresh venv (`make -n`: nothing runs)."""
    env = {k: v for k, v in os.environ.items()  # what .ci/run exports must not leak in
           if k not in ("TORCH_INDEX", "NVIDIA_GPU", "TORCH_SPEC", "MAKEFLAGS", "MFLAGS")}
    env.update(environ)
    result = subprocess.run(["make", "-n", target, f"VENV={tmp_path / 'venv'}", *variables],
                            cwd=REPO, env=env, capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stdout + result.stderr
    return [ln for ln in result.stdout.splitlines() if " -m pip install " in ln]


def _torch_line(tmp_path: Path, *variables: str) -> str:
    (line,) = [ln for ln in _planned("setup", tmp_path, *variables) if '"torch==' in ln]
    return line


def _nvidia_gpu_here() -> bool:
    """What the Makefile looks for, looked at independently: a GPU listed, or the driver."""
    try:
        listed = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True,
                                timeout=30).stdout
    except (OSError, subprocess.TimeoutExpired):
        listed = ""
    return any(ln.startswith("GPU") for ln in listed.splitlines()) or Path(
        "/proc/driver/nvidia/version").exists()


@pytest.mark.parametrize("variables, index", [
    (["NVIDIA_GPU="], CPU_INDEX),  # no GPU: PyTorch's CPU wheel index
    (["NVIDIA_GPU=yes"], None),  # a GPU: the package index's CUDA build
    (["NVIDIA_GPU=", "TORCH_INDEX="], None),  # told to leave it to pip's configuration
    (["NVIDIA_GPU=yes", "TORCH_INDEX=file:///srv/wheels"], "file:///srv/wheels"),
])
def test_make_setup_takes_torch_from_the_index_the_machine_calls_for(tmp_path, variables, index):
    line = _torch_line(tmp_path, *variables)
    assert '"torch==2.13.0"' in line, line
    found = re.findall(r'--index-url "([^"]*)"', line)
    assert found == ([index] if index else []), line
    assert ("--no-deps" in line) == bool(index), line  # its dependencies: the package index
    assert "--extra-index-url" not in line, line  # one index: never CUDA and CPU mixed


def test_make_setup_detects_this_machines_gpu(tmp_path):
    index = re.findall(r'--index-url "([^"]*)"', _torch_line(tmp_path))
    assert index == ([] if _nvidia_gpu_here() else [CPU_INDEX]), index


def test_only_torch_comes_from_the_cpu_index(tmp_path):
    """torch alone (--no-deps); the course's install, after it, resolves torch's own
    dependencies from the package index, with everything else."""
    lines = _planned("setup", tmp_path, "NVIDIA_GPU=")
    torch = [k for k, ln in enumerate(lines) if '"torch==' in ln]
    course = [k for k, ln in enumerate(lines) if '-e ".[' in ln]
    assert torch == [0] and course == [1], lines
    assert "--index-url" not in lines[1] and "--no-deps" not in lines[1], lines


def test_ci_keeps_to_the_wheels_it_has_and_installs_the_book_extra(tmp_path):
    """CI cannot reach PyTorch's index: .ci/run empties TORCH_INDEX before any make."""
    (torch,) = [ln for ln in _planned("setup", tmp_path, "NVIDIA_GPU=", TORCH_INDEX="")
                if '"torch==' in ln]  # exported empty, as .ci/run does
    assert "--index-url" not in torch, torch
    ci = (REPO / ".ci" / "run").read_text()
    first_make = min(m.start() for m in re.finditer(r"^make ", ci, re.M))
    assert re.search(r"^export TORCH_INDEX=$", ci[:first_make], re.M), "TORCH_INDEX= first"
    assert "make book-setup" in ci and "PCOURSE_REQUIRE_BOOK=1" in ci
    (book,) = [ln for ln in _planned("book-setup", tmp_path) if '-e ".[' in ln
               and "book" in ln]
    assert '".[test,book]"' in book, book
