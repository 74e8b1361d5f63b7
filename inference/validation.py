"""Parsing and checking of request bodies (OpenAI's completions and chat shapes); every error names the field."""

from __future__ import annotations

import json
from dataclasses import dataclass, replace
from typing import Any

from gpu_watchdog.inference.engine_api import SamplingParams

# Fields of OpenAI's request schemas that change nothing at these values: clients and
# frameworks send them routinely, so they are accepted; any other value is refused by name.
_NEUTRAL: dict[str, tuple[Any, ...]] = {
    "best_of": (1, None),
    "suffix": (None, ""),
    "tools": (None,),
    "tool_choice": (None, "none"),
    "parallel_tool_calls": (None, True, False),
    "response_format": (None,),
    "store": (None, False),
    "metadata": (None,),
    "service_tier": (None, "auto", "default"),
}
# vLLM's extra sampling parameters, which open-model clients send (LangChain and LiteLLM in extra_body,
# vLLM's own benchmark client always): honoured, not merely tolerated.
EXTRA_FIELDS = frozenset({"top_k", "min_p", "repetition_penalty", "min_tokens", "ignore_eos", "stop_token_ids",
                          "skip_special_tokens", "include_stop_str_in_output"})
_COMMON = {"model", "max_tokens", "temperature", "top_p", "n", "stream", "stream_options", "stop", "seed", "user",
           *EXTRA_FIELDS}
COMPLETION_FIELDS = frozenset(_COMMON | {"prompt", "echo", "best_of", "suffix", "logprobs", "logit_bias",
                                          "presence_penalty", "frequency_penalty"})
CHAT_FIELDS = frozenset(_COMMON | {"messages", "max_completion_tokens", "logprobs", "top_logprobs", "logit_bias",
                                   "presence_penalty", "frequency_penalty", "tools", "tool_choice",
                                   "parallel_tool_calls", "response_format", "store", "metadata", "service_tier"})
ROLES = ("system", "developer", "user", "assistant", "tool")
MAX_STOPS = 4
MAX_PROMPTS = 64
MAX_N = 16
# vLLM's default --max-logprobs.
MAX_LOGPROBS = 20
MAX_STOP_TOKEN_IDS = 64
# The fields that set a chat answer's length (max_completion_tokens where both are sent).
CHAT_TOKEN_FIELDS = ("max_tokens", "max_completion_tokens")


class BadRequest(Exception):
    def __init__(self, status: int, field: str | None, message: str, code: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.field = field
        self.message = message
        self.code = code

    def body(self) -> dict[str, Any]:
        kind = "not_found_error" if self.status == 404 else "invalid_request_error"
        return {"error": {"message": self.message, "type": kind, "param": self.field, "code": self.code}}


@dataclass(frozen=True)
class Limits:
    default_max_tokens: int
    max_tokens_limit: int
    model_name: str


@dataclass(frozen=True)
class Output:
    """How the answer's text is made from its tokens (vLLM's names); the defaults change nothing."""

    ignore_eos: bool = False
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False


@dataclass(frozen=True)
class Sampling:
    """What every generation route shares. `max_tokens` None: as many as the context leaves (chat).

    `logprobs`: alternatives per token (None: no log-probabilities); `echo`: the prompt, and with
    `logprobs` its log-probabilities, come back before the answer (completions only).
    """

    max_tokens: int | None
    # The sampler's parameters, the one shape they have from here to the decode loop: temperature,
    # top-p and the seed, vLLM's extras (top-k, min-p, min_tokens, stop token ids), OpenAI's
    # penalties and bias.
    params: SamplingParams
    stop: tuple[str, ...]
    stream: bool
    include_usage: bool
    user: str | None
    model: str
    n: int = 1
    output: Output = Output()
    logprobs: int | None = None
    echo: bool = False


@dataclass(frozen=True)
class CompletionParams:
    prompts: tuple[str | tuple[int, ...], ...]
    sampling: Sampling


@dataclass(frozen=True)
class Message:
    role: str
    content: str


@dataclass(frozen=True)
class ChatParams:
    messages: tuple[Message, ...]
    sampling: Sampling


def parse_json_object(raw: bytes) -> dict[str, Any]:
    if not raw:
        raise BadRequest(400, "body", "request body is empty; expected a JSON object")
    try:
        data = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise BadRequest(400, "body", f"malformed JSON: {exc}") from None
    if not isinstance(data, dict):
        raise BadRequest(400, "body", "expected a JSON object")
    return data


def _text(value: str, where: str) -> str:
    """JSON may carry lone surrogates (\\ud800); no tokenizer can encode them."""
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        raise BadRequest(400, where, f"{where} is not valid Unicode (a lone surrogate)") from None
    return value


def _is_int(v: object) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_number(v: object) -> bool:
    return isinstance(v, int | float) and not isinstance(v, bool)


def _check_fields(data: dict[str, Any], allowed: frozenset[str]) -> None:
    for name, value in data.items():
        if name not in allowed:
            raise BadRequest(400, name, f"{name}: not a supported field")
        if name in _NEUTRAL and not _neutral(name, value):
            raise BadRequest(400, name, f"{name}: not supported (only {_NEUTRAL[name][0]!r} or absent)")


def neutral(name: str, value: object) -> bool:
    """Whether `value` of OpenAI's field `name` is one that changes nothing (see `_NEUTRAL`)."""
    return name in _NEUTRAL and _neutral(name, value)


def _neutral(name: str, value: object) -> bool:
    if value in ({}, []) or (name == "response_format" and value == {"type": "text"}):
        return True
    return any(value == v and type(value) is type(v) for v in _NEUTRAL[name]) or (
        value is not None and _is_number(value) and any(_is_number(v) and value == v for v in _NEUTRAL[name]))


def _max_tokens(data: dict[str, Any], name: str, default: int | None, limit: int) -> int | None:
    value = data.get(name)
    if value is None:
        return default
    if not _is_int(value):
        raise BadRequest(400, name, f"{name} must be an integer")
    if not 1 <= value <= limit:
        raise BadRequest(400, name, f"{name} must be between 1 and {limit}")
    return int(value)


def sampling(data: dict[str, Any], limits: Limits, *, default_max_tokens: int | None,
             token_fields: tuple[str, ...] = ("max_tokens",), allow_stream: bool = True,
             vocab_size: int | None = None) -> Sampling:
    model = data.get("model")
    if model is not None and not isinstance(model, str):
        raise BadRequest(400, "model", "model must be a string")
    if model is not None and model != limits.model_name:
        raise BadRequest(404, "model", f"The model `{model}` does not exist; this server serves"
                         f" `{limits.model_name}` (GET /v1/models)", code="model_not_found")
    max_tokens = default_max_tokens
    for name in token_fields:
        if data.get(name) is not None:
            max_tokens = _max_tokens(data, name, default_max_tokens, limits.max_tokens_limit)
    temperature = data.get("temperature")
    if temperature is None:
        temperature = 0.0  # greedy unless asked: answers a client can reproduce
    if not _is_number(temperature):
        raise BadRequest(400, "temperature", "temperature must be a number")
    if not 0.0 <= float(temperature) <= 2.0:
        raise BadRequest(400, "temperature", "temperature must be between 0 and 2")
    top_p = data.get("top_p")
    top_p = 1.0 if top_p is None else top_p
    if not _is_number(top_p) or not 0.0 < float(top_p) <= 1.0:
        raise BadRequest(400, "top_p", "top_p must be a number in (0, 1]")
    seed = data.get("seed")
    if seed is not None and (not _is_int(seed) or not -(2**63) <= seed < 2**64):
        raise BadRequest(400, "seed", "seed must be an integer")
    stop = data.get("stop")
    if stop is None:
        stops: tuple[str, ...] = ()
    elif isinstance(stop, str):
        stops = (stop,)
    elif isinstance(stop, list) and all(isinstance(s, str) for s in stop):
        stops = tuple(stop)
    else:
        raise BadRequest(400, "stop", "stop must be a string or a list of strings")
    if len(stops) > MAX_STOPS:
        raise BadRequest(400, "stop", f"stop takes at most {MAX_STOPS} strings")
    if any(not s for s in stops):
        raise BadRequest(400, "stop", "stop strings must not be empty")
    for s in stops:
        _text(s, "stop")
    stream = data.get("stream", False)
    if stream is None:
        stream = False
    if not isinstance(stream, bool):
        raise BadRequest(400, "stream", "stream must be a boolean")
    if stream and not allow_stream:
        raise BadRequest(400, "stream", "this route does not stream; use /stream")
    options = data.get("stream_options")
    include_usage = False
    if options is not None:
        if not stream:
            raise BadRequest(400, "stream_options", "stream_options is only allowed with stream: true")
        if not isinstance(options, dict) or set(options) - {"include_usage", "continuous_usage_stats"}:
            raise BadRequest(400, "stream_options", "stream_options takes include_usage (a boolean)")
        include_usage = options.get("include_usage", False)
        if not isinstance(include_usage, bool):
            raise BadRequest(400, "stream_options.include_usage", "include_usage must be a boolean")
    user = data.get("user")
    if user is not None and not isinstance(user, str):
        raise BadRequest(400, "user", "user must be a string")
    seed_value = None if seed is None else int(seed) % (2**63)
    n = data.get("n")
    if n is not None and (not _is_int(n) or not 1 <= n <= MAX_N):
        raise BadRequest(400, "n", f"n must be an integer between 1 and {MAX_N}")
    params, output = _extras(data, vocab_size, max_tokens, float(temperature), float(top_p), seed_value)
    return Sampling(max_tokens, params, stops, stream, include_usage, user, model or limits.model_name,
                    1 if n is None else int(n), output)


def _number(data: dict[str, Any], name: str, default: float, low: float, high: float, *,
            open_low: bool = False) -> float:
    value = data.get(name)
    if value is None:
        return default
    if not _is_number(value) or not (low < value if open_low else low <= value) or not value <= high:
        where = f"({low:g}, {high:g}]" if open_low else f"[{low:g}, {high:g}]"
        raise BadRequest(400, name, f"{name} must be a number in {where}")
    return float(value)


def _flag(data: dict[str, Any], name: str, default: bool) -> bool:
    value = data.get(name)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise BadRequest(400, name, f"{name} must be a boolean")
    return value


def _token_id(value: object, where: str, vocab_size: int | None) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value < 0 or (
            vocab_size is not None and value >= vocab_size):
        bound = "" if vocab_size is None else f" (0..{vocab_size - 1})"
        raise BadRequest(400, where, f"{where} must be a token id in the vocabulary{bound}")
    return value


def _extras(data: dict[str, Any], vocab_size: int | None, max_tokens: int | None, temperature: float, top_p: float,
            seed: int | None) -> tuple[SamplingParams, Output]:
    top_k = data.get("top_k")
    if top_k is None:
        top_k = 0
    # vLLM's convention: 0 and -1 both mean every token.
    if not _is_int(top_k) or top_k < -1:
        raise BadRequest(400, "top_k", "top_k must be an integer: -1 or 0 (off), or at least 1")
    min_p = _number(data, "min_p", 0.0, 0.0, 1.0)
    repetition = _number(data, "repetition_penalty", 1.0, 0.0, 2.0, open_low=True)
    presence = _number(data, "presence_penalty", 0.0, -2.0, 2.0)
    frequency = _number(data, "frequency_penalty", 0.0, -2.0, 2.0)
    min_tokens = data.get("min_tokens")
    if min_tokens is None:
        min_tokens = 0
    if not _is_int(min_tokens) or min_tokens < 0:
        raise BadRequest(400, "min_tokens", "min_tokens must be a non-negative integer")
    if max_tokens is not None and min_tokens > max_tokens:
        raise BadRequest(400, "min_tokens", f"min_tokens ({min_tokens}) exceeds max_tokens ({max_tokens})")
    raw_ids = data.get("stop_token_ids")
    if raw_ids is None:
        raw_ids = []
    if not isinstance(raw_ids, list) or len(raw_ids) > MAX_STOP_TOKEN_IDS:
        raise BadRequest(400, "stop_token_ids", f"stop_token_ids must be a list of at most {MAX_STOP_TOKEN_IDS}"
                         " token ids")
    stop_ids = tuple(_token_id(t, f"stop_token_ids[{i}]", vocab_size) for i, t in enumerate(raw_ids))
    bias = data.get("logit_bias")
    if bias is None:
        bias = {}
    if not isinstance(bias, dict) or len(bias) > 300:
        raise BadRequest(400, "logit_bias", "logit_bias must be an object of at most 300 token ids to numbers")
    biases: list[tuple[int, float]] = []
    for key, value in bias.items():
        where = f"logit_bias.{key}"
        try:
            token = int(key)
        except ValueError:
            raise BadRequest(400, where, f"{where}: keys must be token ids") from None
        _token_id(token, where, vocab_size)
        if not _is_number(value) or not -100.0 <= value <= 100.0:
            raise BadRequest(400, where, f"{where} must be a number in [-100, 100]")
        biases.append((token, float(value)))
    params = SamplingParams(temperature=temperature, top_p=top_p, seed=seed, top_k=int(top_k) if top_k > 0 else 0,
                            min_p=min_p, repetition_penalty=repetition, presence_penalty=presence,
                            frequency_penalty=frequency, logit_bias=tuple(biases), min_tokens=int(min_tokens),
                            stop_token_ids=stop_ids)
    return params, Output(_flag(data, "ignore_eos", False), _flag(data, "skip_special_tokens", True),
                          _flag(data, "include_stop_str_in_output", False))


def _logprobs_k(value: object, name: str) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or not 0 <= value <= MAX_LOGPROBS:
        raise BadRequest(400, name, f"{name} must be an integer between 0 and {MAX_LOGPROBS}")
    return value


def completion_logprobs(data: dict[str, Any]) -> tuple[int | None, bool]:
    """A completions body's `logprobs` (alternatives per token; None: no log-probabilities) and `echo`."""
    logprobs = data.get("logprobs")
    return None if logprobs is None else _logprobs_k(logprobs, "logprobs"), _flag(data, "echo", False)


def completion_params(data: dict[str, Any], limits: Limits, *, vocab_size: int, allow_stream: bool = True,
                      strict: bool = True) -> CompletionParams:
    """`strict`: OpenAI's route refuses fields it does not know; the plain routes take what they use."""
    if strict:
        _check_fields(data, COMPLETION_FIELDS)
    prompt = data.get("prompt")
    if prompt is None:
        raise BadRequest(400, "prompt", "prompt is required")
    prompts = _prompts(prompt, vocab_size)
    if not strict and len(prompts) != 1:
        raise BadRequest(400, "prompt", "prompt must be a string")
    params = sampling(data, limits, default_max_tokens=limits.default_max_tokens, allow_stream=allow_stream,
                      vocab_size=vocab_size)
    if not strict:
        return CompletionParams(prompts, replace(params, n=1))
    k, echo = completion_logprobs(data)
    if len(prompts) * params.n > MAX_PROMPTS:
        raise BadRequest(400, "n", f"prompts x n must be at most {MAX_PROMPTS}")
    return CompletionParams(prompts, replace(params, logprobs=k, echo=echo))


def _prompts(prompt: object, vocab_size: int) -> tuple[str | tuple[int, ...], ...]:
    if isinstance(prompt, str):
        items: list[object] = [prompt]
    elif isinstance(prompt, list) and prompt and all(_is_int(t) for t in prompt):
        items = [prompt]
    elif isinstance(prompt, list):
        items = list(prompt)
    else:
        raise BadRequest(400, "prompt", "prompt must be a string, a list of strings, or token ids")
    if not items:
        raise BadRequest(400, "prompt", "prompt must not be empty")
    if len(items) > MAX_PROMPTS:
        raise BadRequest(400, "prompt", f"at most {MAX_PROMPTS} prompts per request")
    out: list[str | tuple[int, ...]] = []
    for i, item in enumerate(items):
        where = "prompt" if len(items) == 1 else f"prompt[{i}]"
        if isinstance(item, str):
            if not item:
                raise BadRequest(400, where, f"{where} must not be empty")
            out.append(_text(item, where))
        elif isinstance(item, list) and item and all(_is_int(t) for t in item):
            bad = [t for t in item if not 0 <= t < vocab_size]
            if bad:
                raise BadRequest(400, where,
                                 f"{where}: token id {bad[0]} is outside the vocabulary (0..{vocab_size - 1})")
            out.append(tuple(int(t) for t in item))
        else:
            raise BadRequest(400, where, f"{where} must be a non-empty string or a non-empty list of token ids")
    return tuple(out)


def chat_params(data: dict[str, Any], limits: Limits, *, vocab_size: int | None = None) -> ChatParams:
    _check_fields(data, CHAT_FIELDS)
    messages = chat_messages(data.get("messages"))
    params = sampling(data, limits, default_max_tokens=None, token_fields=CHAT_TOKEN_FIELDS, vocab_size=vocab_size)
    return ChatParams(messages, replace(params, logprobs=chat_top_logprobs(data)))


def chat_messages(raw: object) -> tuple[Message, ...]:
    """A chat body's `messages`: each one's role and its content's text (what the chat template sees)."""
    if not isinstance(raw, list) or not raw:
        raise BadRequest(400, "messages", "messages must be a non-empty list")
    messages: list[Message] = []
    for i, m in enumerate(raw):
        where = f"messages[{i}]"
        if not isinstance(m, dict):
            raise BadRequest(400, where, f"{where} must be an object with role and content")
        role = m.get("role")
        if role not in ROLES:
            raise BadRequest(400, f"{where}.role", f"{where}.role must be one of {', '.join(ROLES)}")
        extra = set(m) - {"role", "content", "name", "tool_call_id", "tool_calls", "refusal"}
        if extra:
            raise BadRequest(400, f"{where}.{sorted(extra)[0]}", f"{where}.{sorted(extra)[0]}: not supported")
        for key in ("name", "tool_call_id", "refusal"):
            if m.get(key) is not None and not isinstance(m[key], str):
                raise BadRequest(400, f"{where}.{key}", f"{where}.{key} must be a string")
        if m.get("tool_calls") not in (None, []):
            raise BadRequest(400, f"{where}.tool_calls", f"{where}.tool_calls: tools are not supported")
        messages.append(Message(str(role), _content(m.get("content"), where)))
    return tuple(messages)


def chat_top_logprobs(data: dict[str, Any]) -> int | None:
    """A chat body's alternatives per token (`logprobs` and `top_logprobs`); None: no log-probabilities."""
    wanted = _flag(data, "logprobs", False)
    top = data.get("top_logprobs")
    if top is not None:
        top = _logprobs_k(top, "top_logprobs")
        if top and not wanted:
            raise BadRequest(400, "top_logprobs", "top_logprobs needs logprobs: true")
    return int(top or 0) if wanted else None


def _content(content: object, where: str) -> str:
    if isinstance(content, str):
        return _text(content, f"{where}.content")
    if content is None:
        return ""
    if isinstance(content, list):
        parts: list[str] = []
        for j, part in enumerate(content):
            if (not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str)
                    or set(part) != {"type", "text"}):
                raise BadRequest(400, f"{where}.content[{j}]",
                                 f"{where}.content[{j}]: only text parts ({{\"type\": \"text\", \"text\": ...}})"
                                 " are supported")
            parts.append(_text(part["text"], f"{where}.content[{j}].text"))
        return "".join(parts)
    raise BadRequest(400, f"{where}.content", f"{where}.content must be a string or a list of text parts")


def check_context(prompt_tokens: int, max_tokens: int, context_len: int, field: str = "prompt") -> None:
    if prompt_tokens >= context_len:
        raise BadRequest(
            413, field, f"{field} is {prompt_tokens} tokens; the model's context is {context_len} tokens"
        )
    if prompt_tokens + max_tokens > context_len:
        raise BadRequest(
            400,
            "max_tokens",
            f"prompt ({prompt_tokens} tokens) + max_tokens ({max_tokens}) exceeds the model's context"
            f" of {context_len} tokens",
        )
