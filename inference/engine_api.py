"""The engine's API types: a generation request as the HTTP layer hands it over, its result, and
what the engine observed of itself. One module, imported by the HTTP layer, the handlers and the
loop alike (the loop's own state, `sequence.Seq`, stays inside it)."""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import Callable
from dataclasses import dataclass, field

from gpu_watchdog.inference.sampling import SamplingParams, TokenLogprob

__all__ = ["EngineProbe", "GenRequest", "GenResult"]


@dataclass
class GenRequest:
    prompt_ids: list[int]
    max_tokens: int
    temperature: float = 0.0
    top_p: float = 1.0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    on_text: Callable[[str], object] | None = None
    cancelled: threading.Event = field(default_factory=threading.Event)
    # The sampler's other knobs (top-k, min-p, penalties, bias, min_tokens, stop token ids).
    options: SamplingParams | None = None
    ignore_eos: bool = False
    include_stop_str: bool = False
    skip_special_tokens: bool = True
    # How many alternatives to report per generated / prompt token; None: no log-probabilities.
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    # Called before the text of the same tokens: (entries, whether they are the prompt's).
    on_logprobs: Callable[[list[TokenLogprob | None], bool], object] | None = None

    @property
    def sampling(self) -> SamplingParams:
        return dataclasses.replace(self.options or SamplingParams(), temperature=self.temperature,
                                   top_p=self.top_p, seed=self.seed)


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
