"""Where request bodies become token ids: large ones off the event loop, for every route that tokenizes;
and POST /tokenize and /detokenize in vLLM's shape, with which clients (vLLM's benchmark client among
them) count and check tokens with the server's own tokenizer rather than guess."""

from __future__ import annotations

import asyncio
import contextvars
import functools
import json
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

from aiohttp import web

from gpu_watchdog.inference.model import Codec, NoChatTemplate
from gpu_watchdog.inference.service import InferenceService
from gpu_watchdog.inference.validation import (
    BadRequest,
    ChatParams,
    CompletionParams,
    Limits,
    chat_params,
    completion_params,
    parse_json_object,
)

T = TypeVar("T")

# A prompt is counted before it can be refused as too long, so one request can ask for a whole
# body's worth of parsing and tokenizing: for a 1 MiB body, seconds with a Hugging Face tokenizer
# (benchmarks/control_under_flood.py). On the event loop that time is taken from the control API
# on the same loop (the watchdog's memory reading and canary, which then look like a hang) and from
# every stream. Larger bodies are parsed, checked and tokenized on a pool of their own, not the
# default executor, where the canary's slot and the memory report are taken: those must not queue
# behind a flood of prompts. Two threads, as tokenizers hold the GIL: more would only take turns
# with the event loop and the decode thread. They share the tokenizer safely: a Hugging Face one
# changes its own state (truncation, padding) only on its first call, made by the warm-up.
# Smaller bodies cost less than the hop.
OFF_LOOP_BYTES = 1024
_POOL = ThreadPoolExecutor(max_workers=2, thread_name_prefix="tokenize")


async def in_pool(fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
    """`fn(...)` on the tokenizing pool; its exceptions (a BadRequest naming the field) come back as raised."""
    call = functools.partial(contextvars.copy_context().run, fn, *args, **kwargs)
    return await asyncio.get_running_loop().run_in_executor(_POOL, call)


async def off_loop(request: web.Request, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
    """`fn(...)` in place for a small body, on the tokenizing pool for a large one (or one of unknown size)."""
    size = request.content_length
    if size is not None and size < OFF_LOOP_BYTES:
        return fn(*args, **kwargs)
    return await in_pool(fn, *args, **kwargs)


def completion_prompts(data: dict[str, Any], limits: Limits, codec: Codec, vocab_size: int, *, strict: bool,
                       allow_stream: bool) -> tuple[CompletionParams, list[list[int]]]:
    """A completion body checked, and its prompts as token ids."""
    params = completion_params(data, limits, vocab_size=vocab_size, strict=strict, allow_stream=allow_stream)
    return params, [codec.encode(p) if isinstance(p, str) else list(p) for p in params.prompts]


def chat_prompt(data: dict[str, Any], limits: Limits, codec: Codec, vocab_size: int | None
                ) -> tuple[ChatParams, list[int]]:
    """A chat body checked, and its conversation through the model's chat template as token ids."""
    params = chat_params(data, limits, vocab_size=vocab_size)
    try:
        ids = codec.chat([{"role": m.role, "content": m.content} for m in params.messages])
    except NoChatTemplate as exc:
        raise BadRequest(400, "messages", str(exc)) from None
    return params, ids


_TOKENIZE_FIELDS = frozenset({"model", "prompt", "messages", "add_special_tokens", "return_token_strs",
                              "add_generation_prompt", "continue_final_message"})
_DETOKENIZE_FIELDS = frozenset({"model", "tokens"})


def tokenize_body(data: dict[str, Any], service: InferenceService) -> dict[str, Any]:
    engine = service.engine
    _check(data, _TOKENIZE_FIELDS, service)
    codec = engine.lm.codec
    strs = _flag(data, "return_token_strs", False)
    if ("prompt" in data) == ("messages" in data):
        raise BadRequest(400, "prompt", "send either prompt (a string) or messages (a chat)")
    if "prompt" in data:
        prompt = data["prompt"]
        if not isinstance(prompt, str):
            raise BadRequest(400, "prompt", "prompt must be a string")
        try:
            prompt.encode("utf-8")
        except UnicodeEncodeError:
            raise BadRequest(400, "prompt", "prompt is not valid Unicode (a lone surrogate)") from None
        ids = codec.encode(prompt, add_special_tokens=_flag(data, "add_special_tokens", True))
    else:
        # The chat template writes the special tokens itself; adding more is not offered.
        for name, wanted in (("add_generation_prompt", True), ("continue_final_message", False),
                             ("add_special_tokens", False)):
            if _flag(data, name, wanted) != wanted:
                raise BadRequest(400, name, f"{name}: only {str(wanted).lower()} is supported")
        limits = Limits(service.settings.default_max_tokens, service.settings.max_tokens_limit, service.model_name)
        _, ids = chat_prompt({"messages": data["messages"]}, limits, codec, None)
    return {"count": len(ids), "max_model_len": engine.lm.context_len, "tokens": ids,
            "token_strs": codec.token_strs(ids) if strs else None}


def detokenize_body(data: dict[str, Any], service: InferenceService) -> dict[str, Any]:
    engine = service.engine
    _check(data, _DETOKENIZE_FIELDS, service)
    tokens = data.get("tokens")
    if not isinstance(tokens, list):
        raise BadRequest(400, "tokens", "tokens must be a list of token ids")
    vocab = engine.lm.vocab_size
    for i, t in enumerate(tokens):
        if not isinstance(t, int) or isinstance(t, bool) or not 0 <= t < vocab:
            raise BadRequest(400, f"tokens[{i}]", f"tokens[{i}] must be a token id in the vocabulary (0..{vocab - 1})")
    # As vLLM: special tokens are spelled out, not dropped.
    return {"prompt": engine.lm.codec.decode(tokens, skip_special_tokens=False)}


def _check(data: dict[str, Any], allowed: frozenset[str], service: InferenceService) -> None:
    for name in data:
        if name not in allowed:
            raise BadRequest(400, name, f"{name}: not a supported field")
    model = data.get("model")
    if model is not None and model != service.model_name:
        raise BadRequest(404, "model", f"The model `{model}` does not exist; this server serves"
                         f" `{service.model_name}` (GET /v1/models)", code="model_not_found")


def _flag(data: dict[str, Any], name: str, default: bool) -> bool:
    value = data.get(name)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise BadRequest(400, name, f"{name} must be a boolean")
    return value


def add_routes(app: web.Application, service: InferenceService) -> None:
    async def tokenize(request: web.Request) -> web.Response:
        return await _answer(request, service, tokenize_body)

    async def detokenize(request: web.Request) -> web.Response:
        return await _answer(request, service, detokenize_body)

    app.router.add_post("/tokenize", tokenize)
    app.router.add_post("/detokenize", detokenize)


async def _answer(request: web.Request, service: InferenceService,
                  body: Callable[[dict[str, Any], InferenceService], dict[str, Any]]) -> web.Response:
    if not service.started:
        return web.json_response({"error": {"message": "the model is still loading", "type": "draining",
                                            "param": None, "code": "draining"}}, status=503,
                                 headers={"Retry-After": str(service.settings.retry_after_s)})
    try:
        raw = await request.read()
        # Rendered where it was computed: a count of a whole body's tokens is a long list to write out.
        answer = await off_loop(request, _rendered, body, raw, service)
    except BadRequest as exc:
        return web.json_response(exc.body(), status=exc.status)
    return web.Response(text=answer, content_type="application/json")


def _rendered(body: Callable[[dict[str, Any], InferenceService], dict[str, Any]], raw: bytes,
              service: InferenceService) -> str:
    return json.dumps(body(parse_json_object(raw), service))
