"""OpenAPI 3.0 descriptions of the public and control APIs, built from the running settings.

Served at `GET /openapi.json` (public) and `GET /control/openapi.json` (control, with the token),
and used by the property-based API fuzzer in the tests.
"""

from __future__ import annotations

from typing import Any

from gpu_watchdog.contract import (
    DRAIN_DEADLINE_DEFAULT_S,
    DRAIN_DEADLINE_MAX_S,
    PROBE_PROMPT_MAX,
    PROBE_TOKENS_MAX,
    PROBE_TOP_MAX,
    MemoryReport,
    record_schema,
)
from gpu_watchdog.contract import VERSION as __version__
from gpu_watchdog.inference.capabilities import CLASSIFY, EMBED, GENERATE, PREDICT

ERROR = {
    "type": "object",
    "required": ["error"],
    "properties": {"error": {"type": "object", "required": ["message"], "properties": {
        "message": {"type": "string"}, "type": {"type": "string"}, "param": {"type": "string", "nullable": True}}}},
}


def _json(schema: dict[str, Any], description: str) -> dict[str, Any]:
    return {"description": description, "content": {"application/json": {"schema": schema}}}


def _body(schema: dict[str, Any], required: bool = True) -> dict[str, Any]:
    return {"required": required, "content": {"application/json": {"schema": schema}}}


def _json_or_sse(schema: dict[str, Any], what: str) -> dict[str, Any]:
    """A generation route's 200: one JSON answer, or server-sent events when the request streams."""
    return {"description": f"{what}, or an SSE stream when stream is true. "
                           "Each event: a JSON chunk, an error object, or [DONE].",
            "content": {"application/json": {"schema": schema}, "text/event-stream": {"schema": {}}}}


def _errors(*codes: int) -> dict[str, Any]:
    words = {400: "invalid input (the error names the field)", 401: "missing or wrong bearer token",
             404: "not available", 408: "body not received in time", 413: "body or prompt too large",
             500: "GPU context lost; the process exits", 503: "overloaded, draining or out of memory; retry later"}
    out: dict[str, Any] = {}
    for code in codes:
        out[str(code)] = _json(ERROR, words[code])
        if code == 503:
            out[str(code)]["headers"] = {"Retry-After": {"schema": {"type": "string"}}}
    return out


_LOGPROBS = {"type": "object", "nullable": True}


def _extras() -> dict[str, Any]:
    """vLLM's extra sampling parameters and OpenAI's penalties, on both generation routes."""
    flag = {"type": "boolean", "nullable": True}
    return {
        "top_k": {"type": "integer", "minimum": -1, "nullable": True, "description": "-1 or 0: off"},
        "min_p": {"type": "number", "minimum": 0, "maximum": 1, "nullable": True},
        "repetition_penalty": {"type": "number", "minimum": 0, "exclusiveMinimum": True, "maximum": 2,
                               "nullable": True},
        "presence_penalty": {"type": "number", "minimum": -2, "maximum": 2, "nullable": True},
        "frequency_penalty": {"type": "number", "minimum": -2, "maximum": 2, "nullable": True},
        "min_tokens": {"type": "integer", "minimum": 0, "nullable": True, "description": "at most max_tokens"},
        "ignore_eos": flag,
        "stop_token_ids": {"type": "array", "maxItems": 64, "items": {"type": "integer", "minimum": 0},
                           "nullable": True},
        "skip_special_tokens": flag,
        "include_stop_str_in_output": flag,
        "logit_bias": {"type": "object", "nullable": True, "maxProperties": 300,
                       "additionalProperties": {"type": "number", "minimum": -100, "maximum": 100},
                       "description": "token id (as a string) to a bias added to its logit"},
    }


def _handler_paths(model: dict[str, Any], capabilities: frozenset[str], max_inputs: int) -> dict[str, Any]:
    """The routes of a request-level handler: what it can do decides what it serves."""
    fails = _errors(400, 404, 408, 413, 500, 503)
    ids = {"type": "array", "minItems": 1, "items": {"type": "integer", "minimum": 0}}
    inputs = {"oneOf": [
        {"type": "string", "minLength": 1},
        {"type": "array", "minItems": 1, "maxItems": max_inputs, "items": {"type": "string", "minLength": 1}},
        ids,
        {"type": "array", "minItems": 1, "maxItems": max_inputs, "items": ids},
    ], "description": "a text, texts, token ids, or lists of token ids (LangChain sends token ids)"}
    usage = {"type": "object", "properties": {"prompt_tokens": {"type": "integer"},
                                              "total_tokens": {"type": "integer"}}}
    paths: dict[str, Any] = {}
    if EMBED in capabilities:
        paths["/v1/embeddings"] = {"post": {
            "operationId": "embeddings",
            "requestBody": {"required": True, "content": {"application/json": {"schema": {
                "type": "object", "required": ["input"], "additionalProperties": False, "properties": {
                    "input": inputs, "model": model,
                    "encoding_format": {"type": "string", "enum": ["float", "base64"], "nullable": True,
                                        "description": "base64: little-endian float32, as the OpenAI SDK asks"},
                    "dimensions": {"type": "integer", "minimum": 1, "nullable": True,
                                   "description": "the model's own, or one of its Matryoshka dimensions"},
                    "user": {"type": "string", "nullable": True}}}}}},
            "responses": {"200": _json({"type": "object", "required": ["object", "data", "model", "usage"],
                                        "properties": {
                "object": {"type": "string"}, "model": {"type": "string"}, "usage": usage,
                "data": {"type": "array", "items": {"type": "object", "required": ["object", "index", "embedding"],
                                                    "properties": {
                    "object": {"type": "string"}, "index": {"type": "integer"},
                    "embedding": {"oneOf": [{"type": "array", "items": {"type": "number"}},
                                            {"type": "string"}]}}}}}},
                "one vector per input, in order"), **fails}}}
    if CLASSIFY in capabilities:
        route = {"post": {
            "requestBody": {"required": True, "content": {"application/json": {"schema": {
                "type": "object", "required": ["input"], "additionalProperties": False, "properties": {
                    "input": inputs, "model": model, "user": {"type": "string", "nullable": True},
                    "use_activation": {"type": "boolean", "enum": [True], "nullable": True,
                                       "description": "probabilities; raw logits are not served"}}}}}},
            "responses": {"200": _json({"type": "object", "required": ["object", "data", "model", "usage"],
                                        "properties": {
                "id": {"type": "string"}, "object": {"type": "string"}, "created": {"type": "integer"},
                "model": {"type": "string"}, "usage": {"type": "object"},
                "data": {"type": "array", "items": {"type": "object", "properties": {
                    "index": {"type": "integer"}, "label": {"type": "string"}, "num_classes": {"type": "integer"},
                    "probs": {"type": "array", "items": {"type": "number"}}}}}}},
                "a label and the probabilities per input (vLLM's shape)"), **fails}}}
        paths["/v1/classify"] = {"post": {**route["post"], "operationId": "classify"}}
        paths["/classify"] = {"post": {**route["post"], "operationId": "classify_unversioned"}}
    if PREDICT in capabilities:
        paths["/predict"] = {"post": {
            "operationId": "predict",
            "requestBody": {"required": True, "content": {"application/json": {"schema": {
                "type": "object", "description": "the body the handler's own decode reads"}}}},
            "responses": {"200": _json({"type": "object", "required": ["outputs"], "properties": {
                "outputs": {"type": "array", "items": {}}}}, "the handler's encoded outputs, in order"), **fails}}}
    return paths


def public_spec(max_tokens_limit: int, context_len: int, model_name: str,
                capabilities: frozenset[str] = frozenset({GENERATE}), max_inputs: int = 2048) -> dict[str, Any]:
    """The public API of the running handler; `capabilities` as the handler declares them."""
    max_tokens = {"type": "integer", "minimum": 1, "maximum": max_tokens_limit, "nullable": True}
    common: dict[str, Any] = {
        "model": {"type": "string", "nullable": True,
                  "description": f"`{model_name}` or absent; any other id is answered with 404"},
        "max_tokens": max_tokens,
        "temperature": {"type": "number", "minimum": 0, "maximum": 2, "nullable": True},
        "top_p": {"type": "number", "minimum": 0, "exclusiveMinimum": True, "maximum": 1, "nullable": True},
        "n": {"type": "integer", "minimum": 1, "maximum": 16, "nullable": True,
              "description": "choices per prompt, generated side by side; prompts x n at most 64"},
        "seed": {"type": "integer", "nullable": True},
        "stop": {"oneOf": [{"type": "string", "minLength": 1},
                           {"type": "array", "maxItems": 4, "items": {"type": "string", "minLength": 1}}],
                 "nullable": True},
        "user": {"type": "string", "nullable": True},
        "stream": {"type": "boolean", "nullable": True},
        **_extras(),
    }
    token_ids = {"type": "array", "minItems": 1, "items": {"type": "integer", "minimum": 0}}
    request: dict[str, Any] = {
        "type": "object",
        "required": ["prompt"],
        "additionalProperties": False,
        "properties": {
            "prompt": {"oneOf": [
                {"type": "string", "minLength": 1},
                {"type": "array", "minItems": 1, "maxItems": 64, "items": {"type": "string", "minLength": 1}},
                token_ids,
                {"type": "array", "minItems": 1, "maxItems": 64, "items": token_ids},
            ]},
            **common,
            "logprobs": {"type": "integer", "minimum": 0, "maximum": 20, "nullable": True,
                         "description": "log-probability of each token and of the k most likely alternatives"},
            "echo": {"type": "boolean", "nullable": True,
                     "description": "the prompt comes back before the answer; with logprobs, scored"},
        },
    }
    message = {"type": "object", "required": ["role"], "additionalProperties": False, "properties": {
        "role": {"type": "string", "enum": ["system", "developer", "user", "assistant", "tool"]},
        "content": {"oneOf": [{"type": "string"}, {"type": "array", "items": {
            "type": "object", "required": ["type", "text"], "additionalProperties": False,
            "properties": {"type": {"type": "string", "enum": ["text"]}, "text": {"type": "string"}}}}],
                    "nullable": True},
        "name": {"type": "string", "nullable": True}, "tool_call_id": {"type": "string", "nullable": True},
        "refusal": {"type": "string", "nullable": True},
        "tool_calls": {"type": "array", "maxItems": 0, "items": {}, "nullable": True}}}
    chat_request: dict[str, Any] = {
        "type": "object",
        "required": ["messages"],
        "additionalProperties": False,
        "properties": {"messages": {"type": "array", "minItems": 1, "items": message},
                       "max_completion_tokens": max_tokens, **common,
                       "logprobs": {"type": "boolean", "nullable": True},
                       "top_logprobs": {"type": "integer", "minimum": 0, "maximum": 20, "nullable": True,
                                        "description": "alternatives per token; needs logprobs: true"}},
    }
    plain_request = {"type": "object", "required": ["prompt"], "properties": {
        "prompt": {"type": "string", "minLength": 1}, "max_tokens": max_tokens,
        "temperature": common["temperature"]}}
    usage = {"type": "object", "properties": {"prompt_tokens": {"type": "integer"},
                                              "completion_tokens": {"type": "integer"},
                                              "total_tokens": {"type": "integer"},
                                              "prompt_tokens_details": {"type": "object", "properties": {
                                                  "cached_tokens": {"type": "integer"}}}}}
    completion = {"type": "object", "required": ["id", "object", "choices", "usage"], "properties": {
        "id": {"type": "string"}, "object": {"type": "string"}, "created": {"type": "integer"},
        "model": {"type": "string"},
        "choices": {"type": "array", "items": {"type": "object", "properties": {
            "text": {"type": "string"}, "index": {"type": "integer"}, "logprobs": _LOGPROBS,
            "finish_reason": {"type": "string", "nullable": True}}}},
        "usage": usage}}
    chat_completion = {"type": "object", "required": ["id", "object", "choices", "usage"], "properties": {
        "id": {"type": "string"}, "object": {"type": "string"}, "created": {"type": "integer"},
        "model": {"type": "string"},
        "choices": {"type": "array", "items": {"type": "object", "properties": {
            "index": {"type": "integer"},
            "message": {"type": "object", "properties": {"role": {"type": "string"},
                                                         "content": {"type": "string"}}},
            "logprobs": _LOGPROBS, "finish_reason": {"type": "string", "nullable": True}}}},
        "usage": usage}}
    model_card = {"type": "object", "required": ["id", "object"], "properties": {
        "id": {"type": "string"}, "object": {"type": "string"}, "created": {"type": "integer"},
        "owned_by": {"type": "string"}, "max_model_len": {"type": "integer"}}}
    probe = {"type": "object"}
    fails = (400, 404, 408, 413, 500, 503)
    generation: dict[str, Any] = {
        "/v1/completions": {"post": {
            "operationId": "completions",
            "requestBody": _body(request),
            "responses": {"200": _json_or_sse(completion, "a completion"), **_errors(*fails)}}},
        "/v1/chat/completions": {"post": {
            "operationId": "chat_completions",
            "requestBody": _body(chat_request),
            "responses": {"200": _json_or_sse(chat_completion, "a chat completion"), **_errors(*fails)}}},
        "/predict": {"post": {
            "operationId": "predict",
            "requestBody": _body(plain_request),
            "responses": {"200": _json({"type": "object", "required": ["result"], "properties": {
                "result": {"type": "string"}, "completion_tokens": {"type": "integer"}}}, "the generated text"),
                **_errors(*fails)}}},
        "/stream": {"post": {
            "operationId": "stream",
            "requestBody": _body(plain_request),
            "responses": {"200": {"description": "the generated text, streamed",
                                  "content": {"text/plain": {"schema": {"type": "string"}}}},
                          **_errors(*fails)}}},
        "/tokenize": {"post": {
            "operationId": "tokenize",
            "requestBody": {"required": True, "content": {"application/json": {"schema": {
                "type": "object", "additionalProperties": False, "properties": {
                    "model": common["model"], "prompt": {"type": "string"},
                    "messages": {"type": "array", "minItems": 1, "items": message},
                    "add_special_tokens": {"type": "boolean", "nullable": True},
                    "add_generation_prompt": {"type": "boolean", "nullable": True},
                    "return_token_strs": {"type": "boolean", "nullable": True}}}}}},
            "responses": {"200": _json({"type": "object", "required": ["count", "max_model_len", "tokens"],
                                        "properties": {"count": {"type": "integer"},
                                                       "max_model_len": {"type": "integer"},
                                                       "tokens": {"type": "array", "items": {"type": "integer"}},
                                                       "token_strs": {"type": "array", "nullable": True,
                                                                      "items": {"type": "string"}}}},
                                       "the prompt's token ids (vLLM's shape)"), **_errors(400, 404, 413, 503)}}},
        "/detokenize": {"post": {
            "operationId": "detokenize",
            "requestBody": {"required": True, "content": {"application/json": {"schema": {
                "type": "object", "required": ["tokens"], "additionalProperties": False, "properties": {
                    "model": common["model"],
                    "tokens": {"type": "array", "items": {"type": "integer", "minimum": 0}}}}}}},
            "responses": {"200": _json({"type": "object", "required": ["prompt"],
                                        "properties": {"prompt": {"type": "string"}}}, "the text of the ids"),
                          **_errors(400, 404, 413, 503)}}},
    }
    probes: dict[str, Any] = {
        "/v1/models": {"get": {"operationId": "models", "responses": {"200": _json(
            {"type": "object", "required": ["data"], "properties": {
                "object": {"type": "string"}, "data": {"type": "array", "items": model_card}}},
            "the served model")}}},
        "/v1/models/{model}": {"get": {
            "operationId": "model",
            "parameters": [{"name": "model", "in": "path", "required": True, "schema": {"type": "string"}}],
            "responses": {"200": _json(model_card, "the served model"), **_errors(404)}}},
        "/healthz": {"get": {"operationId": "healthz", "responses": {"200": _json(probe, "the loop answers")}}},
        "/readyz": {"get": {"operationId": "readyz", "responses": {
            "200": _json(probe, "warmed up and admitting"), "503": _json(probe, "loading, draining or poisoned")}}},
        "/metrics": {"get": {"operationId": "metrics", "responses": {"200": {
            "description": "Prometheus text format", "content": {"text/plain": {"schema": {"type": "string"}}}}}}},
    }
    # Where a handler generates, /predict is generation's plain route, not the handler's own.
    own = capabilities - ({GENERATE, PREDICT} if GENERATE in capabilities else set())
    paths = {**probes, **(generation if GENERATE in capabilities else {}),
             **_handler_paths(common["model"], frozenset(own), max_inputs)}
    what = (f"its context is {context_len} tokens (prompt + max_tokens)" if GENERATE in capabilities
            else "handler routes: " + ", ".join(sorted(capabilities)))
    return {
        "openapi": "3.0.3",
        "info": {"title": "gpu-watchdog inference API", "version": __version__,
                 "description": f"Serves `{model_name}`; {what}."},
        "paths": paths,
    }


def control_spec() -> dict[str, Any]:
    timeout = {"timeout": {"type": "number", "minimum": 0.01, "maximum": 600}}
    canary_body = {"type": "object", "properties": {
        **timeout,
        "probe": {"type": "object", "required": ["prompt"], "additionalProperties": False, "properties": {
            "prompt": {"type": "string", "minLength": 1, "maxLength": PROBE_PROMPT_MAX},
            "max_tokens": {"type": "integer", "minimum": 1, "maximum": PROBE_TOKENS_MAX},
            "top_logprobs": {"type": "integer", "minimum": 1, "maximum": PROBE_TOP_MAX}},
            "description": "a correctness probe: answered greedily with each step's top log-probabilities"}}}
    obj = {"type": "object"}
    entry = {"type": "object", "required": ["fingerprint", "until"], "properties": {
        "fingerprint": {"type": "string", "pattern": "^[0-9a-f]{1,64}$"},
        "until": {"type": "number", "description": "seconds since the epoch"},
        "failures": {"type": "integer", "minimum": 0}, "pods": {"type": "array", "items": {"type": "string"}},
        "enforce": {"type": "boolean", "description": "false: shadow, served and logged as would_quarantine"}}}
    return {
        "openapi": "3.0.3",
        "info": {"title": "gpu-watchdog control API (pod-local)", "version": __version__},
        "components": {"securitySchemes": {"bearer": {"type": "http", "scheme": "bearer"}}},
        "security": [{"bearer": []}],
        "paths": {
            "/control/memory": {"get": {"operationId": "memory", "responses": {
                "200": _json(record_schema(MemoryReport), "allocator figures and process state"),
                **_errors(401, 503)}}},
            "/control/empty_cache": {"post": {"operationId": "empty_cache", "responses": {
                "200": _json({"type": "object", "required": ["freed_bytes"],
                              "properties": {"freed_bytes": {"type": "integer", "minimum": 0}}}, "bytes freed"),
                **_errors(401, 503)}}},
            "/control/canary": {"post": {
                "operationId": "canary",
                "requestBody": _body(canary_body, required=False),
                "responses": {"200": _json({"type": "object", "required": ["ok", "latency_s", "error_class"],
                                            "properties": {"ok": {"type": "boolean"},
                                                           "latency_s": {"type": "number"},
                                                           "error_class": {"type": "string", "nullable": True,
                                                                           "enum": ["oom", "fatal_cuda", "timeout",
                                                                                    "other", None]},
                                                           "draining": {"type": "boolean"},
                                                           "nonfinite": {"type": "boolean"},
                                                           "answer": {"type": "object", "properties": {
                                                               "tokens": {"type": "array",
                                                                          "items": {"type": "integer"}},
                                                               "top": {"type": "array"}}}}},
                                           "one real one-token generation (with `probe`: that prompt's greedy "
                                           "tokens and top log-probabilities in `answer`); `draining`: the "
                                           "server refuses traffic meanwhile"), **_errors(400, 401, 503)}}},
            "/control/drain": {"post": {
                "operationId": "drain",
                "requestBody": {"required": False, "content": {"application/json": {"schema": {
                    "type": "object", "properties": {
                        "timeout": {"type": "number", "minimum": 0, "maximum": 3600,
                                    "description": "seconds to wait for in-flight work (default 30)"},
                        "deadline": {"type": "number", "exclusiveMinimum": True, "minimum": 0,
                                     "maximum": DRAIN_DEADLINE_MAX_S,
                                     "description": "seconds until the server lifts the drain by itself "
                                                    f"(default {DRAIN_DEADLINE_DEFAULT_S:g})"}}}}}},
                "responses": {"200": _json(obj, "admission stopped until the deadline; in-flight work finished "
                                                "or timed out"), **_errors(400, 401, 503)}},
                "delete": {
                "operationId": "undrain",
                "responses": {"200": _json({"type": "object", "required": ["draining", "lifted"],
                                            "properties": {"draining": {"type": "boolean"},
                                                           "lifted": {"type": "boolean"}}},
                                           "the drain lifted (idempotent: `lifted` false when there was none)"),
                              "409": _json(ERROR, "shutting down: the shutdown's drain is not lifted"),
                              **_errors(401)}}},
            "/control/admission": {"post": {
                "operationId": "admission",
                "requestBody": {"required": True, "content": {"application/json": {"schema": {
                    "type": "object", "required": ["limit"],
                    "properties": {"limit": {"type": "integer", "minimum": 1, "maximum": 100000}}}}}},
                "responses": {"200": _json(obj, "new admission limit"), **_errors(400, 401, 503)}}},
            "/control/fault": {"post": {
                "operationId": "fault",
                "requestBody": {"required": True, "content": {"application/json": {"schema": {
                    "type": "object", "required": ["kind"], "properties": {"kind": {"type": "string", "enum": [
                        "context_loss", "oom", "hang", "fragmentation", "slow", "memory_cap", "clear"]},
                        "when_prompt_contains": {"type": "string", "maxLength": 1000,
                                                 "description": "context_loss, oom, hang, slow: only for requests "
                                                                "whose prompt, messages or input contain it"}}}}}},
                "responses": {"200": _json(obj, "fault injected"), **_errors(400, 401, 404)}}},
            "/control/exit": {"post": {
                "operationId": "exit",
                "requestBody": {"required": False, "content": {"application/json": {"schema": {
                    "type": "object", "properties": {
                        "reason": {"type": "string", "minLength": 1, "description": "said in the exit's log line"},
                        "instance_id": {"type": "string",
                                        "description": "only if this process is still that instance (409 if not)"}}}}}},
                "responses": {"202": _json({"type": "object", "required": ["exiting", "code"],
                                            "properties": {"exiting": {"type": "boolean"},
                                                           "code": {"type": "integer"}}},
                                           "the process exits (code 75) once this answer has left: a worker of"
                                           " several, for its server to start again"),
                              "409": _json(ERROR, "another instance: the one named is gone"), **_errors(400, 401)}}},
            "/control/stacks": {"post": {
                "operationId": "stacks",
                "requestBody": {"required": False, "content": {"application/json": {"schema": {
                    "type": "object", "properties": {
                        "reason": {"type": "string", "minLength": 1, "description": "said in the stacks' log line"
                                                                                    " and the termination log"}}}}}},
                "responses": {"200": _json(obj, "every thread's Python stack and where the process is stuck"
                                                " (`stuck`), also written to the termination log"),
                              **_errors(400, 401)}}},
            "/control/requests": {"get": {"operationId": "requests", "parameters": [{
                "name": "evidence", "in": "query", "required": False,
                "schema": {"type": "string", "enum": ["0", "1", "false", "true"]},
                "description": "1: this read takes the failure's evidence (the restart's): a poisoned process"
                               " exits once it is taken (3 s at most), not on any other read"}], "responses": {
                "200": _json(obj, "fingerprints in flight, the newest admitted, those answered lately, and those "
                                  "in flight when the context was lost (`at_failure`) or when the loop stopped "
                                  "advancing (`at_stall`)"), **_errors(400, 401)}}},
            "/control/quarantine": {
                "get": {"operationId": "quarantine", "responses": {
                    "200": _json(obj, "the fingerprints refused (422) and until when"), **_errors(401)}},
                "post": {"operationId": "quarantine_add", "requestBody": _body(entry, required=True),
                         "responses": {"200": _json(obj, "added"), **_errors(400, 401)}},
                "put": {"operationId": "quarantine_replace", "requestBody": _body(
                    {"type": "object", "required": ["entries"],
                     "properties": {"entries": {"type": "array", "items": entry}}}, required=True),
                    "responses": {"200": _json(obj, "the whole list replaced"), **_errors(400, 401)}},
                "delete": {"operationId": "quarantine_lift", "parameters": [
                    {"name": "fingerprint", "in": "query", "required": False, "schema": {"type": "string"}}],
                    "responses": {"200": _json(obj, "lifted (`lifted` false when it was not listed)"),
                                  **_errors(400, 401)}}},
        },
    }
