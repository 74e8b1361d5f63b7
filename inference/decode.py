"""The decode loop: one thread per device runs every forward pass, one step at a time.

At each step, waiting sequences that the batch-taker admits (within the step's prefill budget)
are prefilled together and stitched into the running batch; then every running sequence decodes
one token. A prompt longer than the budget is prefilled a chunk per step, the running sequences
decoding between its chunks, so that no prompt stalls them for longer than one budget's worth of
prefill. A sequence leaves the moment it finishes, its rows and admission share freed for the
next step. Streams are rows like any other. Only this thread touches the model, so there is one
cuBLAS workspace, not one per request thread. How joiners are prefilled (passes, chunks, the
prefix cache's reuse) is `prefill.py`; who joins is the pure `batch.py`; a sequence's own state is
`sequence.py`.
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Callable, Sequence
from typing import Any

import torch

from gpu_watchdog.inference import batch, recovery, scoring
from gpu_watchdog.inference.admission import AdmissionGate
from gpu_watchdog.inference.cpu_threads import ThreadSetter, plan
from gpu_watchdog.inference.engine_api import EngineProbe, GenRequest, GenResult, TokenLogprob
from gpu_watchdog.inference.errors import (
    FatalCudaError,
    InferenceOOM,
    NonFiniteLogits,
    context_lost,
    is_fatal_cuda,
    is_oom,
)
from gpu_watchdog.inference.kv import (
    KVBatch,
    NotStitchable,
    growing,
    stitchable,
)
from gpu_watchdog.inference.loop_thread import LoopHooks, LoopThread
from gpu_watchdog.inference.model import LoadedModel
from gpu_watchdog.inference.prefill import PrefillSteps
from gpu_watchdog.inference.prefix_cache import PrefixCache
from gpu_watchdog.inference.sampling import sample, token_logprobs
from gpu_watchdog.inference.screen import BOOKING
from gpu_watchdog.inference.sequence import Partial, RowOutcome, Seq
from gpu_watchdog.inference.settings import DEFAULT_PREFILL_TOKENS


class DecodeLoop(PrefillSteps, LoopThread):
    def __init__(
        self,
        lm: LoadedModel,
        gate: AdmissionGate,
        *,
        max_rows: int,
        hooks: LoopHooks,
        prefill_tokens: int = DEFAULT_PREFILL_TOKENS,
        score_chunk: int | None = None,
    ) -> None:
        super().__init__("decode", hooks)
        self.lm = lm
        self.gate = gate
        self.max_rows = max_rows
        self.prefill_tokens = prefill_tokens
        self._waiting: deque[Seq] = deque()
        self._rows: list[Seq] = []
        # Admitted and being prefilled: neither waiting nor rows yet, but in flight all the same.
        self._joining: list[Seq] = []
        self._partial: Partial | None = None
        self._kv: KVBatch | None = None
        self._stitchable = True
        self._stitch_known = False  # the first prefill's cache tells
        self._ceiling: int | None = None
        self._ceiling_holders: set[int] = set()
        self._preemptions = 0
        self._cpu_threads = ThreadSetter(plan(lm.device))
        # Set by the engine once sizing is done: the measured runs must compute every prompt.
        self.prefix_cache: PrefixCache | None = None
        # A scored prompt's logits are computed this many positions at a time, through the head
        # split off the forward pass (decided by the loop thread as it starts; None: not split).
        self.score_chunk = score_chunk or scoring.chunk_positions(lm.vocab_size)
        self.score_head: scoring.Head | None = None
        self._score_head_known = False
        # Each queued or running sequence's request booking (`screen.BOOKING`), by its order; and who
        # is told the bookings that ran in a step that lost the context (the request book, before
        # `on_fatal` freezes what is in flight): the failure's evidence is what ran, not what waited.
        self._booked: dict[int, int] = {}
        self.on_failed_step: Callable[[list[int]], object] | None = None

    # -- called from other threads ----------------------------------------------------------

    def new_sequence(self, request: GenRequest, weight: float, canary: bool = False) -> Seq:
        return Seq(request, weight, canary, self.lm.device,
                   self.lm.codec.decoder(skip_special_tokens=request.skip_special_tokens))

    def enqueue(self, seq: Seq) -> None:
        """From the request's task (its booking is read from its context)."""
        booking = BOOKING.get()
        with self._cond:
            if self.poison_reason is not None:
                raise context_lost(self.poison_reason)
            if booking is not None and not seq.canary:
                self._booked[seq.order] = booking
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
            self._booked.pop(seq.order, None)
            # One stepped out by an OOM may leave from the queue: the cap it holds goes with it, or
            # the batch would stay capped for good.
            self._ceiling_holders.discard(seq.order)
            if self._ceiling is not None and not self._ceiling_holders:
                self._ceiling = None
        self._release(seq)
        return True

    def scoring_bytes(self, prompt_tokens: int) -> int:
        """What scoring a prompt of this length holds at once beyond its prefill (`inference.scoring`):
        a chunk's logits, or, where the head is not split off (or not known to be yet), a whole
        pass's: the prefill budget's worth where prompts are prefilled in chunks, else the prompt."""
        positions = prompt_tokens
        if self._score_head_known and self.score_head is not None:
            positions = self.score_chunk
        elif self._stitch_known and self._stitchable:
            positions = self.prefill_tokens
        return scoring.working_set_bytes(prompt_tokens, self.lm.vocab_size, positions)

    @property
    def waiting(self) -> int:
        return len(self._waiting)

    @property
    def running(self) -> int:
        partial = () if self._partial is None else (self._partial.seq,)
        return sum(1 for s in (*self._rows, *self._joining, *partial) if not s.canary)

    def probe(self) -> EngineProbe:
        return EngineProbe(len(self._rows), self._peak, self._forwards, self._largest, len(self._threads),
                           self._preemptions)

    def reset_peak(self) -> None:
        self._peak = len(self._rows)

    def poison(self, reason: str, in_flight: Sequence[Seq] | None = None) -> None:
        """A sticky error was seen (or injected from outside): every later kernel would fail.

        `in_flight`: the loop thread's sequences of the failed step, answered `FatalCudaError` here;
        None from outside a step (what ran is not known here)."""
        with self._cond:
            first = self.poison_reason is None
            if first:
                self.poison_reason = reason
            queued = list(self._waiting)
            self._waiting.clear()
            self._cond.notify_all()
            ran = None if in_flight is None else sorted({self._booked[s.order] for s in in_flight
                                                         if s.order in self._booked})
        if first and ran is not None and self.on_failed_step is not None:
            self.on_failed_step(ran)
        if first and self.on_fatal is not None:
            # Before any answer: what was in flight at the failure is frozen while it still is.
            self.on_fatal(reason)
        # One put back after an OOM (it ran, may have streamed) was in flight like the rest.
        started = [s for s in queued if _started(s)]
        fresh = [s for s in queued if not _started(s)]
        # A request of several sequences (n, best_of, a list of prompts) is one engine sequence
        # each, and answers with the first of them to fail: were a queued sibling of the request
        # whose kernel poisoned the context told `context_lost` before its rows are told the error,
        # the request would answer a retriable 503, and the front would send the killer on to the
        # next engine. Every sequence that ran is answered first, on this one thread, so its
        # request's first failure is the fatal one; only then may the never-started go elsewhere.
        for seq in (*(in_flight or ()), *started):
            self._finish(seq, FatalCudaError(reason))
        for seq in fresh:
            self._finish(seq, context_lost(reason))

    # -- the loop thread --------------------------------------------------------------------

    def _run(self) -> None:
        with torch.inference_mode():
            self.score_head = scoring.resolve(self.lm)
            self._score_head_known = True
            while True:
                with self._cond:
                    while not self._stopping and not self._rows and not self._waiting and self._partial is None:
                        self._cond.wait()
                    if self._stopping:
                        return
                    joiners = self._take()
                if not joiners and not self._rows and self._partial is None:
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
        partial = self._partial
        if partial is not None and partial.seq.request.cancelled.is_set():
            self._partial = None
            self._finish(partial.seq, _cancelled(partial.seq))
        if not alive:
            return []
        if self._partial is not None:
            # Its chunks take the step's budget; only the canary joins beside it.
            chosen = [i for i, s in enumerate(alive) if s.canary]
        else:
            stats = self.gate.stats()
            limit = self.max_rows if self._ceiling is None else min(self.max_rows, self._ceiling)
            room = batch.Room(rows=len(self._rows), max_rows=limit, in_use=stats.in_use, capacity=stats.capacity,
                              can_join_running=self._stitchable, prefill_tokens=self.prefill_tokens)
            chosen = batch.take([batch.Candidate(s.weight, s.canary, s.grant is not None, self._to_compute(s))
                                 for s in alive], room)
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
        long = [s for s in joiners if self._chunked(s)]
        if long:
            # batch.take lets a prompt over the budget in only as the step's one joiner.
            self._partial = Partial(long[0])
            joiners.remove(long[0])
        self._joining = joiners
        return joiners

    def _step(self, joiners: list[Seq]) -> None:
        width = None
        partial = self._partial
        chunk_pending = partial is not None  # its chunk has not succeeded yet
        try:
            if partial is not None:
                if self.faults is not None:
                    self.faults.before_forward(len(self._rows) + 1, partial.seq.marks)
                self._prefill_chunk(partial)
            chunk_pending = False
            if joiners:
                if self.faults is not None:
                    self.faults.before_forward(len(self._rows) + len(joiners), _marks(joiners))
                self._prefill(joiners)
            if self._rows:
                if self.faults is not None:
                    self.faults.during_forward(len(self._rows), _marks(self._rows))
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
            # Admitted, not rows yet: their prefill has not succeeded (passes that did have joined).
            pending = list(self._joining)
            if chunk_pending and partial is not None:
                pending.append(partial.seq)
                self._partial = None  # its cache goes; it starts over if it is retried
            self._failed(exc, [*lost, *pending])
        finally:
            self._joining = []

    def _forward(self, ids: torch.Tensor, mask: torch.Tensor, positions: torch.Tensor, cache: Any,
                 all_logits: bool = False, states: bool = False) -> Any:
        lm = self.lm
        extra = lm.forward_extra
        if all_logits and "logits_to_keep" in extra:
            extra = {**extra, "logits_to_keep": 0}
        self._forwards += 1
        self._largest = max(self._largest, int(ids.shape[0]))
        self._threads.add(threading.get_ident())
        if self.on_step is not None:
            self.on_step(int(ids.shape[0]))
        self._cpu_threads.before(int(ids.numel()), prefill=int(ids.shape[1]) > 1)
        if lm.lean is not None:
            return lm.lean(ids, mask, positions, cache, all_logits, states=states)
        return lm.model(input_ids=ids, attention_mask=mask, position_ids=positions, use_cache=True,
                        **{lm.cache_kwarg: cache}, **extra)

    def _logits(self, out: Any) -> torch.Tensor:
        logits = out.logits[:, -1, :].float()
        if self.faults is not None:
            logits = self.faults.on_logits(logits)
        # NaN or +inf anywhere, or a row with nothing finite, is a card or kernel computing wrong: the
        # step's sequences fail (never noise answered with 200). -inf alone is a model's own mask.
        if bool(torch.isnan(logits).any() | torch.isposinf(logits).any()
                | ~torch.isfinite(logits).any(dim=-1).all()):
            if self.on_nonfinite is not None:
                self.on_nonfinite()
            raise NonFiniteLogits(f"the model's logits held NaN or infinities in a step of {logits.shape[0]}"
                                  " sequence(s): not answered")
        allowed = self.lm.allowed_tokens
        if allowed is not None:
            logits = logits.masked_fill(~allowed[: logits.shape[-1]], float("-inf"))
        return logits

    def _join(self, joiners: list[Seq], out: Any, group: KVBatch) -> None:
        """Prefilled: sample each joiner's first token and stitch its rows into the batch."""
        logits = self._logits(out)
        tokens = sample(logits, [s.sampling for s in joiners], [s.generator for s in joiners],
                        [s.history(self.lm.codec.eos_id) for s in joiners])
        self._record_logprobs(logits, joiners, tokens)
        cache = group.cache
        if stitchable(cache):
            growing(cache)
        if self._kv is None or not self._rows:
            self._stitchable, self._stitch_known = stitchable(cache), True
            self._kv, self._rows = group, list(joiners)
        else:
            self._kv.stitch(group)
            self._rows = [*self._rows, *joiners]
        joined = {id(s) for s in joiners}
        self._joining = [s for s in self._joining if id(s) not in joined]
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

    def _scoring_forward(self, ids: torch.Tensor, mask: torch.Tensor, positions: torch.Tensor, cache: Any
                         ) -> tuple[Any, torch.Tensor, scoring.Head | None]:
        """A prefill pass whose prompts are scored: its output (the last position's logits, for the
        first token), and the rows to score, [rows, width, ...]: every position's final states with
        the head that makes them logits, or, where the head is not split off, the logits themselves."""
        head = self.score_head
        if self.lm.lean is not None and head is not None:
            out = self._forward(ids, mask, positions, cache, states=True)
            return out, out.hidden, head
        if isinstance(head, torch.nn.Module):
            with scoring.states_into(head) as captured:
                out = self._forward(ids, mask, positions, cache, all_logits=True)
            return out, captured[0], head
        out = self._forward(ids, mask, positions, cache, all_logits=True)
        return out, out.logits, None

    def _score_prompts(self, rows: torch.Tensor, head: scoring.Head | None, joiners: list[Seq],
                       scored: list[Seq]) -> None:
        """Prompt log-probabilities from a prefill pass's rows (`_scoring_forward`; left-padded)."""
        width = int(rows.shape[1])
        for seq in scored:
            row = joiners.index(seq)
            prompt = seq.request.prompt_ids
            # Position j predicts token j+1; the first token has no prediction.
            entries: list[TokenLogprob | None] = [None]
            if len(prompt) > 1:
                entries += scoring.score(rows[row, width - len(prompt): width - 1], head, prompt[1:],
                                         int(seq.request.prompt_logprobs or 0), self.lm.allowed_tokens,
                                         self.score_chunk)
            self._scored(seq, entries)

    @staticmethod
    def _scored(seq: Seq, entries: list[TokenLogprob | None]) -> None:
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

    def _finish(self, seq: Seq, outcome: RowOutcome) -> None:
        self._release(seq)
        self._booked.pop(seq.order, None)
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
            if self.prefix_cache is not None:
                self.prefix_cache.clear()  # the memory is worth more to the sequences running
            if self.on_oom is not None:
                self.on_oom(exc)
            self._recover(involved, exc)
            return
        if is_fatal_cuda(exc):
            reason = str(exc) or type(exc).__name__
            if self._partial is not None:  # its cache is on the same dead context
                involved.append(self._partial.seq)
                self._partial = None
            self._rows, self._kv = [], None
            self.poison(reason, in_flight=involved)
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


def _marks(seqs: list[Seq]) -> frozenset[str]:
    return frozenset().union(*(s.marks for s in seqs)) if seqs else frozenset()


def _started(seq: Seq) -> bool:
    return seq.retried or seq.admitted or bool(seq.generated)


def _cancelled(seq: Seq) -> GenResult:
    return seq.result("cancelled")

