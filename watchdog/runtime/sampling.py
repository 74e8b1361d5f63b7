"""The samplers' periodic steps: each samples its source, says what changed (one log line when it
does), folds the sample into the history and has the core evaluate it.

What the loop (`watchdog.runtime.app`) runs on its intervals; nothing here decides.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

from gpu_watchdog import logs
from gpu_watchdog.watchdog.core import edges, policy
from gpu_watchdog.watchdog.core.edges import CanaryDescribed
from gpu_watchdog.watchdog.core.history import History
from gpu_watchdog.watchdog.core.samples import XidEvent
from gpu_watchdog.watchdog.core.settings import Settings
from gpu_watchdog.watchdog.core.state import Outcome
from gpu_watchdog.watchdog.core.timing import TICK_S
from gpu_watchdog.watchdog.edge.effects.restart import Restarter
from gpu_watchdog.watchdog.edge.executor import Executor
from gpu_watchdog.watchdog.edge.metrics import WatchdogMetrics
from gpu_watchdog.watchdog.edge.samplers.assembly import Samplers
from gpu_watchdog.watchdog.runtime.episodes import Episodes

log = logs.get("watchdog")



class Sampling:
    def __init__(self, *, settings: Settings, samplers: Samplers, executor: Executor, restarter: Restarter,
                 metrics: WatchdogMetrics, episodes: Episodes, history: Callable[[], History],
                 fold: Callable[[Outcome], None], evaluate: Callable[[], Awaitable[None]],
                 spawn: Callable[[Awaitable[Any]], None], clock: Callable[[], float],
                 wall_clock: Callable[[], float], read_token: Callable[[], str | None], token: str | None,
                 server_metrics_url: str | None) -> None:
        self.settings = settings
        self.samplers = samplers
        self.executor = executor
        self.restarter = restarter
        self.metrics = metrics
        self.episodes = episodes
        self.history = history
        self.fold = fold
        self.evaluate = evaluate
        self.spawn = spawn
        self.clock = clock
        self.wall_clock = wall_clock
        self.read_token = read_token
        self.token = token
        self.server_metrics_url = server_metrics_url

    def canary_delay(self) -> float:
        return policy.canary_delay(self.settings.canary, self.settings.policy, self.history(), self.clock())

    def server_delay(self) -> float:
        # A failed or timed-out scrape is tried again at the next tick, not a whole interval later.
        last = self.history().server[-1] if self.history().server else None
        return min(TICK_S, self.settings.sampling.server_interval) if last is not None and not last.reachable \
            else self.settings.sampling.server_interval

    async def nvml(self) -> None:
        readout = await self.samplers.nvml.sample(policy.our_gpus(self.history()))
        self.fold(readout)
        for g in readout.gpus:
            if g.lost:
                log.error("gpu_lost", uuid=g.uuid, reason=g.reason)
        await self.evaluate()

    def on_xid(self, ev: XidEvent) -> None:
        h = self.history()
        gpu = next((g for g in h.gpus if g.uuid == ev.uuid and g.index is not None), None)
        index = "" if gpu is None else str(gpu.index)
        self.metrics.xid_errors.labels(gpu=index, uuid=ev.uuid or "", xid=str(ev.xid)).inc()
        log.warning("xid_event", xid=ev.xid, uuid=ev.uuid, critical=ev.xid in policy.XID_CRITICAL,
                    ours=policy.xid_is_ours(h, ev.uuid))
        self.fold(ev)
        self.spawn(self.evaluate())

    async def torch(self) -> None:
        samplers = self.samplers
        assert samplers.allocator is not None and samplers.control is not None
        sample = await samplers.allocator.sample()
        if not sample.reachable and sample.error and sample.error.startswith("unauthorized"):
            samplers.control.set_token(self.read_token())
        before = self.history().idle_memory
        self.fold(sample)
        self.episodes.follow_idle_memory(before, self.history().idle_memory)
        await self.evaluate()

    async def workers(self) -> None:
        workers = self.samplers.workers
        assert workers is not None
        sample = await workers.sample()
        if any((w.memory.error or "").startswith("unauthorized") for w in sample.workers):
            workers.set_token(self.read_token() or self.token)
        seen = self.history().workers
        before = {w.worker: w.memory for w in seen.workers} if seen is not None else {}
        for w in sample.workers:
            last, now = before.get(w.worker), w.memory
            if now.reachable and (last is None or not last.reachable or last.instance_id != now.instance_id):
                log.info("worker_seen", worker=w.worker, url=w.url, instance_id=now.instance_id, device=now.device,
                         uuid=now.uuid)
            elif not now.reachable and (last is None or last.reachable):
                log.warning("worker_unreachable", worker=w.worker, url=w.url, error=now.error)
            if now.poisoned and not (last is not None and last.poisoned):
                # Its agent exits by itself and the pre-fork server starts another: nothing of ours to do.
                log.warning("worker_poisoned", worker=w.worker, url=w.url, reason=now.poison_reason,
                            action="none: the worker exits and its server replaces it")
        self.fold(sample)

    async def device_health(self) -> None:
        device_health = self.samplers.device_health
        assert device_health is not None
        self.fold(await device_health.sample())
        await self.evaluate()

    async def server(self) -> None:
        server_metrics = self.samplers.server_metrics
        assert server_metrics is not None
        sample = await server_metrics.sample()
        last = self.history().server[-1] if self.history().server else None
        if last is None or last.reachable != sample.reachable or last.server != sample.server:
            if sample.reachable:
                log.info("server_metrics", server=sample.server, url=self.server_metrics_url,
                         recognised=sample.server != "unknown")
            else:
                log.warning("server_metrics_unavailable", url=self.server_metrics_url, error=sample.error)
        self.fold(sample)
        self.episodes.follow_target(self.settings.policy, self.history(), self.clock())
        await self.evaluate()

    async def canary(self) -> None:
        samplers = self.samplers
        if self.history().restart_acting:
            return
        sample = await samplers.canary.sample()
        described = samplers.canary.describe()
        if described != self.history().edge.canary:
            self.fold(CanaryDescribed(described))
        if not sample.ok and samplers.control is not None and (
                sample.error_class == "unreachable" or "(401)" in (sample.error or "")):
            # The inference container may have (re)written the token file since we last read it.
            samplers.control.set_token(self.read_token() or self.token)
        served_before = self.history().served_at is not None
        executor = self.executor
        if edges.push_due(executor.edge, 0, sample.ok, sample.instance_id):
            await executor.push_quarantine(sample.instance_id)  # before this pod reads ready again
        self.fold(sample)
        # A drained server's answer is no cure: the verdict stays until a new process serves.
        if sample.served:
            await self.restarter.target_served(self.wall_clock())
        if sample.served and not self.history().restart_in_progress:
            # The ledger's bookkeeping in its own task: an API that is slow must not delay canaries.
            self.spawn(self.executor.target_served())
        if sample.ok:
            self.metrics.canary_duration.observe(sample.latency_s)
            if not served_before and self.history().served_at is not None:
                log.info("target_serving", route=sample.route, latency_s=round(sample.latency_s, 4),
                         starting_s=round(sample.at - max(self.history().started_at, self.history().epoch), 3))
        else:
            self.metrics.canary_failures.labels(error_class=sample.error_class or "other").inc()
            log.warning("canary_failed", error_class=sample.error_class, latency_s=round(sample.latency_s, 4),
                        error=sample.error, route=sample.route, starting=not served_before)
        self.episodes.follow_target(self.settings.policy, self.history(), self.clock())
        await self.evaluate()
