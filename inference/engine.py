"""The engine's front: submit, stream, canary, drain, health and memory, for one model on one device.

Everything the HTTP layers and the service ask of the GPU goes through here. The poisoned state
lives in one place (the decode loop's `poisoned`): once set, every submit fails at once and the
process exits.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import structlog
import torch

from gpu_watchdog.contract import CanaryResult
from gpu_watchdog.inference import allocator
from gpu_watchdog.inference.admission import AdmissionGate
from gpu_watchdog.inference.decode import DecodeLoop
from gpu_watchdog.inference.drain import Drain
from gpu_watchdog.inference.engine_api import EngineProbe, GenRequest, GenResult
from gpu_watchdog.inference.errors import AdmissionTimeout, ContextLost, Draining, QueueFull, classify
from gpu_watchdog.inference.faults import FaultInjector
from gpu_watchdog.inference.handler import RequestHandler, item_cost
from gpu_watchdog.inference.item_loop import BatchLoop, Job
from gpu_watchdog.inference.loop_thread import LoopHooks
from gpu_watchdog.inference.metrics import InferenceMetrics
from gpu_watchdog.inference.model import LoadedModel
from gpu_watchdog.inference.prefix_cache import PrefixCache
from gpu_watchdog.inference.sequence import Seq
from gpu_watchdog.inference.settings import DEFAULT_PREFILL_TOKENS

__all__ = ["Engine", "EngineProbe", "GenRequest", "GenResult"]

log = structlog.get_logger(__name__)

CANARY_PROMPT = "ping"
# Enough rows that the admission budget, not this cap, is what limits a batch.
DEFAULT_MAX_ROWS = 256


@dataclass(frozen=True)
class Batching:
    """How a request-level handler's items are batched (the causal LM batches by decode steps)."""

    max_tokens: int = 16384  # padded tokens in one forward pass
    window_s: float = 0.0  # how long the oldest queued item waits for company


class Engine:
    def __init__(
        self,
        lm: LoadedModel | None,
        *,
        handler: RequestHandler | None = None,
        device: torch.device | None = None,
        batching: Batching = Batching(),
        gate: AdmissionGate | None = None,
        cost: Callable[[int], float] = lambda tokens: 1.0,
        bytes_cost: Callable[[float], float] = lambda nbytes: 0.0,
        metrics: InferenceMetrics | None = None,
        faults: FaultInjector | None = None,
        max_rows: int = DEFAULT_MAX_ROWS,
        prefill_tokens: int = DEFAULT_PREFILL_TOKENS,
        score_chunk: int | None = None,
        max_queue: int = 1 << 20,
        memory_watermark: float = 0.85,
        on_fatal: Callable[[str], object] | None = None,
        drain: Drain | None = None,
    ) -> None:
        self._lm = lm
        self.handler = handler
        self.device = lm.device if lm is not None else device if device is not None else torch.device("cpu")
        self.gate = gate if gate is not None else AdmissionGate(float(1 << 30))
        self.cost = cost
        # Memory a sequence holds beyond what its tokens cost (a scored prompt's logits), in the
        # gate's units; nothing until admission is sized, while the gate is wide open.
        self.bytes_cost = bytes_cost
        self.metrics = metrics
        self.faults = faults
        self.max_queue = max_queue
        self.memory_watermark = memory_watermark
        self.drain = drain if drain is not None else Drain()
        self.oom_count = 0
        self.empty_cache_count = 0
        self._on_fatal = on_fatal
        m = metrics
        self._loop: DecodeLoop | BatchLoop
        hooks = LoopHooks(faults=faults, on_progress=None if m is None else m.tokens.inc,
                          on_prefill=None if m is None else m.prompt_tokens.inc,
                          on_step=None if m is None else m.batch_size.observe,
                          on_oom=self._count_oom, on_fatal=self._fatal, after_release=self._memory_guard,
                          on_prefix_lookup=None if m is None else m.prefix_lookup)
        if handler is None:
            assert lm is not None, "the causal LM engine needs a loaded model"
            self._loop = DecodeLoop(lm, self.gate, max_rows=max_rows, hooks=hooks, prefill_tokens=prefill_tokens,
                                    score_chunk=score_chunk)
        else:
            self._loop = BatchLoop(handler, self.gate, max_rows=max_rows, max_tokens=batching.max_tokens,
                                   window_s=batching.window_s, hooks=hooks)
        self._loop.start()

    @property
    def lm(self) -> LoadedModel:
        """The causal LM; only the decode routes ask, and they are served only where it runs."""
        if self._lm is None:
            raise RuntimeError("this engine serves a request-level handler, not a causal LM")
        return self._lm

    @property
    def context_len(self) -> int:
        """The longest input the model takes, in tokens."""
        if self._lm is not None:
            return self._lm.context_len
        return int(getattr(self.handler, "max_tokens", 0) or 0)

    @property
    def _decode(self) -> DecodeLoop:
        assert isinstance(self._loop, DecodeLoop), "a causal-LM call on a request-level engine"
        return self._loop

    @property
    def _items(self) -> BatchLoop:
        assert isinstance(self._loop, BatchLoop), "a request-level call on the causal-LM engine"
        return self._loop

    # -- state -------------------------------------------------------------------------------

    @property
    def poisoned(self) -> str | None:
        return self._loop.poisoned

    @property
    def draining(self) -> bool:
        return self.drain.active

    @property
    def is_cuda(self) -> bool:
        return self.device.type == "cuda"

    @property
    def queued(self) -> int:
        return self._loop.waiting

    @property
    def inflight(self) -> int:
        return self._loop.running

    @property
    def max_rows(self) -> int:
        return self._loop.max_rows

    def probe(self) -> EngineProbe:
        return self._loop.probe()

    def reset_peak(self) -> None:
        self._loop.reset_peak()

    def poison(self, reason: str) -> None:
        self._loop.poison(reason)

    def stop(self) -> None:
        self._loop.stop()

    # -- work --------------------------------------------------------------------------------

    def _sequence(self, request: GenRequest) -> Seq:
        if self.poisoned is not None:
            raise ContextLost(f"the GPU context was lost ({self.poisoned[:120]}); the process is restarting")
        return self._decode.new_sequence(request, self.weight(request))

    def weight(self, request: GenRequest) -> float:
        """Its share of the admission budget: the predicted peak of its prompt + max_tokens, and, for a
        prompt to score, the logits that scoring holds at once (`inference.scoring`)."""
        weight = self.cost(len(request.prompt_ids) + request.max_tokens)
        if request.prompt_logprobs is not None:
            weight += self.bytes_cost(float(self._decode.scoring_bytes(len(request.prompt_ids))))
        return weight

    async def submit(self, request: GenRequest, timeout: float) -> GenResult:
        """Queue a request; its result once generated. `timeout` bounds the wait for admission only."""
        if self.poisoned is not None:
            raise ContextLost(f"the GPU context was lost ({self.poisoned[:120]}); the process is restarting")
        if self.draining:
            raise Draining("the server is draining")
        if self._loop.waiting >= self.max_queue:
            raise QueueFull(f"{self._loop.waiting} requests already waiting")
        seq = self._sequence(request)
        self._decode.enqueue(seq)
        self._gauges()
        loop = asyncio.get_running_loop()

        def expire() -> None:
            if self._decode.withdraw(seq, unadmitted_only=True):
                seq.future.set_exception(AdmissionTimeout("no admission slot within the queue timeout"))
                self._gauges()

        timer = loop.call_later(timeout, expire)
        try:
            return await asyncio.shield(asyncio.wrap_future(seq.future))
        except asyncio.CancelledError:
            # The client went away: out of the queue now, or out of the batch at the next step.
            request.cancelled.set()
            if not self._decode.withdraw(seq):
                # A row leaves at the next step, after this returns: the gauges follow it then,
                # set on the event loop like every other update of theirs.
                seq.future.add_done_callback(lambda _: self._gauges_from_thread(loop))
            raise
        finally:
            timer.cancel()
            self._gauges()

    def enable_prefix_cache(self, max_bytes: int) -> None:
        """Reuse the keys and values of prompt beginnings already computed, up to `max_bytes`
        (0: off). Enabled after warm-up and measuring, whose runs must compute every prompt."""
        self._decode.prefix_cache = PrefixCache(max_bytes) if max_bytes > 0 else None

    @property
    def prefix_cache(self) -> PrefixCache | None:
        return self._decode.prefix_cache if isinstance(self._loop, DecodeLoop) else None

    def generate(self, requests: list[GenRequest]) -> list[GenResult]:
        """Run requests to completion from a plain thread (warm-up, measuring, checks)."""
        seqs = [self._sequence(r) for r in requests]
        for seq in seqs:
            self._decode.enqueue(seq)
        return [seq.future.result() for seq in seqs]

    async def predict(self, items: list[Any], timeout: float) -> list[Any]:
        """A request-level handler's outputs for one request's items, batched with everyone else's.

        `timeout` bounds the wait for admission only; the request waits for all its items.
        """
        if self.poisoned is not None:
            raise ContextLost(f"the GPU context was lost ({self.poisoned[:120]}); the process is restarting")
        if self.draining:
            raise Draining("the server is draining")
        loop_ = self._items
        # As for generation: refused once the queue is full, so one large request still gets in.
        if loop_.waiting >= self.max_queue:
            raise QueueFull(f"{loop_.waiting} items already waiting")
        jobs = self._jobs(items)
        loop_.enqueue(jobs)
        self._gauges()
        loop = asyncio.get_running_loop()

        def expire() -> None:
            gone = [j for j in jobs if loop_.withdraw(j)]
            for job in gone:
                if not job.future.done():
                    job.future.set_exception(AdmissionTimeout("no admission slot within the queue timeout"))
            if gone:
                self._gauges()

        timer = loop.call_later(timeout, expire)
        try:
            return list(await asyncio.gather(*(asyncio.shield(asyncio.wrap_future(j.future)) for j in jobs)))
        except BaseException:
            # A failed item or a client gone: the others leave the queue (those running finish).
            for job in jobs:
                loop_.withdraw(job)
            raise
        finally:
            timer.cancel()
            self._gauges()

    def predict_now(self, items: list[Any]) -> list[Any]:
        """Run items to completion from a plain thread (warm-up, measuring, checks)."""
        jobs = self._jobs(items)
        self._items.enqueue(jobs)
        return [job.future.result() for job in jobs]

    def _jobs(self, items: list[Any], canary: bool = False) -> list[Job]:
        assert self.handler is not None
        tokens = item_cost(self.handler)
        jobs = []
        for item in items:
            n = tokens(item)
            jobs.append(self._items.new_job(item, n, 0.0 if canary else self.cost(n), canary=canary))
        return jobs

    def _canary_job(self) -> Seq | Job:
        """The canary's one item, queued at the head: a one-token generation, or the handler's sample."""
        if self.handler is None:
            seq = self._decode.new_sequence(GenRequest(self.lm.codec.encode(CANARY_PROMPT), max_tokens=1), 0.0,
                                            canary=True)
            self._decode.enqueue(seq)
            return seq
        [job] = self._jobs([self.handler.sample()], canary=True)
        self._items.enqueue([job])
        return job

    def _gauges(self) -> None:
        if self.metrics is not None:
            self.metrics.queued.set(self._loop.waiting)
            self.metrics.inflight.set(self._loop.running)

    def _gauges_from_thread(self, loop: asyncio.AbstractEventLoop) -> None:
        try:
            loop.call_soon_threadsafe(self._gauges)
        except RuntimeError:  # the loop is closed: nobody left to read them
            pass

    async def canary(self, timeout: float) -> CanaryResult:
        """A real one-token generation on the same path, joining the running batch at the next step.

        It does not queue behind load: it has a reserved slot (one canary at a time), so a busy
        but healthy server answers it within a step.
        """
        loop = asyncio.get_running_loop()
        start = loop.time()
        # One canary at a time: wait (off the event loop) for an earlier one still in the engine.
        if not await asyncio.to_thread(self.gate.acquire_canary, timeout):
            return CanaryResult(False, loop.time() - start, "timeout", "the previous canary has not finished")
        timeout = max(0.0, timeout - (loop.time() - start))
        try:
            seq = self._canary_job()
        except BaseException as exc:
            self.gate.release_canary()
            return CanaryResult(False, loop.time() - start, classify(exc), str(exc)[:300] or type(exc).__name__)
        seq.future.add_done_callback(lambda _: self.gate.release_canary())
        try:
            await asyncio.wait_for(asyncio.shield(asyncio.wrap_future(seq.future)), timeout=timeout)
        except asyncio.CancelledError:
            raise
        except TimeoutError:
            return CanaryResult(False, loop.time() - start, "timeout", f"no token within {timeout:g} s")
        except BaseException as exc:
            return CanaryResult(False, loop.time() - start, classify(exc), str(exc)[:300] or type(exc).__name__)
        return CanaryResult(True, loop.time() - start, None)

    # -- failures ----------------------------------------------------------------------------

    def _count_oom(self, exc: BaseException) -> None:
        self.oom_count += 1
        if self.metrics is not None:
            self.metrics.ooms.inc()
        freed = self.empty_cache()
        log.warning("oom", error=str(exc)[:200], freed_bytes=freed)

    def _fatal(self, reason: str) -> None:
        if self.metrics is not None:
            self.metrics.fatal.inc()
        if self._on_fatal is not None:
            self._on_fatal(reason)

    # -- allocator ---------------------------------------------------------------------------

    def _memory_guard(self) -> None:
        # Flushing after every request would make the next one pay cudaMalloc again; only
        # flush once reserved memory passes the watermark.
        if self.is_cuda and self.reserved_ratio() >= self.memory_watermark:
            freed = self.empty_cache()
            log.info("memory_guard_empty_cache", freed_bytes=freed, watermark=self.memory_watermark)

    def empty_cache(self) -> int:
        """Return cached blocks to the driver; the bytes freed (0 on CPU)."""
        freed = allocator.empty_cache(self.device)
        if self.faults is not None:
            self.faults.on_empty_cache()
        self.empty_cache_count += 1
        if self.metrics is not None:
            self.metrics.empty_cache.inc()
        return freed

    def reserved_ratio(self) -> float:
        if not self.is_cuda:
            return 0.0
        total = torch.cuda.get_device_properties(self.device).total_memory
        return float(torch.cuda.memory_reserved(self.device)) / float(total)

    def memory(self) -> dict[str, Any]:
        """Allocator figures; honest zeros on CPU, where there is no CUDA allocator."""
        return allocator.figures(self.device)
