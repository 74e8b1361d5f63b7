"""The open-model side of the OpenAI routes: vLLM's extra sampling parameters turned into engine
options, and log-probabilities rendered exactly as vLLM renders them (completions and chat, whole
and streamed), so clients written against vLLM (evaluation harnesses, its benchmark client) read
ours unchanged.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from inference.model import Codec
from inference.sampling import SamplingParams, TokenLogprob
from inference.validation import Sampling

# What OpenAI (and vLLM) write instead of -inf, which JSON cannot carry.
FLOOR = -9999.0


def request_options(s: Sampling, *, prompt_logprobs: bool) -> dict[str, Any]:
    """GenRequest keywords for a request's extras, log-probabilities and echo."""
    x = s.extras
    options = SamplingParams(top_k=x.top_k, min_p=x.min_p, repetition_penalty=x.repetition_penalty,
                             presence_penalty=x.presence_penalty, frequency_penalty=x.frequency_penalty,
                             logit_bias=x.logit_bias, min_tokens=x.min_tokens, stop_token_ids=x.stop_token_ids)
    return {
        "options": options,
        "ignore_eos": x.ignore_eos,
        "include_stop_str": x.include_stop_str_in_output,
        "skip_special_tokens": x.skip_special_tokens,
        "logprobs": s.logprobs,
        "prompt_logprobs": s.logprobs if prompt_logprobs and s.logprobs is not None else None,
    }


def choice_seed(seed: int | None, choice: int) -> int | None:
    """Each of n choices draws from its own seed, as vLLM's (seed + index): same seed, different answers."""
    return None if seed is None else (seed + choice) % (2**63)


class TokenText:
    """Token ids spelled one by one, as vLLM spells them in log-probabilities (special tokens too)."""

    def __init__(self, codec: Codec) -> None:
        self._codec = codec
        self._cache: dict[int, str] = {}

    def __call__(self, token_id: int) -> str:
        text = self._cache.get(token_id)
        if text is None:
            text = self._codec.decode([token_id], skip_special_tokens=False)
            if len(self._cache) < 1 << 16:
                self._cache[token_id] = text
        return text


def completion_logprobs(spell: TokenText, token_ids: Sequence[int], entries: Sequence[TokenLogprob | None],
                        initial_offset: int = 0) -> dict[str, Any]:
    """OpenAI's completions `logprobs` object: tokens, token_logprobs, top_logprobs, text_offset.

    `top_logprobs` holds the chosen token and the requested alternatives (k + 1 at most, as OpenAI
    specifies); offsets count the characters of the spelled tokens.
    """
    tokens: list[str] = []
    values: list[float | None] = []
    tops: list[dict[str, float] | None] = []
    offsets: list[int] = []
    offset = initial_offset
    for token_id, entry in zip(token_ids, entries, strict=True):
        token = spell(token_id)
        tokens.append(token)
        if entry is None:
            values.append(None)
            tops.append(None)
        else:
            values.append(max(entry.logprob, FLOOR))
            tops.append({spell(t): max(v, FLOOR) for t, v in entry.top})
        offsets.append(offset)
        offset += len(token)
    return {"text_offset": offsets, "token_logprobs": values, "tokens": tokens, "top_logprobs": tops}


def chat_logprobs(spell: TokenText, entries: Sequence[TokenLogprob], top: int) -> dict[str, Any]:
    """OpenAI's chat `logprobs` object: one content item per generated token, `top` alternatives each."""
    def item(token_id: int, value: float) -> dict[str, Any]:
        token = spell(token_id)
        return {"token": token, "logprob": max(value, FLOOR), "bytes": list(token.encode("utf-8", errors="replace"))}

    return {"content": [{**item(e.token_id, e.logprob), "top_logprobs": [item(t, v) for t, v in e.top[:top]]}
                        for e in entries]}


@dataclass
class _Choice:
    pending: list[TokenLogprob] = field(default_factory=list)
    offset: int = 0


class StreamedLogprobs:
    """Streamed log-probabilities: each token's entry travels with the chunk that carries its text.

    The engine reports a token's entry before its text; text held back for a stop string makes
    entries wait for a later chunk, and whatever is left goes out in a last chunk before the finish.
    """

    def __init__(self, spell: TokenText, chat: bool, top: int) -> None:
        self.spell = spell
        self.chat = chat
        self.top = top
        self._choices: dict[int, _Choice] = {}

    def _choice(self, index: int) -> _Choice:
        return self._choices.setdefault(index, _Choice())

    def add(self, index: int, entries: Sequence[TokenLogprob | None]) -> None:
        self._choice(index).pending.extend(e for e in entries if e is not None)

    def prompt(self, index: int, prompt_ids: Sequence[int], entries: Sequence[TokenLogprob | None]
               ) -> dict[str, Any]:
        """The echoed prompt's logprobs object (completions), which starts the choice's offsets."""
        choice = self._choice(index)
        out = completion_logprobs(self.spell, prompt_ids, entries, choice.offset)
        choice.offset += sum(len(t) for t in out["tokens"])
        return out

    def take(self, index: int) -> dict[str, Any] | None:
        """The logprobs object for the chunk about to go out for this choice (None: nothing pending)."""
        choice = self._choice(index)
        if not choice.pending:
            return None
        entries, choice.pending = choice.pending, []
        if self.chat:
            return chat_logprobs(self.spell, entries, self.top)
        out = completion_logprobs(self.spell, [e.token_id for e in entries], entries, choice.offset)
        choice.offset += sum(len(t) for t in out["tokens"])
        return out

    def waiting(self) -> list[int]:
        return [i for i, c in self._choices.items() if c.pending]
