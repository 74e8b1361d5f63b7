"""A client that leaves frees its sequences within a decode step: plain and streamed, completions and
chat, all `n` of them (the real server on CPU with the built-in model, the client a raw socket)."""

from __future__ import annotations

import time
import uuid
from collections.abc import Iterator

import pytest
import requests

from tests.helpers import Server, json_lines, metric, post_raw, start_server, wait_for

N = 4


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    srv = start_server(tmp_path_factory.mktemp("disconnect"), "--max-concurrency", "8", "--max-tokens-limit", "1000")
    yield srv
    srv.proc.stop()


def _tokens(srv: Server) -> float:
    return metric(srv.url + "/metrics", "gpu_inference_generated_tokens_total") or 0.0


def _closed(srv: Server, route: str) -> float:
    return metric(srv.url + "/metrics", "gpu_inference_requests_total", {"route": route, "code": "499"}) or 0.0


@pytest.mark.parametrize(("route", "stream"), [("/v1/completions", False), ("/v1/completions", True),
                                                ("/v1/chat/completions", False), ("/v1/chat/completions", True)])
def test_a_client_that_leaves_frees_every_sequence_within_a_step(server: Server, route: str, stream: bool) -> None:
    rid = f"gone-{uuid.uuid4().hex[:8]}"
    # Long enough to run for many seconds: only the client leaving ends it early.
    body: dict[str, object] = {"max_tokens": 900, "n": N, "ignore_eos": True, "stream": stream}
    if route == "/v1/chat/completions":
        body["messages"] = [{"role": "user", "content": "talk for a long time"}]
    else:
        body["prompt"] = "talk for a long time"
    closed_before = _closed(server, route)
    sock = post_raw(server, route, body, {"X-Request-Id": rid})
    wait_for(lambda: server.memory()["inflight"] == N, 30, f"the {N} sequences running")
    time.sleep(0.5)
    report = server.memory()
    assert report["inflight"] == N and report["admission"]["holders"] == N  # still generating
    at_close = _tokens(server)
    sock.close()
    left = time.monotonic()
    while True:
        report = server.memory()
        freed_s = time.monotonic() - left
        if not (report["inflight"] or report["engine"]["active_sequences"] or report["admission"]["holders"]):
            break
        assert freed_s < 1.0, f"still {report['inflight']} sequences in flight {freed_s:.2f} s after the client left"
        time.sleep(0.005)
    at_free = _tokens(server)
    print(f"\n{route} stream={stream}: {N} sequences freed {freed_s * 1000:.0f} ms after the client left,"
          f" {at_free - at_close:.0f} tokens generated meanwhile")
    assert report["admission"]["in_use"] == 0
    time.sleep(0.3)
    assert _tokens(server) == at_free  # nothing generates for the gone client any more
    assert metric(server.url + "/metrics", "gpu_inference_inflight_requests") == 0
    wait_for(lambda: _closed(server, route) == closed_before + 1, 5, "the request counted with code 499")
    lines = wait_for(lambda: [e for e in json_lines(server.proc.log()) if e.get("request_id") == rid
                              and e.get("event") in ("request_cancelled", "request")] or None, 5, "its log lines")
    cancelled = [e for e in lines if e["event"] == "request_cancelled"]
    assert len(cancelled) == 1 and cancelled[0]["reason"] == "client_disconnected" and cancelled[0]["sequences"] == N
    assert not [e for e in json_lines(server.proc.log()) if e.get("request_id") == rid and e.get("level") == "error"]


def test_the_server_answers_in_full_after_clients_left(server: Server) -> None:
    r = requests.post(server.url + "/v1/completions", json={"prompt": "still here", "max_tokens": 8, "n": 2},
                      timeout=30)
    assert r.status_code == 200
    assert [c["finish_reason"] for c in r.json()["choices"]] == ["length", "length"]
