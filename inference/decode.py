"""The decode loop: one thread per device runs every forward pass, one step at a time.

At each step, waiting sequences that the batch-taker admits are prefilled together and stitched
into the running batch; then every running sequence decodes one token. A sequence leaves the
moment it finishes, its rows and admission share freed for the next step. Streams are rows like
any other. Only this thread touches the model, so there is one cuBLAS workspace, not one per
request thread.
"""

from __future__ import annotations

import dataclasses
import itertools
import threading
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

import torch

from inference import batch, recovery
from inference.admission import AdmissionGate, Grant
from inference.errors import FatalCudaError, InferenceOOM, is_fatal_cuda, is_oom
from inference.kv import KVBatch, NotStitchable, growing, prefill_inputs, stitchable
from inference.loop_thread import LoopHooks, LoopThread
from inference.model import LoadedModel, StreamDecoder
from inference.sampling import (
    History,
    SamplingParams,
    StopText,
    TokenLogprob,
    new_generator,
    sample,
    token_logprobs,
)


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

    def history(self, eos_id: int | None) -> History:
        return History(self.request.prompt_ids, self.generated, eos_id)

    def result(self, reason: str) -> GenResult:
        req = self.request
        ids = (*self.generated, *(() if self.end_token is None else (self.end_token,)))
        return GenResult(self.text.text, len(req.prompt_ids), len(self.generated), reason, ids,
                         None if req.logprobs is None else tuple(self.logprobs),
                         None if self.prompt_logprobs is None else tuple(self.prompt_logprobs))

    @property
    def prefill_ids(self) -> list[int]:
        # After an OOM a sequence re-enters with what it had generated: it resumes, not restarts.
        return self.request.prompt_ids + self.generated


Outcome = GenResult | BaseException


class DecodeLoop(LoopThread):
    def __init__(
        self,
        lm: LoadedModel,
        gate: AdmissionGate,
        *,
        max_rows: int,
        hooks: LoopHooks,
    ) -> None:
        super().__init__("decode", hooks)
        self.lm = lm
        self.gate = gate
        self.max_rows = max_rows
        self._waiting: deque[Seq] = deque()
        self._rows: list[Seq] = []
        # Admitted and being prefilled: neither waiting nor rows yet, but in flight all the same.
        self._joining: list[Seq] = []
        self._kv: KVBatch | None = None
        self._stitchable = True
        self._ceiling: int | None = None
        self._ceiling_holders: set[int] = set()
        self._preemptions = 0

    # -- called from other threads ----------------------------------------------------------

    def new_sequence(self, request: GenRequest, weight: float, canary: bool = False) -> Seq:
        return Seq(request, weight, canary, self.lm.device,
                   self.lm.codec.decoder(skip_special_tokens=request.skip_special_tokens))

    def enqueue(self, seq: Seq) -> None:
        with self._cond:
            if self.poisoned is not None:
                raise FatalCudaError(self.poisoned)
            if seq.canary:
                self._waiting.appendleft(seq)
            else:
                self._waiting.append(seq)
            self._cond.notify_all()

    def withdraw(self, seq: Seq, *, unadmitted_only: bool = False) -> bool:
        """Take a sequence out of the queue if it is still waiting there (timeout, client gone).

        `unadmitted_only`: leave it if it was admitted once (the queue timeout's case)."""
        with self._cond:
            if unadmitted_only and seq.admitted:
                return False
            try:
                self._waiting.remove(seq)
            except ValueError:
                return False
            # One stepped out by an OOM may leave from the queue: the cap it holds goes with it, or
            # the batch would stay capped for good.
            self._ceiling_holders.discard(seq.order)
            if self._ceiling is not None and not self._ceiling_holders:
                self._ceiling = None
        self._release(seq)
        return True

    @property
    def waiting(self) -> int:
        return len(self._waiting)

    @property
    def running(self) -> int:
        return sum(1 for s in (*self._rows, *self._joining) if not s.canary)

    def probe(self) -> EngineProbe:
        return EngineProbe(len(self._rows), self._peak, self._forwards, self._largest, len(self._threads),
                           self._preemptions)

    def reset_peak(self) -> None:
        self._peak = len(self._rows)

    def poison(self, reason: str) -> None:
        """A sticky error was seen (or injected from outside): every later kernel would fail."""
        with self._cond:
            if self.poisoned is not None:
                return
            self.poisoned = reason
            queued = list(self._waiting)
            self._waiting.clear()
            self._cond.notify_all()
        for seq in queued:
            self._finish(seq, FatalCudaError(reason))
        if self.on_fatal is not None:
            self.on_fatal(reason)

    # -- the loop thread --------------------------------------------------------------------

    def _run(self) -> None:
        with torch.inference_mode():
            while True:
                with self._cond:
                    while not self._stopping and not self._rows and not self._waiting:
                        self._cond.wait()
                    if self._stopping:
                        return
                    joiners = self._take()
                if not joiners and not self._rows:
                    # Waiting sequences that cannot join yet (the budget was just lowered).
                    with self._cond:
                        self._cond.wait(0.01)
                    continue
                self._step(joiners)

    def _take(self) -> list[Seq]:
        """Called with the lock held."""
        alive: deque[Seq] = deque()
        for seq in self._waiting:
            if seq.request.cancelled.is_set():
                self._finish(seq, _cancelled(seq))
            else:
                alive.append(seq)
        self._waiting = alive
        if not alive:
            return []
        stats = self.gate.stats()
        limit = self.max_rows if self._ceiling is None else min(self.max_rows, self._ceiling)
        room = batch.Room(rows=len(self._rows), max_rows=limit, in_use=stats.in_use, capacity=stats.capacity,
                          can_join_running=self._stitchable)
        chosen = batch.take([batch.Candidate(s.weight, s.canary, s.grant is not None) for s in alive], room)
        joiners: list[Seq] = []
        for i in chosen:
            seq = alive[i]
            if not seq.canary and seq.grant is None:
                seq.grant = self.gate.try_acquire(seq.weight)
                if seq.grant is None:
                    break  # the budget moved under us (the control API): try again next step
            joiners.append(seq)
        for seq in joiners:
            self._waiting.remove(seq)
            seq.admitted = True
        self._joining = joiners
        return joiners

    def _step(self, joiners: list[Seq]) -> None:
        width = None
        pending = joiners  # admitted, not yet rows: their prefill has not succeeded
        try:
            if joiners:
                if self.faults is not None:
                    self.faults.before_forward(len(self._rows) + len(joiners))
                self._prefill(joiners)
            pending = []
            if self._rows:
                if self.faults is not None:
                    self.faults.during_forward(len(self._rows))
                assert self._kv is not None
                width = self._kv.width
                self._decode()
        except BaseException as exc:  # every failure is classified and answered in _failed
            lost: list[Seq] = []
            if width is not None and self._kv is not None:
                try:
                    self._kv.rollback(width)
                except NotStitchable:
                    # A sliding window cannot be rolled back: the rows lose their cache and are
                    # prefilled again from their prompt and what they generated.
                    lost, self._rows, self._kv = self._rows, [], None
                    for seq in lost:
                        seq.next_id = None
            self._failed(exc, [*lost, *pending])
        finally:
            self._joining = []

    def _forward(self, ids: torch.Tensor, mask: torch.Tensor, positions: torch.Tensor, cache: Any,
                 all_logits: bool = False) -> Any:
        lm = self.lm
        extra = lm.forward_extra
        if all_logits and "logits_to_keep" in extra:
            extra = {**extra, "logits_to_keep": 0}
        self._forwards += 1
        self._largest = max(self._largest, int(ids.shape[0]))
        self._threads.add(threading.get_ident())
        if self.on_step is not None:
            self.on_step(int(ids.shape[0]))
        if lm.lean is not None:
            return lm.lean(ids, mask, positions, cache, all_logits)
        return lm.model(input_ids=ids, attention_mask=mask, position_ids=positions, use_cache=True,
                        **{lm.cache_kwarg: cache}, **extra)

    def _logits(self, out: Any) -> torch.Tensor:
        logits = out.logits[:, -1, :].float()
        allowed = self.lm.allowed_tokens
        if allowed is not None:
            logits = logits.masked_fill(~allowed[: logits.shape[-1]], float("-inf"))
        return logits

    def _prefill(self, joiners: list[Seq]) -> None:
        lm = self.lm
        ids, mask, positions = prefill_inputs([s.prefill_ids for s in joiners], lm.codec.pad_id, lm.device)
        scoring = [s for s in joiners if s.request.prompt_logprobs is not None and s.prompt_logprobs is None]
        # Scoring a prompt needs the logits of every position, not only the last one.
        out = self._forward(ids, mask, positions, None, all_logits=bool(scoring))
        cache = _cache_of(out)
        if scoring:
            self._score_prompts(out.logits, joiners, scoring)
        logits = self._logits(out)
        tokens = sample(logits, [s.sampling for s in joiners], [s.generator for s in joiners],
                        [s.history(lm.codec.eos_id) for s in joiners])
        self._record_logprobs(logits, joiners, tokens)
        group = KVBatch(cache, mask)
        if stitchable(cache):
            growing(cache)
        if self._kv is None or not self._rows:
            self._stitchable = stitchable(cache)
            self._kv, self._rows = group, list(joiners)
        else:
            self._kv.stitch(group)
            self._rows = [*self._rows, *joiners]
        self._joining = []
        self._peak = max(self._peak, len(self._rows))
        self._emit(tokens, first=len(self._rows) - len(joiners))

    def _decode(self) -> None:
        kv = self._kv
        assert kv is not None
        positions = kv.next_positions()
        kv.grow()
        ids = torch.tensor([[s.next_id] for s in self._rows], dtype=torch.long, device=self.lm.device)
        out = self._forward(ids, kv.mask, positions, kv.cache)
        logits = self._logits(out)
        eos = self.lm.codec.eos_id
        tokens = sample(logits, [s.sampling for s in self._rows], [s.generator for s in self._rows],
                        [s.history(eos) for s in self._rows])
        self._record_logprobs(logits, self._rows, tokens)
        self._emit(tokens, first=0)

    def _record_logprobs(self, logits: torch.Tensor, seqs: list[Seq], tokens: list[int]) -> None:
        """Each asking row's chosen token's log-probability, before `_emit` hands out its text."""
        asking = [i for i, s in enumerate(seqs) if s.request.logprobs is not None]
        if not asking:
            return
        ks = [int(seqs[i].request.logprobs or 0) for i in asking]
        rows = logits[torch.tensor(asking, dtype=torch.long, device=logits.device)]
        for i, entry in zip(asking, token_logprobs(rows, [tokens[i] for i in asking], ks), strict=True):
            seq = seqs[i]
            seq.logprobs.append(entry)
            if seq.request.on_logprobs is not None:
                seq.request.on_logprobs([entry], False)

    def _score_prompts(self, logits: torch.Tensor, joiners: list[Seq], scoring: list[Seq]) -> None:
        """Prompt log-probabilities from a prefill's full logits [rows, width, vocab] (left-padded rows)."""
        allowed = self.lm.allowed_tokens
        width = int(logits.shape[1])
        for seq in scoring:
            row = joiners.index(seq)
            prompt = seq.request.prompt_ids
            # Position j's logits predict token j+1; the first token has no prediction.
            preds = logits[row, width - len(prompt): width - 1].float()
            if allowed is not None:
                preds = preds.masked_fill(~allowed[: preds.shape[-1]], float("-inf"))
            entries: list[TokenLogprob | None] = [None]
            if len(prompt) > 1:
                entries += token_logprobs(preds, prompt[1:], int(seq.request.prompt_logprobs or 0))
            seq.prompt_logprobs = entries
            if seq.request.on_logprobs is not None:
                seq.request.on_logprobs(entries, True)

    def _emit(self, tokens: list[int], first: int) -> None:
        """Hand each row its new token (rows from `first` on), then let finished rows leave."""
        eos = self.lm.codec.eos_id
        produced = 0
        finished: list[tuple[Seq, str]] = []
        for seq, tok in zip(self._rows[first:], tokens, strict=True):
            if (eos is not None and tok == eos and not seq.request.ignore_eos) or tok in seq.sampling.stop_token_ids:
                seq.end_token = tok
                finished.append((seq, "stop"))
                continue
            seq.generated.append(tok)
            produced += 1
            piece = seq.text.feed(seq.decoder.feed([tok]))
            # Every token is reported, even one with no text yet (part of a character, held back for
            # a stop string): a streaming client sees each step, as vLLM's do.
            if seq.request.on_text is not None:
                seq.request.on_text(piece)
            if seq.text.stopped:
                finished.append((seq, "stop"))
            elif len(seq.generated) >= seq.request.max_tokens:
                finished.append((seq, "length"))
            elif seq.request.cancelled.is_set():
                finished.append((seq, "cancelled"))
            else:
                seq.next_id = tok
        if produced and self.on_progress is not None:
            self.on_progress(produced)
        if finished:
            gone = {id(seq) for seq, _ in finished}
            self._leave(gone)
            for seq, reason in finished:
                rest = seq.text.flush()
                if rest and seq.request.on_text is not None:
                    seq.request.on_text(rest)
                self._finish(seq, seq.result(reason))

    def _leave(self, gone: set[int]) -> None:
        """Cut these sequences' rows out of the batch."""
        keep = [i for i, s in enumerate(self._rows) if id(s) not in gone]
        self._rows = [self._rows[i] for i in keep]
        if not self._rows:
            self._kv = None
        elif self._kv is not None:
            self._kv.keep(keep)

    def _finish(self, seq: Seq, outcome: Outcome) -> None:
        self._release(seq)
        self._ceiling_holders.discard(seq.order)
        if self._ceiling is not None and not self._ceiling_holders:
            self._ceiling = None
        if seq.future.done():
            return
        if isinstance(outcome, BaseException):
            seq.future.set_exception(outcome)
        else:
            seq.future.set_result(outcome)

    def _release(self, seq: Seq) -> None:
        if seq.grant is not None:
            self.gate.release(seq.grant)
            seq.grant = None
            if self.after_release is not None:
                self.after_release()

    # -- failures ---------------------------------------------------------------------------

    def _failed(self, exc: BaseException, pending: list[Seq]) -> None:
        """`pending`: admitted in this step, their prefill failed (so they are not rows)."""
        involved = [*self._rows, *pending]
        if is_oom(exc):
            if self.on_oom is not None:
                self.on_oom(exc)
            self._recover(involved, exc)
            return
        if is_fatal_cuda(exc):
            reason = str(exc) or type(exc).__name__
            rows, self._rows, self._kv = involved, [], None
            self.poison(reason)
            for seq in rows:
                self._finish(seq, FatalCudaError(reason))
            return
        # Anything else fails the sequences of the failed forward and only them; the engine goes on.
        failed = pending if pending else involved
        if not pending:
            self._rows, self._kv = [], None
        for seq in failed:
            self._finish(seq, exc)

    def _recover(self, involved: list[Seq], exc: BaseException) -> None:
        involved.sort(key=lambda s: s.order)
        decision = recovery.plan([recovery.Row(s.retried, s.canary) for s in involved])
        out = {id(involved[i]) for i in (*decision.preempt, *decision.fail)}
        self._leave(out)
        self._ceiling = decision.ceiling
        self._ceiling_holders |= {s.order for s in involved}
        for i in decision.preempt:
            involved[i].retried = True
        self._preemptions += len(decision.preempt)
        failed = {id(involved[i]) for i in decision.fail}
        rows = {id(s) for s in self._rows}
        # Back to the head of the queue, oldest first: the preempted, and joiners whose prefill
        # failed through no fault of their own size.
        back = [s for s in involved if id(s) not in rows and id(s) not in failed]
        for seq in back:
            seq.next_id = None
        with self._cond:
            self._waiting.extendleft(reversed(back))
        for i in decision.fail:
            self._finish(involved[i], InferenceOOM(str(exc)))


def _cache_of(out: Any) -> Any:
    cache = getattr(out, "cache", None)
    return cache if cache is not None else getattr(out, "past_key_values", None)


def _cancelled(seq: Seq) -> GenResult:
    return seq.result("cancelled")

