"""Property-based fuzzing of both APIs from their published OpenAPI descriptions, plus slow and oversized clients."""

from __future__ import annotations

import socket
import time
from collections.abc import Iterator

import pytest
import requests

from tests.helpers import Server, start_server
from tests.integration.fuzzing import fuzz


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    srv = start_server(tmp_path_factory.mktemp("fuzz"), "--max-tokens-limit", "32", "--max-concurrency", "4",
                       "--body-timeout", "1")
    yield srv
    srv.proc.stop()


def test_public_api_survives_fuzzing_without_5xx(server: Server) -> None:
    spec = requests.get(server.url + "/openapi.json", timeout=10).json()
    assert set(spec["paths"]) == {"/v1/models", "/v1/models/{model}", "/v1/completions", "/v1/chat/completions",
                                  "/predict", "/stream", "/healthz", "/readyz", "/metrics", "/tokenize",
                                  "/detokenize"}
    out = fuzz(server.url + "/openapi.json")
    assert out.returncode == 0, out.stdout[-6000:]
    assert "passed" in out.stdout
    r = requests.post(server.url + "/v1/completions", json={"prompt": "still here", "max_tokens": 3}, timeout=30)
    assert r.status_code == 200


def test_control_api_survives_fuzzing_without_5xx(server: Server) -> None:
    # Draining would (correctly) stop the server admitting work, and exiting end it (the worker rung:
    # its own tests); everything else is fair game.
    out = fuzz(server.control + "/control/openapi.json", "-H", f"Authorization: Bearer {server.token}",
               "--exclude-path", "/control/drain", "--exclude-path", "/control/exit")
    assert out.returncode == 0, out.stdout[-6000:]
    assert requests.get(server.control + "/control/openapi.json", timeout=5).status_code == 401
    assert server.ctl("POST", "/control/canary").json()["ok"] is True


def test_slow_body_gets_408_and_the_server_keeps_serving(server: Server) -> None:
    with socket.create_connection(("127.0.0.1", server.port), timeout=10) as s:
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                  b"Content-Length: 100\r\n\r\n{\"prompt\": ")
        start = time.monotonic()
        data = s.recv(4096)
        waited = time.monotonic() - start
    assert data.startswith(b"HTTP/1.1 408"), data[:200]
    assert b'"param": "body"' in data
    assert waited < 10
    assert requests.get(server.url + "/healthz", timeout=5).status_code == 200


def test_malformed_http_is_rejected_cleanly(server: Server) -> None:
    with socket.create_connection(("127.0.0.1", server.port), timeout=10) as s:
        s.sendall(b"GARBAGE / NOT-HTTP\r\n\r\n")
        data = s.recv(4096)
    assert data.startswith(b"HTTP/1.") and b" 400 " in data.split(b"\r\n", 1)[0]
    assert requests.get(server.url + "/healthz", timeout=5).status_code == 200
