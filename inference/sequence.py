"""One request's life in the decode loop: waiting, then rows in the batch, then a result; and a long
prompt part-way through its prefill."""

from __future__ import annotations

import itertools
from concurrent.futures import Future
from dataclasses import dataclass, field

import torch

from gpu_watchdog.inference.admission import Grant
from gpu_watchdog.inference.engine_api import GenRequest, GenResult, TokenLogprob
from gpu_watchdog.inference.kv import KVBatch
from gpu_watchdog.inference.model import StreamDecoder
from gpu_watchdog.inference.sampling import RowTokens, StopText, new_generator
from gpu_watchdog.inference.screen import MARKED

_order = itertools.count()


class Seq:
    """One request's life in the engine: waiting, then rows in the batch, then a result."""

    def __init__(self, request: GenRequest, weight: float, canary: bool, device: torch.device,
                 decoder: StreamDecoder) -> None:
        self.request = request
        self.weight = weight
        self.canary = canary
        self.order = next(_order)
        self.future: Future[GenResult] = Future()
        self.grant: Grant | None = None
        self.generated: list[int] = []
        self.next_id: int | None = None  # sampled, not yet fed to the model
        self.retried = False
        # Set once it first joins the batch: the queue timeout bounds the wait for admission only,
        # so one stepped out by an OOM and waiting again is never timed out half-answered.
        self.admitted = False
        self.decoder = decoder
        self.text = StopText(request.stop, request.include_stop_str)
        self.sampling = request.sampling
        self.generator = new_generator(self.sampling, device)
        self.logprobs: list[TokenLogprob] = []
        self.prompt_logprobs: list[TokenLogprob | None] | None = None
        self.end_token: int | None = None
        self.cached_tokens = 0
        # The per-request faults its request triggers (fault injection; created in the request's task).
        self.marks = MARKED.get()

    def history(self, eos_id: int | None) -> RowTokens:
        return RowTokens(self.request.prompt_ids, self.generated, eos_id)

    def result(self, reason: str) -> GenResult:
        req = self.request
        ids = (*self.generated, *(() if self.end_token is None else (self.end_token,)))
        return GenResult(self.text.text, len(req.prompt_ids), len(self.generated), reason, ids,
                         None if req.logprobs is None else tuple(self.logprobs),
                         None if self.prompt_logprobs is None else tuple(self.prompt_logprobs),
                         min(self.cached_tokens, len(req.prompt_ids)))

    @property
    def scoring(self) -> bool:
        """Its prompt's log-probabilities are still to compute: every position's logits, none cached."""
        return self.request.prompt_logprobs is not None and self.prompt_logprobs is None

    @property
    def prefill_ids(self) -> list[int]:
        # After an OOM a sequence re-enters with what it had generated: it resumes, not restarts.
        return self.request.prompt_ids + self.generated


RowOutcome = GenResult | BaseException


@dataclass
class Partial:
    """A prompt longer than the step's budget, part-way through its prefill (admitted, not yet a row)."""

    seq: Seq
    kv: KVBatch | None = None  # its cache so far: one row, no padding
    done: int = 0  # prompt tokens already in it
    looked_up: bool = False  # in the prefix cache, before its first chunk
    # A scored prompt's log-probabilities, chunk by chunk (the first token has no prediction).
    scored: list[TokenLogprob | None] = field(default_factory=lambda: [None])
