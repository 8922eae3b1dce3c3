# Set-up is part of the two README commands: `make study` and `make test`.
PYTHON ?= python3
VENV ?= .venv
CORES ?= 2
BIN := $(abspath $(VENV))/bin
# Rules call `python -m offload_study...`: the venv's python must come first on PATH.
export PATH := $(BIN):$(PATH)

.PHONY: study test lint docs

$(VENV)/.installed: pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	# Keep a torch that is already there (a GPU user's CUDA build); else the release CI uses.
	$(BIN)/python -c "import torch" 2>/dev/null || $(BIN)/python -m pip install -q torch==2.13.0
	$(BIN)/python -m pip install -q -e '.[workflow,test]'
	touch $@

study: $(VENV)/.installed
	$(BIN)/snakemake --cores $(CORES)

test: $(VENV)/.installed
	$(BIN)/python -m pytest -q -rs

lint: $(VENV)/.installed
	$(BIN)/ruff check workflow tests benchmarks
	$(BIN)/snakefmt --check Snakefile workflow/rules
	$(BIN)/snakemake --lint

docs: $(VENV)/.installed
	$(BIN)/python -m offload_study.schemadoc study
