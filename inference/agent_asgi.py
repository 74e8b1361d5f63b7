"""The agent in a FastAPI or Starlette app: `install(app, agent)`, one line.

Adds the `gpu_inference_` request metrics (route template and status code), `GET /metrics`, and
the answers of `serve`: 503 + Retry-After for a queue timeout, a full queue, draining or an OOM
the cache flush did not cure; 500 for a poisoned context.
"""

from __future__ import annotations

import json
import time
from typing import Any

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from gpu_watchdog.inference.agent import METRICS_CONTENT_TYPE, Agent
from gpu_watchdog.inference.errors import AdmissionTimeout, Draining, FatalCudaError, InferenceOOM, QueueFull
from gpu_watchdog.inference.http_errors import error_response
from gpu_watchdog.inference.screen import MARKED, SCREEN_MAX_BYTES, QuarantinedRequest, RequestAccount

ANSWERED = (AdmissionTimeout, QueueFull, Draining, InferenceOOM, FatalCudaError)
BODY_METHODS = frozenset({"POST", "PUT", "PATCH"})


async def _send_json(send: Send, status: int, body: dict[str, Any]) -> None:
    data = json.dumps(body).encode()
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(data)).encode())]})
    await send({"type": "http.response.body", "body": data})


class _Observe:
    """Pure ASGI (no request objects built): counts each answer by its route template and code."""

    def __init__(self, app: ASGIApp, agent: Agent, skip: str) -> None:
        self.app = app
        self.agent = agent
        self.skip = skip

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        # Scrapes are not requests: counted, they would pass for progress while the model hangs.
        if scope["type"] != "http" or scope["path"] == self.skip:
            await self.app(scope, receive, send)
            return
        start = time.perf_counter()
        status = 500
        account = RequestAccount()

        async def sending(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        # One connection's requests may share a context: no request's fault marks carry over.
        marked = MARKED.set(frozenset())
        try:
            if scope["method"] in BODY_METHODS:
                receive = await self._screened(receive, account)
            await self.app(scope, receive, sending)
        except QuarantinedRequest as exc:
            status = exc.status
            await _send_json(send, status, exc.body())
        finally:
            MARKED.reset(marked)
            self.agent.request_done(account, status)
            route = scope.get("route")
            # The template, not the path: a scan of random paths must not grow the label set.
            name = getattr(route, "path", None) or "other"
            self.agent.observe(name, status, time.perf_counter() - start)

    async def _screened(self, receive: Receive, account: RequestAccount) -> Receive:
        """The body read whole (the app reads it again from the returned `receive`), fingerprinted,
        refused if quarantined (`QuarantinedRequest`), else booked in flight."""
        chunks: list[bytes] = []
        size, whole = 0, False
        after: list[Message] = []
        while size <= SCREEN_MAX_BYTES:
            message = await receive()
            if message["type"] != "http.request":
                after.append(message)  # the client left: the app hears it as it would have
                break
            chunks.append(message.get("body", b""))
            size += len(chunks[-1])
            if not message.get("more_body", False):
                whole = True
                break
        raw = b"".join(chunks)
        if whole:
            self.agent.screen_body(account, raw)
        # A body cut short (the client left) or too large to hold goes on unscreened, as it came.
        pending: list[Message] = [{"type": "http.request", "body": raw, "more_body": not whole}, *after]

        async def replay() -> Message:
            return pending.pop(0) if pending else await receive()

        return replay


def install(app: Starlette, agent: Agent, metrics_path: str = "/metrics") -> None:
    retry_after = agent.settings.retry_after_s

    async def answer(request: Request, exc: Exception) -> Response:
        resp = error_response(exc, retry_after)
        headers = {k: v for k, v in resp.headers.items() if k == "Retry-After"}
        return Response(content=resp.body, status_code=resp.status, headers=headers,  # type: ignore[arg-type]
                        media_type="application/json")

    async def metrics(request: Request) -> Response:
        return Response(content=agent.metrics_page(), media_type=METRICS_CONTENT_TYPE)

    for exc_type in ANSWERED:
        app.add_exception_handler(exc_type, answer)
    app.add_route(metrics_path, metrics, methods=["GET"], include_in_schema=False)
    app.add_middleware(_Observe, agent=agent, skip=metrics_path)
