"""`target.http`: a plain aiohttp `/predict` service, written here, watched by the watchdog over loopback.

Healthy; slow within the timeout (never acted on); stopped answering (hang); stopped answering
while its counter of finished work advances (saturated, not hung); gone (refused: not a hang).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import aiohttp
import pytest
from aiohttp import web

from gpu_watchdog.watchdog.core import policy
from gpu_watchdog.watchdog.edge.config import from_mapping
from gpu_watchdog.watchdog.edge.samplers.canary import EMBEDDINGS, OpenAICanary
from gpu_watchdog.watchdog.edge.samplers.http_canary import HttpCanary
from gpu_watchdog.watchdog.runtime.app import Watchdog
from tests.integration.loopback import serve_everything
from tests.integration.sidecar_stand_ins import RecordingRestarter


@dataclass
class Predict:
    """The service's behaviour, switched by the test."""

    mode: str = "ok"  # ok | slow | stuck
    advancing: bool = False  # other clients' requests finish (the counter moves) while the canary waits
    finished: int = 0
    requests: list[dict[str, Any]] = field(default_factory=list)
    release: asyncio.Event = field(default_factory=asyncio.Event)
    runner: web.AppRunner | None = None


@pytest.fixture
async def service() -> AsyncIterator[tuple[str, Predict]]:
    state = Predict()

    async def predict(request: web.Request) -> web.Response:
        body = await request.json()
        state.requests.append({"body": body, "auth": request.headers.get("Authorization")})
        if state.mode == "slow":
            await asyncio.sleep(0.25)
        elif state.mode == "stuck":
            await state.release.wait()
        state.finished += 1
        return web.json_response({"outputs": [f"echo {body.get('inputs')}"]})

    async def metrics(request: web.Request) -> web.Response:
        if state.advancing:
            state.finished += 3
        return web.Response(text="# TYPE predictions counter\n"
                                 f'predictions_total{{model="m"}} {state.finished}\n'
                                 f'predictions_total{{model="other"}} 7\n', content_type="text/plain")

    app = web.Application()
    app.router.add_post("/predict", predict)
    app.router.add_get("/metrics", metrics)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    state.runner = runner
    try:
        yield f"http://127.0.0.1:{port}", state
    finally:
        state.release.set()
        await runner.cleanup()


def settings(url: str, **http: Any) -> Any:
    return from_mapping({
        "target": {"http": {"url": url + "/predict", "body": {"inputs": "ping"}, "expect_json": "outputs.0", **http},
                   "metrics_url": url + "/metrics", "progress_metric": 'predictions_total{model="m"}'},
        "sampling": {"nvml_interval": "1s", "server_interval": "100ms"},
        "canary": {"interval": "200ms", "timeout": "600ms"},
        "policy": {"hang": {"consecutive_timeouts": 3}},
        "restart": {"strategy": "none"},
        "server": {"host": "127.0.0.1", "port": 0},
    })


@contextlib.asynccontextmanager
async def watching(url: str, **http: Any) -> AsyncIterator[tuple[Watchdog, RecordingRestarter]]:
    restarter = RecordingRestarter()
    wd = Watchdog(settings(url, **http), restarter)
    await wd.start(serve_http=False)
    try:
        yield wd, restarter
    finally:
        await wd.stop()


async def test_a_healthy_service_is_served_and_left_alone(service: tuple[str, Predict]) -> None:
    url, state = service
    async with watching(url, headers={"X-Tenant": "canary"}) as (wd, restarter):
        await asyncio.sleep(1.5)
        canaries = list(wd.history.canaries)
        assert len(canaries) >= 4 and all(c.ok for c in canaries) and canaries[-1].route == "/predict"
        assert wd.ready()[0] and restarter.calls == []
        assert state.requests[0]["body"] == {"inputs": "ping"}
        # The named series, not its neighbour with another label.
        assert wd.history.server[-1].progress == state.finished


async def test_slow_within_the_timeout_is_never_acted_on(service: tuple[str, Predict]) -> None:
    url, state = service
    state.mode = "slow"
    async with watching(url) as (wd, restarter):
        await asyncio.sleep(2.5)
        canaries = list(wd.history.canaries)
        assert len(canaries) >= 3 and all(c.ok and c.latency_s >= 0.25 for c in canaries)
        assert restarter.calls == [] and wd.ready()[0]


async def test_a_service_that_stopped_answering_is_hung(service: tuple[str, Predict]) -> None:
    url, state = service
    async with watching(url) as (wd, restarter):
        await asyncio.sleep(0.6)
        assert wd.history.served_at is not None
        state.mode = "stuck"
        stuck_at = time.monotonic()
        deadline = stuck_at + 15
        while not restarter.calls and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        assert [d.reason for d in restarter.calls][:1] == ["hang"]
        assert restarter.calls[0].detail["server_progress"] == "flat"
        print(f"hang decided {time.monotonic() - stuck_at:.2f}s after the service stopped answering")


async def test_timeouts_while_the_counter_advances_are_saturation(service: tuple[str, Predict]) -> None:
    url, state = service
    async with watching(url) as (wd, restarter):
        await asyncio.sleep(0.6)
        state.mode, state.advancing = "stuck", True
        await asyncio.sleep(4.0)
        timeouts = [c for c in wd.history.canaries if c.error_class == "timeout"]
        assert len(timeouts) >= 3
        assert policy.saturated(wd.history)[0]
        assert restarter.calls == [] and wd.ready()[0]  # busy is not hung; it stays in the Service


async def test_a_refused_connection_is_not_a_hang(service: tuple[str, Predict]) -> None:
    url, state = service
    async with watching(url) as (wd, restarter):
        await asyncio.sleep(0.6)
        assert wd.history.served_at is not None
        assert state.runner is not None
        await state.runner.cleanup()  # the process is gone: the kubelet restarts it, not us
        await asyncio.sleep(2.0)
        gone = [c for c in wd.history.canaries if not c.ok]
        assert len(gone) >= 3 and {c.error_class for c in gone} == {"unreachable"}
        assert restarter.calls == []


async def test_the_answer_is_judged_by_status_and_key(service: tuple[str, Predict]) -> None:
    url, _ = service
    async with aiohttp.ClientSession() as session:
        cfg = settings(url, expect_json="outputs.3").target.http
        sample = await HttpCanary(cfg, session, time.monotonic, 2.0).sample()
        assert not sample.ok and sample.error_class == "other" and "outputs.3" in (sample.error or "")
        cfg = settings(url, expect_status=201).target.http
        sample = await HttpCanary(cfg, session, time.monotonic, 2.0).sample()
        assert not sample.ok and "expected 201" in (sample.error or "")
        cfg = settings(url, expect_json="outputs.-1").target.http
        assert (await HttpCanary(cfg, session, time.monotonic, 2.0).sample()).ok


async def test_an_openai_server_with_only_embedding_models_is_canaried_by_embeddings() -> None:
    seen: list[str] = []

    async def handler(request: web.Request) -> web.Response:
        seen.append(request.path)
        if request.path == "/v1/models":
            return web.json_response({"object": "list", "data": [{"id": "bge-small", "object": "model"}]})
        if request.path == "/v1/embeddings":
            body = await request.json()
            assert body == {"input": "ping", "model": "bge-small"}
            return web.json_response({"data": [{"embedding": [0.1, 0.2], "index": 0}]})
        return web.json_response({"error": {"message": "The model does not support this API"}}, status=400)

    async with serve_everything(handler) as url, aiohttp.ClientSession() as session:
        canary = OpenAICanary(f"{url}/v1", None, None, session, time.monotonic, 2.0)
        first = await canary.sample()
        assert first.ok and canary.route == EMBEDDINGS
        assert seen == ["/v1/models", "/v1/completions", "/v1/chat/completions", "/v1/embeddings"]
        second = await canary.sample()
        assert second.ok and second.route == EMBEDDINGS and seen[-1] == "/v1/embeddings" and len(seen) == 5


async def test_the_api_key_is_sent_from_the_request_or_the_target(service: tuple[str, Predict], tmp_path: Any,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    url, state = service
    monkeypatch.setenv("GPU_WATCHDOG_TOKEN", "the-control-token")  # the control API's, never sent here
    key = tmp_path / "key"
    key.write_text("s3cret\n")
    async with aiohttp.ClientSession() as session:
        cfg = settings(url).target.http
        assert (await HttpCanary(cfg, session, time.monotonic, 2.0, api_key_file=str(key)).sample()).ok
        assert state.requests[-1]["auth"] == "Bearer s3cret"
        own = tmp_path / "own"
        own.write_text("mine")
        cfg = settings(url, api_key_file=str(own)).target.http
        assert (await HttpCanary(cfg, session, time.monotonic, 2.0, api_key_file=str(key)).sample()).ok
        assert state.requests[-1]["auth"] == "Bearer mine"


async def test_the_targets_key_reaches_the_http_canary_the_sidecar_builds(service: tuple[str, Predict], tmp_path: Any,
                                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    """`target.api_key_file` (where the chart mounts an external server's key) is sent by the canary the
    sidecar itself assembles for `target.http`, not only by one built by hand."""
    from gpu_watchdog.watchdog.edge.samplers.assembly import build_samplers
    from gpu_watchdog.watchdog.edge.samplers.nvml import PynvmlBackend

    url, state = service
    monkeypatch.setenv("POD_NAME", "p")
    monkeypatch.setenv("POD_NAMESPACE", "n")
    key = tmp_path / "key"
    key.write_text("target-key\n")
    base = settings(url)
    s = dataclasses.replace(base, target=dataclasses.replace(base.target, api_key_file=str(key)))
    async with aiohttp.ClientSession() as session:
        samplers = build_samplers(s, session, time.monotonic, None, PynvmlBackend(), None)
        assert isinstance(samplers.canary, HttpCanary)
        assert (await samplers.canary.sample()).ok
    assert state.requests[-1]["auth"] == "Bearer target-key"
