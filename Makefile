# The course's front door. `make lab` opens the course; `make test` runs every check.
# Both create .venv on first use and re-install only when pyproject.toml changes.
PYTHON ?= python3
VENV ?= .venv
BIN := $(abspath $(VENV))/bin
PY := $(BIN)/python
# Named exactly so pip takes the CPU build already on disk here (and the usual CUDA
# build on a GPU machine); the looser range in pyproject.toml is then already satisfied.
TORCH_SPEC ?= torch==2.13.0
EXTRAS ?= test
STAMP := $(VENV)/.pcourse-installed
# mpiexec and hydra_pmi_proxy come from the mpich wheel and live in the venv's bin/.
RUN := PATH="$(BIN):$$PATH"
NOTEBOOKS ?= notebooks

.PHONY: setup lab test lint gpu-check clean-venv exercises grade grade-class

$(STAMP): pyproject.toml
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	@$(PY) -c 'import sys; sys.exit(sys.version_info < (3, 10))' || \
		{ echo "pcourse needs Python >= 3.10; run: make PYTHON=python3.11 ..."; exit 1; }
	$(PY) -m pip install --quiet --disable-pip-version-check "$(TORCH_SPEC)"
	$(PY) -m pip install --quiet --disable-pip-version-check -e ".[$(EXTRAS)]"
	@touch $@

setup: $(STAMP)

lab: setup
	$(RUN) $(BIN)/jupyter lab --ip=127.0.0.1 --no-browser --allow-root \
		--ServerApp.root_dir="$(abspath $(NOTEBOOKS))"

test: setup
	$(RUN) $(PY) -m pytest

lint: setup
	$(RUN) $(BIN)/ruff check pcourse tests

# CuPy and NCCL's runtime on top of the usual setup (a stamp of their own, so that
# a venv set up without them still gets them here).
GPU_STAMP := $(VENV)/.pcourse-gpu-installed
$(GPU_STAMP): $(STAMP)
	$(PY) -m pip install --quiet --disable-pip-version-check -e ".[test,gpu]"
	@touch $@

# Both NCCL backends, one rank per visible GPU, checked against MPI's own Allreduce.
gpu-check: $(GPU_STAMP)
	$(RUN) $(PY) -m pcourse.checks.gpu_check

clean-venv:
	rm -rf $(VENV)

# exercises/ is generated from solutions/ (the solved, executed notebooks).
exercises: setup
	$(RUN) $(PY) -m pcourse.grading.exercises

# Grade every exercise (or: make grade NOTEBOOKS_TO_GRADE="exercises/01_partitioner.ipynb").
grade: setup
	$(RUN) $(PY) -m pcourse.grading.grade $(NOTEBOOKS_TO_GRADE)

# Grade a class: CLASS/<learner>/<exercise>.ipynb for every learner; writes CLASS/grades.csv
# and CLASS/gradebook.csv (GRADE_ARGS="-j 4 --timeout 300 --out results/" to change).
grade-class: setup
	@test -n "$(CLASS)" || { echo "usage: make grade-class CLASS=path/to/submissions"; exit 2; }
	$(RUN) $(PY) -m pcourse.grading.grade --class "$(CLASS)" $(GRADE_ARGS)
