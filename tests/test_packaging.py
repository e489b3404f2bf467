"""The install paths stay in step: pyproject.toml (pip), environment.yml (conda), the
Makefile; every package the code imports is declared."""

from __future__ import annotations

import ast
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


# import name -> distribution that provides it, for every third-party import we use
DISTRIBUTIONS = {"torch": "torch", "numpy": "numpy", "mpi4py": "mpi4py", "ipyparallel":
                 "ipyparallel", "matplotlib": "matplotlib", "tqdm": "tqdm", "IPython": "ipython",
                 "nbformat": "nbformat", "nbclient": "nbclient", "psutil": "psutil",
                 "pytest": "pytest",
                 "cupy": "cupy-cuda12x", "playwright": "playwright",
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
