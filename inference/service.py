"""The inference service: loads the model, sizes admission, owns the engine and the process state."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import structlog
import torch

from gpu_watchdog.contract import CanaryProbe, CanaryResult
from gpu_watchdog.inference import cpu_threads, host_memory, scoring
from gpu_watchdog.inference import handler as handler_mod
from gpu_watchdog.inference import model as model_mod
from gpu_watchdog.inference.engine import Batching, Engine
from gpu_watchdog.inference.engine_api import GenRequest
from gpu_watchdog.inference.faults import FaultInjector
from gpu_watchdog.inference.guard import Guard
from gpu_watchdog.inference.handler import Handler, RequestHandler
from gpu_watchdog.inference.handlers.causal_lm import CausalLM
from gpu_watchdog.inference.measure import SHORT_PROMPT, filler, measure, measure_items
from gpu_watchdog.inference.metrics import InferenceMetrics
from gpu_watchdog.inference.model import BUILTIN_NAME
from gpu_watchdog.inference.planner import CostModel, Plan, plan
from gpu_watchdog.inference.screen import StallRule
from gpu_watchdog.inference.settings import CPU_PREFIX_CACHE_MIB, ServeSettings

log = structlog.get_logger(__name__)

# How often `watch_progress` samples the engine's forward-pass counter (the stall rule's grain).
PROGRESS_CHECK_S = 1.0


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


@dataclass
class Started:
    """What exists once the model is loaded and admission sized, built whole in `start`."""

    handler: Handler
    engine: Engine
    admission: Admission


class InferenceService:
    def __init__(self, settings: ServeSettings) -> None:
        self.settings = settings
        # The gate opens wide for the warm-up and the measuring runs; sizing closes it to the budget.
        # The device is picked in `start`, where a failure is the start's (exit 2, probes answering).
        self.guard = Guard(metrics=InferenceMetrics(),
                           faults=FaultInjector() if settings.fault_injection else None,
                           model=settings.served_model_name or settings.model or BUILTIN_NAME)
        self.guard.quarantine_wait = settings.quarantine_wait
        self.metrics = self.guard.metrics
        # Set, on the event loop, once the guard recorded a poisoned context: `serve` lingers, then exits.
        self.fatal_event = asyncio.Event()
        self._started: Started | None = None

    # -- start -------------------------------------------------------------------------------

    async def start(self) -> None:
        """Load the handler's model, warm it up, size admission: one path for every handler, the
        causal LM included (its decode loop, its prefix cache and its measuring are its own)."""
        loop = asyncio.get_running_loop()
        self.guard.on_poisoned = lambda: loop.call_soon_threadsafe(self.fatal_event.set)
        s = self.settings
        self.guard.device = device = model_mod.pick_device(s.device)
        if device.type == "cpu":
            # Before the model and its activations: see host_memory.
            log.info("host_memory", keep_freed_bytes=host_memory.KEEP_BYTES, outcome=host_memory.keep_freed_memory())
        if s.memory_fraction is not None and device.type == "cuda":
            torch.cuda.set_per_process_memory_fraction(s.memory_fraction, device)
        t0 = loop.time()
        # Resolving may import the user's own module: off the event loop, like the load.
        handler = await asyncio.to_thread(handler_mod.resolve, s.handler)
        causal = isinstance(handler, CausalLM)
        if not causal and not isinstance(handler, RequestHandler):
            raise handler_mod.HandlerError(f"--handler {s.handler}: needs decode, predict and encode")
        if not causal:
            _leave_a_core(device)
        await asyncio.to_thread(handler.load, s.model, device)
        window = (s.batch_window_ms or 0.0) / 1000.0
        engine = Engine(handler, device=device, batching=Batching(s.max_batch_tokens, window), guard=self.guard,
                        max_rows=s.max_batch_size, prefill_tokens=s.max_prefill_tokens, max_queue=s.max_queue,
                        memory_watermark=s.memory_watermark)
        log.info("model_loaded", **self._loaded(handler, engine), served_model_name=self.model_name,
                 device=str(device), seconds=round(loop.time() - t0, 3))
        try:
            admission = await asyncio.to_thread(self._size_admission if causal else self._size_items, engine)
        except BaseException:
            engine.stop()  # its loop thread must not outlive a start that failed
            raise
        if causal:
            cache_bytes = self._prefix_cache_bytes()
            engine.enable_prefix_cache(cache_bytes)
            log.info("prefix_cache", max_bytes=cache_bytes,
                     why="auto" if s.prefix_cache_mib is None else "--prefix-cache")
            batching: dict[str, Any] = {}
        else:
            batching = {"max_batch_tokens": s.max_batch_tokens, "batch_window_ms": s.batch_window_ms or 0.0}
        self.guard.gate.set_capacity(admission.capacity)
        engine.cost = admission.cost
        engine.bytes_cost = admission.bytes_cost
        self.metrics.admission_limit.set(admission.limit)
        log.info("admission", mode=admission.mode, limit=admission.limit, capacity=admission.capacity,
                 source=admission.source, max_batch_size=s.max_batch_size, **batching)
        if causal and s.batch_window_ms is not None:
            log.warning("deprecated_flag", flag="--batch-window-ms", value=s.batch_window_ms,
                        note="ignored: requests join the running batch at the next step")
        self._started = Started(handler, engine, admission)
        self.guard.serving()
        log.info("ready", instance_id=self.guard.instance_id,
                 **({"awaits_quarantine_s": s.quarantine_wait} if s.quarantine_wait > 0 else {}))

    def _loaded(self, handler: Handler, engine: Engine) -> dict[str, Any]:
        """What the `model_loaded` line says of the model."""
        if isinstance(handler, CausalLM):
            lm = handler.lm
            return {"model": lm.name, "dtype": str(lm.dtype).replace("torch.", ""), "context_len": lm.context_len,
                    "forward": lm.forward_path, "products": None if lm.lean is None else lm.lean.products}
        return {"handler": self.settings.handler, "capabilities": sorted(handler.capabilities),
                "max_tokens": engine.context_len}

    def _size_items(self, engine: Engine) -> Admission:
        """A request-level handler's admission: warmed up on the canary's item (kernels, allocator),
        then measured in items on CUDA, or the configured slots."""
        s = self.settings
        handler = engine.handler
        engine.predict_now([handler.sample()])
        sized = getattr(handler, "sized_sample", None)
        longest = engine.context_len
        if s.max_concurrency is not None:
            limit = s.max_concurrency
            return Admission("slots", float(limit), limit, None, longest, None, "--max-concurrency")
        if engine.is_cuda and sized is not None and longest > SHORT_PROMPT:
            return self._measure_items(engine, sized, longest)
        # On CPU there is no allocator to measure; a handler that cannot size an item cannot be measured.
        limit = s.cpu_default_concurrency
        return Admission("slots", float(limit), limit, None, longest, None,
                         "default slots (per-item memory not measured)")

    def _measure_items(self, engine: Engine, sized: Callable[[int], Any], longest: int) -> Admission:
        """The memory budget in items of a request-level handler: one item's peak at two sizes, on CUDA."""
        m = measure_items(engine, sized, longest)
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

    def _prefix_cache_bytes(self) -> int:
        mib = self.settings.prefix_cache_mib
        if mib is None:
            mib = 0 if self.guard.device.type == "cuda" else CPU_PREFIX_CACHE_MIB
        return mib << 20

    def _size_admission(self, engine: Engine) -> Admission:
        """The causal LM's admission: warm up, then measure the memory budget on CUDA (`auto`) or
        take the configured slots."""
        s = self.settings

        def warm_up(tokens: int) -> None:
            engine.generate([GenRequest(prompt_ids=filler(engine, tokens - 1), max_tokens=1)])

        # The worst case is the longest sequence the context admits: prompt + output.
        worst = engine.lm.context_len
        warm_up(8)
        if s.max_concurrency is not None:
            warm_up(worst)
            return Admission("slots", float(s.max_concurrency), s.max_concurrency, None, worst, None,
                             "--max-concurrency", float(scoring.kv_bytes(engine.lm, worst)))
        if not engine.is_cuda:
            warm_up(worst)
            n = s.cpu_default_concurrency
            log.info("admission_auto_cpu", note="no CUDA allocator to measure: using a fixed number of slots", slots=n)
            return Admission("slots", float(n), n, None, worst, None, "cpu default (no CUDA budget to measure)",
                             float(scoring.kv_bytes(engine.lm, worst)))
        m = measure(engine, worst - 1, 1)
        # The prefix cache, filled, holds its size on the card for good: it counts with the weights.
        p = self._plan(m, m.base_bytes + self._prefix_cache_bytes())
        limit = max(1, p.max_concurrency)
        return Admission("bytes", float(max(p.budget_bytes, m.cost.peak_bytes(worst))), limit, m.cost, worst, p,
                         "measured")

    # -- state -------------------------------------------------------------------------------

    @property
    def model_name(self) -> str:
        """The id clients use (`model` in requests, `GET /v1/models`)."""
        if self.settings.served_model_name:
            return self.settings.served_model_name
        if not self.settings.model and self.settings.handler != "causal-lm":
            return self.settings.handler.rpartition(":")[2]
        return Path(self.settings.model).name if self.settings.model else BUILTIN_NAME

    @property
    def started(self) -> bool:
        """The model is loaded and admission sized (what `/readyz` waits for, besides health)."""
        return self._started is not None

    ready = started

    @property
    def running(self) -> Started:
        if self._started is None:
            raise RuntimeError("the service has not started: its model is still loading")
        return self._started

    @property
    def engine(self) -> Engine:
        return self.running.engine

    @property
    def handler(self) -> Handler:
        return self.running.handler

    @property
    def admission(self) -> Admission:
        return self.running.admission

    @property
    def poisoned(self) -> bool:
        return self.guard.poisoned

    def is_ready(self) -> bool:
        return self.started and not self.guard.poisoned and not self.guard.drain.active \
            and not self.guard.awaiting_quarantine()

    async def watch_progress(self, rule: StallRule | None = None, every: float = PROGRESS_CHECK_S) -> None:
        """Until cancelled (a task of `serve`, once started): freeze what is in flight when the
        engine's loop stops advancing with work in flight (`screen.StallRule`, `RequestBook.stalled`),
        the evidence of a hang the sidecar reads later; drop it once the loop advances again."""
        rule = rule if rule is not None else StallRule()
        book = self.guard.screen.book
        while True:
            try:
                engine = self.engine
                forwards = engine.probe().forward_batches
                was = rule.stalled
                if rule.observe(forwards, engine.inflight + engine.queued > 0):
                    if not was:
                        frozen = book.stalled()
                        log.warning("engine_stalled", flat_s=rule.after_s, inflight=frozen["inflight_total"],
                                    fingerprints=frozen["inflight"], forward_batches=forwards)
                elif book.resumed():
                    log.info("engine_resumed", forward_batches=forwards)
            except Exception as exc:  # a sample that fails costs this sample, never the watch
                log.warning("progress_watch_failed", error=repr(exc)[:200])
            await asyncio.sleep(every)

    # -- what the control API drives (inference.http_control.ControlTarget) -------------------

    @property
    def inflight(self) -> int:
        return 0 if self._started is None else self._started.engine.inflight

    @property
    def queued(self) -> int:
        return 0 if self._started is None else self._started.engine.queued

    @property
    def admission_capacity(self) -> float:
        return self.guard.gate.capacity if self._started is not None else 0.0

    async def canary(self, timeout: float, probe: CanaryProbe | None = None) -> CanaryResult:
        return await self.engine.canary(timeout, probe)

    def set_admission_limit(self, limit: int) -> None:
        run = self.running
        capacity = run.admission.capacity_for(limit)
        self.guard.set_limit(limit, capacity)
        run.admission = replace(run.admission, capacity=capacity, limit=limit, source="control api")

    def _prefix_cache_report(self) -> dict[str, Any] | None:
        cache = self.engine.prefix_cache
        if cache is None:
            return None
        return {"bytes": cache.bytes, "max_bytes": cache.max_bytes, "blocks": len(cache),
                "queried_tokens": cache.queried_tokens, "hit_tokens": cache.hit_tokens}

    def memory_report(self) -> dict[str, Any]:
        engine, a = self.engine, self.admission
        probe = engine.probe()
        return self.guard.memory_report(
            admission=(a.mode, a.limit, a.source), inflight=engine.inflight, queued=engine.queued,
            ready=True, model=self.model_name,
            engine={
                "active_sequences": probe.active_sequences,
                "peak_active_sequences": probe.peak_active_sequences,
                "forward_batches": probe.forward_batches,
                "largest_batch": probe.largest_batch,
                "threads": probe.threads,
                "preemptions": probe.preemptions,
                "max_batch_size": engine.max_rows,
            },
            prefix_cache=self._prefix_cache_report())
