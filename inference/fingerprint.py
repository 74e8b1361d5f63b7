"""Request fingerprints: a keyed hash of what determines a request's computation, never its text.

The same request sent to any replica of a workload gets the same fingerprint (the key is the
workload's), so a request that kills engines can be recognised and refused fleet-wide; the keyed
hash cannot be reversed into the prompt, nor guessed for a prompt without the key.

OpenAI's shapes (a body with `prompt`, `messages` or `input`) are fingerprinted over the work as
the server reads it, so one computation has one fingerprint however it is spelt:

- the prompt, messages or input: a lone string or token list is a list of one; a message is its
  role and its content's text (the parts joined, `name` left out);
- every parameter that changes the work, read by the server's own parsing (`validation`): the
  length, `n`, `stop`, log-probabilities and `echo`, and the sampler's parameters (temperature,
  top-p, top-k, min-p, the seed, the penalties, `logit_bias`, `min_tokens`, `ignore_eos`, stop
  token ids, how the text is made). A field at the value the server takes when it is absent is
  absent; values it reads alike are alike (1 and 1.0, `"x"` and `["x"]`, `[]` and null); the order
  of stop strings, stop token ids and `logit_bias` entries does not count;
- fields the bundled server does not serve but an app behind the agent may (tools,
  `response_format`, guided decoding, ...), as sent: null and OpenAI's values that change nothing
  are absent.

What does not count: `model` (a server serves one, and the key is the workload's), `user`,
`stream`, `stream_options`, request ids, `metadata`, timeouts, how embeddings are written out
(`encoding_format`, `dimensions`), and any field the server ignores. A body the server refuses
still gets a fingerprint (over its fields as sent); it never runs.

Any other body (an app's own, in the agent) counts whole but for what never changes the work.

Beside it, the input fingerprint (`input_fingerprint`): the input alone, whatever the settings and the
spelling, so that a killer sent each time with another sampler, length or spelling is still one
input. The prompt, messages or input as the server reads them: each prompt or input item's text
(token ids decoded by the model's tokenizer where the server has one), each message's content text,
in order; not the roles, not any parameter. Keyed apart from the exact fingerprint, so the two never
collide. Only OpenAI's shapes have one.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import math
from collections.abc import Callable, Mapping
from dataclasses import asdict, fields, replace
from typing import Any

from gpu_watchdog.inference.validation import (
    CHAT_TOKEN_FIELDS,
    BadRequest,
    Limits,
    Sampling,
    chat_messages,
    chat_top_logprobs,
    completion_logprobs,
    neutral,
    sampling,
)

# What the prompt is in OpenAI's shapes (completions, chat, embeddings and classify).
PROMPT_FIELDS = ("prompt", "messages", "input")
# The fields the server reads for every generation (`validation.sampling`), and each route's own
# (`completion_logprobs`, `chat_top_logprobs`); named for a body it refuses, fingerprinted over
# them as sent. A body it reads is fingerprinted over what it read.
SAMPLING_FIELDS = ("max_tokens", "n", "stop", "temperature", "top_p", "seed", "top_k", "min_p",
                   "repetition_penalty", "presence_penalty", "frequency_penalty", "logit_bias", "min_tokens",
                   "ignore_eos", "stop_token_ids", "skip_special_tokens", "include_stop_str_in_output")
COMPLETION_ONLY = ("logprobs", "echo")
CHAT_ONLY = ("max_completion_tokens", "logprobs", "top_logprobs")
# Fields taken as sent: the bundled server refuses them (or takes only values that change nothing).
AS_SENT = ("suffix", "best_of", "tools", "tool_choice", "response_format", "guided_json", "guided_regex",
           "guided_choice", "guided_grammar", "prompt_logprobs", "truncate_prompt_tokens")
# Every field of OpenAI's shapes that can change the fingerprint.
WORK_FIELDS = (*PROMPT_FIELDS, *SAMPLING_FIELDS, *COMPLETION_ONLY, *CHAT_ONLY, *AS_SENT)
# What `validation.sampling` reads that says how the answer is sent or whose it is, not the work.
_HOW_ANSWERED = frozenset({"model", "stream", "include_usage", "user"})
# Read as sets: the order they are sent in, and repeats, do not count.
_UNORDERED = ("stop", "stop_token_ids")
# Fields of an app's own body that never change the work (who asks, how it is answered).
NOT_WORK = frozenset({"user", "stream", "stream_options", "request_id", "id", "metadata", "timeout"})
LENGTH = 16  # hex digits: 64 bits, plenty for the requests in flight across a fleet in an hour
_ANY_LENGTH = 2**62  # the server's own limit refuses what is longer; this reading only needs the value


def digest(key: bytes, value: Any) -> str:
    """The keyed hash of `value` (anything JSON can write) as it is: sorted keys, no spaces."""
    # ASCII escapes: a lone surrogate a client sent is hashed, not an error.
    canonical = json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=True, default=str)
    return hmac.new(key, canonical.encode(), hashlib.sha256).hexdigest()[:LENGTH]


def fingerprint(key: bytes, body: Mapping[str, Any] | Any, tokens: list[int] | None = None) -> str:
    """`body`'s fingerprint under `key`. `tokens`: the prompt after tokenization, where the server has
    it (two spellings of one prompt that tokenize alike are one computation)."""
    work: Any
    if isinstance(body, Mapping) and any(name in body for name in PROMPT_FIELDS):
        work = work_of(body)
    elif isinstance(body, Mapping):  # an app's own JSON: all of it but what never changes the work
        work = {k: v for k, v in body.items() if k not in NOT_WORK}
    else:
        work = body  # an app's own body (the agent's default): all of it
    if tokens is not None:
        work = {**{k: v for k, v in work.items() if k not in PROMPT_FIELDS}, "tokens": tokens} \
            if isinstance(work, dict) else {"body": work, "tokens": tokens}
    return digest(key, work)


def input_fingerprint(key: bytes, body: Any, decode: Callable[[list[int]], str] | None = None) -> str | None:
    """`body`'s input fingerprint under `key` (see the module); None for a body that is not one of
    OpenAI's shapes (an app's own: its exact fingerprint stands for its input). `decode`: the model's
    tokenizer, so a prompt sent as token ids is the text it reads as."""
    if not isinstance(body, Mapping) or not any(name in body for name in PROMPT_FIELDS):
        return None
    texts: list[Any] = []
    for name in PROMPT_FIELDS:
        if name not in body:
            continue
        value = body[name]
        if name == "messages":
            try:
                texts += [m.content for m in chat_messages(value)]
            except BadRequest:
                texts.append(_plain(value))  # refused: it never runs, as sent will do
        elif isinstance(items := _items(value), list):
            texts += [_text(item, decode) for item in items]
        else:
            texts.append(_plain(value))
    return digest(key + INPUT_KEY, texts)


# Keys the input fingerprint apart from the exact one (a body could otherwise spell the other's work).
INPUT_KEY = b"/input"


def _text(item: Any, decode: Callable[[list[int]], str] | None) -> Any:
    """One prompt or input item as text: token ids decoded where they can be (with the special tokens
    left out, as the text they came from has none); anything else as sent."""
    if decode is not None and _token_ids(item):
        try:
            return decode(item)
        except Exception:  # ids the tokenizer cannot read: the server refuses them, as sent will do
            return _plain(item)
    return _plain(item)


def _token_ids(item: Any) -> bool:
    return isinstance(item, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in item)


def work_of(body: Mapping[str, Any]) -> dict[str, Any]:
    """What an OpenAI-shaped body asks the engine to compute, one spelling for each computation."""
    data = dict(body)
    chat = "messages" in data
    work: dict[str, Any] = {}
    for name in PROMPT_FIELDS:
        if name in data:
            work[name] = _messages(data[name]) if name == "messages" else _items(data[name])
    work.update(_as_read(data, chat))
    for name in AS_SENT:
        value = data.get(name)
        if value is not None and not neutral(name, value):
            work[name] = _plain(value)
    return work


def _items(value: Any) -> Any:
    """A prompt or input as the list of its items: a lone string or a lone list of token ids is one
    (the server reads a list whose items are token ids as one prompt; any other mix it refuses)."""
    if isinstance(value, str) or (isinstance(value, list) and value and isinstance(value[0], int)
                                  and not isinstance(value[0], bool)):
        return [value]
    return value


def _messages(value: Any) -> Any:
    try:
        return [[m.role, m.content] for m in chat_messages(value)]
    except BadRequest:
        return value  # refused: as sent


def _read(data: dict[str, Any], chat: bool) -> Sampling:
    """The server's reading of the body's parameters: `validation`'s own, without its limits (the model
    is the one the body names, any length), which are checked where the request is served."""
    model = data.get("model")
    limits = Limits(_ANY_LENGTH, _ANY_LENGTH, model if isinstance(model, str) else "")
    if chat:
        read = sampling(data, limits, default_max_tokens=None, token_fields=CHAT_TOKEN_FIELDS)
        return replace(read, logprobs=chat_top_logprobs(data))
    logprobs, echo = completion_logprobs(data)
    return replace(sampling(data, limits, default_max_tokens=None), logprobs=logprobs, echo=echo)


def _flat(read: Sampling) -> dict[str, Any]:
    """A reading's fields that change the work, the sampler's and the text's among them."""
    out: dict[str, Any] = {}
    for f in fields(read):
        value = getattr(read, f.name)
        if f.name in _HOW_ANSWERED:
            continue
        if f.name in ("params", "output"):
            out.update(asdict(value))
        else:
            out[f.name] = value
    for name in _UNORDERED:
        out[name] = sorted(set(out[name]))
    out["logit_bias"] = sorted(out["logit_bias"])  # added up: a repeated token counts twice
    return {k: _plain(v) for k, v in out.items()}


def _as_read(data: dict[str, Any], chat: bool) -> dict[str, Any]:
    """The parameters that change the work, at their values as the server reads them, less those at
    the value the server takes when they are absent."""
    try:
        read = _flat(_read(data, chat))
    except BadRequest:  # refused: it never runs, so as sent will do
        names = (*SAMPLING_FIELDS, *(CHAT_ONLY if chat else COMPLETION_ONLY))
        return {name: _plain(data[name]) for name in names if data.get(name) is not None}
    absent = _ABSENT[chat]
    return {k: v for k, v in read.items() if v != absent[k]}


def _plain(value: Any) -> Any:
    """One spelling of a number: 1.0 is 1, -0.0 is 0 (in lists and objects too)."""
    if isinstance(value, float) and math.isfinite(value) and value == int(value) and abs(value) < 2**53:
        return int(value)
    if isinstance(value, list | tuple):
        return [_plain(v) for v in value]
    if isinstance(value, Mapping):
        return {k: _plain(v) for k, v in value.items()}
    return value


# What the server takes for a body that sends none of the parameters: its own defaults.
_ABSENT = {chat: _flat(_read({}, chat)) for chat in (False, True)}
