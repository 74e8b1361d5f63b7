"""The service's other workers (k >= 1, `target.workers`): their canaries, and the worker rung for
one that hangs — told to exit through its own control API, its server starting it again while the
others serve. The decision is the policy's (`policy.other_workers`); its restart is the same
procedure as the watched target's (`watchdog.core.procedure`, performed by `watchdog.runtime.restarting`): its
evidence recorded, within the budget, its Event written first, a slot of the workload's ledger
taken (given back once that worker serves again), reported only under strategy `none`; a worker
its control API cannot tell to exit, `timing.EXIT_TRIES` times running, gets the container's rung."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from gpu_watchdog.watchdog.core import edges, policy
from gpu_watchdog.watchdog.core.history import History
from gpu_watchdog.watchdog.core.policy import Decision
from gpu_watchdog.watchdog.core.settings import Settings
from gpu_watchdog.watchdog.edge.executor import Executor
from gpu_watchdog.watchdog.edge.samplers.workers import WorkersSampler
from gpu_watchdog.watchdog.runtime.restarting import Restarts


class WorkerRung:
    def __init__(self, *, settings: Settings, sampler: WorkersSampler, executor: Executor, restarts: Restarts,
                 fold: Callable[[Any], None], clock: Callable[[], float], budget_from_events: bool,
                 decided: Callable[[float, list[Decision]], None] = lambda now, decisions: None) -> None:
        self.settings = settings
        self.decided = decided  # each evaluation and what it decided, for the flight recorder
        self.sampler = sampler
        self.executor = executor
        self.restarts = restarts
        self.fold = fold
        self.clock = clock
        self.budget_from_events = budget_from_events

    async def sample(self, history: Callable[[], History]) -> None:
        self.fold(await self.sampler.canaries())
        h, ex = history(), self.executor
        for k, canaries in list(h.worker_canaries.items()):
            newest = canaries[-1] if canaries else None
            if newest is None or not newest.ok:
                continue
            if edges.push_due(ex.edge, k, newest.ok, newest.instance_id):
                await ex.push_quarantine_to(k, newest.instance_id)
            if newest.served and k in ex.restarting_workers():
                await ex.served(k, newest.instance_id)
        now = self.clock()
        decisions = policy.other_workers(self.settings.policy, h, now, self.budget_from_events)
        self.decided(now, decisions)
        for decision in decisions:
            await self._restart(decision, history)

    async def _restart(self, decision: Decision, history: Callable[[], History]) -> None:
        k = int(decision.detail["worker"])
        if history().restart_in_progress or not self.executor.begin(k):
            return  # another restart is under way: decided again at the next canaries
        await self.restarts.run(k, decision)
