"""The engine's API types: a generation request as the HTTP layer hands it over (its sampler's
parameters in one `SamplingParams`, vLLM's shape), its result and log-probabilities, and what the
engine observed of itself. One module, imported by the HTTP layer, the handlers and the loops
alike (the loop's own state, `sequence.Seq`, stays inside it). No torch here: the HTTP layer's
parsing builds these."""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass, field

__all__ = ["EngineProbe", "GenRequest", "GenResult", "SamplingParams", "TokenLogprob"]


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 0.0
    top_p: float = 1.0
    seed: int | None = None
    top_k: int = 0  # 0: every token
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: tuple[tuple[int, float], ...] = ()
    min_tokens: int = 0
    # Tokens that end the sequence besides EOS (and that min_tokens holds back like EOS).
    stop_token_ids: tuple[int, ...] = ()

    @property
    def greedy(self) -> bool:
        return self.temperature <= 0.0

    @property
    def adjusts_logits(self) -> bool:
        """Whether the logits change before the choice (anything beyond temperature and top-p)."""
        return (self.repetition_penalty != 1.0 or self.presence_penalty != 0.0 or self.frequency_penalty != 0.0
                or bool(self.logit_bias) or self.min_tokens > 0)


@dataclass(frozen=True)
class TokenLogprob:
    """A chosen token's log-probability and the alternatives: the chosen one first, then the most
    likely by rank (without repeating the chosen one), as vLLM orders them."""

    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...]


@dataclass
class GenRequest:
    prompt_ids: list[int]
    max_tokens: int
    sampling: SamplingParams = field(default_factory=SamplingParams)  # greedy unless asked
    stop: tuple[str, ...] = ()
    on_text: Callable[[str], object] | None = None
    cancelled: threading.Event = field(default_factory=threading.Event)
    ignore_eos: bool = False
    include_stop_str: bool = False
    skip_special_tokens: bool = True
    # How many alternatives to report per generated / prompt token; None: no log-probabilities.
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    # Called before the text of the same tokens: (entries, whether they are the prompt's).
    on_logprobs: Callable[[list[TokenLogprob | None], bool], object] | None = None



@dataclass(frozen=True)
class GenResult:
    text: str
    prompt_tokens: int
    completion_tokens: int
    finish_reason: str
    # Generated ids, the token that ended the sequence (EOS, a stop token id) included.
    token_ids: tuple[int, ...] = ()
    logprobs: tuple[TokenLogprob, ...] | None = None
    # One per prompt token, None for the first (nothing predicts it).
    prompt_logprobs: tuple[TokenLogprob | None, ...] | None = None
    # Prompt tokens whose keys and values came from the prefix cache (OpenAI's `cached_tokens`).
    cached_tokens: int = 0


@dataclass(frozen=True)
class EngineProbe:
    """What the engine observed itself, independent of the admission gate's own bookkeeping."""

    active_sequences: int
    peak_active_sequences: int
    forward_batches: int
    largest_batch: int
    # Distinct threads that ran a forward pass: on CUDA each keeps a cuBLAS workspace.
    threads: int
    preemptions: int
