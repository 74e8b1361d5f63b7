"""The watchdog's own HTTP server on :9402: /metrics, /healthz, /readyz, /status."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from aiohttp import web
from prometheus_client.aiohttp import make_aiohttp_handler
from prometheus_client.registry import CollectorRegistry


def build_app(
    registry: CollectorRegistry,
    healthy: Callable[[], tuple[bool, dict[str, Any]]],
    ready: Callable[[], tuple[bool, dict[str, Any]]],
    status: Callable[[], dict[str, Any]],
) -> web.Application:
    async def healthz(_: web.Request) -> web.Response:
        ok, body = healthy()
        return web.json_response(body, status=200 if ok else 503)

    async def readyz(_: web.Request) -> web.Response:
        ok, body = ready()
        return web.json_response(body, status=200 if ok else 503)

    async def status_handler(_: web.Request) -> web.Response:
        return web.json_response(status(), dumps=_dumps)

    app = web.Application()
    app.router.add_get("/metrics", make_aiohttp_handler(registry))
    app.router.add_get("/healthz", healthz)
    app.router.add_get("/readyz", readyz)
    app.router.add_get("/status", status_handler)
    return app


def _dumps(obj: Any) -> str:
    import json

    return json.dumps(obj, default=str)
