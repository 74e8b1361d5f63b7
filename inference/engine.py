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

from inference import allocator
from inference.admission import AdmissionGate
from inference.decode import DecodeLoop, EngineProbe, GenRequest, GenResult, Seq
from inference.errors import AdmissionTimeout, Draining, FatalCudaError, QueueFull, classify
from inference.faults import FaultInjector
from inference.metrics import InferenceMetrics
from inference.model import LoadedModel

__all__ = ["CanaryResult", "Engine", "EngineProbe", "GenRequest", "GenResult"]

log = structlog.get_logger(__name__)

CANARY_PROMPT = "ping"
# Enough rows that the admission budget, not this cap, is what limits a batch.
DEFAULT_MAX_ROWS = 256


@dataclass(frozen=True)
class CanaryResult:
    ok: bool
    latency_s: float
    error_class: str | None
    error: str | None = None


class Engine:
    def __init__(
        self,
        lm: LoadedModel,
        *,
        gate: AdmissionGate | None = None,
        cost: Callable[[int], float] = lambda tokens: 1.0,
        metrics: InferenceMetrics | None = None,
        faults: FaultInjector | None = None,
        max_rows: int = DEFAULT_MAX_ROWS,
        max_queue: int = 1 << 20,
        memory_watermark: float = 0.85,
        on_fatal: Callable[[str], object] | None = None,
    ) -> None:
        self.lm = lm
        self.gate = gate if gate is not None else AdmissionGate(float(1 << 30))
        self.cost = cost
        self.metrics = metrics
        self.faults = faults
        self.max_queue = max_queue
        self.memory_watermark = memory_watermark
        self.draining = False
        self.oom_count = 0
        self.empty_cache_count = 0
        self._on_fatal = on_fatal
        m = metrics
        self._loop = DecodeLoop(
            lm, self.gate, max_rows=max_rows, faults=faults,
            on_tokens=None if m is None else m.tokens.inc,
            on_step=None if m is None else m.batch_size.observe,
            on_oom=self._count_oom, on_fatal=self._fatal, after_release=self._memory_guard,
        )
        self._loop.start()

    # -- state -------------------------------------------------------------------------------

    @property
    def poisoned(self) -> str | None:
        return self._loop.poisoned

    @property
    def is_cuda(self) -> bool:
        return self.lm.device.type == "cuda"

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
            raise FatalCudaError(self.poisoned)
        weight = self.cost(len(request.prompt_ids) + request.max_tokens)
        return self._loop.new_sequence(request, weight)

    async def submit(self, request: GenRequest, timeout: float) -> GenResult:
        """Queue a request; its result once generated. `timeout` bounds the wait for admission only."""
        if self.poisoned is not None:
            raise FatalCudaError(self.poisoned)
        if self.draining:
            raise Draining("the server is draining")
        if self._loop.waiting >= self.max_queue:
            raise QueueFull(f"{self._loop.waiting} requests already waiting")
        seq = self._sequence(request)
        self._loop.enqueue(seq)
        self._gauges()
        loop = asyncio.get_running_loop()

        def expire() -> None:
            if self._loop.withdraw(seq):
                seq.future.set_exception(AdmissionTimeout("no admission slot within the queue timeout"))
                self._gauges()

        timer = loop.call_later(timeout, expire)
        try:
            return await asyncio.shield(asyncio.wrap_future(seq.future))
        except asyncio.CancelledError:
            # The client went away: out of the queue now, or out of the batch at the next step.
            request.cancelled.set()
            self._loop.withdraw(seq)
            raise
        finally:
            timer.cancel()
            self._gauges()

    def generate(self, requests: list[GenRequest]) -> list[GenResult]:
        """Run requests to completion from a plain thread (warm-up, measuring, checks)."""
        seqs = [self._sequence(r) for r in requests]
        for seq in seqs:
            self._loop.enqueue(seq)
        return [seq.future.result() for seq in seqs]

    def _gauges(self) -> None:
        if self.metrics is not None:
            self.metrics.queued.set(self._loop.waiting)
            self.metrics.inflight.set(self._loop.running)

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
            seq = self._loop.new_sequence(GenRequest(self.lm.codec.encode(CANARY_PROMPT), max_tokens=1), 0.0,
                                          canary=True)
            self._loop.enqueue(seq)
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
        freed = allocator.empty_cache(self.lm.device)
        if self.faults is not None:
            self.faults.on_empty_cache()
        self.empty_cache_count += 1
        if self.metrics is not None:
            self.metrics.empty_cache.inc()
        return freed

    def reserved_ratio(self) -> float:
        if not self.is_cuda:
            return 0.0
        total = torch.cuda.get_device_properties(self.lm.device).total_memory
        return float(torch.cuda.memory_reserved(self.lm.device)) / float(total)

    def memory(self) -> dict[str, Any]:
        """Allocator figures; honest zeros on CPU, where there is no CUDA allocator."""
        return allocator.figures(self.lm.device)
