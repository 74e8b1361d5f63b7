"""The agent's gate in an aiohttp app under a flood: the GPU-bound section never holds more than the limit."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import AsyncIterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import aiohttp
import pytest
from aiohttp import web

from gpu_watchdog.inference.agent import Agent, AgentSettings
from gpu_watchdog.inference.agent_aiohttp import install

TOKEN = "flood-token"


@dataclass
class Section:
    """Stands in for the GPU: counts who is inside, from whichever thread."""

    lock = threading.Lock()
    inside: int = 0
    most: int = 0

    def run(self, seconds: float) -> None:
        with self.lock:
            self.inside += 1
            self.most = max(self.most, self.inside)
        time.sleep(seconds)
        with self.lock:
            self.inside -= 1


@dataclass
class App:
    url: str
    control: str
    agent: Agent
    section: Section


@pytest.fixture
async def app(monkeypatch: pytest.MonkeyPatch) -> AsyncIterator[App]:
    monkeypatch.setenv("GPU_WATCHDOG_TOKEN", TOKEN)
    section = Section()
    agent = Agent(AgentSettings(limit=3, queue_timeout=10, max_queue=200, control_port=0, device="cpu"),
                  canary=lambda: section.run(0.0))
    web_app = web.Application()

    async def predict_async(request: web.Request) -> web.Response:
        async with agent.admit():
            await asyncio.to_thread(section.run, 0.02)
        return web.json_response({"outputs": "ok"})

    def sync_model_call() -> None:
        # The other way in: the gate taken inside the worker thread, around the model call.
        with agent.admit():
            section.run(0.02)

    # The sync path's own pool (FastAPI's `def` endpoints have anyio's): a thread waiting at the
    # gate must not hold a thread the async path's holders need to finish.
    pool = ThreadPoolExecutor(max_workers=16)

    async def predict_sync(request: web.Request) -> web.Response:
        await asyncio.get_running_loop().run_in_executor(pool, sync_model_call)
        return web.json_response({"outputs": "ok"})

    web_app.router.add_post("/predict", predict_async)
    web_app.router.add_post("/predict_sync", predict_sync)
    install(web_app, agent)
    runner = web.AppRunner(web_app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    try:
        yield App(f"http://127.0.0.1:{port}", f"http://127.0.0.1:{agent.control_port}", agent, section)
    finally:
        await runner.cleanup()
        pool.shutdown(wait=False)


async def flood(url: str, n: int, concurrency: int) -> list[tuple[int, str | None]]:
    sem = asyncio.Semaphore(concurrency)
    async with aiohttp.ClientSession() as session:

        async def one(i: int) -> tuple[int, str | None]:
            async with sem:
                path = "/predict" if i % 2 else "/predict_sync"
                async with session.post(url + path, json={"inputs": "x"},
                                        timeout=aiohttp.ClientTimeout(total=30)) as resp:
                    await resp.read()
                    return resp.status, resp.headers.get("Retry-After")

        return await asyncio.gather(*(one(i) for i in range(n)))


async def test_a_flood_never_puts_more_than_the_limit_in_the_section(app: App) -> None:
    answers = await flood(app.url, 90, 30)
    assert [s for s, _ in answers] == [200] * 90
    assert app.section.most == 3  # reached, never passed
    report = app.agent.memory_report()
    assert report["admission"]["peak_holders"] == 3 and report["inflight"] == 0 and report["queued"] == 0

    # Lowered through the control API, as the watchdog does: the next flood runs one at a time.
    async with aiohttp.ClientSession(headers={"Authorization": f"Bearer {TOKEN}"}) as ctl:
        async with ctl.post(app.control + "/control/admission", json={"limit": 1}) as resp:
            assert resp.status == 200, await resp.text()
    app.section.most = 0
    answers = await flood(app.url, 20, 20)
    assert [s for s, _ in answers] == [200] * 20
    assert app.section.most == 1

    page = await asyncio.to_thread(lambda: app.agent.metrics_page().decode())
    assert 'gpu_inference_requests_total{code="200",route="/predict"}' in page
    assert "gpu_inference_admission_limit 1.0" in page


async def test_overflow_past_the_queue_bound_is_a_503_with_retry_after(app: App) -> None:
    app.agent.settings = AgentSettings(limit=3, queue_timeout=10, max_queue=4, control_port=0, device="cpu")
    answers = await flood(app.url, 40, 40)
    codes = [s for s, _ in answers]
    assert set(codes) == {200, 503}
    assert all(ra == "1" for s, ra in answers if s == 503)
    assert app.section.most <= 3
