# Set-up is part of the two README commands, `make study` and `make test`: Debian packages
# (scripts/setup.sh; apt-get as root), .venv, DeepSpeed's CPU ops compiled ahead of the first run.
# Each step is skipped when done (stamp files in .venv, package checks), so a re-run starts at once.
# `sudo make setup` does the set-up alone.
PYTHON ?= python3
VENV ?= .venv
CORES ?= 2
TEST_WORKERS ?= 3
STUDY ?=
BIN := $(abspath $(VENV))/bin
# What the default study and the tests run: CPU Adam, fused Adam, gloo's shared-memory comm,
# async_io (NVMe offload). Built for DeepSpeed's CPU accelerator, the one the default study uses.
OPS := cpu_adam fused_adam shm_comm async_io pin_memory
# The ops compiled for this venv's torch and DeepSpeed are kept beside it. torch's default cache
# (~/.cache/torch_extensions) is shared by every environment of the user: one that loads an op
# with other paths or flags rebuilds it there, and a run loading that op meanwhile waits for the
# build (NVMe runs of the tests then time out on a machine shared with other checkouts). A
# TORCH_EXTENSIONS_DIR set by the caller is kept.
export TORCH_EXTENSIONS_DIR ?= $(abspath $(VENV))/torch-extensions
OPS_STAMP := $(TORCH_EXTENSIONS_DIR)/.offload-study-ops
# Rules call `python -m offload_study...`: the venv's python must come first on PATH.
export PATH := $(BIN):$(PATH)
export PYTHON

.PHONY: study test setup lint docs debian-study debian-test

# `make study STUDY=config/studies/X.yaml`: another study, read as data (--config study_file;
# never --configfile, whose YAML template engine can run a file's Python).
# --logger rich (snakemake-logger-plugin-rich, the `workflow` extra): a job-count table and one
# line per job instead of Snakemake's scroll; the full log stays in .snakemake/log/.
study: debian-study $(OPS_STAMP)
	$(BIN)/snakemake --cores $(CORES) --logger rich $(if $(STUDY),--config study_file='$(STUDY)')

# --durations: the CI log names the slowest tests (where the suite's time goes).
# -n $(TEST_WORKERS) (pytest-xdist): the tests wait much of their time (SLURM polling, process
# start-up, sleeps; serially the 2 cores were ~37 % busy), so 3 workers share the 2 cores;
# --dist worksteal: an idle worker takes queued tests from a busy one (the durations vary from
# ms to minutes). Measured from a fresh clone with an empty torch extensions folder on the
# 2-core dev machine: 926 tests in 19 min 57 s + 2 `alone` in 1 min 22 s, `make test` 30 min
# 32 s with the set-up (docs/results/README.md); all 3 workers stayed busy to the end, so the
# suite is bound by the 2 cores (benchmarks/test_timeline.py).
# Tests marked `alone` judge timing (an adaptive run that must reach its CI target, a speed
# margin whose CI must clear 1): they run after the parallel ones, by themselves, so that the
# other workers' load is not their noise.
# OFFLOAD_STUDY_TEST_SHARED (tests/conftest.py made_once): the two runs measure this machine's
# calibration once, into a folder emptied first.
test: debian-test $(OPS_STAMP)
	rm -rf .pytest-shared
	OFFLOAD_STUDY_TEST_SHARED=$(abspath .pytest-shared) $(BIN)/python -m pytest -q -rs \
		-n $(TEST_WORKERS) --dist worksteal --durations=15 -m "not alone"
	OFFLOAD_STUDY_TEST_SHARED=$(abspath .pytest-shared) $(BIN)/python -m pytest -q -rs -m alone

setup: debian-test $(OPS_STAMP)

debian-study debian-test: debian-%:
	bash scripts/setup.sh $*

# Order-only: .venv needs python3-venv, the ops need the compiler and libaio-dev.
# A torch that is already there is kept (a GPU user's CUDA build); else the release CI uses.
$(VENV)/.installed: pyproject.toml | debian-study
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -c "import torch" 2>/dev/null || $(BIN)/python -m pip install -q torch==2.13.0
	$(BIN)/python -m pip install -q -e '.[train,analysis,workflow,test]'
	touch $@

# Compiled into TORCH_EXTENSIONS_DIR (above); removing the stamp rebuilds what changed.
$(OPS_STAMP): $(VENV)/.installed | debian-study
	DS_ACCELERATOR=cpu $(BIN)/python -m offload_study.admission.ops $(OPS)
	mkdir -p $(TORCH_EXTENSIONS_DIR) && touch $@

# ruff format --check: the code is as `ruff format` writes it (pyproject.toml's [tool.ruff]);
# a `# fmt: skip` keeps only a table whose rows read better aligned.
# check_history: comments say why, never when (no lease, stop, issue number or path outside the
# repository in workflow/, config/, benchmarks/, tests/; history goes to docs/CHANGELOG.md).
lint: $(VENV)/.installed
	$(BIN)/ruff check workflow tests benchmarks scripts
	$(BIN)/ruff format --check workflow tests benchmarks scripts
	$(BIN)/python scripts/check_history.py
	$(BIN)/snakefmt --check Snakefile workflow/rules
	$(BIN)/snakemake --lint

docs: $(VENV)/.installed
	$(BIN)/python -m offload_study.schemadoc study
