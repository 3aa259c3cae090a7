# `make run` and `make test` work on a fresh machine with only Python 3.11+ on it: they create .venv first.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
# Two stamps, so that serving never pulls the development tools: `make run` needs only the first,
# `make test` (and lint, bench) both; `make test` after `make run` adds the tools and nothing else.
STAMP := $(VENV)/.installed
DEV_STAMP := $(VENV)/.installed-dev
HOST ?= 127.0.0.1
PORT ?= 8094
# The version pyproject.toml pins. PyPI's Linux x86_64 wheel of torch is the CUDA build (cuda-toolkit, cudnn,
# nccl: gigabytes); PyTorch's CPU index serves the CPU build under the same version (2.13.0+cpu), which the
# pin accepts. On a CUDA machine take a CUDA build instead: make TORCH_INDEX=https://pypi.org/simple (CUDA 13).
TORCH_VERSION := 2.13.0
TORCH_INDEX ?= https://download.pytorch.org/whl/cpu

.PHONY: run test lint bench clean

# Each step says what it does and pip shows its progress: a first install downloads torch (~200 MB on
# CPU) and takes a minute or two. Step 3 takes only torch itself from TORCH_INDEX (--no-deps): its
# dependencies come from PyPI in step 4, so where that index cannot be reached but a local copy of the wheel
# can (a package mirror, pip's find-links), pip gives up on the index once, for torch alone, not for every
# package: that once is still six tries (pip's default --retries 5, with back-off, each up to --timeout 15 s
# where connections hang), kept because they are what carries an install over a flaky connection.
$(STAMP): pyproject.toml
	@echo "==> [1/4] creating the virtual environment $(VENV) with $(PYTHON)"
	$(PYTHON) -m venv $(VENV)
	@echo "==> [2/4] upgrading pip"
	$(BIN)/python -m pip install --quiet --upgrade pip
	@echo "==> [3/4] installing torch $(TORCH_VERSION) from $(TORCH_INDEX) (the CPU build unless TORCH_INDEX says otherwise)"
	$(BIN)/python -m pip install --progress-bar on --no-deps torch==$(TORCH_VERSION) --index-url $(TORCH_INDEX)
	@echo "==> [4/4] installing clef-runtime and what serving needs"
	$(BIN)/python -m pip install --progress-bar on -e .
	touch $(STAMP)
	@echo "==> $(VENV) is ready to serve"

$(DEV_STAMP): $(STAMP)
	@echo "==> installing the development tools (pytest, ruff, ray, playwright, the official clients, ...)"
	$(BIN)/python -m pip install --progress-bar on -e '.[dev]'
	touch $(DEV_STAMP)

run: $(STAMP)
	@echo "==> serving the untrained tiny model on http://$(HOST):$(PORT) (Ctrl+C to stop)"
	$(BIN)/clef serve --model tiny --host $(HOST) --port $(PORT)

# One worker per core (pytest-xdist); --dist loadfile keeps each test file on one worker, so a module's
# shared fixtures (a live server, the Ray cluster) start once. --no-loadscope-reorder hands the files out in
# collection order, which tests/conftest.py starts with the longest files. The fast part: pytest -m "not slow".
test: $(DEV_STAMP)
	$(BIN)/python -m pytest -q -n auto --dist loadfile --no-loadscope-reorder

# mypy checks what pyproject.toml's [tool.mypy] names (src/clef_runtime), with its settings.
lint: $(DEV_STAMP)
	$(BIN)/ruff check . && $(BIN)/ruff format --check . && $(BIN)/python -m mypy

bench: $(DEV_STAMP)
	$(BIN)/python -m benchmarks.suite

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache
