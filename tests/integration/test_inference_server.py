"""The real inference server, started as a process on loopback, on CPU with the built-in model."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
import requests

from tests.helpers import Server, json_lines, start_server
from tests.unit.memory_record import check_against_the_record


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    # --batch-window-ms: a retired flag that existing command lines still carry.
    srv = start_server(tmp_path_factory.mktemp("serve"), "--fault-injection", "--max-concurrency", "4",
                       "--max-tokens-limit", "512", "--batch-window-ms", "20")
    yield srv
    srv.proc.stop()


def complete(srv: Server, prompt: str, max_tokens: int, **extra: object) -> requests.Response:
    return requests.post(srv.url + "/v1/completions", json={"prompt": prompt, "max_tokens": max_tokens, **extra},
                         timeout=60)


def flood(srv: Server, requests_n: int, delay_s: float) -> dict[str, Any]:
    """Slow every forward pass, send `requests_n` requests at once, all must succeed; the memory report after."""
    srv.fault("slow", delay_s=delay_s)
    with ThreadPoolExecutor(requests_n) as pool:
        results = list(pool.map(lambda i: complete(srv, f"request {i}", 3), range(requests_n)))
    assert [r.status_code for r in results] == [200] * requests_n
    return srv.memory()


def test_completion_has_exactly_max_tokens_and_usage(server: Server) -> None:
    r = complete(server, "The GPU said", 12)
    assert r.status_code == 200, r.text
    body = r.json()
    choice = body["choices"][0]
    # The built-in model emits one printable ASCII character per token.
    assert len(choice["text"]) == 12
    assert choice["finish_reason"] == "length"
    assert body["usage"]["completion_tokens"] == 12
    assert body["usage"]["prompt_tokens"] == len("The GPU said") + 1
    assert r.headers["X-Request-Id"]


def test_a_retired_flag_still_starts_the_server_and_says_it_is_ignored(server: Server) -> None:
    lines = [e for e in json_lines(server.proc.log()) if e.get("event") == "deprecated_flag"]
    assert [e["flag"] for e in lines] == ["--batch-window-ms"]
    assert "ignored" in lines[0]["note"]


def test_greedy_generation_is_deterministic(server: Server) -> None:
    a = complete(server, "same prompt", 10).json()["choices"][0]["text"]
    b = complete(server, "same prompt", 10).json()["choices"][0]["text"]
    c = complete(server, "other prompt", 10).json()["choices"][0]["text"]
    assert a == b
    assert a != c


def test_sse_stream_matches_plain_completion(server: Server) -> None:
    plain = complete(server, "stream me", 9).json()["choices"][0]["text"]
    with requests.post(server.url + "/v1/completions", json={"prompt": "stream me", "max_tokens": 9, "stream": True},
                       stream=True, timeout=60) as r:
        assert r.status_code == 200
        assert r.headers["Content-Type"].startswith("text/event-stream")
        events = [line[len("data: "):] for line in r.iter_lines(decode_unicode=True) if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"
    assert "".join(c["choices"][0]["text"] for c in chunks) == plain


def test_predict_and_plain_stream(server: Server) -> None:
    r = requests.post(server.url + "/predict", json={"prompt": "predict", "max_tokens": 7}, timeout=60)
    assert r.status_code == 200
    result = r.json()["result"]
    assert len(result) == 7
    with requests.post(server.url + "/stream", json={"prompt": "predict", "max_tokens": 7}, stream=True,
                       timeout=60) as s:
        assert s.status_code == 200
        assert s.headers["Content-Type"].startswith("text/plain")
        streamed = b"".join(s.iter_content(chunk_size=None)).decode()
    assert streamed == result


@pytest.mark.parametrize(
    ("body", "status", "field"),
    [
        (b"{not json", 400, "body"),
        (b"", 400, "body"),
        (b"[1, 2]", 400, "body"),
        (json.dumps({"max_tokens": 5}).encode(), 400, "prompt"),
        (json.dumps({"prompt": "", "max_tokens": 5}).encode(), 400, "prompt"),
        (json.dumps({"prompt": 42}).encode(), 400, "prompt"),
        (json.dumps({"prompt": "x", "max_tokens": "ten"}).encode(), 400, "max_tokens"),
        (json.dumps({"prompt": "x", "max_tokens": 0}).encode(), 400, "max_tokens"),
        (json.dumps({"prompt": "x", "max_tokens": 513}).encode(), 400, "max_tokens"),
        (json.dumps({"prompt": "x", "max_tokens": 1.5}).encode(), 400, "max_tokens"),
        (json.dumps({"prompt": "x", "temperature": "hot"}).encode(), 400, "temperature"),
        (json.dumps({"prompt": "x", "temperature": 9}).encode(), 400, "temperature"),
        (json.dumps({"prompt": "x", "stream": "yes"}).encode(), 400, "stream"),
        (json.dumps({"prompt": "x" * 2000, "max_tokens": 5}).encode(), 413, "prompt"),
        (json.dumps({"prompt": "x" * 900, "max_tokens": 500}).encode(), 400, "max_tokens"),
    ],
)
def test_bad_input_is_a_4xx_naming_the_field(server: Server, body: bytes, status: int, field: str) -> None:
    r = requests.post(server.url + "/v1/completions", data=body, timeout=30)
    assert r.status_code == status, r.text
    assert r.json()["error"]["param"] == field


def test_oversized_body_and_unknown_route(server: Server) -> None:
    r = requests.post(server.url + "/v1/completions", data=b"x" * (2 << 20), timeout=30)
    assert r.status_code == 413
    assert r.json()["error"]["param"] == "body"
    r = requests.get(server.url + "/v1/nothing-here", timeout=30)
    assert r.status_code == 404
    assert "no route" in r.json()["error"]["message"]
    r = requests.post(server.url + "/predict", json={"prompt": "x", "stream": True}, timeout=30)
    assert r.status_code == 400 and r.json()["error"]["param"] == "stream"
    assert complete(server, "still serving", 3).status_code == 200


def test_control_api_requires_the_token(server: Server) -> None:
    # A prefix of the real token and the real token with one more character are as wrong as any.
    for headers in ({}, {"Authorization": "Bearer "}, {"Authorization": "Bearer wrong"},
                    {"Authorization": f"Basic {server.token}"}, {"Authorization": f"Bearer {server.token[:-1]}"},
                    {"Authorization": f"Bearer {server.token}x"}, {"Authorization": f"Bearer {server.token[:4]}"}):
        r = requests.get(server.control + "/control/memory", headers=headers, timeout=10)
        assert r.status_code == 401, headers
        assert r.headers["WWW-Authenticate"].startswith("Bearer")
    assert server.ctl("GET", "/control/memory").status_code == 200
    assert server.token not in server.proc.log()


def test_memory_endpoint_is_honest_on_cpu(server: Server) -> None:
    m = server.memory()
    assert m["device"] == "cpu"
    assert m["injected"] is False
    for key in ("total_bytes", "allocated_bytes", "reserved_bytes", "active_bytes", "inactive_split_bytes",
                "alloc_retries", "num_ooms"):
        assert m[key] == 0, key
    assert m["admission"]["limit"] == 4
    assert m["poisoned"] is False and m["uptime_s"] > 0


def test_canary_runs_a_real_generation(server: Server) -> None:
    before = server.memory()["engine"]["forward_batches"]
    r = server.ctl("POST", "/control/canary")
    assert r.status_code == 200
    body = r.json()
    assert body["ok"] is True and body["error_class"] is None and body["latency_s"] > 0
    assert server.memory()["engine"]["forward_batches"] == before + 1


def test_probes_answer_while_a_long_generation_runs(server: Server) -> None:
    with ThreadPoolExecutor(1) as pool:
        long = pool.submit(complete, server, "long one", 500)
        deadline = time.monotonic() + 30
        while server.memory()["engine"]["active_sequences"] == 0 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert server.memory()["engine"]["active_sequences"] >= 1
        for path in ("/healthz", "/metrics", "/readyz"):
            assert requests.get(server.url + path, timeout=5).status_code == 200
        # The generation was still running when the probes answered: the loop is not blocked.
        assert not long.done()
        assert long.result().status_code == 200


def test_injected_oom_gives_503_then_recovers(server: Server) -> None:
    server.fault("oom", count=1)
    r = complete(server, "oom me", 4)
    assert r.status_code == 503
    assert r.headers["Retry-After"] == "1"
    assert r.json()["error"]["type"] == "out_of_memory"
    assert complete(server, "after oom", 4).status_code == 200
    m = server.memory()
    assert m["ooms_caught"] >= 1
    metrics = requests.get(server.url + "/metrics", timeout=10).text
    assert "gpu_inference_ooms_total 1.0" in metrics


def test_injected_fragmentation_is_reported_as_injected_and_cured_by_empty_cache(server: Server) -> None:
    server.fault("fragmentation", ratio=0.5)
    m = server.memory()
    assert m["injected"] is True
    assert m["fragmentation_ratio"] == pytest.approx(0.5)
    assert m["reserved_bytes"] > m["allocated_bytes"] > 0
    r = server.ctl("POST", "/control/empty_cache")
    assert r.status_code == 200 and r.json()["freed_bytes"] == 0  # nothing to free on CPU, honestly
    m = server.memory()
    assert m["injected"] is False and m["fragmentation_ratio"] == 0.0


def test_injected_hang_makes_the_canary_time_out(server: Server) -> None:
    server.fault("hang")
    try:
        r = server.ctl("POST", "/control/canary", {"timeout": 0.5})
        assert r.status_code == 200
        assert r.json()["ok"] is False and r.json()["error_class"] == "timeout"
        # The probes still answer: the hang is in the GPU thread, not the event loop.
        assert requests.get(server.url + "/healthz", timeout=5).status_code == 200
    finally:
        server.fault("clear")
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        if server.ctl("POST", "/control/canary", {"timeout": 5}).json()["ok"]:
            break
        time.sleep(0.1)
    else:
        pytest.fail("canary did not recover after the hang was cleared")


def test_fault_endpoint_validates(server: Server) -> None:
    r = server.ctl("POST", "/control/fault", {"kind": "meteor"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "kind"
    r = server.ctl("POST", "/control/fault", {"kind": "oom", "count": -1})
    assert r.status_code == 400 and r.json()["error"]["param"] == "count"
    r = server.ctl("POST", "/control/admission", {"limit": 0})
    assert r.status_code == 400 and r.json()["error"]["param"] == "limit"


def test_fault_injection_is_off_by_default(tmp_path: Path) -> None:
    srv = start_server(tmp_path, "--max-concurrency", "1")
    try:
        r = srv.ctl("POST", "/control/fault", {"kind": "context_loss"})
        assert r.status_code == 404
        assert complete(srv, "fine", 2).status_code == 200
    finally:
        srv.proc.stop()


def test_admission_never_lets_more_than_the_limit_into_the_gpu_section(tmp_path: Path) -> None:
    srv = start_server(tmp_path, "--fault-injection", "--max-concurrency", "2")
    try:
        m = flood(srv, 16, delay_s=0.15)
        # Observed by the engine itself (sequences inside generate), not the gate's bookkeeping.
        assert m["engine"]["peak_active_sequences"] == 2
        assert m["admission"]["peak_holders"] == 2
        # 16 requests queued, but every forward pass (the warm-up's too) ran on the one decode
        # thread: on CUDA each thread that runs kernels keeps a cuBLAS workspace for life.
        assert m["engine"]["threads"] == 1
    finally:
        srv.proc.stop()


def test_a_limit_above_the_thread_pool_default_still_applies_exactly(tmp_path: Path) -> None:
    # 40 slots: more than a typical fixed worker pool (32). The engine must see all 40 at once,
    # or a configured limit (and the benchmarks' `unbounded` mode) would be silently capped.
    srv = start_server(tmp_path, "--fault-injection", "--max-concurrency", "40")
    try:
        m = flood(srv, 48, delay_s=0.4)
        assert m["engine"]["peak_active_sequences"] == 40
        assert m["admission"]["peak_holders"] == 40
    finally:
        srv.proc.stop()


def test_a_raised_limit_applies_at_once(tmp_path: Path) -> None:
    srv = start_server(tmp_path, "--fault-injection", "--max-concurrency", "2")
    try:
        r = srv.ctl("POST", "/control/admission", {"limit": 6})
        assert r.status_code == 200, r.text
        m = flood(srv, 12, delay_s=0.3)
        assert m["admission"]["limit"] == 6
        assert m["engine"]["peak_active_sequences"] == 6
        assert m["engine"]["threads"] == 1
    finally:
        srv.proc.stop()


def test_queue_timeout_gives_503_with_retry_after(tmp_path: Path) -> None:
    srv = start_server(tmp_path, "--fault-injection", "--max-concurrency", "1",
                       "--queue-timeout", "0.5")
    try:
        srv.fault("slow", delay_s=2.0)
        with ThreadPoolExecutor(2) as pool:
            first = pool.submit(complete, srv, "first", 2)
            time.sleep(0.3)
            second = complete(srv, "second", 2)
            assert second.status_code == 503
            assert second.headers["Retry-After"] == "1"
            assert second.json()["error"]["type"] == "queue_timeout"
            assert first.result().status_code == 200
    finally:
        srv.proc.stop()


def test_continuous_batching_shares_forward_passes_and_keeps_answers_apart(tmp_path: Path) -> None:
    srv = start_server(tmp_path, "--max-concurrency", "8")
    try:
        prompts = [(f"prompt number {i} " + "x" * i, 3 + i) for i in range(8)]
        # Alone first (sequentially, so each runs as a batch of one) to know each right answer.
        solo = [complete(srv, p, n).json()["choices"][0]["text"] for p, n in prompts]
        before = srv.memory()["engine"]["forward_batches"]
        with ThreadPoolExecutor(8) as pool:
            together = list(pool.map(lambda pn: complete(srv, pn[0], pn[1]), prompts))
        texts = [r.json()["choices"][0]["text"] for r in together]
        m = srv.memory()
        assert m["engine"]["largest_batch"] > 1
        # One after another they need one forward pass per token; together they share them.
        assert m["engine"]["forward_batches"] - before < sum(n for _, n in prompts) // 2
        assert [len(t) for t in texts] == [n for _, n in prompts]
        assert texts == solo
    finally:
        srv.proc.stop()


def test_context_loss_poisons_and_exits_non_zero(tmp_path: Path) -> None:
    termination_log = tmp_path / "termination-log"
    srv = start_server(tmp_path, "--fault-injection", env={"GPU_WATCHDOG_TERMINATION_LOG": str(termination_log)})
    try:
        srv.fault("context_loss")
        r = srv.ctl("POST", "/control/canary", {"timeout": 5})
        assert r.status_code == 200
        assert r.json()["ok"] is False and r.json()["error_class"] == "fatal_cuda"
        code = srv.proc.proc.wait(timeout=20)
        assert code == 3
        assert "illegal memory access" in termination_log.read_text()
        lines = [json.loads(line) for line in srv.proc.log().splitlines() if line.startswith("{")]
        assert any(e["event"] == "fatal_cuda_error" for e in lines)
    finally:
        srv.proc.stop()


def test_a_stream_cut_by_context_loss_ends_with_an_error_event(tmp_path: Path) -> None:
    srv = start_server(tmp_path, "--fault-injection", "--max-concurrency", "2")
    try:
        with requests.post(srv.url + "/v1/completions", json={"prompt": "long", "max_tokens": 400, "stream": True},
                           stream=True, timeout=60) as r:
            assert r.status_code == 200
            lines = r.iter_lines(decode_unicode=True)
            events = []
            for line in lines:
                if line.startswith("data: "):
                    events.append(line[6:])
                    if len(events) == 3:
                        srv.fault("context_loss")
        assert events[-1] != "[DONE]"
        last = json.loads(events[-1])
        assert last["error"]["type"] == "FatalCudaError"
        assert "illegal memory access" in last["error"]["message"]
        assert len(events) < 400
    finally:
        srv.proc.stop()


def test_a_plain_stream_cut_by_context_loss_fails_loudly(tmp_path: Path) -> None:
    srv = start_server(tmp_path, "--fault-injection", "--max-concurrency", "2")
    try:
        with requests.post(srv.url + "/stream", json={"prompt": "long", "max_tokens": 400}, stream=True,
                           timeout=60) as r:
            assert r.status_code == 200
            chunks = r.iter_content(chunk_size=None)
            next(chunks)
            srv.fault("context_loss")
            with pytest.raises(requests.exceptions.ChunkedEncodingError):
                for _ in chunks:
                    pass
    finally:
        srv.proc.stop()


def test_the_memory_report_is_the_shared_record(server: Server) -> None:
    # The same record as the agent's (tests/unit/test_memory_report.py), with serve's engine figures.
    parsed = check_against_the_record(server.memory())
    assert parsed.engine is not None and parsed.engine["max_batch_size"] >= 1
    assert parsed.admission.limit == 4 and parsed.device == "cpu" and parsed.pid == server.proc.proc.pid
