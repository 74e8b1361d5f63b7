"""What the in-process agent costs a request, in microseconds.

    python -m gpu_watchdog.benchmarks.agent_overhead [--n 20000]

Measures, on this machine: the gate taken and given back in a worker thread (`with agent.admit()`)
and from a coroutine (`async with`), uncontended; and a whole FastAPI request served in-process
(ASGI called directly, no sockets, so the figure is not drowned in network noise) with and without
`install(app, agent)` plus `agent.admit()` in the endpoint. The difference is the agent's overhead.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import time
from collections.abc import Callable
from typing import Any

from fastapi import FastAPI

from gpu_watchdog.inference.agent import Agent, AgentSettings
from gpu_watchdog.inference.agent_asgi import install


def per_call_us(fn: Callable[[], None], n: int) -> float:
    runs = []
    for _ in range(5):
        start = time.perf_counter()
        for _ in range(n):
            fn()
        runs.append((time.perf_counter() - start) / n * 1e6)
    return statistics.median(runs)


async def per_call_async_us(fn: Callable[[], Any], n: int) -> float:
    runs = []
    for _ in range(5):
        start = time.perf_counter()
        for _ in range(n):
            await fn()
        runs.append((time.perf_counter() - start) / n * 1e6)
    return statistics.median(runs)


def build(with_agent: bool) -> FastAPI:
    app = FastAPI()
    agent = Agent(AgentSettings(limit=4, device="cpu"))
    if with_agent:
        install(app, agent)

        @app.post("/predict")
        async def predict_agent() -> dict[str, str]:
            async with agent.admit():
                return {"outputs": "x"}
    else:

        @app.post("/predict")
        async def predict_plain() -> dict[str, str]:
            return {"outputs": "x"}

    return app


async def asgi_request(app: Any) -> None:
    scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": "POST",
             "scheme": "http", "path": "/predict", "raw_path": b"/predict", "root_path": "", "query_string": b"",
             "headers": [(b"content-type", b"application/json")], "client": ("127.0.0.1", 1),
             "server": ("127.0.0.1", 80)}
    sent = False

    async def receive() -> dict[str, Any]:
        nonlocal sent
        if sent:
            await asyncio.sleep(3600)
        sent = True
        return {"type": "http.request", "body": b"{}", "more_body": False}

    status = 0

    async def send(message: dict[str, Any]) -> None:
        nonlocal status
        if message["type"] == "http.response.start":
            status = message["status"]

    await app(scope, receive, send)
    assert status == 200, status


async def main_async(n: int) -> dict[str, float]:
    agent = Agent(AgentSettings(limit=4, device="cpu"))

    def sync_admit() -> None:
        with agent.admit():
            pass

    async def async_admit() -> None:
        async with agent.admit():
            pass

    out = {"admit_sync_us": per_call_us(sync_admit, n), "admit_async_us": await per_call_async_us(async_admit, n)}
    plain, agented = build(False), build(True)
    m = max(200, n // 10)
    for app in (plain, agented):  # warm the routers and the metric children
        for _ in range(100):
            await asgi_request(app)
    out["fastapi_request_plain_us"] = await per_call_async_us(lambda: asgi_request(plain), m)
    out["fastapi_request_agent_us"] = await per_call_async_us(lambda: asgi_request(agented), m)
    out["agent_overhead_us"] = out["fastapi_request_agent_us"] - out["fastapi_request_plain_us"]
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--n", type=int, default=20000)
    args = p.parse_args()
    for name, value in asyncio.run(main_async(args.n)).items():
        print(f"{name:28s} {value:8.1f}")


if __name__ == "__main__":
    main()
