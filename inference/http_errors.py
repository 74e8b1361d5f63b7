"""The HTTP answer to each failure, one table for `serve`'s routes and the agent's glue alike.

A client's mistake is a 4xx naming the field; a full gate, a drain, an OOM or a lost context a
503 with Retry-After; a poisoned context a 500 that says so; anything else a 500 that leaks nothing.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable

from aiohttp import web

from gpu_watchdog.inference.errors import (
    AdmissionTimeout,
    ContextLost,
    Draining,
    FatalCudaError,
    InferenceOOM,
    NonFiniteLogits,
    QueueFull,
)
from gpu_watchdog.inference.validation import BadRequest

# What a middleware hands a request on to: the route's handler, or the next middleware.
Route = Callable[[web.Request], Awaitable[web.StreamResponse]]


def error_response(exc: BaseException, retry_after: int) -> web.Response:
    """Map a failure to its HTTP answer; a client mistake is never a 500."""
    if isinstance(exc, BadRequest):
        return web.json_response(exc.body(), status=exc.status)
    if isinstance(exc, AdmissionTimeout | QueueFull | Draining | InferenceOOM):
        kind = {
            ContextLost: "context_lost",
            AdmissionTimeout: "queue_timeout",
            QueueFull: "queue_full",
            Draining: "draining",
            InferenceOOM: "out_of_memory",
        }[type(exc)]
        return web.json_response(
            {"error": {"message": str(exc) or kind, "type": kind, "param": None, "code": kind}},
            status=503,
            headers={"Retry-After": str(retry_after)},
        )
    if isinstance(exc, FatalCudaError):
        return web.json_response({"error": {"message": "GPU context lost; the process is restarting",
                                            "type": "fatal_cuda", "param": None, "code": None}}, status=500)
    if isinstance(exc, NonFiniteLogits):
        return web.json_response({"error": {"message": str(exc), "type": "nonfinite", "param": None,
                                            "code": None}}, status=500)
    return web.json_response({"error": {"message": "internal error", "type": "internal", "param": None,
                                        "code": None}}, status=500)


async def read_body(request: web.Request, timeout_s: float, max_bytes: int) -> bytes:
    """The whole body, or the 4xx that says why not: a client that trickles its body must not hold
    a connection (and memory) forever."""
    try:
        return await asyncio.wait_for(request.read(), timeout=timeout_s)
    except TimeoutError:
        raise BadRequest(408, "body", f"request body not received within {timeout_s:g} s") from None
    except web.HTTPRequestEntityTooLarge:
        raise BadRequest(413, "body", f"request body larger than {max_bytes} bytes") from None
