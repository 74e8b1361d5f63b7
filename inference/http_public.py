"""The public API on :8000: completions (plain and SSE), /predict, /stream, probes and metrics."""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections.abc import Awaitable, Callable
from typing import Any

from aiohttp import web
from prometheus_client.aiohttp import make_aiohttp_handler

from inference.engine import GenRequest, GenResult
from inference.errors import AdmissionTimeout, Draining, FatalCudaError, InferenceOOM, QueueFull
from inference.openapi import public_spec
from inference.service import InferenceService
from inference.validation import BadRequest, CompletionParams, check_context, completion_params, parse_json_object
from watchdog import logs

log = logs.get("inference.http")

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]
SERVICE_KEY = web.AppKey("service", InferenceService)


def error_response(exc: BaseException, retry_after: int) -> web.Response:
    """Map a failure to its HTTP answer; a client mistake is never a 500."""
    if isinstance(exc, BadRequest):
        return web.json_response(exc.body(), status=exc.status)
    if isinstance(exc, AdmissionTimeout | QueueFull | Draining | InferenceOOM):
        kind = {
            AdmissionTimeout: "queue_timeout",
            QueueFull: "queue_full",
            Draining: "draining",
            InferenceOOM: "out_of_memory",
        }[type(exc)]
        return web.json_response(
            {"error": {"message": str(exc) or kind, "type": kind}},
            status=503,
            headers={"Retry-After": str(retry_after)},
        )
    if isinstance(exc, FatalCudaError):
        return web.json_response({"error": {"message": "GPU context lost; the process is restarting",
                                            "type": "fatal_cuda"}}, status=500)
    return web.json_response({"error": {"message": "internal error", "type": "internal"}}, status=500)


@web.middleware
async def request_log(request: web.Request, handler: Handler) -> web.StreamResponse:
    rid = request.headers.get("X-Request-Id") or uuid.uuid4().hex[:16]
    request["rid"] = rid
    start = time.perf_counter()
    service = request.app[SERVICE_KEY]
    status = 500
    try:
        response = await handler(request)
        status = response.status
        if not response.prepared:
            response.headers.setdefault("X-Request-Id", rid)
        return response
    except web.HTTPException as exc:
        status = exc.status
        if exc.status == 413:
            return web.json_response(
                {"error": {"message": f"request body larger than {request.app['max_body']} bytes",
                           "type": "invalid_request_error", "param": "body"}}, status=413)
        if exc.status in (404, 405):
            return web.json_response(
                {"error": {"message": f"no route {request.method} {request.path}", "type": "not_found"}},
                status=exc.status)
        raise
    finally:
        elapsed = time.perf_counter() - start
        route = request.match_info.route.resource.canonical if request.match_info.route.resource else "unmatched"
        if request.path not in ("/metrics", "/healthz", "/readyz"):
            service.metrics.requests.labels(route=route, code=str(status)).inc()
            service.metrics.duration.labels(route=route).observe(elapsed)
            log.info("request", request_id=rid, route=route, method=request.method, status=status,
                     latency_s=round(elapsed, 4), prompt_tokens=request.get("prompt_tokens"),
                     completion_tokens=request.get("completion_tokens"))


class PublicAPI:
    def __init__(self, service: InferenceService) -> None:
        self.service = service

    def app(self) -> web.Application:
        app = web.Application(middlewares=[request_log], client_max_size=self.service.settings.max_body_bytes)
        app[SERVICE_KEY] = self.service
        app["max_body"] = self.service.settings.max_body_bytes
        app.router.add_post("/v1/completions", self.completions)
        app.router.add_post("/predict", self.predict)
        app.router.add_post("/stream", self.stream)
        app.router.add_get("/healthz", self.healthz)
        app.router.add_get("/readyz", self.readyz)
        app.router.add_get("/metrics", make_aiohttp_handler(self.service.metrics.registry))
        app.router.add_get("/openapi.json", self.openapi)
        return app

    async def openapi(self, request: web.Request) -> web.Response:
        ctx = self.service.engine.lm.context_len if self.service.engine is not None else 0
        return web.json_response(public_spec(self.service.settings.max_tokens_limit, ctx))

    # -- probes ------------------------------------------------------------------------------

    async def healthz(self, request: web.Request) -> web.Response:
        # Liveness: the event loop answers. A poisoned process exits on its own.
        return web.json_response({"status": "ok", "poisoned": self.service.poisoned})

    async def readyz(self, request: web.Request) -> web.Response:
        s = self.service
        if s.is_ready():
            return web.json_response({"ready": True})
        reason = "poisoned" if s.poisoned else "draining" if s.ready else "warming_up"
        return web.json_response({"ready": False, "reason": reason}, status=503)

    # -- generation --------------------------------------------------------------------------

    async def _params(self, request: web.Request, allow_stream: bool) -> tuple[CompletionParams, list[int]]:
        s = self.service
        if not s.ready or s.engine is None:
            raise Draining("the model is still loading")
        try:
            # A client that trickles its body must not hold a connection (and memory) forever.
            raw = await asyncio.wait_for(request.read(), timeout=s.settings.body_timeout_s)
        except TimeoutError:
            raise BadRequest(408, "body", f"request body not received within {s.settings.body_timeout_s:g} s") from None
        except web.HTTPRequestEntityTooLarge:
            raise BadRequest(413, "body", f"request body larger than {s.settings.max_body_bytes} bytes") from None
        data = parse_json_object(raw)
        params = completion_params(data, default_max_tokens=s.settings.default_max_tokens,
                                   max_tokens_limit=s.settings.max_tokens_limit, allow_stream=allow_stream)
        ids = s.engine.lm.codec.encode(params.prompt)
        check_context(len(ids), params.max_tokens, s.engine.lm.context_len)
        request["prompt_tokens"] = len(ids)
        return params, ids

    async def _generate(self, request: web.Request, params: CompletionParams, ids: list[int]) -> GenResult:
        assert self.service.scheduler is not None
        result = await self.service.scheduler.submit(
            GenRequest(ids, params.max_tokens, params.temperature), timeout=self.service.settings.queue_timeout)
        request["completion_tokens"] = result.completion_tokens
        return result

    async def completions(self, request: web.Request) -> web.StreamResponse:
        try:
            params, ids = await self._params(request, allow_stream=True)
            if params.stream:
                return await self._stream(request, params, ids, sse=True)
            result = await self._generate(request, params, ids)
        except Exception as exc:
            return self._fail(request, exc)
        return web.json_response({
            "id": f"cmpl-{request['rid']}",
            "object": "text_completion",
            "created": int(time.time()),
            "model": self.service.engine.lm.name if self.service.engine else "",
            "choices": [{"text": result.text, "index": 0, "logprobs": None, "finish_reason": result.finish_reason}],
            "usage": {"prompt_tokens": result.prompt_tokens, "completion_tokens": result.completion_tokens,
                      "total_tokens": result.prompt_tokens + result.completion_tokens},
        })

    async def predict(self, request: web.Request) -> web.StreamResponse:
        try:
            params, ids = await self._params(request, allow_stream=False)
            result = await self._generate(request, params, ids)
        except Exception as exc:
            return self._fail(request, exc)
        return web.json_response({"result": result.text, "completion_tokens": result.completion_tokens})

    async def stream(self, request: web.Request) -> web.StreamResponse:
        try:
            params, ids = await self._params(request, allow_stream=True)
            return await self._stream(request, params, ids, sse=False)
        except Exception as exc:
            return self._fail(request, exc)

    def _fail(self, request: web.Request, exc: BaseException) -> web.Response:
        if not isinstance(exc, BadRequest | AdmissionTimeout | QueueFull | Draining | InferenceOOM | FatalCudaError):
            log.exception("request_failed", request_id=request.get("rid"), error=repr(exc))
        return error_response(exc, self.service.settings.retry_after_s)

    async def _stream(
        self, request: web.Request, params: CompletionParams, ids: list[int], sse: bool
    ) -> web.StreamResponse:
        """Hold one admission slot for the whole stream; headers go out only once generation started,
        so admission failures still get a proper status code."""
        assert self.service.scheduler is not None
        loop = asyncio.get_running_loop()
        pieces: asyncio.Queue[str | None] = asyncio.Queue()
        gen = GenRequest(ids, params.max_tokens, params.temperature,
                         on_text=lambda piece: loop.call_soon_threadsafe(pieces.put_nowait, piece))
        task = asyncio.ensure_future(
            self.service.scheduler.submit(gen, timeout=self.service.settings.queue_timeout, batchable=False))
        task.add_done_callback(lambda _: pieces.put_nowait(None))
        cid = f"cmpl-{request['rid']}"
        model_name = self.service.engine.lm.name if self.service.engine else ""

        def sse_chunk(payload: dict[str, Any]) -> bytes:
            return f"data: {json.dumps(payload)}\n\n".encode()

        def text_chunk(text: str, finish: str | None) -> bytes:
            if not sse:
                return text.encode()
            return sse_chunk({"id": cid, "object": "text_completion", "created": int(time.time()), "model": model_name,
                              "choices": [{"text": text, "index": 0, "logprobs": None, "finish_reason": finish}]})

        first = await pieces.get()
        if first is None and task.exception() is not None:
            exc = task.exception()
            assert exc is not None
            return self._fail(request, exc)
        response = web.StreamResponse(headers={
            "Content-Type": "text/event-stream" if sse else "text/plain; charset=utf-8",
            "Cache-Control": "no-cache",
            "X-Request-Id": request["rid"],
        })
        await response.prepare(request)
        try:
            piece = first
            while piece is not None:
                await response.write(text_chunk(piece, None))
                piece = await pieces.get()
        except (ConnectionResetError, asyncio.CancelledError):
            gen.cancelled.set()
            raise
        exc = task.exception()
        if exc is not None:
            # Never end silently: an SSE client gets an error event; a plain-text client gets a
            # truncated chunked body (no terminating chunk), which every HTTP client reports.
            log.warning("stream_failed", request_id=request["rid"], error=str(exc)[:200])
            if sse:
                await response.write(sse_chunk({"error": {"message": str(exc)[:300] or type(exc).__name__,
                                                          "type": type(exc).__name__}}))
                await response.write_eof()
            else:
                if request.transport is not None:
                    request.transport.close()
            return response
        result = task.result()
        request["completion_tokens"] = result.completion_tokens
        if sse:
            await response.write(text_chunk("", result.finish_reason))
            await response.write(b"data: [DONE]\n\n")
        await response.write_eof()
        return response
