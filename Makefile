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

.PHONY: install run test clean

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e '.[test]'
	# NIXL (KV data plane). --no-deps: its wheel asks for torch, which NIXL does not need at
	# run time, and an unpinned torch would pull several GB of CUDA packages.
	$(PY) -m pip install -q --no-deps nixl-cu12==1.5.1
	touch $@

install: $(VENV)/.installed

run: install
	PORT=$(PORT) ENGINE=$(ENGINE) MODEL=$(MODEL) $(VENV)/bin/tandem up

test: install
	$(VENV)/bin/ruff check services shared connector tests
	$(PY) -m pytest $(PYTEST_ARGS)

clean:
	rm -rf $(VENV) .tandem .pytest_cache
