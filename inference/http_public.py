"""The public API on :8000: OpenAI's models, completions and chat (plain and SSE), /predict, /stream, probes."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import structlog
from aiohttp import web
from prometheus_client.aiohttp import make_aiohttp_handler

from gpu_watchdog.inference import http_tokenize
from gpu_watchdog.inference.engine_api import GenRequest, GenResult
from gpu_watchdog.inference.errors import (
    AdmissionTimeout,
    Draining,
    FatalCudaError,
    InferenceOOM,
    QueueFull,
)
from gpu_watchdog.inference.handlers.inputs import MAX_INPUTS
from gpu_watchdog.inference.http_errors import Route, error_response, read_body
from gpu_watchdog.inference.http_handlers import ACCOUNT, HandlerRoutes, capabilities
from gpu_watchdog.inference.mailbox import Mailbox
from gpu_watchdog.inference.openai_extras import (
    StreamedLogprobs,
    TokenText,
    chat_logprobs,
    choice_seed,
    completion_logprobs,
    request_options,
)
from gpu_watchdog.inference.openapi import public_spec
from gpu_watchdog.inference.screen import BOOKING, MARKED, RequestAccount
from gpu_watchdog.inference.service import InferenceService
from gpu_watchdog.inference.validation import (
    BadRequest,
    ChatParams,
    CompletionParams,
    Limits,
    Sampling,
    check_context,
    parse_json_object,
)

log = structlog.get_logger(__name__)

SERVICE_KEY = web.AppKey("service", InferenceService)
_EXPECTED = (BadRequest, AdmissionTimeout, QueueFull, Draining, InferenceOOM, FatalCudaError)
# The code recorded for a request whose client left before its answer ended (nginx's "client closed
# request"): nobody received a status, and a gone client is not the server's failure (no 5xx).
CLIENT_CLOSED = 499


@web.middleware
async def request_log(request: web.Request, handler: Route) -> web.StreamResponse:
    rid = request.headers.get("X-Request-Id") or uuid.uuid4().hex[:16]
    account = request[ACCOUNT] = RequestAccount(rid)
    start = time.perf_counter()
    service = request.app[SERVICE_KEY]
    status = 500
    # One connection's requests run in one task: no request's fault marks or booking carry over to the next.
    marked = MARKED.set(frozenset())
    booking = BOOKING.set(None)
    try:
        response = await handler(request)
        status = CLIENT_CLOSED if account.client_gone else response.status
        if not response.prepared:
            response.headers.setdefault("X-Request-Id", rid)
        return response
    except web.HTTPException as exc:
        status = exc.status
        if exc.status == 413:
            return web.json_response(
                {"error": {"message": f"request body larger than {request.app['max_body']} bytes",
                           "type": "invalid_request_error", "param": "body", "code": None}}, status=413)
        if exc.status in (404, 405):
            return web.json_response(
                {"error": {"message": f"no route {request.method} {request.path}", "type": "not_found",
                           "param": None, "code": None}}, status=exc.status)
        raise
    except asyncio.CancelledError:
        # The client closed the connection (the public app cancels its handlers then).
        status = CLIENT_CLOSED
        raise
    finally:
        MARKED.reset(marked)
        BOOKING.reset(booking)
        service.guard.screen.done(account.ticket, ok=status < 400)
        elapsed = time.perf_counter() - start
        route = request.match_info.route.resource.canonical if request.match_info.route.resource else "unmatched"
        if request.path not in ("/metrics", "/healthz", "/readyz"):
            service.metrics.requests.labels(route=route, code=str(status)).inc()
            service.metrics.duration.labels(route=route).observe(elapsed)
            log.info("request", request_id=rid, route=route, method=request.method, status=status,
                     latency_s=round(elapsed, 4), prompt_tokens=account.prompt_tokens,
                     completion_tokens=account.completion_tokens, user=account.user,
                     fingerprint=account.fingerprint, input_fingerprint=account.input_fingerprint)


@dataclass(frozen=True)
class _Job:
    """One prompt of a request, ready for the engine."""

    index: int
    ids: list[int]
    max_tokens: int
    # Which prompt of the request, and which of its n choices.
    prompt: int = 0
    choice: int = 0


def _cancel_all(requests: Sequence[GenRequest], tasks: Sequence[asyncio.Future[GenResult]]) -> None:
    for r, t in zip(requests, tasks, strict=True):
        r.cancelled.set()  # seen by the decode loop at once, before the tasks' cancellation runs
        t.cancel()


class PublicAPI:
    def __init__(self, service: InferenceService) -> None:
        self.service = service
        self.created = int(time.time())
        self._box: Mailbox | None = None
        self._box_loop: asyncio.AbstractEventLoop | None = None

    def _mailbox(self, loop: asyncio.AbstractEventLoop) -> Mailbox:
        """One per event loop: every stream's pieces of a step arrive in one wake-up."""
        if self._box is None or self._box_loop is not loop:
            self._box, self._box_loop = Mailbox(loop), loop
        return self._box

    def app(self) -> web.Application:
        app = web.Application(middlewares=[request_log], client_max_size=self.service.settings.max_body_bytes)
        app[SERVICE_KEY] = self.service
        app["max_body"] = self.service.settings.max_body_bytes
        app.router.add_get("/v1/models", self.models)
        app.router.add_get("/v1/models/{model}", self.model)
        app.router.add_post("/v1/completions", self.completions)
        app.router.add_post("/v1/chat/completions", self.chat)
        app.router.add_post("/predict", self.predict)
        app.router.add_post("/stream", self.stream)
        app.router.add_get("/healthz", self.healthz)
        app.router.add_get("/readyz", self.readyz)
        app.router.add_get("/metrics", make_aiohttp_handler(self.service.metrics.registry))
        app.router.add_get("/openapi.json", self.openapi)
        http_tokenize.add_routes(app, self.service)
        HandlerRoutes(self.service, self._fail).add_to(app)
        return app

    async def openapi(self, request: web.Request) -> web.Response:
        started = self.service.started
        ctx = self.service.engine.context_len if started else 0
        limits = getattr(self.service.handler, "limits", None) if started else None
        return web.json_response(public_spec(self.service.settings.max_tokens_limit, ctx, self.service.model_name,
                                             capabilities(self.service) or frozenset(),
                                             getattr(limits, "max_inputs", MAX_INPUTS)))

    # -- probes and models -------------------------------------------------------------------

    async def healthz(self, request: web.Request) -> web.Response:
        # Liveness: the event loop answers. A poisoned process exits on its own.
        return web.json_response({"status": "ok", "poisoned": self.service.poisoned})

    async def readyz(self, request: web.Request) -> web.Response:
        s = self.service
        if s.is_ready():
            # The limit tells `serve --workers`' front which worker has room, without the control
            # API (whose memory read is the watchdog's, and counts as its seeing a poisoning).
            return web.json_response({"ready": True, "admission_limit": s.admission.limit})
        reason = "poisoned" if s.poisoned else "warming_up" if not s.ready else "draining" if s.guard.drain.active \
            else "awaiting_quarantine"
        return web.json_response({"ready": False, "reason": reason}, status=503)

    def _model_card(self) -> dict[str, Any]:
        card: dict[str, Any] = {"id": self.service.model_name, "object": "model", "created": self.created,
                                "owned_by": "gpu-watchdog"}
        if self.service.started:
            card["max_model_len"] = self.service.engine.context_len
        return card

    async def models(self, request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [self._model_card()]})

    async def model(self, request: web.Request) -> web.Response:
        name = request.match_info["model"]
        if name != self.service.model_name:
            return error_response(BadRequest(404, "model", f"The model `{name}` does not exist",
                                             code="model_not_found"), 0)
        return web.json_response(self._model_card())

    # -- parsing -----------------------------------------------------------------------------

    def _limits(self) -> Limits:
        s = self.service.settings
        return Limits(s.default_max_tokens, s.max_tokens_limit, self.service.model_name)

    async def _body(self, request: web.Request) -> dict[str, Any]:
        s = self.service
        if not s.started:
            raise Draining("the model is still loading")
        raw = await read_body(request, s.settings.body_timeout_s, s.settings.max_body_bytes)
        screen = s.guard.screen

        def parsed(raw: bytes) -> tuple[dict[str, Any], tuple[str | None, str | None]]:
            data = parse_json_object(raw)
            return data, screen.prints(data)  # a large body's token ids decoded off the loop too

        data, prints = await http_tokenize.off_loop(request, parsed, raw)
        screen.mark(data)
        screen.screened(request[ACCOUNT], *prints)
        return data

    def _jobs(self, request: web.Request, prompts: list[list[int]], sampling: Sampling) -> list[_Job]:
        engine = self.service.engine
        ctx = engine.lm.context_len
        jobs: list[_Job] = []
        for i, ids in enumerate(prompts):
            field = "prompt" if len(prompts) == 1 else f"prompt[{i}]"
            # Without max_tokens (chat) the answer may use what the context leaves, within the limit.
            max_tokens = sampling.max_tokens
            if max_tokens is None:
                max_tokens = max(1, min(self.service.settings.max_tokens_limit, ctx - len(ids)))
            check_context(len(ids), max_tokens, ctx, field)
            jobs += [_Job(i * sampling.n + c, ids, max_tokens, i, c) for c in range(sampling.n)]
        account = request[ACCOUNT]
        account.prompt_tokens = sum(len(j.ids) for j in jobs if j.choice == 0)
        account.user = sampling.user
        return jobs

    async def _completion_jobs(self, request: web.Request, strict: bool, allow_stream: bool
                               ) -> tuple[CompletionParams, list[_Job]]:
        data = await self._body(request)  # 503 while the model loads
        engine = self.service.engine
        params, prompts = await http_tokenize.off_loop(request, http_tokenize.completion_prompts, data, self._limits(),
                                                       engine.lm.codec, engine.lm.vocab_size, strict=strict,
                                                       allow_stream=allow_stream)
        return params, self._jobs(request, prompts, params.sampling)

    async def _chat_jobs(self, request: web.Request) -> tuple[ChatParams, list[_Job]]:
        data = await self._body(request)  # 503 while the model loads
        engine = self.service.engine
        params, ids = await http_tokenize.off_loop(request, http_tokenize.chat_prompt, data, self._limits(),
                                                   engine.lm.codec, engine.lm.vocab_size)
        return params, self._jobs(request, [ids], params.sampling)

    def _request(self, job: _Job, sampling: Sampling, on_text: Callable[[str], object] | None = None,
                 on_logprobs: Callable[[list[Any], bool], object] | None = None) -> GenRequest:
        params = dataclasses.replace(sampling.params, seed=choice_seed(sampling.params.seed, job.choice))
        return GenRequest(job.ids, job.max_tokens, params, sampling.stop, on_text=on_text,
                          on_logprobs=on_logprobs, **request_options(sampling, prompt_logprobs=sampling.echo))

    async def _run(self, request: web.Request, jobs: list[_Job], sampling: Sampling) -> list[GenResult]:
        engine = self.service.engine
        timeout = self.service.settings.queue_timeout
        requests = [self._request(j, sampling) for j in jobs]
        tasks = [asyncio.ensure_future(engine.submit(r, timeout)) for r in requests]
        try:
            results = await asyncio.gather(*tasks)
        except asyncio.CancelledError:
            self._client_left(request, requests, tasks)
            raise
        except BaseException:
            for t in tasks:
                t.cancel()
            raise
        request[ACCOUNT].completion_tokens = sum(r.completion_tokens for r in results)
        return list(results)

    @staticmethod
    def _client_left(request: web.Request, requests: Sequence[GenRequest],
                     tasks: Sequence[asyncio.Future[GenResult]]) -> None:
        """The client closed its connection: every sequence of the request leaves at the next step,
        its admission share freed, rather than generating for nobody."""
        _cancel_all(requests, tasks)
        account = request[ACCOUNT]
        if not account.client_gone:
            account.client_gone = True
            log.info("request_cancelled", request_id=account.rid, reason="client_disconnected",
                     sequences=len(tasks))

    def _fail(self, request: web.Request, exc: BaseException) -> web.Response:
        if not isinstance(exc, _EXPECTED):
            log.exception("request_failed", request_id=request[ACCOUNT].rid, error=repr(exc))
        return error_response(exc, self.service.settings.retry_after_s)

    @staticmethod
    def _usage(results: list[GenResult], jobs: list[_Job] | None = None) -> dict[str, Any]:
        # A prompt answered n times is counted once, as vLLM and OpenAI count it.
        firsts = [r for i, r in enumerate(results) if jobs is None or jobs[i].choice == 0]
        prompt = sum(r.prompt_tokens for r in firsts)
        completion = sum(r.completion_tokens for r in results)
        cached = sum(r.cached_tokens for r in firsts)
        return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
                "prompt_tokens_details": {"cached_tokens": cached}}

    # -- routes ------------------------------------------------------------------------------

    async def completions(self, request: web.Request) -> web.StreamResponse:
        try:
            params, jobs = await self._completion_jobs(request, strict=True, allow_stream=True)
            if params.sampling.stream:
                return await self._sse(request, jobs, params.sampling, chat=False, params=params)
            results = await self._run(request, jobs, params.sampling)
        except Exception as exc:
            return self._fail(request, exc)
        return web.json_response({
            "id": f"cmpl-{request[ACCOUNT].rid}",
            "object": "text_completion",
            "created": int(time.time()),
            "model": params.sampling.model,
            "choices": [self._completion_choice(params, j, r) for j, r in zip(jobs, results, strict=True)],
            "usage": self._usage(results, jobs),
        })

    def _echo_text(self, params: CompletionParams, job: _Job) -> str:
        prompt = params.prompts[job.prompt]
        if isinstance(prompt, str):
            return prompt
        return self.service.engine.lm.codec.decode(list(prompt), skip_special_tokens=False)

    def _completion_choice(self, params: CompletionParams, job: _Job, r: GenResult) -> dict[str, Any]:
        s = params.sampling
        text = self._echo_text(params, job) + r.text if s.echo else r.text
        logprobs = None
        if s.logprobs is not None and r.logprobs is not None:
            spell = TokenText(self.service.engine.lm.codec)
            logprobs = completion_logprobs(spell, r.token_ids, r.logprobs)
            if s.echo and r.prompt_logprobs is not None:
                scored = completion_logprobs(spell, job.ids, r.prompt_logprobs)
                shift = sum(len(t) for t in scored["tokens"])
                logprobs = {key: scored[key] + ([o + shift for o in logprobs[key]] if key == "text_offset"
                                                else logprobs[key]) for key in scored}
        return {"text": text, "index": job.index, "logprobs": logprobs, "finish_reason": r.finish_reason}

    async def chat(self, request: web.Request) -> web.StreamResponse:
        try:
            params, jobs = await self._chat_jobs(request)
            if params.sampling.stream:
                return await self._sse(request, jobs, params.sampling, chat=True)
            results = await self._run(request, jobs, params.sampling)
        except Exception as exc:
            return self._fail(request, exc)
        spell = TokenText(self.service.engine.lm.codec)
        top = params.sampling.logprobs
        return web.json_response({
            "id": f"chatcmpl-{request[ACCOUNT].rid}",
            "object": "chat.completion",
            "created": int(time.time()),
            "model": params.sampling.model,
            "choices": [{"index": j.index, "message": {"role": "assistant", "content": r.text},
                         "logprobs": None if top is None or r.logprobs is None else
                         chat_logprobs(spell, r.logprobs, top), "finish_reason": r.finish_reason}
                        for j, r in zip(jobs, results, strict=True)],
            "usage": self._usage(results, jobs),
        })

    async def predict(self, request: web.Request) -> web.StreamResponse:
        try:
            params, jobs = await self._completion_jobs(request, strict=False, allow_stream=False)
            [result] = await self._run(request, jobs, params.sampling)
        except Exception as exc:
            return self._fail(request, exc)
        return web.json_response({"result": result.text, "completion_tokens": result.completion_tokens})

    async def stream(self, request: web.Request) -> web.StreamResponse:
        try:
            params, jobs = await self._completion_jobs(request, strict=False, allow_stream=True)
            return await self._stream(request, jobs, params.sampling, lambda _i, text, _f: text.encode(),
                                      "text/plain; charset=utf-8", sse=False)
        except Exception as exc:
            return self._fail(request, exc)

    # -- streaming ---------------------------------------------------------------------------

    async def _sse(self, request: web.Request, jobs: list[_Job], sampling: Sampling, chat: bool,
                   params: CompletionParams | None = None) -> web.StreamResponse:
        cid = f"{'chatcmpl' if chat else 'cmpl'}-{request[ACCOUNT].rid}"
        created = int(time.time())
        kind = "chat.completion.chunk" if chat else "text_completion"
        engine = self.service.engine
        streamed = None if sampling.logprobs is None else StreamedLogprobs(TokenText(engine.lm.codec), chat,
                                                                            sampling.logprobs)
        echo = params if not chat and sampling.echo else None
        by_index = {j.index: j for j in jobs}

        def event(payload: dict[str, Any]) -> bytes:
            return f"data: {json.dumps(payload)}\n\n".encode()

        def choice(index: int, text: str, finish: str | None, logprobs: dict[str, Any] | None) -> bytes:
            if chat:
                delta: dict[str, Any] = {"content": text} if text or finish is None else {}
                body: dict[str, Any] = {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish}
            else:
                body = {"text": text, "index": index, "logprobs": logprobs, "finish_reason": finish}
            return event({"id": cid, "object": kind, "created": created, "model": sampling.model,
                          "choices": [body]})

        def chunk(index: int, item: Any, finish: str | None) -> bytes:
            if isinstance(item, tuple):  # log-probabilities (entries, of the prompt?) ahead of their text
                entries, of_prompt = item
                assert streamed is not None
                if not of_prompt:
                    streamed.add(index, entries)
                    return b""
                if echo is None:
                    return b""
                job = by_index[index]
                return choice(index, self._echo_text(echo, job), None, streamed.prompt(index, job.ids, entries))
            return choice(index, item, finish, None if streamed is None else streamed.take(index))

        def opening() -> bytes:
            # Chat streams announce the role first, as OpenAI's do.
            if chat:
                return event({"id": cid, "object": kind, "created": created, "model": sampling.model,
                              "choices": [{"index": j.index, "delta": {"role": "assistant", "content": ""},
                                           "logprobs": None, "finish_reason": None} for j in jobs]})
            if echo is not None and streamed is None:  # with logprobs the prompt goes out once scored
                return b"".join(choice(j.index, self._echo_text(echo, j), None, None) for j in jobs)
            return b""

        def closing(results: list[GenResult]) -> bytes:
            tail = b""
            if streamed is not None:
                tail += b"".join(choice(i, "", None, streamed.take(i)) for i in streamed.waiting())
            tail += b"".join(choice(j.index, "", r.finish_reason, None) for j, r in zip(jobs, results, strict=True))
            if sampling.include_usage:
                tail += event({"id": cid, "object": kind, "created": created, "model": sampling.model,
                               "choices": [], "usage": self._usage(results, jobs)})
            return tail + b"data: [DONE]\n\n"

        return await self._stream(request, jobs, sampling, chunk,
                                  "text/event-stream", sse=True, opening=opening, closing=closing,
                                  error_event=lambda exc: event({"error": {
                                      "message": str(exc)[:300] or type(exc).__name__,
                                      "type": type(exc).__name__}}))

    async def _stream(
        self, request: web.Request, jobs: list[_Job], sampling: Sampling,
        render: Callable[[int, Any, str | None], bytes], content_type: str, *, sse: bool,
        opening: Callable[[], bytes] | None = None, closing: Callable[[list[GenResult]], bytes] | None = None,
        error_event: Callable[[BaseException], bytes] | None = None,
    ) -> web.StreamResponse:
        """Headers go out only once generation started, so admission failures still get a proper
        status code; the sequences are batched with everything else in the engine."""
        engine = self.service.engine
        loop = asyncio.get_running_loop()
        mailbox = self._mailbox(loop)
        pieces: asyncio.Queue[tuple[int, Any] | None] = asyncio.Queue()

        def sink(index: int) -> Callable[[str], object]:
            return lambda piece: mailbox.post(pieces.put_nowait, (index, piece))

        def logprobs_sink(index: int) -> Callable[[list[Any], bool], object]:
            return lambda entries, prompt: mailbox.post(pieces.put_nowait, (index, (entries, prompt)))

        wants = sampling.logprobs is not None
        requests = [self._request(j, sampling, on_text=sink(j.index),
                                  on_logprobs=logprobs_sink(j.index) if wants else None) for j in jobs]
        timeout = self.service.settings.queue_timeout
        tasks = [asyncio.ensure_future(engine.submit(r, timeout)) for r in requests]
        whole = asyncio.gather(*tasks)
        # After the last piece: every on_text call was queued on the loop before its future resolved.
        whole.add_done_callback(lambda _: loop.call_soon(pieces.put_nowait, None))

        try:
            first = await pieces.get()
        except asyncio.CancelledError:  # gone while queued or prefilled, before any header went out
            self._client_left(request, requests, tasks)
            raise
        if first is None and whole.exception() is not None:
            exc = whole.exception()
            assert exc is not None
            _cancel_all(requests, tasks)
            return self._fail(request, exc)
        response = web.StreamResponse(headers={"Content-Type": content_type, "Cache-Control": "no-cache",
                                               "X-Request-Id": request[ACCOUNT].rid})
        try:
            await response.prepare(request)
            if opening is not None:
                await response.write(opening())
            item = first
            while item is not None:
                data = render(item[0], item[1], None)
                if data:  # an empty write could end a chunked body early
                    await response.write(data)
                item = await pieces.get()
            exc = whole.exception()
            if exc is not None:
                _cancel_all(requests, tasks)
                # Never end silently: an SSE client gets an error event; a plain-text client gets a
                # truncated chunked body (no terminating chunk), which every HTTP client reports.
                log.warning("stream_failed", request_id=request[ACCOUNT].rid, error=str(exc)[:200])
                if sse and error_event is not None:
                    await response.write(error_event(exc))
                    await response.write_eof()
                elif request.transport is not None:
                    request.transport.close()
                return response
            results = list(whole.result())
            request[ACCOUNT].completion_tokens = sum(r.completion_tokens for r in results)
            if closing is not None:
                await response.write(closing(results))
            await response.write_eof()
        except ConnectionResetError:  # a write found the connection closed by the client
            self._client_left(request, requests, tasks)
        except asyncio.CancelledError:  # the connection closed while waiting for the next pieces
            self._client_left(request, requests, tasks)
            raise
        return response
