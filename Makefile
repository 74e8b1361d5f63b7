# One entry point for people and CI. `make up` starts the stack; `make test` runs every check.
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed-stamp
PYTHON ?= python3

.PHONY: install up test lint unit tools clean

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	# torch first, pinned: the CPU build of this exact release needs no multi-GB download.
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e '.[inference,dev]'
	touch $(STAMP)

install: $(STAMP)

# Prometheus and promtool check the alert rules and the dashboard queries for real.
tools:
	@command -v promtool >/dev/null 2>&1 || { \
	  echo "installing prometheus (promtool) from the distribution's packages"; \
	  if [ "$$(id -u)" = 0 ]; then apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq prometheus >/dev/null; \
	  else sudo apt-get update -qq && sudo DEBIAN_FRONTEND=noninteractive apt-get install -y -qq prometheus >/dev/null; fi; }

up: install
	$(VENV)/bin/gpu-watchdog up $(ARGS)

lint: install
	$(VENV)/bin/ruff check .
	$(VENV)/bin/mypy
	$(VENV)/bin/lint-imports

test: install tools lint
	$(VENV)/bin/pytest

clean:
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache
