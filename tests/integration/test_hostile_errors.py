"""An application's exception that reads like CUDA trouble is an ordinary 500: no exit, no OOM counted.

For `serve`, a handler of one's own raises it from the engine's thread; for the agent, a FastAPI
and an aiohttp service raise it inside `agent.admit()` and `agent.guard()`. Real processes on
loopback; a sticky error or an OOM would show in `/control/memory`, the metrics and the exit code.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import requests
import torch

from tests.helpers import ROOT, Server, json_lines, metric, start_app, start_server

ILLEGAL = "CUDA error: an illegal memory access was encountered"
OOM_TEXT = "CUDA out of memory. Tried to allocate 2.00 GiB (GPU 0; 79.15 GiB total capacity)"
TOKEN = "hostile-token"


class LookupFailed(RuntimeError):
    """The handler author's own exception class."""


RAISES: dict[str, type[Exception]] = {"key": KeyError, "value": ValueError, "own": LookupFailed,
                                      "runtime": RuntimeError}


class Hostile:
    """A handler of one's own whose model code fails, for some inputs, with CUDA-sounding messages."""

    capabilities = {"predict"}

    def load(self, model: str | None, device: torch.device) -> None:
        self.device = device

    def decode(self, body: dict[str, Any]) -> list[dict[str, str]]:
        return [dict(item) for item in body["inputs"]]

    def predict(self, items: list[dict[str, str]]) -> list[str]:
        for item in items:
            if item.get("kind") in RAISES:
                raise RAISES[item["kind"]](item["message"])
        return ["ok" for _ in items]

    def encode(self, output: str) -> str:
        return output

    def sample(self) -> dict[str, str]:
        return {"kind": "none"}


CASES = [("key", f"no such name: {ILLEGAL}"), ("value", OOM_TEXT), ("own", ILLEGAL), ("own", OOM_TEXT),
         ("runtime", OOM_TEXT), ("runtime", ILLEGAL)]


def assert_unharmed(memory: dict[str, Any], metrics_url: str) -> None:
    assert memory["poisoned"] is False and memory["poison_reason"] is None, memory
    assert memory["ooms_caught"] == 0 and memory["empty_cache_count"] == 0, memory
    assert metric(metrics_url, "gpu_inference_ooms_total") == 0.0
    assert metric(metrics_url, "gpu_inference_fatal_errors_total") == 0.0


def test_serve_answers_a_handlers_hostile_exceptions_with_plain_500s(tmp_path: Path) -> None:
    srv = start_server(tmp_path, "--handler", "tests.integration.test_hostile_errors:Hostile", name="hostile")
    try:
        for kind, message in CASES:
            r = requests.post(srv.url + "/predict", json={"inputs": [{"kind": kind, "message": message}]}, timeout=30)
            assert r.status_code == 500, (kind, message, r.text)
            assert r.json()["error"]["type"] == "internal", r.text
        assert_unharmed(srv.memory(), srv.url + "/metrics")
        time.sleep(0.5)  # a poisoned process would be on its way out by now
        assert srv.proc.proc.poll() is None
        assert requests.get(srv.url + "/readyz", timeout=5).status_code == 200
        ok = requests.post(srv.url + "/predict", json={"inputs": [{"kind": "none"}]}, timeout=30)
        assert ok.status_code == 200 and ok.json() == {"outputs": ["ok"]}
        canary = srv.ctl("POST", "/control/canary", {"timeout": 5}).json()
        assert canary["ok"] is True
        # A plain RuntimeError in torch's CUDA-check words was put to the device, which said no.
        ruled_out = [e for e in json_lines(srv.proc.log()) if e.get("event") == "cuda_error_not_sticky"]
        assert ruled_out and ILLEGAL in ruled_out[0]["error"]
    finally:
        srv.proc.stop()


@pytest.fixture(params=["fastapi", "aiohttp"], scope="module")
def app(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    tmp = tmp_path_factory.mktemp(f"hostile-{request.param}")
    app = start_app(ROOT / "tests/integration/hostile_agent_app.py", tmp, TOKEN, "--framework", request.param,
                    ready="/ok")
    try:
        yield app
    finally:
        app.proc.stop()


def test_a_lookup_failing_with_cuda_words_in_its_name_is_a_500_not_an_exit(app: Server) -> None:
    # The measured case: the name came from the URL, and read as a sticky CUDA error.
    r = requests.get(app.url + "/names/" + requests.utils.quote(f"bob {ILLEGAL}"), timeout=10)
    assert r.status_code == 500, r.text
    assert "GPU context lost" not in r.text and "fatal_cuda" not in r.text
    for where in ("admit", "async", "guard"):
        for kind, message in CASES:
            r = requests.post(app.url + "/raise", json={"kind": kind, "message": message, "where": where},
                              timeout=10)
            assert r.status_code == 500, (where, kind, r.text)
            assert "out_of_memory" not in r.text and "fatal_cuda" not in r.text
    memory = app.ctl("GET", "/control/memory").json()  # a poisoned agent exits once this is read
    assert_unharmed(memory, app.url + "/metrics")
    assert memory["inflight"] == 0, memory  # every slot given back
    time.sleep(1.0)
    assert app.proc.proc.poll() is None, app.proc.log()[-2000:]
    assert requests.get(app.url + "/ok", timeout=10).json() == {"ok": True}
    assert app.ctl("POST", "/control/canary", {"timeout": 5}).json()["ok"] is True
    assert metric(app.url + "/metrics", "gpu_inference_requests_total", {"route": "/raise", "code": "500"}) == \
        3 * len(CASES)
