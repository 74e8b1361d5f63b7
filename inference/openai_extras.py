"""The open-model side of the OpenAI routes: vLLM's extra sampling parameters turned into engine
options, and log-probabilities rendered exactly as vLLM renders them (completions and chat, whole
and streamed), so clients written against vLLM (evaluation harnesses, its benchmark client) read
ours unchanged.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from gpu_watchdog.inference.engine_api import TokenLogprob
from gpu_watchdog.inference.model import Codec
from gpu_watchdog.inference.validation import Sampling

# What OpenAI (and vLLM) write instead of -inf, which JSON cannot carry.
FLOOR = -9999.0


def request_options(s: Sampling, *, prompt_logprobs: bool) -> dict[str, Any]:
    """GenRequest keywords for how a request's text is made, its log-probabilities and echo."""
    x = s.output
    return {
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

    def __call__(self, token_id: int, context: Sequence[int] | None = None) -> str:
        """`context`: the chosen tokens before this one, for a token that ends inside a character
        (None: spelled alone, as vLLM spells tokens without log-probabilities)."""
        text = self._cache.get(token_id)
        if text is None:
            text = self._codec.decode([token_id], skip_special_tokens=False)
            if len(self._cache) < 1 << 16:
                self._cache[token_id] = text
        return self._completed(token_id, context) if context is not None and text.endswith("\ufffd") else text

    def _completed(self, token_id: int, context: Sequence[int]) -> str:
        """A token that ends inside a multi-byte character, spelled with the tokens before it (up to 4),
        as vLLM spells it: the text it completes, or "" while the character is still unfinished."""
        decode = self._codec.decode
        for n in range(1, min(len(context), 4) + 1):
            ctx = list(context[-n:])
            full = decode([*ctx, token_id], skip_special_tokens=False)
            if full.endswith("\ufffd"):
                continue
            clean = len(ctx)
            for j in range(len(ctx) - 1, -1, -1):
                if not decode([ctx[j]], skip_special_tokens=False).endswith("\ufffd"):
                    break
                clean = j
            prefix = decode(ctx[:clean], skip_special_tokens=False) if clean else ""
            if full.startswith(prefix):
                return full[len(prefix):]
            common = 0
            for a, b in zip(prefix, full, strict=False):
                if a != b:
                    break
                common += 1
            return full[common:]
        return ""


def completion_logprobs(spell: TokenText, token_ids: Sequence[int], entries: Sequence[TokenLogprob | None],
                        initial_offset: int = 0, context: list[int] | None = None) -> dict[str, Any]:
    """OpenAI's completions `logprobs` object: tokens, token_logprobs, top_logprobs, text_offset.

    `top_logprobs` holds the chosen token and the requested alternatives (k + 1 at most, as OpenAI
    specifies); offsets count the characters of the spelled tokens. `context`: the chosen tokens
    before these (the prompt's and the answer's are separate), extended in place.
    """
    context = [] if context is None else context
    tokens: list[str] = []
    values: list[float | None] = []
    tops: list[dict[str, float] | None] = []
    offsets: list[int] = []
    offset = initial_offset
    for token_id, entry in zip(token_ids, entries, strict=True):
        if entry is None:
            token = spell(token_id)
            values.append(None)
            tops.append(None)
        else:
            token = spell(token_id, context)
            values.append(max(entry.logprob, FLOOR))
            tops.append({spell(t, context): max(v, FLOOR) for t, v in entry.top})
            context.append(token_id)
            del context[:-4]
        tokens.append(token)
        offsets.append(offset)
        offset += len(token)
    return {"text_offset": offsets, "token_logprobs": values, "tokens": tokens, "top_logprobs": tops}


def chat_logprobs(spell: TokenText, entries: Sequence[TokenLogprob], top: int,
                  context: list[int] | None = None) -> dict[str, Any]:
    """OpenAI's chat `logprobs` object: one content item per generated token, `top` alternatives each."""
    context = [] if context is None else context

    def item(token_id: int, value: float) -> dict[str, Any]:
        token = spell(token_id, context)
        return {"token": token, "logprob": max(value, FLOOR), "bytes": list(token.encode("utf-8", errors="replace"))}

    content = []
    for e in entries:
        content.append({**item(e.token_id, e.logprob), "top_logprobs": [item(t, v) for t, v in e.top[:top]]})
        context.append(e.token_id)
        del context[:-4]
    return {"content": content}


@dataclass
class _Choice:
    pending: list[TokenLogprob] = field(default_factory=list)
    offset: int = 0
    context: list[int] = field(default_factory=list)


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
            return chat_logprobs(self.spell, entries, self.top, choice.context)
        out = completion_logprobs(self.spell, [e.token_id for e in entries], entries, choice.offset, choice.context)
        choice.offset += sum(len(t) for t in out["tokens"])
        return out

    def waiting(self) -> list[int]:
        return [i for i, c in self._choices.items() if c.pending]
