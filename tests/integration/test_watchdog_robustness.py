"""Malformed data from outside never crashes the watchdog and never causes a restart by itself."""

from __future__ import annotations

import asyncio
import itertools
import random
from collections.abc import AsyncIterator

import pytest
from aiohttp import web
from kubernetes import client

from gpu_watchdog.watchdog.core.policy import Decision
from gpu_watchdog.watchdog.edge.config import RestartSettings, from_mapping
from gpu_watchdog.watchdog.edge.effects.restart import KubeRestarter, RestartOutcome
from gpu_watchdog.watchdog.edge.kube.kube import PodActions
from gpu_watchdog.watchdog.edge.samplers.nvml import GpuReading
from gpu_watchdog.watchdog.runtime.app import Watchdog
from tests.integration.loopback import serve_everything, settings
from tests.integration.sidecar_stand_ins import RecordingDrain, RecordingRestarter

GARBAGE: list[tuple[int, str, str]] = [
    (200, "text/html", "<html>oops</html>"),
    (200, "application/json", "[1, 2, 3]"),
    (200, "application/json", '{"ok": "yes", "latency_s": "fast"}'),
    (200, "application/json", '{"device": "cuda", "reserved_bytes": -5, "fragmentation_ratio": 7}'),
    (200, "application/json", '{"poisoned": "maybe"}'),
    (200, "application/json", '{"truncated": '),
    (500, "text/plain", "internal error"),
    (404, "text/plain", "not here"),
    (200, "application/json", '{"ok": false, "error_class": "meteor", "latency_s": 1}'),
]


class ExplodingNvml:
    """Stands in for NVML at the hardware edge and fails in every way it can."""

    def __init__(self) -> None:
        self.rng = random.Random(7)

    def open(self) -> None:
        return None

    def uuids(self) -> list[str]:
        if self.rng.random() < 0.3:
            raise RuntimeError("NVML: Unknown Error")
        return ["GPU-x"]

    def read(self, uuid: str) -> GpuReading:
        raise self.rng.choice([RuntimeError("NVML_ERROR_UNKNOWN"), ValueError("bad struct"), OSError(5, "EIO")])

    def wait_xid(self, timeout_ms: int) -> list[tuple[str | None, int]]:
        raise RuntimeError("event set broken")

    def recovery_action(self, uuid: str) -> int | None:
        raise RuntimeError("NVML_ERROR_UNKNOWN")

    def close(self) -> None:
        raise RuntimeError("cannot shut down")


@pytest.fixture
async def garbage_server() -> AsyncIterator[tuple[str, dict[str, int]]]:
    hits = {"empty_cache": 0, "drain": 0, "memory": 0}
    cycle = itertools.cycle(GARBAGE)

    async def handler(request: web.Request) -> web.StreamResponse:
        if request.path.endswith("/empty_cache"):
            hits["empty_cache"] += 1
        if request.path.endswith("/drain"):
            hits["drain"] += 1
        if request.path.endswith("/memory"):
            hits["memory"] += 1
            if hits["memory"] % 7 == 0:
                await asyncio.sleep(1.5)  # now and then the memory endpoint hangs past the client timeout
        status, ctype, body = next(cycle)
        return web.Response(status=status, content_type=ctype.split(";")[0], text=body)

    async with serve_everything(handler) as url:
        yield url, hits


async def test_garbage_from_control_api_and_nvml_never_restarts(garbage_server: tuple[str, dict[str, int]]) -> None:
    url, hits = garbage_server
    restarter = RecordingRestarter()
    wd = Watchdog(settings(url), restarter, nvml_backend=ExplodingNvml(), token="t")
    await wd.start(serve_http=False)
    try:
        await asyncio.sleep(3.0)
        assert restarter.calls == []
        assert hits["empty_cache"] == 0 and hits["drain"] == 0
        ok, _ = wd.healthy()
        assert ok, "the loop must keep ticking"
        status = wd.status()
        assert status["ready"] is False
        assert {"canary_failing", "target_unreachable"} <= set(status["states"])
        assert not any(t.reachable for t in wd.history.torch)
        assert len(wd.history.canaries) > 10 and len(wd.history.torch) > 5
        assert wd.history.gpus and not any(g.available for g in wd.history.gpus)
        assert all(c.error_class in ("other", "unreachable") for c in wd.history.canaries)
    finally:
        await wd.stop()


@pytest.fixture
async def hanging_api() -> AsyncIterator[str]:
    async def handler(request: web.Request) -> web.StreamResponse:
        if "hang" in request.path or (request.method == "POST" and "eviction" in request.path):
            await asyncio.sleep(3)
        return web.Response(status=201, content_type="application/json", text='{"kind": "Status", "broken": ')

    async with serve_everything(handler) as url:
        yield url


def api_client(url: str) -> client.ApiClient:
    cfg = client.Configuration()
    cfg.host = url
    cfg.retries = 0
    return client.ApiClient(cfg)


async def test_hanging_kubernetes_api_is_bounded_and_reported(hanging_api: str) -> None:
    slept: list[float] = []

    async def fake_sleep(s: float) -> None:
        slept.append(s)

    pod = PodActions(api_client(hanging_api), "p", "ns", request_timeout=0.3)
    r = KubeRestarter(pod, RestartSettings(max_attempts=3, retry_initial=0.1), sleep=fake_sleep)
    loop = asyncio.get_running_loop()
    start = loop.time()
    outcome = await r.restart(Decision("restart", "hang", {}), RecordingDrain())
    assert outcome.done is False and outcome.attempts == 3
    assert loop.time() - start < 10
    assert "Timeout" in outcome.detail or "timed out" in outcome.detail.lower()


async def test_malformed_kubernetes_json_does_not_crash(hanging_api: str) -> None:
    pod = PodActions(api_client(hanging_api), "p", "ns", request_timeout=2)

    async def no_sleep(s: float) -> None:
        return None

    r = KubeRestarter(pod, RestartSettings(strategy="delete", max_attempts=2, retry_initial=0.1), sleep=no_sleep)
    outcome = await r.restart(Decision("restart", "context_loss", {}), RecordingDrain())
    # The status code is the API's answer (201: accepted); a body that is not JSON only goes unread,
    # and the Event written after it (same garbage back) is reported, not raised.
    assert outcome == RestartOutcome(True, "delete accepted", attempts=1, recorded=True)



@pytest.mark.parametrize("page", ["hang", "garbage", "huge", "404"])
async def test_a_metrics_page_that_hangs_or_lies_is_reported_never_acted_on(page: str) -> None:
    """An OpenAI server whose canary answers fine while its /metrics misbehaves."""
    hits = {"metrics": 0}

    async def handler(request: web.Request) -> web.StreamResponse:
        if request.path == "/metrics":
            hits["metrics"] += 1
            if page == "hang":
                await asyncio.sleep(4)  # well past the scrape's timeout (2 s here)
            if page == "404":
                return web.Response(status=404, text="no metrics here")
            if page == "huge":
                return web.Response(text="vllm:num_requests_running 1\n" * 400_000)
            return web.Response(text="vllm:generation_tokens_total{oops 12\n<html>")
        if request.path == "/v1/models":
            return web.json_response({"data": [{"id": "m"}]})
        return web.json_response({"choices": [{"text": "x"}]})

    async with serve_everything(handler) as url:
        restarter = RecordingRestarter()
        settings = from_mapping({
            "target": {"openai_url": url + "/v1"},
            "sampling": {"server_interval": "100ms", "server_timeout": "2s"},
            "canary": {"interval": "100ms", "timeout": "1s"},
            "restart": {"strategy": "none"},
            "server": {"host": "127.0.0.1", "port": 0},
        })
        wd = Watchdog(settings, restarter, nvml_backend=ExplodingNvml())
        await wd.start(serve_http=False)
        try:
            await asyncio.sleep(3.5)
            status = wd.status()
        finally:
            await wd.stop()
    assert hits["metrics"] >= 1 and restarter.calls == []
    assert status["ready"] is True and "server_metrics_unavailable" in status["states"]
    last = status["server_metrics"]["last"]
    assert last["reachable"] is False
    expected = {"hang": "timeout:", "garbage": "bad_response: not Prometheus", "huge": "bad_response: page over",
                "404": "bad_response:"}[page]
    assert last["error"].startswith(expected), last["error"]


async def test_a_server_gone_dark_whole_is_progress_unknown_then_a_hang_after_the_bound() -> None:
    """Its canary and its /metrics both stop answering after it served: no evidence either way.

    Readiness is held and nothing is decided while that lasts less than `no_evidence_after`; then
    the timeouts decide, once (strategy none reports and changes nothing about the target).
    """
    dark = asyncio.Event()
    release = asyncio.Event()
    tokens = itertools.count(100, 7)

    async def handler(request: web.Request) -> web.StreamResponse:
        if dark.is_set():
            await release.wait()
        if request.path == "/metrics":
            return web.Response(text=f"vllm:num_requests_running 1\nvllm:generation_tokens_total {next(tokens)}\n")
        if request.path == "/v1/models":
            return web.json_response({"data": [{"id": "m"}]})
        return web.json_response({"choices": [{"text": "x"}]})

    async with serve_everything(handler) as url:
        restarter = RecordingRestarter()
        settings = from_mapping({
            "target": {"openai_url": url + "/v1"},
            "sampling": {"server_interval": "100ms", "server_timeout": "300ms"},
            "canary": {"interval": "200ms", "timeout": "200ms"},
            "policy": {"hang": {"consecutive_timeouts": 2, "no_evidence_after": "2s"}},
            "restart": {"strategy": "none"},
            "server": {"host": "127.0.0.1", "port": 0},
        })
        wd = Watchdog(settings, restarter, nvml_backend=ExplodingNvml())
        await wd.start(serve_http=False)
        try:
            await asyncio.sleep(0.6)
            assert wd.status()["target"]["state"] == "healthy"
            dark.set()
            await asyncio.sleep(1.2)
            during = wd.status()
            ready_during = wd.ready()[0]
            await asyncio.sleep(2.0)
            after = wd.status()
            ready_after = wd.ready()[0]
            episodes = wd.metrics.registry.get_sample_value("gpu_watchdog_progress_unknown_episodes_total")
        finally:
            release.set()
            await wd.stop()
    assert during["target"]["state"] == "progress_unknown" and "progress_unknown" in during["states"]
    assert ready_during and during["target"]["progress_unknown"]["last_progress"] >= 100
    assert "canary_failing" not in during["states"]
    assert [d.reason for d in restarter.calls] == ["hang"]  # decided once the bound passed, reported once
    assert restarter.calls[0].detail["server_progress"] == "no_evidence"
    assert not ready_after and after["target"]["state"] == "canary_failing"
    assert after["target"]["served_at_s"] is not None  # nothing restarted: not `starting`
    assert [d["outcome"] for d in after["last_decisions"]] == ["started", "reported"]
    assert episodes == 1.0
