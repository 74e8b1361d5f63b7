"""A loopback HTTP server that answers whatever the test's handler says, and the sidecar settings that
watch one as the inference process's control API. Tests use it to feed the real sidecar answers no
real server would give (garbage, a leak's figures, a server that hangs on cue)."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from typing import Any

from aiohttp import web

from gpu_watchdog.watchdog.edge.config import from_mapping


@contextlib.asynccontextmanager
async def serve_everything(handler: Any) -> AsyncIterator[str]:
    """A loopback HTTP server that sends every method and path to `handler`."""
    app = web.Application()
    app.router.add_route("*", "/{tail:.*}", handler)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        await runner.cleanup()


def settings(control_url: str) -> Any:
    return from_mapping({
        "target": {"control_url": control_url, "token_file": None},
        "sampling": {"nvml_interval": "50ms", "torch_interval": "50ms"},
        "canary": {"interval": "100ms", "timeout": "1s"},
        "restart": {"strategy": "none"},
        "server": {"host": "127.0.0.1", "port": 0},
    })
