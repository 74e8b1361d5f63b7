"""The service's other workers (k >= 1, `target.workers`): their canaries, and the worker rung for
one that hangs — told to exit through its own control API, its server starting it again while the
others serve. The decision is the policy's (`policy.other_workers`); this carries it out once, as
the watched target's restarts are: within the budget, its Event written first, a slot of the
workload's ledger taken (given back once that worker serves again), reported only under strategy
`none`."""

from __future__ import annotations

import dataclasses
from collections.abc import Awaitable, Callable
from typing import Any

from gpu_watchdog import logs
from gpu_watchdog.watchdog import policy
from gpu_watchdog.watchdog.escalation import CURING_REASONS
from gpu_watchdog.watchdog.executor import BUDGET_FRESH_S, Executor
from gpu_watchdog.watchdog.metrics import WatchdogMetrics
from gpu_watchdog.watchdog.names import BLOCKED_BY_BUDGET, RUNG_WORKER
from gpu_watchdog.watchdog.policy import Decision
from gpu_watchdog.watchdog.samplers.workers import WorkersSampler
from gpu_watchdog.watchdog.samples import RESTART_FAILED, RESTART_HELD, RESTART_REPORTED, History, WorkerRestarted
from gpu_watchdog.watchdog.settings import Settings

log = logs.get("watchdog.workers")

class WorkerRung:
    def __init__(self, settings: Settings, sampler: WorkersSampler, executor: Executor, metrics: WatchdogMetrics,
                 fold: Callable[[Any], None], record: Callable[[Decision, str, float], None],
                 clock: Callable[[], float], read_budget: Callable[[], Awaitable[None]] | None,
                 decided: Callable[[float, list[Decision]], None] = lambda now, decisions: None) -> None:
        self.settings = settings
        self.decided = decided  # each evaluation and what it decided, for the flight recorder
        self.sampler = sampler
        self.executor = executor
        self.metrics = metrics
        self.fold = fold
        self.record = record
        self.clock = clock
        # The workload's Events, where the budget is counted from them (None: this sidecar's own).
        self.read_budget = read_budget

    async def sample(self, history: Callable[[], History]) -> None:
        self.fold(await self.sampler.canaries())
        h, ex = history(), self.executor
        for k, canaries in list(h.worker_canaries.items()):
            newest = canaries[-1] if canaries else None
            if newest is None or not newest.ok:
                continue
            if newest.instance_id is not None and newest.instance_id != ex.worker_pushed_to.get(k):
                # A new process of that worker gets the workload's quarantine now, not at the next sync.
                await ex.push_quarantine_to(k, newest.instance_id)
            if newest.served and k in ex.restarting_workers():
                await ex.served(k, newest.instance_id)
        now = self.clock()
        decisions = policy.other_workers(self.settings.policy, h, now, self.read_budget is not None)
        self.decided(now, decisions)
        for decision in decisions:
            await self._restart(decision, history)

    async def _restart(self, decision: Decision, history: Callable[[], History]) -> None:
        ex = self.executor
        k = int(decision.detail["worker"])
        if history().restart_in_progress or not ex.begin(k):
            return  # another restart is under way: decided again at the next canaries
        try:
            await self._carry_out(decision, k, history)
        except Exception as exc:
            # Refused by the API's own rules or anything unforeseen: nothing done, said, backed off.
            log.exception("restart_failed", reason=decision.reason, rung=RUNG_WORKER, worker=k, error=repr(exc))
            await ex.release_slot(k, "restart failed")
            self._ended(decision, k, RESTART_FAILED, "failed")
        finally:
            ex.end(k)

    async def _carry_out(self, decision: Decision, k: int, history: Callable[[], History]) -> None:
        now, ex = self.clock(), self.executor
        s = self.settings.policy
        from_events = self.read_budget is not None
        if decision.allowed:
            if self.read_budget is not None:
                # Another pod of the workload may have restarted since the last read.
                read_at = history().workload_read_at
                if read_at is None or now - read_at >= BUDGET_FRESH_S:
                    await self.read_budget()
            # Again for each: the restart before this one (of another worker) spent the budget too.
            if policy.budget_remaining(s, history(), self.clock(), from_events) <= 0:
                decision = dataclasses.replace(decision, allowed=False, blocked_by=policy.budget_blocker(
                    s, history(), self.clock(), from_events))
        if not decision.allowed:
            if not _last_blocked(history(), k):
                self.record(decision, BLOCKED_BY_BUDGET, now)
                log.error("restart_blocked", reason=decision.reason, worker=k, blocked_by=decision.blocked_by,
                          detail=decision.detail)
            return
        if ex.restarter.strategy == "none":
            log.warning("restart_not_performed", reason=decision.reason, strategy="none", rung=RUNG_WORKER,
                        worker=k, detail=decision.detail)
            self._ended(decision, k, RESTART_REPORTED, "reported")
            return
        held = await ex.take_slot(decision)
        if held is not None:
            # The fleet's ledger says not now: nothing was done; asked again after the hold's interval.
            if ex.fleet_episode(held):
                self.record(decision, held, self.clock())
            self._ended(decision, k, RESTART_HELD, None, why=held)
            return
        if decision.reason in CURING_REASONS:
            # What was in flight in that worker: the query of death's evidence, before it leaves.
            inflight = await ex.record_failure(decision, self.sampler.client(k))
            if inflight is not None:
                decision = dataclasses.replace(decision, detail={**decision.detail, "inflight": list(inflight)})
        log.warning("decision", action="restart", reason=decision.reason, rung=RUNG_WORKER, worker=k,
                    detail=decision.detail)
        self.record(decision, "started", now)
        outcome = await ex.worker_exit(decision, k, self.sampler.client(k))
        if outcome is None or not outcome.done:
            detail = "its control API refused the exit" if outcome is None else outcome.detail
            await ex.release_slot(k, "restart failed")
            if outcome is not None and outcome.not_recorded:
                ex.note_not_recorded(decision, outcome.detail)
            log.error("restart_failed", reason=decision.reason, rung=RUNG_WORKER, worker=k, error=detail)
            self._ended(decision, k, RESTART_FAILED,
                        "not_recorded" if outcome is not None and outcome.not_recorded else "failed")
            return
        if outcome.recorded:
            ex.note_recorded(decision)
        ex.worker_restarted(k, decision.instance_id)
        self.metrics.restarts.labels(reason=decision.reason, rung=RUNG_WORKER).inc()
        self._ended(decision, k, "restart", "done")
        log.warning("restart_finished", reason=decision.reason, rung=RUNG_WORKER, worker=k, done=True,
                    detail=outcome.detail)

    def _ended(self, decision: Decision, k: int, action: str, record: str | None, why: str = "") -> None:
        self.fold(WorkerRestarted(self.clock(), k, decision.reason, decision.instance_id, action, why))
        if record is not None:
            self.record(decision, record, self.clock())


def _last_blocked(h: History, worker: int) -> bool:
    """The last decision about this worker was a restart the budget blocked: said once, not at every canary."""
    for d in reversed(h.decisions):
        if d.detail.get("worker") == worker:
            return d.outcome == BLOCKED_BY_BUDGET
    return False
