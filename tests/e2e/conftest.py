"""One real vLLM for every test beside it (its start takes a minute and a half here): a tiny model
generated here (random weights, no download), served with 8 sequence slots."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from gpu_watchdog.benchmarks import peer_vllm

VLLM_SLOTS = 8


@pytest.fixture(scope="session")
def vllm_python() -> Path:
    found = peer_vllm.vllm_python()
    if found is None:
        if os.environ.get("CI"):
            pytest.fail("no vLLM venv in CI: `make test` installs it (make vllm)")
        pytest.skip("no vLLM venv: run `make vllm` (or set GPU_WATCHDOG_VLLM_PYTHON)")
    return found


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return peer_vllm.make_tiny_model(tmp_path_factory.mktemp("tiny") / "model")


@pytest.fixture(scope="session")
def vllm(vllm_python: Path, tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[peer_vllm.Vllm]:
    server = peer_vllm.start_vllm(vllm_python, tiny_model, tmp_path_factory.mktemp("vllm"), max_num_seqs=VLLM_SLOTS)
    try:
        yield server
    finally:
        server.stop()
