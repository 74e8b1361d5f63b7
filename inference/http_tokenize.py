"""POST /tokenize and /detokenize in vLLM's shape: clients (vLLM's benchmark client among them) count
and check tokens with the server's own tokenizer rather than guess."""

from __future__ import annotations

from typing import Any

from aiohttp import web

from inference.model import NoChatTemplate
from inference.service import InferenceService
from inference.validation import BadRequest, Limits, chat_params, parse_json_object

_TOKENIZE_FIELDS = frozenset({"model", "prompt", "messages", "add_special_tokens", "return_token_strs",
                              "add_generation_prompt", "continue_final_message"})
_DETOKENIZE_FIELDS = frozenset({"model", "tokens"})


def tokenize_body(data: dict[str, Any], service: InferenceService) -> dict[str, Any]:
    engine = service.engine
    assert engine is not None
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
        params = chat_params({"messages": data["messages"]}, limits)
        try:
            ids = codec.chat([{"role": m.role, "content": m.content} for m in params.messages])
        except NoChatTemplate as exc:
            raise BadRequest(400, "messages", str(exc)) from None
    return {"count": len(ids), "max_model_len": engine.lm.context_len, "tokens": ids,
            "token_strs": codec.token_strs(ids) if strs else None}


def detokenize_body(data: dict[str, Any], service: InferenceService) -> dict[str, Any]:
    engine = service.engine
    assert engine is not None
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


async def _answer(request: web.Request, service: InferenceService, body: Any) -> web.Response:
    if not service.ready or service.engine is None:
        return web.json_response({"error": {"message": "the model is still loading", "type": "draining",
                                            "param": None, "code": "draining"}}, status=503,
                                 headers={"Retry-After": str(service.settings.retry_after_s)})
    try:
        raw = await request.read()
        return web.json_response(body(parse_json_object(raw), service))
    except BadRequest as exc:
        return web.json_response(exc.body(), status=exc.status)
