"""The public routes of request-level handlers, grouped by what a handler can do.

`embed`: OpenAI's `POST /v1/embeddings`. `classify`: vLLM's `POST /classify` (and `/v1/classify`).
`predict`: `POST /predict`, the body handed to the handler's own `decode`. A route the running
handler cannot serve answers 404 saying which handler runs and what the route needs, instead of
reaching a model that cannot answer it.
"""

from __future__ import annotations

import base64
import json
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import structlog
from aiohttp import web

from gpu_watchdog.inference import http_tokenize
from gpu_watchdog.inference.capabilities import CLASSIFY, EMBED, GENERATE, PREDICT
from gpu_watchdog.inference.errors import AdmissionTimeout, Draining, FatalCudaError, InferenceOOM, QueueFull
from gpu_watchdog.inference.handler import RequestHandler
from gpu_watchdog.inference.http_errors import Route, read_body
from gpu_watchdog.inference.screen import RequestAccount
from gpu_watchdog.inference.service import InferenceService
from gpu_watchdog.inference.validation import BadRequest, parse_json_object

# Each public request's account (its id, tokens, user, fingerprint), set by the request log's middleware.
ACCOUNT = web.RequestKey("account", RequestAccount)

log = structlog.get_logger(__name__)

_EXPECTED = (BadRequest, AdmissionTimeout, QueueFull, Draining, InferenceOOM, FatalCudaError)

# What each route needs of the handler. /predict is the causal LM's own where it generates.
NEEDS = {
    "/v1/completions": GENERATE,
    "/v1/chat/completions": GENERATE,
    "/stream": GENERATE,
    "/tokenize": GENERATE,
    "/detokenize": GENERATE,
    "/v1/embeddings": EMBED,
    "/v1/classify": CLASSIFY,
    "/classify": CLASSIFY,
}
WHAT = {GENERATE: "text generation (--handler causal-lm)", EMBED: "an embedding model (--handler embeddings)",
        CLASSIFY: "a sequence classifier (--handler classifier)", PREDICT: "a handler with decode/predict"}
EMBEDDING_FIELDS = frozenset({"input", "model", "encoding_format", "dimensions", "user"})
CLASSIFY_FIELDS = frozenset({"input", "model", "user", "use_activation"})


def capabilities(service: InferenceService) -> frozenset[str] | None:
    """What the running handler can do; None while it is still being loaded."""
    if service.settings.handler == "causal-lm":
        return frozenset({GENERATE})
    return service.handler.capabilities if service.started else None


def _not_served(service: InferenceService, request: web.Request, need: str) -> web.Response:
    message = (f"this server runs the `{service.settings.handler}` handler; {request.method} {request.path}"
               f" needs {WHAT[need]}")
    return web.json_response({"error": {"message": message, "type": "not_found_error", "param": None,
                                        "code": "route_not_served"}}, status=404)


class HandlerRoutes:
    def __init__(self, service: InferenceService, fail: Callable[[web.Request, BaseException], web.Response]) -> None:
        self.service = service
        self.fail = fail

    @web.middleware
    async def capability_gate(self, request: web.Request, handler: Route) -> web.StreamResponse:
        served = capabilities(self.service)
        need = NEEDS.get(request.path)
        if request.path == "/predict" and served is not None and GENERATE not in served:
            need = PREDICT
            if PREDICT in served:
                return await self.predict(request)
        if need is not None and served is not None and need not in served:
            return _not_served(self.service, request, need)
        return await handler(request)

    def add_to(self, app: web.Application) -> None:
        app.middlewares.append(self.capability_gate)
        app.router.add_post("/v1/embeddings", self.embeddings)
        app.router.add_post("/v1/classify", self.classify)
        app.router.add_post("/classify", self.classify)

    # -- shared ------------------------------------------------------------------------------

    def _handler(self) -> RequestHandler:
        s = self.service
        if not s.started:
            raise Draining("the model is still loading")
        assert isinstance(s.handler, RequestHandler)
        return s.handler

    async def _body(self, request: web.Request, allowed: frozenset[str] | None) -> dict[str, Any]:
        settings = self.service.settings
        raw = await read_body(request, settings.body_timeout_s, settings.max_body_bytes)
        data = await http_tokenize.off_loop(request, parse_json_object, raw)
        if allowed is not None:
            unknown = sorted(set(data) - allowed)
            if unknown:
                raise BadRequest(400, unknown[0], f"unknown field {unknown[0]}")
        model = data.get("model")
        if model is not None and model != self.service.model_name:
            raise BadRequest(404, "model", f"The model `{model}` does not exist", code="model_not_found")
        self.service.guard.screen.request(request[ACCOUNT], data)
        return data

    async def _outputs(self, request: web.Request, handler: RequestHandler, data: dict[str, Any]
                       ) -> tuple[list[Any], list[Any]]:
        # Tokenizing thousands of inputs is real work: off the event loop, on the tokenizing pool.
        items = await http_tokenize.in_pool(handler.decode, data)
        engine = self.service.engine
        outputs = await engine.predict(items, self.service.settings.queue_timeout)
        return items, outputs

    def _tokens(self, request: web.Request, handler: RequestHandler, items: list[Any]) -> int:
        cost = getattr(handler, "cost", None)
        tokens = sum(int(cost(i)) for i in items) if cost is not None else 0
        request[ACCOUNT].prompt_tokens = tokens
        return tokens

    # -- routes ------------------------------------------------------------------------------

    async def embeddings(self, request: web.Request) -> web.Response:
        try:
            handler = self._handler()
            data = await self._body(request, EMBEDDING_FIELDS)
            encoding = data.get("encoding_format", "float")
            if encoding not in ("float", "base64"):
                raise BadRequest(400, "encoding_format", "encoding_format must be float or base64")
            cut = _dimensions(data.get("dimensions"), handler)
            items, outputs = await self._outputs(request, handler, data)
        except Exception as exc:
            return self.fail(request, exc)
        request[ACCOUNT].user = data.get("user")
        tokens = self._tokens(request, handler, items)
        # Written out off the event loop, like the inputs were read: 2048 vectors of 768 floats are
        # seconds of JSON.
        body = await http_tokenize.in_pool(_embeddings_json, outputs, cut, encoding, self.service.model_name, tokens)
        return web.Response(text=body, content_type="application/json")

    async def classify(self, request: web.Request) -> web.Response:
        try:
            handler = self._handler()
            data = await self._body(request, CLASSIFY_FIELDS)
            use_activation = data.get("use_activation", True)
            if use_activation not in (True, None):
                raise BadRequest(400, "use_activation", "only use_activation true (probabilities) is served")
            items, outputs = await self._outputs(request, handler, data)
        except Exception as exc:
            return self.fail(request, exc)
        tokens = self._tokens(request, handler, items)
        rid = request[ACCOUNT].rid

        def answer() -> str:
            data_rows = [{"index": i, **handler.encode(out)} for i, out in enumerate(outputs)]
            return json.dumps({"id": f"classify-{rid}", "object": "list", "created": int(time.time()),
                               "model": self.service.model_name, "data": data_rows,
                               "usage": {"prompt_tokens": tokens, "total_tokens": tokens,
                                         "completion_tokens": 0, "prompt_tokens_details": None}})

        return web.Response(text=await http_tokenize.in_pool(answer), content_type="application/json")

    async def predict(self, request: web.Request) -> web.Response:
        try:
            handler = self._handler()
            data = await self._body(request, None)
            items, outputs = await self._outputs(request, handler, data)
        except Exception as exc:
            return self.fail(request, exc)
        self._tokens(request, handler, items)
        return web.json_response({"outputs": [handler.encode(out) for out in outputs]})


def _embeddings_json(outputs: list[Any], cut: int | None, encoding: str, model: str, tokens: int) -> str:
    rows = []
    for i, vector in enumerate(outputs):
        v = np.asarray(vector, dtype=np.float32)
        if cut is not None:
            v = v[:cut]
            v = v / max(float(np.linalg.norm(v)), 1e-12)
        embedding: Any = (base64.b64encode(v.astype("<f4").tobytes()).decode() if encoding == "base64"
                          else v.tolist())
        rows.append({"object": "embedding", "index": i, "embedding": embedding})
    return json.dumps({"object": "list", "data": rows, "model": model,
                       "usage": {"prompt_tokens": tokens, "total_tokens": tokens}})


def _dimensions(value: object, handler: RequestHandler) -> int | None:
    """The length to cut vectors to, None for the model's own; a 400 where the model was not trained for it."""
    if value is None:
        return None
    native = int(getattr(handler, "dimensions", 0))
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise BadRequest(400, "dimensions", "dimensions must be a positive integer")
    if value == native:
        return None
    shorter: frozenset[int] = getattr(handler, "shorter", frozenset())
    if value in shorter:
        return value
    raise BadRequest(400, "dimensions", f"this model gives {native}-dimensional vectors and was not trained to be"
                                        f" shortened to {value} (no Matryoshka dimensions in its config)")
