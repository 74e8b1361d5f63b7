"""The restart procedure's edge: each step `watchdog.core.procedure` decides, performed and answered.

One procedure for every worker (0: the watched target) and every rung: this performs the step it
is handed, folds what the step says into the history, and asks the procedure for the next. It
decides nothing of its own; the effects themselves are the executor's (`watchdog.edge.executor`).
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any

from gpu_watchdog import logs
from gpu_watchdog.watchdog.core import policy, procedure
from gpu_watchdog.watchdog.core.escalation import SUSPECT_REASONS
from gpu_watchdog.watchdog.core.history import History
from gpu_watchdog.watchdog.core.names import BLOCKED_BY_BUDGET, RUNG_WORKER, WOULD
from gpu_watchdog.watchdog.core.policy import Decision
from gpu_watchdog.watchdog.core.procedure import Facts, Procedure, Step
from gpu_watchdog.watchdog.core.samples import (
    RESTART_FAILED,
    RESTART_HELD,
    RESTART_REPORTED,
    WorkerRestarted,
    WorkerUntold,
)
from gpu_watchdog.watchdog.core.settings import Settings
from gpu_watchdog.watchdog.core.state import Outcome, RestartBegun, RestartCancelled, RestartEnded, RestartHeld
from gpu_watchdog.watchdog.edge.control_client import ControlClient
from gpu_watchdog.watchdog.edge.executor import Executor
from gpu_watchdog.watchdog.edge.keep_out import KeepOut
from gpu_watchdog.watchdog.edge.metrics import WatchdogMetrics

log = logs.get("watchdog")


class Restarts:
    """Carries out restarts, one at a time (`Executor.begin`), step by step."""

    def __init__(self, *, settings: Settings, executor: Executor, metrics: WatchdogMetrics,
                 fold: Callable[[Outcome], None], record_decision: Callable[[Decision, str, float], None],
                 clock: Callable[[], float], history: Callable[[], History],
                 read_budget: Callable[[], Awaitable[None]] | None, keep_out: KeepOut | None,
                 worker_control: Callable[[int], ControlClient | None],
                 spawn: Callable[[Awaitable[Any]], None],
                 restarted: Callable[[RestartEnded], None],
                 escalate: Callable[[str], Awaitable[None]],
                 sleep: Callable[[float], Awaitable[None]] = asyncio.sleep) -> None:
        self.settings = settings
        self.executor = executor
        self.metrics = metrics
        self.fold = fold
        self.record_decision = record_decision
        self.clock = clock
        self.history = history
        # The workload's Events, where the budget is counted from them (None: this sidecar's own).
        self.read_budget = read_budget
        self.keep_out = keep_out
        self.worker_control = worker_control
        self.spawn = spawn
        self.restarted = restarted  # a restart done: the target's canary is asked again
        self.escalate = escalate
        self.sleep = sleep  # the slot's wait (a simulation passes its own time)

    def facts(self) -> Facts:
        ex = self.executor
        return Facts(now=self.clock(), strategy=ex.restarter.strategy, slot_held=ex.fleet.slot_held,
                     in_place=bool(ex.restarting_workers()), keep_out=self.keep_out is not None,
                     slot_taken_at=ex.edge.slot_taken_at)

    def begin(self, worker: int, decision: Decision, asked_again: bool = False) -> Procedure:
        """`worker`'s restart, begun (`Executor.begin`) by the caller: its procedure, no step taken yet."""
        p = procedure.begin(self.settings.policy, self.history(), worker, decision, self.clock(),
                            self.read_budget is not None, asked_again)
        if worker == 0 and decision.enforced:
            # The driver's word that the GPU needs a reset or the node a reboot: the Node hears of it
            # now, whether or not this restart goes ahead.
            self.spawn(self.executor.report_driver_word(decision))
        return p

    async def run(self, worker: int, decision: Decision, asked_again: bool = False) -> None:
        """`worker`'s restart, begun (`Executor.begin`) by the caller and ended here."""
        p: Procedure | None = self.begin(worker, decision, asked_again)
        while p is not None:  # `step` ends it (`Executor.end`) however the restart ends
            p = await self.step(p)

    async def step(self, p: Procedure) -> Procedure | None:
        """The procedure's next step, performed and answered: the procedure as it stands after it, or
        None once the restart is over (ended: `Executor.end`)."""
        ex, worker = self.executor, p.worker
        step: Step | None = None
        try:
            step = procedure.next_step(self.settings.policy, self.history(), p, self.facts())
            if step is None:
                ex.end(worker)
                return None
            return await self._perform(p, step)
        except asyncio.CancelledError:
            ex.end(worker)
            raise
        except Exception as exc:
            kind = None if step is None else step.kind
            # Refused by the API's own rules or anything unforeseen: said, and backed off.
            log.exception("restart_failed", reason=p.decision.reason, rung=p.decision.rung, worker=worker,
                          error=repr(exc), step=kind)
            if kind != procedure.RESTART:
                # Nothing was done: our slot back. After the act it may have been (the pod going), and
                # the slot is given back by what follows it (its replacement serving, or its timeout).
                await ex.release_slot(worker, "restart failed")
            if worker and kind != procedure.RESTART:
                self._ended(p.decision, worker, RESTART_FAILED, "failed")
            if self.history().restart_in_progress and (worker == 0 or kind == procedure.RESTART):
                self.fold(RestartEnded(self.clock(), p.decision.reason, False, False, False, p.decision.rung,
                                       p.decision.instance_id))
            ex.end(worker)
            return None

    async def _perform(self, p: Procedure, step: Step) -> Procedure:
        ex, d, k, now = self.executor, step.decision, p.worker, self.clock()
        kind = step.kind
        if kind == procedure.STACKS:
            # Where it is stuck, read while it still is: the restart that follows takes that with it.
            control = ex.control if k == 0 else self.worker_control(k)
            return procedure.advance(p, step, stacks=await ex.take_stacks(d, k, control))
        if kind == procedure.EVIDENCE:
            # What was in flight, read first (a poisoned server leaves a few seconds after it is seen):
            # the query of death's evidence, recorded before anything restarts.
            control = ex.control if k == 0 else self.worker_control(k)
            inflight = await ex.record_failure(d, control) if control is not None else None
            return procedure.advance(p, step, inflight=inflight)
        if kind == procedure.READ_BUDGET:
            assert self.read_budget is not None
            await self.read_budget()
        elif kind == procedure.BLOCKED:
            if k == 0:
                self.fold(RestartCancelled(now))  # the next evaluation reports it blocked
            elif not _last_blocked(self.history(), k):
                self.record_decision(d, BLOCKED_BY_BUDGET, now)
                log.error("restart_blocked", reason=d.reason, worker=k, blocked_by=d.blocked_by, detail=d.detail)
        elif kind == procedure.REPORTED:
            log.warning("restart_not_performed", reason=d.reason, strategy="none", rung=RUNG_WORKER, worker=k,
                        detail=d.detail)
            self._ended(d, k, RESTART_REPORTED, "reported")
        elif kind == procedure.WOULD:
            await self._would(p, d)
        elif kind == procedure.TAKE_SLOT:
            return procedure.advance(p, step, held=await ex.take_slot(d))
        elif kind == procedure.HELD:
            assert p.held is not None
            # The fleet's ledger says not now: nothing was done; asked again shortly (policy).
            if ex.fleet_episode(p.held):
                self.record_decision(d, p.held, now)
            if k == 0:
                self.fold(RestartHeld(now, d.reason, p.held))
            else:
                self._ended(d, k, RESTART_HELD, None, why=p.held)
        elif kind == procedure.KEEP_OUT:
            assert self.keep_out is not None
            # Before the pod goes: its replacement must not be placed on the card the evidence is about.
            await self.keep_out.before_pod_rung(d, self.history().pod_gpus, ex.suspects)
        elif kind == procedure.EXIT:
            return await self._exit(p, step)
        elif kind == procedure.EXITED:
            # Folded: our slot (if any) is held until that worker serves again as a new process.
            self.metrics.restarts.labels(reason=d.reason, rung=RUNG_WORKER).inc()
            self._ended(d, k, "restart", "done", detail=p.exit_detail, recorded=True if p.exit_recorded else None)
            log.warning("restart_finished", reason=d.reason, rung=RUNG_WORKER, worker=k, done=True,
                        detail=p.exit_detail)
        elif kind == procedure.EXIT_FAILED:
            detail = p.exit_detail or "its control API refused the exit"
            await ex.release_slot(k, "restart failed")
            refused = p.exit == procedure.NOT_RECORDED
            if refused:
                ex.not_recorded_said(d, detail, recorded=False)
            log.error("restart_failed", reason=d.reason, rung=RUNG_WORKER, worker=k, error=detail)
            self._ended(d, k, RESTART_FAILED, "not_recorded" if refused else "failed", detail=detail,
                        recorded=False if refused else None)
        elif kind == procedure.FALL_BACK:
            if p.did(procedure.EXIT):
                self.record_decision(p.decision, "failed", now)
            untold = p.untold or self.history().untold.get(k)
            log.error("worker_unreachable_fallback", reason=d.reason, worker=k,
                      tries=None if untold is None else untold.tries, error=None if untold is None else untold.error,
                      rung=d.rung, instance_id=d.instance_id,
                      action=f"its control API could not tell it to exit: the {d.rung} restarts")
        elif kind == procedure.SWAP_SLOT:
            # The slot taken for the worker is kept for a restart in place; a pod's restart needs a slot
            # of the pod's rung, the one its replacement gives back.
            await ex.give_back_slot(False, f"worker {k} could not be told: its pod restarts instead")
        elif kind == procedure.NOT_NEEDED:
            served = procedure.served_anew(self.history(), d, p.begun_at)
            assert served is not None
            await ex.release_slot(k, "not needed: a new process serves")
            self.fold(RestartCancelled(now, renewed_at=served.started_at, reason=d.reason))
            self.record_decision(d, procedure.NOT_NEEDED, now)
            log.warning("restart_not_needed", reason=d.reason, rung=d.rung, instance_id=d.instance_id,
                        served_by=served.instance_id, served_after_s=round(served.at - p.begun_at, 3),
                        action="the target's new process serves: nothing restarted, the slot given back")
        elif kind == procedure.RECOUNT:
            held = await ex.recount(d)
            if held is not None:
                await ex.release_slot(k, f"recounted before the act: {held}")
            return procedure.advance(p, step, held=held)
        elif kind == procedure.SLOT_WAIT:
            await self.sleep(procedure.slot_wait_left(d, self.facts()))
        elif kind == procedure.RESTART:
            await self._restart(p, d)
        return procedure.advance(p, step)

    async def _exit(self, p: Procedure, step: Step) -> Procedure:
        ex, d, k = self.executor, step.decision, p.worker
        log.warning("decision", action="restart", reason=d.reason, rung=RUNG_WORKER, worker=k, detail=d.detail)
        self.record_decision(d, "started", self.clock())
        errors: list[str] = []
        outcome = await ex.worker_exit(d, k, self.worker_control(k), untold=errors.append)
        if outcome is None:
            error = errors[-1] if errors else "not told"
            self.fold(WorkerUntold(self.clock(), k, d.instance_id, error))
            return procedure.advance(p, step, exit=procedure.UNTOLD, exit_detail=error)
        if outcome.done:
            if outcome.recorded:
                ex.not_recorded_said(d, outcome.detail, recorded=True)
            return procedure.advance(p, step, exit=procedure.LEFT, exit_detail=outcome.detail,
                                     exit_recorded=outcome.recorded)
        return procedure.advance(p, step, exit=procedure.NOT_RECORDED if outcome.not_recorded else procedure.REFUSED,
                                 exit_detail=outcome.detail)

    async def _would(self, p: Procedure, d: Decision) -> None:
        """A shadow restart: said everywhere a restart is (the log, the decisions, a Normal Event that
        points to the evidence), performed nowhere; reported once in its episode, as strategy none is."""
        ex, k = self.executor, p.worker
        recorded = await ex.would_restart(d)
        log.warning("decision", action="restart", reason=d.reason, rung=d.rung, shadow=True, performed=False,
                    normal_event=recorded, detail=d.detail, **({"worker": k} if k else {}))
        self.record_decision(d, WOULD, self.clock())
        if k == 0:
            self.fold(RestartEnded(self.clock(), d.reason, False, False, True, d.rung, d.instance_id,
                                   lasting=policy.lasting(d)))
        else:
            self._ended(d, k, RESTART_REPORTED, None)

    async def _restart(self, p: Procedure, d: Decision) -> None:
        """The restarter's rung, its slot taken: its Event written first, then the drain and the act."""
        ex, k = self.executor, p.worker
        h = self.history()
        if k == 0:
            log.warning("decision", action="restart", reason=d.reason, strategy=ex.restarter.strategy,
                        drain=d.drain, detail=d.detail,
                        budget_remaining=policy.budget_remaining(self.settings.policy, h, self.clock(),
                                                                 p.from_events) - 1)
        else:
            log.warning("decision", action="restart", reason=d.reason, rung=d.rung, worker=k,
                        strategy=ex.restarter.strategy, drain=d.drain, detail=d.detail)
            self.record_decision(d, "started", self.clock())
            self.fold(RestartBegun(self.clock()))
        ended, record = await ex.restart(d, self.fold)
        if self.keep_out is not None:
            if p.did(procedure.KEEP_OUT):
                self.spawn(self.keep_out.after_pod_rung(ended.done))
            elif ended.done:
                self.spawn(self.keep_out.remember_restart(d, h.pod_gpus))
        self.record_decision(d, record, ended.at)
        self.fold(ended)  # an in-place restart done holds our slot until the target serves again
        if not ended.done:
            await ex.release_slot(k, f"restart {record}")
            if k:
                self._ended(d, k, RESTART_FAILED, None)  # asked again after its backoff
        else:
            self.restarted(ended)
        if d.reason in SUSPECT_REASONS and record != "reported":
            self.spawn(self.escalate(d.reason))

    def _ended(self, decision: Decision, k: int, action: str, record: str | None, why: str = "",
               detail: str | None = None, recorded: bool | None = None) -> None:
        self.fold(WorkerRestarted(self.clock(), k, decision.reason, decision.instance_id, action, why, detail,
                                  recorded))
        if record is not None:
            self.record_decision(decision, record, self.clock())


def _last_blocked(h: History, worker: int) -> bool:
    """The last decision about this worker was a restart the budget blocked: said once, not at every canary."""
    for d in reversed(h.decisions):
        if d.detail.get("worker") == worker:
            return d.outcome == BLOCKED_BY_BUDGET
    return False
