"""The `input` field of embeddings and classify requests, checked: text, texts, token ids, lists of them.

Pure: the tokenizer is passed in as a function. Every error is a 400 naming `input` (or the item
at fault) and, where a limit is crossed, the limit.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from gpu_watchdog.inference.validation import BadRequest

# OpenAI's own bound on inputs per embeddings request.
MAX_INPUTS = 2048


@dataclass(frozen=True)
class InputLimits:
    max_inputs: int  # items in one request
    max_tokens: int  # tokens in one item: the model's positions
    vocab_size: int  # token ids accepted: 0 .. vocab_size - 1


def _is_int(v: object) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def token_items(value: object, tokenize: Callable[[list[str]], list[list[int]]], limits: InputLimits,
                field: str = "input") -> list[list[int]]:
    """One token-id list per item of `value`."""
    if value is None:
        raise BadRequest(400, field, f"{field} is required: a string, a list of strings, a list of token ids,"
                                     " or a list of such lists")
    if isinstance(value, str):
        texts: list[str] | None = [value]
        arrays: list[Sequence[Any]] = []
    elif isinstance(value, list):
        if not value:
            raise BadRequest(400, field, f"{field} must not be empty")
        if all(isinstance(v, str) for v in value):
            texts = value
        elif all(_is_int(v) for v in value):
            texts, arrays = None, [value]
        elif all(isinstance(v, list) for v in value):
            texts, arrays = None, value
        else:
            raise BadRequest(400, field, f"{field} must be a string, a list of strings, a list of token ids, or a"
                                         " list of token-id lists (not a mix)")
    else:
        raise BadRequest(400, field, f"{field} must be a string, a list of strings, a list of token ids, or a"
                                     f" list of token-id lists, not {type(value).__name__}")
    count = len(texts) if texts is not None else len(arrays)
    if count > limits.max_inputs:
        raise BadRequest(400, field, f"{field} has {count} items; at most {limits.max_inputs} per request")
    # A lone string or a lone token list is `input` itself; items of a list are `input[i]`.
    single = isinstance(value, str) or (texts is None and arrays[0] is value)

    def where(i: int) -> str:
        return field if single else f"{field}[{i}]"

    if texts is not None:
        for i, text in enumerate(texts):
            if not text:
                raise BadRequest(400, where(i), f"{where(i)} is an empty string")
        items = tokenize(texts)
    else:
        items = []
        for i, ids in enumerate(arrays):
            at = where(i)
            if not ids:
                raise BadRequest(400, at, f"{at} is an empty token list")
            for j, t in enumerate(ids):
                if not _is_int(t) or not 0 <= t < limits.vocab_size:
                    raise BadRequest(400, at, f"{at}[{j}] must be a token id between 0 and {limits.vocab_size - 1}")
            items.append(list(ids))
    for i, ids in enumerate(items):
        if len(ids) > limits.max_tokens:
            at = where(i)
            raise BadRequest(400, at, f"{at} has {len(ids)} tokens; this model takes at most {limits.max_tokens}")
    return items
