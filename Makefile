# Two entry points for a fresh clone: `make demo` (the main job) and `make test` (the suite).
# Both create .venv and install the project into it on first use.
#
# TORCH is the torch requirement installed first. On a CPU-only machine point pip at a CPU
# build (e.g. PIP_TORCH_ARGS="--index-url https://download.pytorch.org/whl/cpu"); GPU users
# keep the default, which is PyPI's CUDA build (see README).

PY ?= python3
VENV ?= .venv
TORCH ?= torch==2.13.0
PIP_TORCH_ARGS ?=
BIN := $(VENV)/bin

.PHONY: setup demo test bench clean

$(BIN)/.installed: pyproject.toml
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q $(PIP_TORCH_ARGS) "$(TORCH)"
	$(BIN)/pip install -q -e ".[test,bench]"
	touch $@

setup: $(BIN)/.installed

demo: setup
	$(BIN)/shardstore demo

test: setup
	$(BIN)/python -m pytest -q

bench: setup
	$(BIN)/python -m benchmarks --quick

clean:
	rm -rf $(VENV) checkpoints results
