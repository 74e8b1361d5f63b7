"""The service's other workers (k >= 1, `target.workers`): their canaries, and the worker rung for
one that hangs — told to exit through its own control API, its server starting it again while the
others serve. The decision is the policy's (`policy.other_workers`); this carries it out once, as
the watched target's restarts are: within the budget, its Event written first, a slot of the
workload's ledger taken (given back once that worker serves again), reported only under strategy
`none`. A worker its control API cannot tell to exit, EXIT_TRIES times running, gets the container's
rung (the restart the watched worker gets when it cannot be told)."""

from __future__ import annotations

import dataclasses
from collections.abc import Awaitable, Callable
from typing import Any

from gpu_watchdog import logs
from gpu_watchdog.watchdog import policy
from gpu_watchdog.watchdog.escalation import CURING_REASONS
from gpu_watchdog.watchdog.executor import BUDGET_FRESH_S, Executor
from gpu_watchdog.watchdog.metrics import WatchdogMetrics
from gpu_watchdog.watchdog.names import BLOCKED_BY_BUDGET, RUNG_CONTAINER, RUNG_POD, RUNG_WORKER
from gpu_watchdog.watchdog.policy import Decision
from gpu_watchdog.watchdog.samplers.workers import WorkersSampler
from gpu_watchdog.watchdog.samples import RESTART_FAILED, RESTART_HELD, RESTART_REPORTED, History, WorkerRestarted
from gpu_watchdog.watchdog.settings import Settings
from gpu_watchdog.watchdog.state import RestartBegun

log = logs.get("watchdog.workers")

# Failed exits of one worker process (its control API timed out or answered nothing usable; not
# "gone already") before its restart falls back to the container's rung. Two: one exit that times
# out may be a control loop slow for a moment (a long pause, a flood of requests), and the next try
# comes only after the failure's backoff (30 s); a second is a process wedged past its control API,
# which only a new container frees, and every further try would leave it a zombie on its GPU for
# another, doubled, backoff.
EXIT_TRIES = 2


@dataclasses.dataclass(frozen=True)
class _Untold:
    """A worker process its control API could not tell to exit: how many times running, and why."""

    instance_id: str | None
    tries: int
    error: str

    def same(self, instance_id: str | None) -> bool:
        """Whether `instance_id` is this process (where either is unknown, the worker's is taken for it)."""
        return self.instance_id is None or instance_id is None or self.instance_id == instance_id


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
        self._untold: dict[int, _Untold] = {}  # per worker: its process's failed exits running

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
            if newest.served:
                self._untold.pop(k, None)  # it serves again: a later hang counts its failed exits anew
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
        untold = self._untold_now(k, decision.instance_id)
        if not await self._slot(decision if untold is None else self._container(decision, history, untold), k):
            return
        if decision.reason in CURING_REASONS:
            # What was in flight in that worker: the query of death's evidence, before it leaves.
            inflight = await ex.record_failure(decision, self.sampler.client(k))
            if inflight is not None:
                decision = dataclasses.replace(decision, detail={**decision.detail, "inflight": list(inflight)})
        if untold is not None:
            # Its fallback failed or was held before: that process is not told again.
            await self._fall_back(self._container(decision, history, untold), k, history, untold)
            return
        log.warning("decision", action="restart", reason=decision.reason, rung=RUNG_WORKER, worker=k,
                    detail=decision.detail)
        self.record(decision, "started", now)
        errors: list[str] = []
        outcome = await ex.worker_exit(decision, k, self.sampler.client(k), untold=errors.append)
        if outcome is None:
            untold = self._count_untold(k, decision.instance_id, errors[-1] if errors else "not told")
            if untold.tries >= EXIT_TRIES:
                self.record(decision, "failed", self.clock())
                container = self._container(decision, history, untold)
                # The slot taken for the worker is kept for a restart in place; a pod's restart needs
                # a slot of the pod's rung, the one its replacement gives back.
                if ex.slot_rung(container) == RUNG_POD and ex.fleet.slot_held and not ex.restarting_workers():
                    await ex.give_back_slot(False, f"worker {k} could not be told: its pod restarts instead")
                    if not await self._slot(container, k):
                        return
                await self._fall_back(container, k, history, untold)
                return
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
        self._untold.pop(k, None)
        ex.worker_restarted(k, decision.instance_id)
        self.metrics.restarts.labels(reason=decision.reason, rung=RUNG_WORKER).inc()
        self._ended(decision, k, "restart", "done")
        log.warning("restart_finished", reason=decision.reason, rung=RUNG_WORKER, worker=k, done=True,
                    detail=outcome.detail)

    async def _slot(self, decision: Decision, k: int) -> bool:
        """A slot of the workload's ledger for this restart; False: held (nothing done, asked again
        after the hold's interval)."""
        ex = self.executor
        held = await ex.take_slot(decision)
        if held is None:
            return True
        if ex.fleet_episode(held):
            self.record(decision, held, self.clock())
        self._ended(decision, k, RESTART_HELD, None, why=held)
        return False

    def _untold_now(self, k: int, instance_id: str | None) -> _Untold | None:
        """Worker k's process, if its control API failed to tell it EXIT_TRIES times running (the same
        process: the same instance id, or the same worker where either is unknown)."""
        u = self._untold.get(k)
        return u if u is not None and u.same(instance_id) and u.tries >= EXIT_TRIES else None

    def _count_untold(self, k: int, instance_id: str | None, error: str) -> _Untold:
        u = self._untold.get(k)
        tries = u.tries + 1 if u is not None and u.same(instance_id) else 1
        self._untold[k] = _Untold(instance_id if instance_id is not None or u is None else u.instance_id,
                                  tries, error)
        return self._untold[k]

    def _container(self, decision: Decision, history: Callable[[], History], untold: _Untold) -> Decision:
        """The container's rung for worker k's restart: in place, or the pod where in place no longer
        cures (`policy.rung_for`, as for the watched target). Drained: the watched worker serves, and
        a canary it served would clear the verdict before the kubelet reads it."""
        rung = policy.rung_for(self.settings.policy, history(), decision, self.clock())
        return dataclasses.replace(decision, rung=RUNG_CONTAINER if rung == RUNG_WORKER else rung, drain=True,
                                   detail={**decision.detail, "exit_tries": untold.tries,
                                           "exit_error": untold.error[:200]})

    async def _fall_back(self, container: Decision, k: int, history: Callable[[], History], untold: _Untold) -> None:
        """The watched target's restart (`Executor.restart`) on the container's rung, its slot already
        taken: its Event written first, then the verdict (or the pod's eviction)."""
        ex = self.executor
        log.error("worker_unreachable_fallback", reason=container.reason, worker=k, tries=untold.tries,
                  error=untold.error, rung=container.rung, instance_id=container.instance_id,
                  action=f"its control API could not tell it to exit: the {container.rung} restarts")
        log.warning("decision", action="restart", reason=container.reason, rung=container.rung, worker=k,
                    strategy=ex.restarter.strategy, drain=container.drain, detail=container.detail)
        self.record(container, "started", self.clock())
        self.fold(RestartBegun(self.clock()))
        ended, record = await ex.restart(container, self.fold)
        self.record(container, record, ended.at)
        self.fold(ended)
        ex.restart_ended(ended)
        if ended.done:
            # Every worker is a new process now: what worker k said before no longer counts (policy).
            self._untold.pop(k, None)
        else:
            await ex.release_slot(k, f"restart {record}")
            self._ended(container, k, RESTART_FAILED, None)  # asked again after its backoff
        if container.reason in CURING_REASONS and record != "reported":
            await ex.escalate(container.reason, policy.our_gpus(history()))

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
