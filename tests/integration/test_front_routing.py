"""The front of `serve --workers N` against workers that misbehave on purpose, over real Unix
sockets: a request goes to another worker only when the first never started it."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from aiohttp import web

from gpu_watchdog.inference.front import Front, WorkerMetrics
from gpu_watchdog.inference.settings import ServeSettings
from gpu_watchdog.inference.workers import Supervisor, WorkerPlan


class Alive:
    returncode = None


async def unix_app(path: Path, handler: Callable[[web.Request], Any]) -> web.AppRunner:
    app = web.Application()
    app.router.add_route("*", "/{tail:.*}", handler)
    runner = web.AppRunner(app)
    await runner.setup()
    await web.UnixSite(runner, str(path)).start()
    return runner


@pytest.fixture
async def front(tmp_path: Path) -> AsyncIterator[tuple[Front, dict[str, int], str]]:
    seen = {"dies": 0, "refuses": 0, "serves": 0}

    async def dies(request: web.Request) -> web.StreamResponse:
        seen["dies"] += 1
        await request.read()
        assert request.transport is not None
        request.transport.close()  # as a worker that exits with the request inside it
        await asyncio.sleep(1)
        return web.Response()

    async def refuses(request: web.Request) -> web.Response:
        seen["refuses"] += 1
        return web.json_response({"error": {"message": "the GPU context was lost", "type": "context_lost",
                                            "param": None, "code": "context_lost"}}, status=503,
                                 headers={"Retry-After": "1"})

    async def serves(request: web.Request) -> web.StreamResponse:
        seen["serves"] += 1
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        for i in range(3):
            await resp.write(f"data: {i}\n\n".encode())
        await resp.write_eof()
        return resp

    settings = ServeSettings(workers=3, control_port=9001)
    plans = [WorkerPlan(k, None, 9001 + k, str(tmp_path / f"w{k}.sock")) for k in range(3)]
    runners = [await unix_app(Path(p.socket), h) for p, h in zip(plans, (dies, refuses, serves), strict=True)]
    supervisor = Supervisor(settings, plans)
    for w in supervisor.workers:
        w.proc, w.ready, w.limit = Alive(), True, 4  # type: ignore[assignment]
    f = Front(settings, supervisor, WorkerMetrics())
    runner = web.AppRunner(f.app())
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    yield f, seen, f"http://127.0.0.1:{port}"
    await runner.cleanup()
    for r in runners:
        await r.cleanup()


async def test_a_request_a_worker_took_and_lost_is_a_502_never_a_second_run(
        front: tuple[Front, dict[str, int], str]) -> None:
    f, seen, url = front
    for w in f.supervisor.workers[1:]:
        w.ready = False  # only the worker that dies is in rotation, then the one that serves
    f.supervisor.workers[2].ready = True
    f.supervisor.workers[2].inflight = 3  # busier: the dying one is picked first
    async with aiohttp.ClientSession() as s, s.post(url + "/v1/completions", json={"prompt": "x"}) as r:
        body = await r.json()
    assert r.status == 502 and body["error"]["code"] == "worker_lost"
    assert seen == {"dies": 1, "refuses": 0, "serves": 0}


async def test_a_refusal_of_unstarted_work_goes_to_the_next_worker_and_takes_the_refuser_off(
        front: tuple[Front, dict[str, int], str]) -> None:
    f, seen, url = front
    f.supervisor.workers[0].ready = False
    f.supervisor.workers[2].inflight = 3  # the refusing worker is picked first
    async with aiohttp.ClientSession() as s, s.post(url + "/v1/completions", json={"prompt": "x"}) as r:
        text = await r.text()
    assert r.status == 200 and text == "data: 0\n\ndata: 1\n\ndata: 2\n\n"
    assert seen == {"dies": 0, "refuses": 1, "serves": 1}
    assert not f.supervisor.workers[1].ready  # no new work until it says it is ready again


async def test_every_worker_refusing_returns_the_last_refusal_as_it_was(
        front: tuple[Front, dict[str, int], str]) -> None:
    f, seen, url = front
    f.supervisor.workers[0].ready = f.supervisor.workers[2].ready = False
    async with aiohttp.ClientSession() as s, s.post(url + "/v1/completions", json={"prompt": "x"}) as r:
        body = await r.json()
    assert r.status == 503 and r.headers["Retry-After"] == "1" and body["error"]["code"] == "context_lost"
    async with aiohttp.ClientSession() as s, s.post(url + "/v1/completions", json={"prompt": "x"}) as r:
        none = await r.json()
    assert r.status == 503 and none["error"]["code"] == "no_worker_ready"
    assert seen == {"dies": 0, "refuses": 1, "serves": 0}  # the refuser is off until it is ready again
    async with aiohttp.ClientSession() as s, s.get(url + "/readyz") as r:
        assert r.status == 503 and (await r.json())["reason"] == "no_worker_ready"
