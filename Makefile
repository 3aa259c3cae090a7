# `make run` and `make test` work on a fresh machine with only Python 3.11+ on it: they create .venv first.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
HOST ?= 127.0.0.1
PORT ?= 8094

.PHONY: run test lint bench clean

# Each step says what it does and pip shows its progress: a first install downloads torch (~200 MB on
# CPU) and takes a minute or two.
$(STAMP): pyproject.toml
	@echo "==> [1/4] creating the virtual environment $(VENV) with $(PYTHON)"
	$(PYTHON) -m venv $(VENV)
	@echo "==> [2/4] upgrading pip"
	$(BIN)/python -m pip install --quiet --upgrade pip
	@echo "==> [3/4] installing torch 2.13.0 (pinned: a bare torch would pull a multi-GB CUDA build)"
	$(BIN)/python -m pip install --progress-bar on torch==2.13.0
	@echo "==> [4/4] installing clef-runtime and its development tools"
	$(BIN)/python -m pip install --progress-bar on -e '.[dev]'
	touch $(STAMP)
	@echo "==> $(VENV) is ready"

run: $(STAMP)
	@echo "==> serving the untrained tiny model on http://$(HOST):$(PORT) (Ctrl+C to stop)"
	$(BIN)/clef serve --model tiny --host $(HOST) --port $(PORT)

test: $(STAMP)
	$(BIN)/python -m pytest -q

lint: $(STAMP)
	$(BIN)/ruff check . && $(BIN)/ruff format --check .

bench: $(STAMP)
	$(BIN)/python benchmarks/suite.py

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache
