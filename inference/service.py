"""The inference service: loads the model, sizes admission, owns the engine and the process state."""

from __future__ import annotations

import asyncio
import os
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import structlog
import torch

from gpu_watchdog.contract import AdmissionReport, CanaryResult, MemoryReport
from gpu_watchdog.inference import allocator, cpu_threads, host_memory, scoring
from gpu_watchdog.inference import handler as handler_mod
from gpu_watchdog.inference import model as model_mod
from gpu_watchdog.inference.admission import AdmissionGate
from gpu_watchdog.inference.drain import Drain
from gpu_watchdog.inference.engine import Batching, Engine
from gpu_watchdog.inference.engine_api import GenRequest
from gpu_watchdog.inference.faults import FaultInjector
from gpu_watchdog.inference.handler import Handler, RequestHandler
from gpu_watchdog.inference.handlers.causal_lm import CausalLM
from gpu_watchdog.inference.measure import SHORT_PROMPT, filler, measure, measure_items
from gpu_watchdog.inference.metrics import InferenceMetrics
from gpu_watchdog.inference.model import BUILTIN_NAME
from gpu_watchdog.inference.planner import CostModel, Plan, plan
from gpu_watchdog.inference.poison import write_termination_log
from gpu_watchdog.inference.screen import Screen
from gpu_watchdog.inference.settings import CPU_PREFIX_CACHE_MIB, ServeSettings

log = structlog.get_logger(__name__)


def _leave_a_core(device: torch.device) -> None:
    """A request-level model's passes are short and frequent: with a thread on every core, OpenMP
    threads spinning between passes take the core the event loop needs to answer and queue the
    next requests (measured: several times fewer items/s on 2 cores). They all run on the threads
    `cpu_threads` gives decode steps.
    """
    threads = cpu_threads.plan(device)
    if threads is None or threads.stream == torch.get_num_threads():
        return
    torch.set_num_threads(threads.stream)
    log.info("cpu_threads", torch_threads=threads.stream, cores=threads.compute, why="one core left to the event loop")


@dataclass(frozen=True)
class Admission:
    """How admission is sized: `slots` (one unit per sequence) or `bytes` (measured budget)."""

    mode: str
    capacity: float
    limit: int
    cost_model: CostModel | None
    worst_case_tokens: int
    plan: Plan | None
    source: str
    # What one slot stands for in bytes (slots mode): the keys and values of a sequence at the
    # worst-case length, from the model's shapes (`scoring.kv_bytes`); 0 where not known.
    slot_bytes: float = 0.0

    def cost(self, tokens: int) -> float:
        return 1.0 if self.cost_model is None else self.cost_model.peak_bytes(tokens)

    def bytes_cost(self, nbytes: float) -> float:
        """Memory a sequence holds beyond what its tokens cost (a scored prompt's logits), in the
        budget's units: bytes as they are; in slots, the share of a slot they amount to (one more
        slot where a slot's size is not known)."""
        if self.cost_model is not None or nbytes <= 0:
            return max(nbytes, 0.0)
        return nbytes / self.slot_bytes if self.slot_bytes > 0 else 1.0

    def capacity_for(self, limit: int) -> float:
        return float(limit) if self.cost_model is None else limit * self.cost(self.worst_case_tokens)


class InferenceService:
    def __init__(self, settings: ServeSettings) -> None:
        self.settings = settings
        self.metrics = InferenceMetrics()
        self.faults = FaultInjector() if settings.fault_injection else None
        self.instance_id = os.environ.get("GPU_WATCHDOG_INSTANCE_ID") or uuid.uuid4().hex[:12]
        # Fingerprints in flight and the quarantine list (the query of death): one key per model.
        self.screen = Screen(self.instance_id, settings.served_model_name or settings.model or BUILTIN_NAME,
                             self.faults)
        self.screen.on_refused = self.metrics.quarantined.inc
        self.ready = False
        self.fatal_event = asyncio.Event()
        # Set once the poisoned state was reported through the control API (to the watchdog).
        self.poison_reported = asyncio.Event()
        # Whether new work is refused: the control API's drains and the shutdown's (engine and probes read it).
        self.drain = Drain()
        self.engine: Engine | None = None
        self.gate: AdmissionGate | None = None
        self.admission: Admission | None = None
        self._started = 0.0
        self._loop: asyncio.AbstractEventLoop | None = None
        self.handler: Handler | None = None

    # -- start -------------------------------------------------------------------------------

    async def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._started = self._loop.time()
        s = self.settings
        device = model_mod.pick_device(s.device)
        if device.type == "cpu":
            # Before the model and its activations: see host_memory.
            log.info("host_memory", keep_freed_bytes=host_memory.KEEP_BYTES, outcome=host_memory.keep_freed_memory())
        if s.memory_fraction is not None and device.type == "cuda":
            torch.cuda.set_per_process_memory_fraction(s.memory_fraction, device)
        t0 = self._loop.time()
        # Resolving may import the user's own module: off the event loop, like the load.
        self.handler = await asyncio.to_thread(handler_mod.resolve, s.handler)
        if not isinstance(self.handler, CausalLM):
            await self._start_request_level(device)
            return
        await asyncio.to_thread(self.handler.load, s.model, device)
        lm = self.handler.lm
        # The gate opens wide for the warm-up and the measuring runs; sizing closes it to the budget.
        self.gate = AdmissionGate(float(1 << 30))
        self.engine = Engine(lm, gate=self.gate, metrics=self.metrics, faults=self.faults, max_rows=s.max_batch_size,
                             prefill_tokens=s.max_prefill_tokens, max_queue=s.max_queue,
                             memory_watermark=s.memory_watermark, on_fatal=self._on_fatal_threadsafe,
                             drain=self.drain)
        log.info("model_loaded", model=lm.name, served_model_name=self.model_name, device=str(device),
                 dtype=str(lm.dtype).replace("torch.", ""), context_len=lm.context_len, forward=lm.forward_path,
                 products=None if lm.lean is None else lm.lean.products,
                 seconds=round(self._loop.time() - t0, 3))
        self.admission = await asyncio.to_thread(self._size_admission)
        cache_bytes = self._prefix_cache_bytes()
        self.engine.enable_prefix_cache(cache_bytes)
        log.info("prefix_cache", max_bytes=cache_bytes,
                 why="auto" if s.prefix_cache_mib is None else "--prefix-cache")
        self.gate.set_capacity(self.admission.capacity)
        self.engine.cost = self.admission.cost
        self.engine.bytes_cost = self.admission.bytes_cost
        self.metrics.admission_limit.set(self.admission.limit)
        log.info("admission", mode=self.admission.mode, limit=self.admission.limit,
                 capacity=self.admission.capacity, source=self.admission.source, max_batch_size=s.max_batch_size)
        if s.batch_window_ms is not None:
            log.warning("deprecated_flag", flag="--batch-window-ms", value=s.batch_window_ms,
                        note="ignored: requests join the running batch at the next step")
        self.ready = True
        log.info("ready", instance_id=self.instance_id)

    async def _start_request_level(self, device: torch.device) -> None:
        """Start a request-level handler (embeddings, classifier, one's own): the batch loop, then admission."""
        assert self._loop is not None and self.handler is not None
        s = self.settings
        handler = self.handler
        if not isinstance(handler, RequestHandler):
            raise handler_mod.HandlerError(f"--handler {s.handler}: needs decode, predict and encode")
        t0 = self._loop.time()
        _leave_a_core(device)
        await asyncio.to_thread(handler.load, s.model, device)
        self.gate = AdmissionGate(float(1 << 30))
        window = (s.batch_window_ms or 0.0) / 1000.0
        self.engine = Engine(None, handler=handler, device=device, batching=Batching(s.max_batch_tokens, window),
                             gate=self.gate, metrics=self.metrics, faults=self.faults, max_rows=s.max_batch_size,
                             max_queue=s.max_queue, memory_watermark=s.memory_watermark,
                             on_fatal=self._on_fatal_threadsafe, drain=self.drain)
        log.info("model_loaded", handler=s.handler, served_model_name=self.model_name, device=str(device),
                 capabilities=sorted(handler.capabilities), max_tokens=self.engine.context_len,
                 seconds=round(self._loop.time() - t0, 3))
        # Warm up on the canary's item (kernels, allocator), then size admission.
        await asyncio.to_thread(self.engine.predict_now, [handler.sample()])
        sized = getattr(handler, "sized_sample", None)
        longest = self.engine.context_len
        if s.max_concurrency is not None:
            limit = s.max_concurrency
            self.admission = Admission("slots", float(limit), limit, None, longest, None, "--max-concurrency")
        elif self.engine.is_cuda and sized is not None and longest > SHORT_PROMPT:
            self.admission = await asyncio.to_thread(self._measure_items, sized, longest)
        else:
            # On CPU there is no allocator to measure; a handler that cannot size an item cannot be measured.
            limit = s.cpu_default_concurrency
            self.admission = Admission("slots", float(limit), limit, None, longest, None,
                                       "default slots (per-item memory not measured)")
        self.gate.set_capacity(self.admission.capacity)
        self.engine.cost = self.admission.cost
        self.metrics.admission_limit.set(self.admission.limit)
        log.info("admission", mode=self.admission.mode, limit=self.admission.limit,
                 capacity=self.admission.capacity, source=self.admission.source, max_batch_size=s.max_batch_size,
                 max_batch_tokens=s.max_batch_tokens, batch_window_ms=s.batch_window_ms or 0.0)
        self.ready = True
        log.info("ready", instance_id=self.instance_id)

    def _measure_items(self, sized: Callable[[int], Any], longest: int) -> Admission:
        """The memory budget in items of a request-level handler: one item's peak at two sizes, on CUDA."""
        assert self.engine is not None
        m = measure_items(self.engine, sized, longest)
        p = self._plan(m, m.base_bytes, per="item")
        return Admission("bytes", float(max(p.budget_bytes, m.cost.peak_bytes(longest))), max(1, p.max_concurrency),
                         m.cost, longest, p, "measured")

    def _plan(self, m: Any, base_bytes: int, **context: Any) -> Plan:
        """The budget from measured figures (`m`: total, peak and context bytes), logged."""
        s = self.settings
        # Several workers share the card (or a smaller card is emulated): budget only our share.
        total = m.total_bytes if s.memory_fraction is None else int(m.total_bytes * s.memory_fraction)
        p = plan(total_bytes=total, base_bytes=base_bytes, peak_bytes=m.peak_bytes, reserve_ratio=s.reserve_ratio,
                 context_bytes=m.context_bytes)
        log.info("admission_measured", total_bytes=total, base_bytes=p.base_bytes, peak_bytes=p.peak_bytes,
                 reserve_bytes=p.reserve_bytes, budget_bytes=p.budget_bytes, max_concurrency=p.max_concurrency,
                 **context, notes=list(p.notes))
        return p

    def _warm_up(self, tokens: int) -> None:
        assert self.engine is not None
        self.engine.generate([GenRequest(prompt_ids=filler(self.engine, tokens - 1), max_tokens=1)])

    def _prefix_cache_bytes(self) -> int:
        mib = self.settings.prefix_cache_mib
        if mib is None:
            mib = 0 if self.engine is not None and self.engine.is_cuda else CPU_PREFIX_CACHE_MIB
        return mib << 20

    def _size_admission(self) -> Admission:
        """Warm up, then measure the memory budget on CUDA (`auto`) or take the configured slots."""
        assert self.engine is not None
        s = self.settings
        # The worst case is the longest sequence the context admits: prompt + output.
        worst = self.engine.lm.context_len
        self._warm_up(8)
        if s.max_concurrency is not None:
            self._warm_up(worst)
            return Admission("slots", float(s.max_concurrency), s.max_concurrency, None, worst, None,
                             "--max-concurrency", float(scoring.kv_bytes(self.engine.lm, worst)))
        if not self.engine.is_cuda:
            self._warm_up(worst)
            n = s.cpu_default_concurrency
            log.info("admission_auto_cpu", note="no CUDA allocator to measure: using a fixed number of slots", slots=n)
            return Admission("slots", float(n), n, None, worst, None, "cpu default (no CUDA budget to measure)",
                             float(scoring.kv_bytes(self.engine.lm, worst)))
        m = measure(self.engine, worst - 1, 1)
        # The prefix cache, filled, holds its size on the card for good: it counts with the weights.
        p = self._plan(m, m.base_bytes + self._prefix_cache_bytes())
        limit = max(1, p.max_concurrency)
        return Admission("bytes", float(max(p.budget_bytes, m.cost.peak_bytes(worst))), limit, m.cost, worst, p,
                         "measured")

    # -- state -------------------------------------------------------------------------------

    def uptime(self) -> float:
        return 0.0 if self._loop is None else self._loop.time() - self._started

    @property
    def model_name(self) -> str:
        """The id clients use (`model` in requests, `GET /v1/models`)."""
        if self.settings.served_model_name:
            return self.settings.served_model_name
        if not self.settings.model and self.settings.handler != "causal-lm":
            return self.settings.handler.rpartition(":")[2]
        return Path(self.settings.model).name if self.settings.model else BUILTIN_NAME

    @property
    def fatal_reason(self) -> str | None:
        return None if self.engine is None else self.engine.poisoned

    @property
    def poisoned(self) -> bool:
        return self.fatal_reason is not None

    @property
    def draining(self) -> bool:
        return self.drain.active

    def is_ready(self) -> bool:
        return self.ready and not self.poisoned and not self.draining

    # -- what the control API drives (inference.http_control.ControlTarget) -------------------

    @property
    def started(self) -> bool:
        return self.engine is not None and self.ready

    @property
    def inflight(self) -> int:
        return 0 if self.engine is None else self.engine.inflight

    @property
    def queued(self) -> int:
        return 0 if self.engine is None else self.engine.queued

    @property
    def admission_capacity(self) -> float:
        return 0.0 if self.gate is None else self.gate.capacity

    def empty_cache(self) -> int:
        assert self.engine is not None
        return self.engine.empty_cache()

    async def canary(self, timeout: float) -> CanaryResult:
        assert self.engine is not None
        return await self.engine.canary(timeout)

    def set_admission_limit(self, limit: int) -> None:
        assert self.gate is not None and self.admission is not None
        self.gate.set_capacity(self.admission.capacity_for(limit))
        self.admission = replace(self.admission, capacity=self.gate.capacity, limit=limit, source="control api")
        self.metrics.admission_limit.set(limit)
        log.info("admission_limit_changed", limit=limit, capacity=self.gate.capacity)

    def _on_fatal_threadsafe(self, reason: str) -> None:
        # What was in flight at the failure, frozen here in the engine's thread: by the time the
        # loop runs `_on_fatal`, those requests have been answered.
        self.screen.book.failed()
        assert self._loop is not None
        self._loop.call_soon_threadsafe(self._on_fatal, reason)

    def _on_fatal(self, reason: str) -> None:
        if self.fatal_event.is_set():
            return
        at_failure = self.screen.book.failed()
        log.error("fatal_cuda_error", reason=reason, action="exit", instance_id=self.instance_id,
                  inflight=at_failure["inflight"])
        write_termination_log(reason, at_failure["inflight"])
        self.fatal_event.set()

    def _prefix_cache_report(self) -> dict[str, Any] | None:
        cache = None if self.engine is None else self.engine.prefix_cache
        if cache is None:
            return None
        return {"bytes": cache.bytes, "max_bytes": cache.max_bytes, "blocks": len(cache),
                "queried_tokens": cache.queried_tokens, "hit_tokens": cache.hit_tokens}

    def memory_report(self) -> dict[str, Any]:
        assert self.engine is not None and self.gate is not None
        assert self.admission is not None
        figures = allocator.with_fragmentation(self.engine.memory(),
                                               None if self.faults is None else self.faults.fragmentation)
        stats = self.gate.stats()
        probe = self.engine.probe()
        return MemoryReport(
            **figures,
            ooms_caught=self.engine.oom_count,
            empty_cache_count=self.engine.empty_cache_count,
            uptime_s=round(self.uptime(), 3),
            poisoned=self.poisoned,
            poison_reason=self.fatal_reason,
            inflight=self.engine.inflight,
            queued=self.engine.queued,
            draining=self.drain.active,
            drain_deadline_left_s=self.drain.left_s(),
            ready=self.is_ready(),
            instance_id=self.instance_id,
            pid=os.getpid(),
            model=self.model_name,
            time=time.time(),
            admission=AdmissionReport(
                mode=self.admission.mode, limit=self.admission.limit, capacity=stats.capacity,
                in_use=stats.in_use, holders=stats.holders, waiting=stats.waiting,
                peak_holders=stats.peak_holders, canary_busy=stats.canary_busy, source=self.admission.source),
            engine={
                "active_sequences": probe.active_sequences,
                "peak_active_sequences": probe.peak_active_sequences,
                "forward_batches": probe.forward_batches,
                "largest_batch": probe.largest_batch,
                "threads": probe.threads,
                "preemptions": probe.preemptions,
                "max_batch_size": self.engine.max_rows,
            },
            prefix_cache=self._prefix_cache_report(),
            faults=None if self.faults is None else self.faults.describe(),
        ).to_json()
