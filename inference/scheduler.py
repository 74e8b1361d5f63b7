"""From requests to GPU work: dynamic batching on the event loop, admission and OOM recovery in threads.

The event loop only groups requests and waits on futures; every torch call, and the admission
gate itself, lives in a worker thread (the gate must bound threads, not coroutines).
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

from inference.admission import AdmissionGate
from inference.engine import Engine, GenRequest, GenResult
from inference.errors import (
    AdmissionTimeout,
    Draining,
    FatalCudaError,
    InferenceOOM,
    QueueFull,
    classify,
    is_fatal_cuda,
    is_oom,
)
from inference.metrics import InferenceMetrics
from watchdog import logs

log = logs.get("inference.scheduler")

Outcome = GenResult | BaseException


@dataclass
class Job:
    request: GenRequest
    deadline: float  # on the scheduler's monotonic clock
    future: asyncio.Future[GenResult]
    batchable: bool = True
    tokens: int = field(init=False)

    def __post_init__(self) -> None:
        self.tokens = len(self.request.prompt_ids) + self.request.max_tokens


@dataclass(frozen=True)
class CanaryResult:
    ok: bool
    latency_s: float
    error_class: str | None
    error: str | None = None


_UNLIMITED_WORKERS = 1_000_000


class Scheduler:
    def __init__(
        self,
        engine: Engine,
        gate: AdmissionGate,
        metrics: InferenceMetrics,
        cost: Callable[[int], float],
        *,
        batch_window_s: float,
        max_batch_size: int,
        max_queue: int,
        gpu_threads: int,
        memory_watermark: float,
        on_fatal: Callable[[str], None],
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.engine = engine
        self.gate = gate
        self.metrics = metrics
        self.cost = cost
        self.batch_window_s = batch_window_s
        self.max_batch_size = max_batch_size
        self.max_queue = max_queue
        self.memory_watermark = memory_watermark
        self.on_fatal = on_fatal
        self.clock = clock
        self.draining = False
        self._pending: list[Job] = []
        self._wakeup = asyncio.Event()
        self._lock = threading.Lock()
        self._queued = 0
        self._inflight = 0
        self._batches_running = 0
        # Two pools. Batches wait for admission on `_waiters`: the gate and the queue bound are the
        # limits, so that pool has none of its own (a third, hidden limit would silently override a
        # configured one); its threads start lazily and never touch CUDA. Admitted batches run on
        # `_runners`, sized to the admission limit: every thread that runs a forward pass keeps a
        # cuBLAS handle and workspace (up to 32 MiB each on recent GPUs) for as long as it lives,
        # memory the planner does not see, so their number must follow the admission limit, not the
        # number of requests that ever queued.
        self._waiters = ThreadPoolExecutor(max_workers=_UNLIMITED_WORKERS, thread_name_prefix="admission")
        self._runners = ThreadPoolExecutor(max_workers=max(1, gpu_threads), thread_name_prefix="gpu")
        self._gpu_threads = max(1, gpu_threads)
        self._canary_executor = ThreadPoolExecutor(max_workers=4, thread_name_prefix="canary")
        self._batcher: asyncio.Task[None] | None = None
        self.oom_count = 0
        self.empty_cache_count = 0

    # -- lifecycle ---------------------------------------------------------------------------

    def start(self) -> None:
        self._batcher = asyncio.get_running_loop().create_task(self._batch_loop(), name="batcher")

    async def stop(self) -> None:
        if self._batcher is not None:
            self._batcher.cancel()
        self._waiters.shutdown(wait=False, cancel_futures=True)
        with self._lock:
            self._runners.shutdown(wait=False, cancel_futures=True)
        self._canary_executor.shutdown(wait=False, cancel_futures=True)

    def set_gpu_threads(self, n: int) -> None:
        """Follow a changed admission limit; the old runners finish their batches, then exit."""
        n = max(1, n)
        with self._lock:
            if n == self._gpu_threads:
                return
            old, self._runners = self._runners, ThreadPoolExecutor(max_workers=n, thread_name_prefix="gpu")
            self._gpu_threads = n
        old.shutdown(wait=False)

    @property
    def queued(self) -> int:
        return self._queued

    @property
    def inflight(self) -> int:
        return self._inflight

    # -- submission --------------------------------------------------------------------------

    async def submit(self, request: GenRequest, timeout: float, batchable: bool = True) -> GenResult:
        if self.engine.poisoned is not None:
            raise FatalCudaError(self.engine.poisoned)
        if self.draining:
            raise Draining("the server is draining")
        with self._lock:
            if self._queued >= self.max_queue:
                raise QueueFull(f"{self._queued} requests already waiting")
            self._queued += 1
        self.metrics.queued.set(self._queued)
        loop = asyncio.get_running_loop()
        job = Job(request, self.clock() + timeout, loop.create_future(), batchable)
        # An idle engine gains nothing from waiting for company: the window would only add latency.
        # Under load a batch is running, so later arrivals still gather.
        idle = self._batches_running == 0 and not self._pending
        if batchable and self.batch_window_s > 0 and self.max_batch_size > 1 and not idle:
            self._pending.append(job)
            self._wakeup.set()
        else:
            self._dispatch([job])
        try:
            return await asyncio.shield(job.future)
        except asyncio.CancelledError:
            # The client went away: stop generating for it at the next token.
            request.cancelled.set()
            raise

    async def _batch_loop(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            await self._wakeup.wait()
            self._wakeup.clear()
            if not self._pending:
                continue
            window_end = loop.time() + self.batch_window_s
            while len(self._pending) < self.max_batch_size and loop.time() < window_end:
                self._wakeup.clear()
                try:
                    await asyncio.wait_for(self._wakeup.wait(), timeout=max(0.0, window_end - loop.time()))
                except TimeoutError:
                    break
            while self._pending:
                batch = self._take_batch()
                self._dispatch(batch)

    def _take_batch(self) -> list[Job]:
        """Oldest first; as many as fit the batch size and, padded to the longest, the whole budget."""
        batch: list[Job] = []
        longest = 0
        for job in list(self._pending):
            if len(batch) >= self.max_batch_size:
                break
            tokens = max(longest, job.tokens)
            if batch and (len(batch) + 1) * self.cost(tokens) > self.gate.capacity + 1e-9:
                break
            batch.append(job)
            longest = tokens
            self._pending.remove(job)
        return batch

    def batch_weight(self, jobs: list[Job]) -> float:
        return len(jobs) * self.cost(max(j.tokens for j in jobs))

    def _dispatch(self, jobs: list[Job]) -> None:
        loop = asyncio.get_running_loop()
        self._batches_running += 1
        fut = loop.run_in_executor(self._waiters, self._run_batch, jobs)

        def deliver(done: asyncio.Future[list[Outcome]]) -> None:
            self._batches_running -= 1
            if done.cancelled():
                outcomes: list[Outcome] = [asyncio.CancelledError() for _ in jobs]
            elif done.exception() is not None:
                exc = done.exception()
                assert exc is not None
                outcomes = [exc for _ in jobs]
            else:
                outcomes = done.result()
            for job, outcome in zip(jobs, outcomes, strict=True):
                if job.future.done():
                    continue
                if isinstance(outcome, BaseException):
                    job.future.set_exception(outcome)
                else:
                    job.future.set_result(outcome)

        fut.add_done_callback(deliver)

    # -- worker thread -----------------------------------------------------------------------

    def _run_batch(self, jobs: list[Job]) -> list[Outcome]:
        weight = self.batch_weight(jobs)
        remaining = min(j.deadline for j in jobs) - self.clock()
        grant = self.gate.acquire(weight, timeout=remaining) if remaining > 0 else None
        with self._lock:
            self._queued -= len(jobs)
            if grant is not None:
                self._inflight += len(jobs)
        self.metrics.queued.set(self._queued)
        if grant is None:
            return [AdmissionTimeout("no admission slot within the queue timeout") for _ in jobs]
        self.metrics.inflight.set(self._inflight)
        try:
            if self.engine.poisoned is not None:
                return [FatalCudaError(self.engine.poisoned) for _ in jobs]
            self.metrics.batch_size.observe(len(jobs))
            with self._lock:
                run = self._runners.submit(self._generate_recovering, jobs)
            return run.result()
        finally:
            self.gate.release(grant)
            with self._lock:
                self._inflight -= len(jobs)
            self.metrics.inflight.set(self._inflight)
            self._memory_guard()

    def _generate_recovering(self, jobs: list[Job]) -> list[Outcome]:
        try:
            return list(self.engine.generate([j.request for j in jobs]))
        except BaseException as exc:
            if not is_oom(exc):
                return [self._failure(exc) for _ in jobs]
            self._count_oom(exc)
            if len(jobs) == 1:
                return [InferenceOOM(str(exc))]
            # A smaller batch needs less activation memory: retry once, in halves.
            half = len(jobs) // 2
            outcomes: list[Outcome] = []
            for part in (jobs[:half], jobs[half:]):
                try:
                    outcomes.extend(self.engine.generate([j.request for j in part]))
                except BaseException as again:
                    if is_oom(again):
                        self._count_oom(again)
                        outcomes.extend(InferenceOOM(str(again)) for _ in part)
                    else:
                        outcomes.extend(self._failure(again) for _ in part)
            return outcomes

    def _count_oom(self, exc: BaseException) -> None:
        self.oom_count += 1
        self.metrics.ooms.inc()
        freed = self.empty_cache()
        log.warning("oom", error=str(exc)[:200], freed_bytes=freed)

    def _failure(self, exc: BaseException) -> BaseException:
        if is_fatal_cuda(exc):
            reason = str(exc) or type(exc).__name__
            if self.engine.poisoned is None:
                self.engine.poison(reason)
                self.metrics.fatal.inc()
                self.on_fatal(reason)
            return FatalCudaError(reason)
        return exc

    def empty_cache(self) -> int:
        freed = self.engine.empty_cache()
        if self.engine.faults is not None:
            self.engine.faults.on_empty_cache()
        self.empty_cache_count += 1
        self.metrics.empty_cache.inc()
        return freed

    def _memory_guard(self) -> None:
        # Flushing after every request would make the next one pay cudaMalloc again; only
        # flush once reserved memory passes the watermark.
        if self.engine.is_cuda and self.engine.reserved_ratio() >= self.memory_watermark:
            freed = self.empty_cache()
            log.info("memory_guard_empty_cache", freed_bytes=freed, watermark=self.memory_watermark)

    # -- canary ------------------------------------------------------------------------------

    async def canary(self, timeout: float) -> CanaryResult:
        """A real one-token generation on the same engine path, through the canary's own slot."""
        loop = asyncio.get_running_loop()
        start = loop.time()
        request = GenRequest(prompt_ids=self.engine.lm.codec.encode("ping"), max_tokens=1)

        def run() -> None:
            if not self.gate.acquire_canary(timeout=timeout):
                raise TimeoutError("canary slot still held by an earlier canary")
            try:
                if self.engine.poisoned is not None:
                    raise FatalCudaError(self.engine.poisoned)
                try:
                    self.engine.generate([request])
                except BaseException as exc:
                    if is_oom(exc):
                        self._count_oom(exc)
                        raise
                    raise self._failure(exc) from exc
            finally:
                self.gate.release_canary()

        try:
            await asyncio.wait_for(loop.run_in_executor(self._canary_executor, run), timeout=timeout)
        except BaseException as exc:
            if isinstance(exc, asyncio.CancelledError):
                raise
            return CanaryResult(False, loop.time() - start, classify(exc), str(exc)[:300] or type(exc).__name__)
        return CanaryResult(True, loop.time() - start, None)
