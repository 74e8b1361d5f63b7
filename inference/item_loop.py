"""The request-level batch loop: one thread per device runs a request-level handler's forward passes.

Items from every request queue here; the loop takes a batch (`item_rules.take`: the window, the
item and token budgets, the admission gate), sorts it by length into forward passes of at most
`--max-batch-tokens` padded tokens, and answers each item as its pass ends. It answers to the
engine front with the same names as the decode loop (`waiting`, `running`, `poison`, `probe`),
and follows the same rules: an OOM empties the cache and splits the pass once, a lone item gets
a clean 503; a sticky CUDA error poisons the process.
"""

from __future__ import annotations

import itertools
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from typing import Any

import torch

from gpu_watchdog.inference import item_rules
from gpu_watchdog.inference.admission import AdmissionGate, Grant
from gpu_watchdog.inference.engine_api import EngineProbe
from gpu_watchdog.inference.errors import FatalCudaError, InferenceOOM, context_lost, is_fatal_cuda, is_oom
from gpu_watchdog.inference.handler import RequestHandler
from gpu_watchdog.inference.loop_thread import LoopHooks, LoopThread
from gpu_watchdog.inference.screen import MARKED

_order = itertools.count()


class Job:
    """One item's life in the loop: queued, then in a forward pass, then an output."""

    def __init__(self, item: Any, tokens: int, weight: float, canary: bool, arrived: float) -> None:
        self.item = item
        self.tokens = tokens
        self.weight = weight
        self.canary = canary
        self.arrived = arrived
        self.order = next(_order)
        self.future: Future[Any] = Future()
        self.grant: Grant | None = None
        self.marks = MARKED.get()  # the per-request faults its request triggers (fault injection)
        self.request = self.order  # the items enqueued together share it (`BatchLoop.enqueue`)


class BatchLoop(LoopThread):
    def __init__(
        self,
        handler: RequestHandler,
        gate: AdmissionGate,
        *,
        max_rows: int,
        max_tokens: int,
        window_s: float,
        hooks: LoopHooks,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        super().__init__("batch", hooks)
        self.handler = handler
        self.gate = gate
        self.max_rows = max_rows
        self.max_tokens = max_tokens
        self.window_s = window_s
        self.clock = clock
        self._waiting: deque[Job] = deque()
        self._batch: list[Job] = []
        self._splits = 0

    # -- called from other threads ----------------------------------------------------------

    def new_job(self, item: Any, tokens: int, weight: float, canary: bool = False) -> Job:
        return Job(item, tokens, weight, canary, self.clock())

    def enqueue(self, jobs: list[Job]) -> None:
        with self._cond:
            if self.poison_reason is not None:
                raise context_lost(self.poison_reason)
            # One call is one request's items: a poisoning tells them apart from bystanders by it.
            request = next(_order)
            for job in jobs:
                job.request = request
                if job.canary:
                    self._waiting.appendleft(job)
                else:
                    self._waiting.append(job)
            self._cond.notify_all()

    def withdraw(self, job: Job) -> bool:
        """Take a job out of the queue if it is still waiting there (timeout, client gone)."""
        with self._cond:
            try:
                self._waiting.remove(job)
            except ValueError:
                return False
        return True

    @property
    def waiting(self) -> int:
        return len(self._waiting)

    @property
    def running(self) -> int:
        return sum(1 for j in self._batch if not j.canary)

    def probe(self) -> EngineProbe:
        return EngineProbe(len(self._batch), self._peak, self._forwards, self._largest, len(self._threads),
                           self._splits)

    def reset_peak(self) -> None:
        self._peak = len(self._batch)

    def poison(self, reason: str, in_flight: Sequence[Job] = ()) -> None:
        """`in_flight`: the loop thread's items of the failed pass, answered `FatalCudaError` here."""
        with self._cond:
            first = self.poison_reason is None
            if first:
                self.poison_reason = reason
            queued = list(self._waiting)
            self._waiting.clear()
            ran = {j.request for j in (*self._batch, *in_flight)}
            self._cond.notify_all()
        if first and self.on_fatal is not None:
            # Before any answer: what was in flight at the failure is frozen while it still is.
            self.on_fatal(reason)
        for job in in_flight:
            _settle(job, FatalCudaError(reason))
        # A request answers with the first of its items to fail: a queued item of one whose items
        # ran (the killer's, perhaps) is told the fatal error too, or the request would answer a
        # retriable 503 and be sent on to the next engine. Only a request that never started
        # anywhere may go elsewhere.
        for job in queued:
            _settle(job, FatalCudaError(reason) if job.request in ran else context_lost(reason))

    # -- the loop thread --------------------------------------------------------------------

    def _run(self) -> None:
        with torch.inference_mode():
            while True:
                with self._cond:
                    while not self._stopping and not self._waiting:
                        self._cond.wait()
                    if self._stopping:
                        return
                    batch, wait_s = self._take()
                    if not batch:
                        # The window is open, or the budget was just lowered: look again soon
                        # (an arrival wakes the loop earlier).
                        self._cond.wait(wait_s if wait_s > 0 else 0.01)
                        continue
                    self._batch = batch
                self._peak = max(self._peak, len(batch))
                try:
                    self._run_batch(batch)
                finally:
                    for job in batch:
                        self._release(job)
                    self._batch = []

    def _take(self) -> tuple[list[Job], float]:
        """Called with the lock held."""
        stats = self.gate.stats()
        limits = item_rules.BatchLimits(self.max_rows, self.max_tokens, self.window_s, stats.capacity, stats.in_use)
        queue = list(self._waiting)
        plan = item_rules.take([item_rules.Item(j.tokens, j.weight, j.arrived, j.canary) for j in queue], limits,
                              self.clock())
        batch: list[Job] = []
        for i in plan.chosen:
            job = queue[i]
            if not job.canary:
                job.grant = self.gate.try_acquire(job.weight)
                if job.grant is None:
                    break  # the budget moved under us (the control API): try again
            batch.append(job)
        for job in batch:
            self._waiting.remove(job)
        return batch, plan.wait_s

    def _run_batch(self, batch: list[Job]) -> None:
        for indices in item_rules.forwards([j.tokens for j in batch], self.max_tokens):
            if self.poison_reason is not None:
                for i in indices:
                    _settle(batch[i], FatalCudaError(self.poison_reason))
                continue
            self._forward([batch[i] for i in indices], retried=False)

    def _forward(self, jobs: list[Job], retried: bool) -> None:
        live = [j for j in jobs if not j.future.done()]
        if not live:
            return
        try:
            if self.faults is not None:
                self.faults.before_forward(len(live), frozenset().union(*(j.marks for j in live)))
            self._forwards += 1
            self._largest = max(self._largest, len(live))
            self._threads.add(threading.get_ident())
            if self.on_step is not None:
                self.on_step(len(live))
            outputs = self.handler.predict([j.item for j in live])
            if len(outputs) != len(live):
                raise RuntimeError(f"the handler returned {len(outputs)} outputs for {len(live)} items")
        except BaseException as exc:  # every failure is classified and answered here
            self._failed(live, exc, retried)
            return
        for job, out in zip(live, outputs, strict=True):
            _settle(job, out)
        answered = sum(1 for j in live if not j.canary)
        if answered and self.on_progress is not None:
            self.on_progress(answered)

    def _failed(self, jobs: list[Job], exc: BaseException, retried: bool) -> None:
        if is_oom(exc):
            if self.on_oom is not None:
                self.on_oom(exc)
            halves = item_rules.after_oom(len(jobs), retried)
            if halves is None:
                for job in jobs:
                    _settle(job, InferenceOOM(str(exc)))
                return
            self._splits += 1
            for start, stop in halves:
                self._forward(jobs[start:stop], retried=True)
            return
        if is_fatal_cuda(exc):
            self.poison(str(exc) or type(exc).__name__, in_flight=jobs)
            return
        # Anything else fails this pass's items and only them; the loop goes on.
        for job in jobs:
            _settle(job, exc)

    def _release(self, job: Job) -> None:
        if job.grant is not None:
            self.gate.release(job.grant)
            job.grant = None
            if self.after_release is not None:
                self.after_release()


def _settle(job: Job, outcome: Any) -> None:
    if job.future.done():
        return
    if isinstance(outcome, BaseException):
        job.future.set_exception(outcome)
    else:
        job.future.set_result(outcome)
