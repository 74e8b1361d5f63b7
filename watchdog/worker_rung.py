"""The service's other workers (k >= 1, `target.workers`): their canaries, and the worker rung for
one that hangs — told to exit through its own control API, its server starting it again while the
others serve. The decision is the policy's (`policy.other_workers`); this carries it out once."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from gpu_watchdog import logs
from gpu_watchdog.watchdog import policy
from gpu_watchdog.watchdog.config import Settings
from gpu_watchdog.watchdog.control_client import ControlError
from gpu_watchdog.watchdog.metrics import WatchdogMetrics
from gpu_watchdog.watchdog.names import BLOCKED_BY_BUDGET, RUNG_WORKER
from gpu_watchdog.watchdog.policy import Decision
from gpu_watchdog.watchdog.samplers.workers import WorkersSampler
from gpu_watchdog.watchdog.samples import History, WorkerRestarted

log = logs.get("watchdog.workers")


class WorkerRung:
    def __init__(self, settings: Settings, sampler: WorkersSampler, metrics: WatchdogMetrics,
                 fold: Callable[[Any], None], record: Callable[[Decision, str, float], None],
                 clock: Callable[[], float], budget_from_events: bool) -> None:
        self.settings = settings
        self.sampler = sampler
        self.metrics = metrics
        self.fold = fold
        self.record = record
        self.clock = clock
        self.budget_from_events = budget_from_events
        self.telling: set[int] = set()  # workers being told now: one exit per hang

    async def sample(self, history: Callable[[], History]) -> None:
        self.fold(await self.sampler.canaries())
        now = self.clock()
        h = history()
        for decision in policy.other_workers(self.settings.policy, h, now, self.budget_from_events):
            k = int(decision.detail["worker"])
            if k in self.telling:
                continue
            if not decision.allowed:
                if not _last_blocked(h, k):
                    self.record(decision, BLOCKED_BY_BUDGET, now)
                    log.error("restart_blocked", reason=decision.reason, worker=k, blocked_by=decision.blocked_by,
                              detail=decision.detail)
                continue
            self.telling.add(k)
            try:
                await self._tell(decision, k, now)
            finally:
                self.telling.discard(k)

    async def _tell(self, decision: Decision, k: int, now: float) -> None:
        log.warning("decision", action="restart", reason=decision.reason, rung=RUNG_WORKER, worker=k,
                    detail=decision.detail)
        self.record(decision, "started", now)
        outcome = "done"
        try:
            await self.sampler.client(k).exit(f"{decision.reason}: worker {k}'s canaries timed out",
                                              decision.instance_id)
            detail = "told to exit; its server starts it again"
        except ControlError as exc:
            if exc.kind not in ("unreachable", "conflict"):
                log.error("restart_failed", reason=decision.reason, rung=RUNG_WORKER, worker=k, error=str(exc))
                self.record(decision, "failed", self.clock())
                return
            detail, outcome = f"gone already ({exc})", "done"
        self.fold(WorkerRestarted(self.clock(), k, decision.reason, decision.instance_id))
        self.metrics.restarts.labels(reason=decision.reason, rung=RUNG_WORKER).inc()
        self.record(decision, outcome, self.clock())
        log.warning("restart_finished", reason=decision.reason, rung=RUNG_WORKER, worker=k, done=True, detail=detail)


def _last_blocked(h: History, worker: int) -> bool:
    """The last decision about this worker was a restart the budget blocked: said once, not at every canary."""
    for d in reversed(h.decisions):
        if d.detail.get("worker") == worker:
            return d.outcome == BLOCKED_BY_BUDGET
    return False
