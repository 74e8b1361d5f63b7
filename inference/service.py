"""The inference service: loads the model, sizes admission, owns the scheduler and process state."""

from __future__ import annotations

import asyncio
import os
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from inference import model as model_mod
from inference.admission import AdmissionGate
from inference.engine import Engine, GenRequest
from inference.faults import FaultInjector
from inference.metrics import InferenceMetrics
from inference.planner import CostModel, Plan, plan
from inference.scheduler import Scheduler
from inference.settings import ServeSettings
from watchdog import logs

log = logs.get("inference.service")

TERMINATION_LOG = os.environ.get("GPU_WATCHDOG_TERMINATION_LOG", "/dev/termination-log")


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

    def cost(self, tokens: int) -> float:
        return 1.0 if self.cost_model is None else self.cost_model.peak_bytes(tokens)

    def capacity_for(self, limit: int) -> float:
        return float(limit) if self.cost_model is None else limit * self.cost(self.worst_case_tokens)


class InferenceService:
    def __init__(self, settings: ServeSettings) -> None:
        self.settings = settings
        self.metrics = InferenceMetrics()
        self.faults = FaultInjector() if settings.fault_injection else None
        self.instance_id = os.environ.get("GPU_WATCHDOG_INSTANCE_ID") or uuid.uuid4().hex[:12]
        self.ready = False
        self.fatal_reason: str | None = None
        self.fatal_event = asyncio.Event()
        # Set once the poisoned state was reported through the control API (to the watchdog).
        self.poison_reported = asyncio.Event()
        self.engine: Engine | None = None
        self.scheduler: Scheduler | None = None
        self.gate: AdmissionGate | None = None
        self.admission: Admission | None = None
        self._started = 0.0
        self._loop: asyncio.AbstractEventLoop | None = None

    # -- start -------------------------------------------------------------------------------

    async def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._started = self._loop.time()
        s = self.settings
        device = model_mod.pick_device(s.device)
        if s.memory_fraction is not None and device.type == "cuda":
            torch.cuda.set_per_process_memory_fraction(s.memory_fraction, device)
        t0 = self._loop.time()
        lm = await asyncio.to_thread(model_mod.load, s.model, device)
        self.engine = Engine(lm, self.faults, on_tokens=self.metrics.tokens.inc)
        log.info("model_loaded", model=lm.name, device=str(device), dtype=str(lm.dtype).replace("torch.", ""),
                 context_len=lm.context_len, seconds=round(self._loop.time() - t0, 3))
        self.admission = await asyncio.to_thread(self._size_admission)
        self.gate = AdmissionGate(self.admission.capacity)
        self.metrics.admission_limit.set(self.admission.limit)
        self.scheduler = Scheduler(
            self.engine, self.gate, self.metrics, self.admission.cost,
            batch_window_s=s.batch_window_ms / 1000.0, max_batch_size=s.max_batch_size,
            max_queue=s.max_queue, gpu_threads=self.admission.limit, memory_watermark=s.memory_watermark,
            on_fatal=self._on_fatal_threadsafe,
        )
        self.scheduler.start()
        log.info("admission", mode=self.admission.mode, limit=self.admission.limit,
                 capacity=self.admission.capacity, source=self.admission.source,
                 batch_window_ms=s.batch_window_ms, max_batch_size=s.max_batch_size)
        self.ready = True
        log.info("ready", instance_id=self.instance_id)

    def _warm_up(self, tokens: int) -> None:
        assert self.engine is not None
        lm = self.engine.lm
        unit = lm.codec.encode("warm up ")
        prompt = (unit * (tokens // len(unit) + 1))[: max(1, tokens - 1)]
        self.engine.generate([GenRequest(prompt_ids=prompt, max_tokens=1)])

    def _size_admission(self) -> Admission:
        """Warm up, then measure the memory budget on CUDA (`auto`) or take the configured slots."""
        assert self.engine is not None
        s = self.settings
        lm = self.engine.lm
        # The worst case is the longest sequence the context admits: prompt + output.
        worst = lm.context_len
        self._warm_up(8)
        if s.max_concurrency is not None:
            self._warm_up(worst)
            return Admission("slots", float(s.max_concurrency), s.max_concurrency, None, worst, None,
                             "--max-concurrency")
        if not self.engine.is_cuda:
            self._warm_up(worst)
            n = s.cpu_default_concurrency
            log.info("admission_auto_cpu", note="no CUDA allocator to measure: using a fixed number of slots", slots=n)
            return Admission("slots", float(n), n, None, worst, None, "cpu default (no CUDA budget to measure)")
        dev = lm.device
        torch.cuda.synchronize(dev)
        base_reserved = torch.cuda.memory_reserved(dev)
        free, total = torch.cuda.mem_get_info(dev)
        context_bytes = max(0, (total - free) - base_reserved)  # CUDA context and other non-torch use
        if s.memory_fraction is not None:
            # Several workers share the card (or a smaller card is emulated): budget only our share.
            total = int(total * s.memory_fraction)
        short = 16
        peaks: list[tuple[int, float]] = []
        for tokens in (short, worst):
            torch.cuda.reset_peak_memory_stats(dev)
            before = torch.cuda.memory_allocated(dev)
            self._warm_up(tokens)
            torch.cuda.synchronize(dev)
            peaks.append((tokens, float(torch.cuda.max_memory_allocated(dev) - before)))
        cost = CostModel.fit(peaks[0][0], peaks[0][1], peaks[1][0], peaks[1][1])
        # The measuring runs left their blocks cached; the base is what stays once they are returned.
        torch.cuda.empty_cache()
        base = int(torch.cuda.memory_reserved(dev))
        p = plan(total_bytes=int(total), base_bytes=base, peak_bytes=int(cost.peak_bytes(worst)),
                 reserve_ratio=s.reserve_ratio, context_bytes=int(context_bytes))
        log.info("admission_measured", total_bytes=int(total), base_bytes=p.base_bytes, peak_bytes=p.peak_bytes,
                 reserve_bytes=p.reserve_bytes, budget_bytes=p.budget_bytes, max_concurrency=p.max_concurrency,
                 notes=list(p.notes))
        limit = max(1, p.max_concurrency)
        return Admission("bytes", float(max(p.budget_bytes, cost.peak_bytes(worst))), limit, cost, worst, p, "measured")

    # -- state -------------------------------------------------------------------------------

    def uptime(self) -> float:
        return 0.0 if self._loop is None else self._loop.time() - self._started

    @property
    def poisoned(self) -> bool:
        return self.fatal_reason is not None

    def is_ready(self) -> bool:
        return self.ready and not self.poisoned and not (self.scheduler is not None and self.scheduler.draining)

    def set_admission_limit(self, limit: int) -> None:
        assert self.gate is not None and self.admission is not None
        self.gate.set_capacity(self.admission.capacity_for(limit))
        assert self.scheduler is not None
        self.scheduler.set_gpu_threads(limit)
        self.admission = Admission(self.admission.mode, self.gate.capacity, limit, self.admission.cost_model,
                                   self.admission.worst_case_tokens, self.admission.plan, "control api")
        self.metrics.admission_limit.set(limit)
        log.info("admission_limit_changed", limit=limit, capacity=self.gate.capacity)

    def _on_fatal_threadsafe(self, reason: str) -> None:
        assert self._loop is not None
        self._loop.call_soon_threadsafe(self._on_fatal, reason)

    def _on_fatal(self, reason: str) -> None:
        if self.fatal_reason is not None:
            return
        self.fatal_reason = reason
        log.error("fatal_cuda_error", reason=reason, action="exit", instance_id=self.instance_id)
        try:
            path = Path(TERMINATION_LOG)
            # Kubernetes mounts /dev/termination-log; elsewhere only an explicitly named file is written.
            if path.exists() or "GPU_WATCHDOG_TERMINATION_LOG" in os.environ:
                path.write_text(f"gpu-watchdog inference: CUDA context poisoned: {reason}\n", encoding="utf-8")
        except OSError:
            pass
        self.fatal_event.set()

    def memory_report(self) -> dict[str, Any]:
        assert self.engine is not None and self.scheduler is not None and self.gate is not None
        assert self.admission is not None
        figures = self.engine.memory()
        injected = False
        frag = self.faults.fragmentation if self.faults is not None else None
        if frag is not None:
            # Labelled as injected: these are not measurements.
            reserved = figures["reserved_bytes"] or (1 << 30)
            figures["reserved_bytes"] = reserved
            figures["allocated_bytes"] = int(reserved * (1 - frag.ratio))
            figures["active_bytes"] = figures["allocated_bytes"]
            figures["inactive_split_bytes"] = int(reserved * frag.ratio)
            figures["alloc_retries"] = figures["alloc_retries"] + 1
            injected = True
        reserved = figures["reserved_bytes"]
        figures["fragmentation_ratio"] = (
            (reserved - figures["allocated_bytes"]) / reserved if reserved > 0 else 0.0
        )
        stats = self.gate.stats()
        probe = self.engine.probe()
        figures.update(
            injected=injected,
            ooms_caught=self.scheduler.oom_count,
            empty_cache_count=self.scheduler.empty_cache_count,
            uptime_s=round(self.uptime(), 3),
            poisoned=self.poisoned,
            poison_reason=self.fatal_reason,
            inflight=self.scheduler.inflight,
            queued=self.scheduler.queued,
            draining=self.scheduler.draining,
            ready=self.is_ready(),
            instance_id=self.instance_id,
            pid=os.getpid(),
            model=self.engine.lm.name,
            time=time.time(),
            admission={
                "mode": self.admission.mode,
                "limit": self.admission.limit,
                "capacity": stats.capacity,
                "in_use": stats.in_use,
                "holders": stats.holders,
                "waiting": stats.waiting,
                "peak_holders": stats.peak_holders,
                "canary_busy": stats.canary_busy,
                "source": self.admission.source,
            },
            engine={
                "active_sequences": probe.active_sequences,
                "peak_active_sequences": probe.peak_active_sequences,
                "forward_batches": probe.forward_batches,
                "largest_batch": probe.largest_batch,
                "threads": probe.threads,
            },
            faults=None if self.faults is None else self.faults.describe(),
        )
        return figures
