"""The watchdog's effects: each performs one action at its edge and returns what happened.

It decides nothing: the loop (`watchdog.app`) hands it a decision, folds the outcome it returns
into the history with `state.reduce`, and the policy reads the history again. Failures at an edge
(an API that refuses, a control API that hangs) come back as outcomes and log lines, never as
exceptions that could take the loop down.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Protocol

from watchdog import contract, escalation, ladder, logs
from watchdog.actions.node import NodeReporter
from watchdog.actions.restart import NOT_RECORDED, DrainHandle, Restarter
from watchdog.config import Settings
from watchdog.control_client import ControlClient, ControlError
from watchdog.escalation import RestartRecord, Suspect, workload_restarts
from watchdog.ladder import Change
from watchdog.metrics import WatchdogMetrics
from watchdog.names import RUNG_POD
from watchdog.policy import Decision
from watchdog.state import AdmissionAnswered, Outcome, PodGpus, RestartEnded, RestartWaiting, WorkloadRestarts

log = logs.get("watchdog")

POD_GPUS_RETRY_S, POD_GPUS_RETRY_MAX_S = 5.0, 300.0
ESCALATION_RETRY_S, ESCALATION_RETRY_MAX_S = 30.0, 3600.0
# The server lifts a drain by itself this long after `drain_timeout`, should we never say more
# (a sidecar killed mid-restart): an accepted eviction replaces the pod well before.
DRAIN_DEADLINE_MARGIN_S = 120.0
# `restart_not_recorded` is said while the last attempt's Event was refused and a restart is still
# wanted: a wanted one is tried again within the longest backoff (15 min), so after twice that
# without an attempt the restart is no longer wanted and the episode is over.
NOT_RECORDED_HOLD_S = 1800.0


class ServerDrain:
    """The bundled server's drain through its control API, told to the loop as it changes.

    `fold` hands the loop an outcome: while a restart waits, the server serves and is ready.
    Without a control API (or a restart that asks for no drain) only the waiting is told."""

    def __init__(self, control: ControlClient | None, timeout: float, fold: Callable[[Outcome], None],
                 clock: Callable[[], float]) -> None:
        self.control = control
        self.timeout = timeout
        self.fold = fold
        self.clock = clock
        self.drained = False
        # The server refuses a deadline past its bound; a drain timeout that long keeps the bound.
        self.deadline = min(timeout + DRAIN_DEADLINE_MARGIN_S, contract.DRAIN_DEADLINE_MAX_S)

    async def begin(self) -> None:
        self.fold(RestartWaiting(self.clock(), False))
        if self.control is None or self.drained:
            return
        self.drained = True  # even a drain call that timed out may have reached the server
        try:
            drained = await self.control.drain(self.timeout, self.deadline)
            log.info("drained", **{k: drained.get(k) for k in ("drained", "inflight", "queued")})
        except ControlError as exc:
            log.warning("drain_failed", error=str(exc))

    async def lift(self, why: str) -> None:
        self.fold(RestartWaiting(self.clock(), True))
        if self.control is None or not self.drained:
            return
        self.drained = False
        try:
            await self.control.undrain()
            log.warning("drain_lifted", why=why, by="watchdog")
        except ControlError as exc:
            log.error("drain_lift_failed", why=why, error=str(exc), deadline_s=self.deadline,
                      action="the server lifts it at its deadline")


class RestartEvents(Protocol):
    """The namespace's restart Events, read back (blocking; run in a thread)."""

    def restart_records(self) -> list[RestartRecord]: ...


class Executor:
    def __init__(self, settings: Settings, restarter: Restarter, metrics: WatchdogMetrics,
                 clock: Callable[[], float], wall_clock: Callable[[], float], control: ControlClient | None,
                 node: NodeReporter | None, restart_events: RestartEvents | None, workload: str | None,
                 pod_gpus: Callable[[], tuple[str, ...] | None]) -> None:
        self.settings = settings
        self.restarter = restarter
        self.metrics = metrics
        self.clock = clock
        self.wall_clock = wall_clock  # Events carry wall-clock times
        self.control = control
        self.node = node
        self.restart_events = restart_events
        self.workload = workload
        self._pod_gpus = pod_gpus
        # What the edges last said, reported once per kind rather than at every attempt.
        self.restart_failed: str | None = None
        self.restart_not_recorded: str | None = None
        self.not_recorded_at = 0.0
        self.budget_read_error: str | None = None
        self.pod_gpus_error: str | None = None
        self.pod_gpus_retry_s = POD_GPUS_RETRY_S
        self.suspects: dict[str, Suspect] = {}
        self.ignored_records: set[tuple[str, float]] = set()
        self._escalation_errors: set[str] = set()
        self.escalation_retry_at = 0.0
        self._escalation_backoff = ESCALATION_RETRY_S

    # -- the bundled server's control API ----------------------------------------------------

    async def empty_cache(self, decision: Decision) -> None:
        if self.control is None:
            return
        self.metrics.empty_cache.labels(reason=decision.reason).inc()
        try:
            result = await self.control.empty_cache()
            freed = result.get("freed_bytes", 0)
            freed = freed if isinstance(freed, int) and freed >= 0 else 0
            self.metrics.empty_cache_freed.inc(freed)
            log.info("decision", action="empty_cache", reason=decision.reason, freed_bytes=freed,
                     detail=decision.detail)
        except ControlError as exc:
            log.warning("empty_cache_failed", reason=decision.reason, error=str(exc))

    async def set_admission(self, change: Change) -> AdmissionAnswered:
        ok = False
        if self.control is not None:
            try:
                await self.control.set_admission(change.limit)
                ok = True
            except ControlError as exc:
                log.warning("admission_change_failed", action=change.action, limit=change.limit, error=str(exc))
        if ok:
            self.metrics.admission_changes.labels(direction="down" if change.action == ladder.SHRINK else "up").inc()
        return AdmissionAnswered(self.clock(), change, ok)

    # -- restarts ------------------------------------------------------------------------------

    async def restart(self, decision: Decision, fold: Callable[[Outcome], None]) -> tuple[RestartEnded, str]:
        """The restarter's strategy with the drain where asked and possible; the outcome and its record.

        A restart that did not happen lifts the drain it made: a drained server that is not going
        away serves nothing, the zombie this sidecar exists to prevent."""
        s = self.settings
        started = self.clock()
        reported_only = self.restarter.strategy == "none"
        done, keep_unready, rung, record = False, False, decision.rung, "failed"
        drain: DrainHandle = ServerDrain(self.control if decision.drain and not reported_only else None,
                                         s.restart.drain_timeout, fold, self.clock)
        try:
            outcome = await self.restarter.restart(decision, drain)
            done, rung = outcome.done, outcome.rung
            if done:
                self.restart_failed = None
                self.metrics.restarts.labels(reason=decision.reason, rung=rung).inc()
                # An evicted or deleted pod is going away: it stays unready until it has.
                keep_unready = rung == RUNG_POD and self.restarter.strategy in ("evict", "delete", "container")
                record = "done"
            elif reported_only:
                record = "reported"
            else:
                self.restart_failed = outcome.detail
                await drain.lift("restart_failed")
            if outcome.not_recorded:
                record = "not_recorded"
                self._not_recorded(decision, outcome.detail)
            elif outcome.recorded:
                self._recorded(decision)
            log.warning("restart_finished", reason=decision.reason, strategy=self.restarter.strategy, rung=rung,
                        done=done, detail=outcome.detail, attempts=outcome.attempts,
                        seconds=round(self.clock() - started, 3))
        except asyncio.CancelledError:
            # The sidecar is stopping mid-restart: leave the server serving, not drained until its deadline.
            await drain.lift("watchdog_stopping")
            raise
        except Exception as exc:
            self.restart_failed = repr(exc)
            log.exception("restart_failed", reason=decision.reason, error=repr(exc))
            await drain.lift("restart_failed")
        return RestartEnded(self.clock(), decision.reason, done, keep_unready, reported_only, rung), record

    def _not_recorded(self, decision: Decision, detail: str) -> None:
        """An episode: said when it starts, again when an Event is written, and over when no restart is
        wanted any more (see NOT_RECORDED_HOLD_S)."""
        if self.not_recorded_now() is None:
            log.error(NOT_RECORDED, reason=decision.reason, detail=detail,
                      action="no restart until its Event can be written; retried with backoff")
        self.restart_not_recorded, self.not_recorded_at = detail, self.clock()

    def _recorded(self, decision: Decision) -> None:
        if self.not_recorded_now() is not None:
            log.info("restart_recorded_again", reason=decision.reason)
        self.restart_not_recorded = None

    def not_recorded_now(self) -> str | None:
        """Why the last restart wanted was not carried out for want of its Event; None: no such episode."""
        if self.restart_not_recorded is None or self.clock() - self.not_recorded_at >= NOT_RECORDED_HOLD_S:
            return None
        return self.restart_not_recorded

    async def read_budget(self) -> WorkloadRestarts:
        """The workload's restarts from the Events; unreadable, slow or partial means spent (fail safe)."""
        assert self.restart_events is not None
        try:
            records = await asyncio.to_thread(self.restart_events.restart_records)
        except Exception as exc:
            error = f"{getattr(exc, 'status', None) or type(exc).__name__}: {str(exc)[:200]}"
            if error != self.budget_read_error:
                log.error("restart_budget_unknown", error=error, action="no restarts until the Events can be read",
                          workload=self.workload)
            self.budget_read_error = error
            return WorkloadRestarts(self.clock(), self.wall_clock(), None)
        if self.budget_read_error is not None:
            log.info("restart_budget_read", workload=self.workload, restarts=len(records))
        self.budget_read_error = None
        wall_now = self.wall_clock()
        return WorkloadRestarts(self.clock(), wall_now, workload_restarts(self._believable(records, wall_now),
                                                                          self.workload))

    def _believable(self, records: list[RestartRecord], wall_now: float) -> list[RestartRecord]:
        kept, ignored = escalation.believable(records, wall_now)
        seen = {(r.pod, r.at) for r in ignored}
        if ignored and seen != self.ignored_records:
            log.warning("restart_records_ignored", why="dated in the future", count=len(ignored),
                        pods=sorted({r.pod for r in ignored}),
                        ahead_s=round(max(r.at for r in ignored) - wall_now, 1))
        self.ignored_records = seen
        return kept

    # -- which GPUs, and those restarts did not cure -------------------------------------------

    async def learn_pod_gpus(self) -> PodGpus | None:
        """The kubelet's answer; None while it has none (the error is kept and said once)."""
        try:
            uuids = await asyncio.to_thread(self._pod_gpus)
        except Exception as exc:  # the kubelet socket missing, refused, slow: say so, go on without
            error = str(exc)[:300]
            if error != self.pod_gpus_error:
                log.warning("pod_gpus_unknown", error=error, retry_in_s=self.pod_gpus_retry_s)
            self.pod_gpus_error = error
            return None
        self.pod_gpus_error = None
        if uuids is None:
            return None
        log.info("pod_gpus", uuids=list(uuids), source="kubelet")
        return PodGpus(uuids)

    async def escalate(self, why: str, ours: tuple[str, ...] | None) -> None:
        """Read the namespace's restart Events back; report our GPUs that restarts did not cure."""
        if self.node is None or self.clock() < self.escalation_retry_at:
            return
        try:
            records = await asyncio.to_thread(self.node.restart_records)
        except Exception as exc:  # 403, timeouts, garbage: reported once per kind, retried later
            self._escalation_failed("list_events", exc)
            return
        wall_now = self.wall_clock()
        for suspect in escalation.suspects(self.settings.policy.escalation, self._believable(records, wall_now),
                                           wall_now, ours):
            if suspect.uuid in self.suspects:
                continue
            log.error("gpu_suspect", uuid=suspect.uuid, node=self.node.node_name, restarts=len(suspect.restarts),
                      reasons=suspect.reasons, xids=suspect.xids, action="report", trigger=why,
                      node_condition=self.node.node_condition)
            try:
                await asyncio.to_thread(self.node.report, suspect, self.settings.kubernetes.pod_name)
            except Exception as exc:
                self._escalation_failed("report", exc)
                continue  # not marked: reported again on the next look
            self.suspects[suspect.uuid] = suspect
        self._escalation_backoff = ESCALATION_RETRY_S

    def _escalation_failed(self, step: str, exc: BaseException) -> None:
        status = getattr(exc, "status", None)
        key = f"{step}:{status or type(exc).__name__}"
        if key not in self._escalation_errors:
            self._escalation_errors.add(key)
            log.warning("escalation_failed", step=step, status=status, error=str(exc)[:300],
                        retry_in_s=self._escalation_backoff)
        self.escalation_retry_at = self.clock() + self._escalation_backoff
        self._escalation_backoff = min(self._escalation_backoff * 2, ESCALATION_RETRY_MAX_S)
