"""Request fingerprints: a keyed hash of what determines a request's computation, never its text.

The same request sent to any replica of a workload gets the same fingerprint (the key is the
workload's), so a request that kills engines can be recognised and refused fleet-wide; the keyed
hash cannot be reversed into the prompt, nor guessed for a prompt without the key.

What counts: the model, the prompt / messages / input, and the sampling parameters that change the
work (how many sequences, how long, with logprobs or echo, ...). What does not: the client's
identity, `user`, `stream`, the request id, temperature-like knobs that change only which tokens
are drawn.
"""

from __future__ import annotations

import hashlib
import hmac
import json
from collections.abc import Mapping
from typing import Any

# The body fields that change what the engine computes (OpenAI and vLLM's extra sampling parameters).
WORK_FIELDS = ("model", "prompt", "messages", "input", "suffix", "n", "best_of", "max_tokens",
               "max_completion_tokens", "min_tokens", "logprobs", "top_logprobs", "echo", "prompt_logprobs",
               "stop", "stop_token_ids", "ignore_eos", "tools", "tool_choice", "response_format",
               "guided_json", "guided_regex", "guided_choice", "guided_grammar", "encoding_format",
               "dimensions", "truncate_prompt_tokens", "inputs")
# Fields of a body with none of the above that never change the work (who asks, how it is answered).
NOT_WORK = frozenset({"user", "stream", "stream_options", "request_id", "id", "metadata", "temperature", "top_p",
                      "top_k", "seed", "timeout"})
LENGTH = 16  # hex digits: 64 bits, plenty for the requests in flight across a fleet in an hour


def fingerprint(key: bytes, body: Mapping[str, Any] | Any, tokens: list[int] | None = None) -> str:
    """`body`'s fingerprint under `key`. `tokens`: the prompt after tokenization, where the server has
    it (two spellings of one prompt that tokenize alike are one computation)."""
    if isinstance(body, Mapping):
        work: Any = {k: body[k] for k in WORK_FIELDS if k in body}
        if not work:  # an app's own JSON: all of it but what never changes the work
            work = {k: v for k, v in body.items() if k not in NOT_WORK}
    else:
        work = body  # an app's own body (the agent's default): all of it
    if tokens is not None:
        work = {**work, "prompt": None, "messages": None, "tokens": tokens} if isinstance(work, dict) else \
            {"body": work, "tokens": tokens}
    # ASCII escapes: a lone surrogate a client sent is hashed, not an error.
    canonical = json.dumps(work, sort_keys=True, separators=(",", ":"), ensure_ascii=True, default=str)
    return hmac.new(key, canonical.encode(), hashlib.sha256).hexdigest()[:LENGTH]
