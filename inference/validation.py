"""Parsing and checking of request bodies; every error names the field at fault."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any


class BadRequest(Exception):
    def __init__(self, status: int, field: str | None, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.field = field
        self.message = message

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": "invalid_request_error", "param": self.field}}


@dataclass(frozen=True)
class CompletionParams:
    prompt: str
    max_tokens: int
    temperature: float
    stream: bool


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


def completion_params(
    data: dict[str, Any], *, default_max_tokens: int, max_tokens_limit: int, allow_stream: bool = True
) -> CompletionParams:
    prompt = data.get("prompt")
    if prompt is None:
        raise BadRequest(400, "prompt", "prompt is required")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
        prompt = prompt[0]
    if not isinstance(prompt, str):
        raise BadRequest(400, "prompt", "prompt must be a string")
    if not prompt:
        raise BadRequest(400, "prompt", "prompt must not be empty")
    max_tokens = data.get("max_tokens", default_max_tokens)
    if isinstance(max_tokens, bool) or not isinstance(max_tokens, int):
        raise BadRequest(400, "max_tokens", "max_tokens must be an integer")
    if not 1 <= max_tokens <= max_tokens_limit:
        raise BadRequest(400, "max_tokens", f"max_tokens must be between 1 and {max_tokens_limit}")
    temperature = data.get("temperature", 0.0)
    if temperature is None:
        temperature = 0.0
    if isinstance(temperature, bool) or not isinstance(temperature, int | float):
        raise BadRequest(400, "temperature", "temperature must be a number")
    if not 0.0 <= float(temperature) <= 2.0:
        raise BadRequest(400, "temperature", "temperature must be between 0 and 2")
    stream = data.get("stream", False)
    if not isinstance(stream, bool):
        raise BadRequest(400, "stream", "stream must be a boolean")
    if stream and not allow_stream:
        raise BadRequest(400, "stream", "this route does not stream; use /stream")
    return CompletionParams(prompt=prompt, max_tokens=max_tokens, temperature=float(temperature), stream=stream)


def check_context(prompt_tokens: int, max_tokens: int, context_len: int) -> None:
    if prompt_tokens >= context_len:
        raise BadRequest(
            413, "prompt", f"prompt is {prompt_tokens} tokens; the model's context is {context_len} tokens"
        )
    if prompt_tokens + max_tokens > context_len:
        raise BadRequest(
            400,
            "max_tokens",
            f"prompt ({prompt_tokens} tokens) + max_tokens ({max_tokens}) exceeds the model's context"
            f" of {context_len} tokens",
        )
