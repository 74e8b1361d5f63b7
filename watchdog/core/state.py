"""How each outcome changes what the watchdog knows: pure functions of (history, outcome).

The loop performs I/O and hands every result here; nothing else writes the history. Like the
policy, these take the time as an argument and do no I/O, so traces can drive them.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, replace
from typing import Any

from gpu_watchdog.watchdog.core import edges, idle_memory, ladder
from gpu_watchdog.watchdog.core.history import History
from gpu_watchdog.watchdog.core.ladder_state import FailedLimit, Ladder
from gpu_watchdog.watchdog.core.names import BLOCKED_BY_BUDGET, RUNG_CONTAINER, RUNG_POD, RUNG_WORKER, WOULD
from gpu_watchdog.watchdog.core.samples import (
    RESTART_FAILED,
    RESTART_HELD,
    RESTART_NOT_NEEDED,
    RESTART_REPORTED,
    ActionRecord,
    CanarySample,
    DecisionRecord,
    DeviceHealthSample,
    GpuReadout,
    PastRestart,
    ProbeSample,
    ServerSample,
    TorchSample,
    Untold,
    WorkerCanaries,
    WorkerRestarted,
    WorkersSample,
    WorkerUntold,
    XidEvent,
)
from gpu_watchdog.watchdog.core.settings import AdmissionSettings

# Enough of another worker's canaries for any hang rule (`policy.hang.consecutive_timeouts`).
WORKER_CANARIES_KEPT = 32


@dataclass(frozen=True)
class PodGpus:
    """The kubelet's answer: the UUIDs this pod got (empty when it got none; None: no answer, and
    `error` says why where it refused)."""

    uuids: tuple[str, ...] | None
    error: str | None = None


@dataclass(frozen=True)
class RestartBegun:
    at: float


@dataclass(frozen=True)
class RestartWaiting:
    """The restart in progress waits (drain lifted, serving) or goes ahead (draining, acting)."""

    at: float
    waiting: bool


@dataclass(frozen=True)
class RestartEnded:
    at: float
    reason: str
    done: bool
    # After an eviction the pod is going away: it stays unready until it does.
    keep_unready: bool
    # Not done because the strategy only reports (`none`), rather than because it failed.
    reported_only: bool = False
    rung: str = RUNG_POD
    instance_id: str | None = None  # the process restarted, where known
    detail: str | None = None  # what the restarter said (None: nothing new, as for an exception)
    recorded: bool | None = None  # its Event written (True), refused (False), or not tried
    lasting: str | None = None  # a shadow restart's evidence that serving does not clear (`policy.lasting`)


@dataclass(frozen=True)
class RestartCancelled:
    """A restart given up before it began: the workload's budget turned out spent on a fresh read, or
    (`renewed_at`) a new process of the target served since it was decided: evidence older than its
    first canary is about the process that is gone."""

    at: float
    renewed_at: float | None = None
    reason: str | None = None  # renewed: the restart's reason


@dataclass(frozen=True)
class RestartHeld:
    """A restart the workload's ledger held back (no slot, the breaker, the ledger unknown): nothing
    was done, and it is asked again after a while (policy)."""

    at: float
    reason: str
    why: str


@dataclass(frozen=True)
class WorkloadRestarts:
    """The workload's restarts read back from the Events (wall-clock seconds), or None: unreadable."""

    at: float
    wall_now: float
    restarts: tuple[PastRestart, ...] | None  # wall-clock times
    # The workload's desired replicas, read with them; None: not known.
    replicas: int | None = None
    error: str | None = None  # why they could not be read


@dataclass(frozen=True)
class CacheFlushRequested:
    at: float
    reason: str


@dataclass(frozen=True)
class AdmissionRequested:
    change: ladder.Change


@dataclass(frozen=True)
class AdmissionAnswered:
    at: float
    change: ladder.Change
    ok: bool


Outcome = (CanarySample | ProbeSample | ServerSample | TorchSample | GpuReadout | XidEvent | PodGpus | RestartBegun
           | RestartEnded | CacheFlushRequested | AdmissionRequested | AdmissionAnswered | WorkloadRestarts
           | RestartCancelled | RestartWaiting | RestartHeld | DeviceHealthSample | DecisionRecord | WorkersSample
           | WorkerCanaries | WorkerRestarted | WorkerUntold | edges.EdgeOutcome)


def reduce(h: History, outcome: Outcome, admission: AdmissionSettings = AdmissionSettings()) -> History:
    """Fold one outcome into the history (in place: the deques are bounded logs) and return it."""
    if isinstance(outcome, edges.EDGE_OUTCOMES):
        h.edge = edges.fold(h.edge, outcome)
    elif isinstance(outcome, CanarySample):
        h.canaries.append(outcome)
        if outcome.served and h.served_at is None and outcome.at >= h.epoch:
            h.served_at = outcome.at
    elif isinstance(outcome, ProbeSample):
        h.probes.append(outcome)
    elif isinstance(outcome, ServerSample):
        # Only this process's samples: after a restart of ours the counters start again by design,
        # and the restart already made it a server starting anew until it serves.
        last = next((x for x in reversed(h.server) if x.reachable and x.progress is not None and x.at >= h.epoch),
                    None)
        if (outcome.progress is not None and last is not None and last.progress is not None
                and outcome.progress < last.progress):
            # Its counters started again: the server process was replaced (a container restart,
            # an engine that exited and came back) and may be loading its model: starting anew.
            h.served_at = None
        h.server.append(outcome)
        if outcome.reachable and outcome.progress is not None:
            h.last_progress = outcome
    elif isinstance(outcome, TorchSample):
        h.torch.append(outcome)
        h.ladder = observe_ladder(h.ladder, outcome, admission)
        h.idle_memory = idle_memory.observe(h.idle_memory, outcome)
    elif isinstance(outcome, GpuReadout):
        h.gpus, h.gpus_visible = outcome.gpus, outcome.visible
    elif isinstance(outcome, XidEvent):
        h.xids.append(outcome)
    elif isinstance(outcome, DeviceHealthSample):
        if outcome.read:  # an unreadable status says nothing of the devices: the last read stands
            h.device_health = outcome
    elif isinstance(outcome, PodGpus):
        if outcome.uuids is not None:
            h.pod_gpus = outcome.uuids or None
        h.edge = replace(h.edge, pod_gpus_error=outcome.error,
                         pod_gpus_tries=h.edge.pod_gpus_tries + (outcome.error is not None))
    elif isinstance(outcome, RestartBegun):
        # Nothing is drained or done until the restarter says so (after asking the disruption
        # budget and writing the Event): the server serves meanwhile.
        h.restart_in_progress, h.restart_waiting = True, True
        h.blocked_reported = None
    elif isinstance(outcome, WorkersSample):
        h.workers = outcome
    elif isinstance(outcome, WorkerCanaries):
        for k, c in outcome.canaries:
            h.worker_canaries.setdefault(k, deque(maxlen=WORKER_CANARIES_KEPT)).append(c)
            if c.served:
                h.untold.pop(k, None)  # it serves again: a later hang counts its failed exits anew
    elif isinstance(outcome, WorkerUntold):
        u = h.untold.get(outcome.worker)
        same = u is not None and u.same(outcome.instance_id)
        h.untold[outcome.worker] = Untold(
            outcome.instance_id if outcome.instance_id is not None or u is None else u.instance_id,
            u.tries + 1 if u is not None and same else 1, outcome.error)
    elif isinstance(outcome, WorkerRestarted):
        record = ActionRecord(outcome.at, outcome.action, outcome.reason, RUNG_WORKER, outcome.why)
        h.edge = edges.worker_restarted(h.edge, outcome.worker, outcome.instance_id, outcome.action == "restart",
                                        outcome.detail, outcome.recorded, outcome.at)
        h.worker_actions.setdefault(outcome.worker, deque(maxlen=WORKER_CANARIES_KEPT)).append(record)
        if outcome.action == "restart":
            # Counted as a restart (the budget), and what that worker said before is about a process gone.
            h.actions.append(record)
            h.worker_canaries.pop(outcome.worker, None)
            h.untold.pop(outcome.worker, None)
    elif isinstance(outcome, DecisionRecord):
        h.decisions.append(outcome)
        if outcome.outcome == BLOCKED_BY_BUDGET:
            h.blocked_reported = outcome.reason
        elif outcome.outcome == WOULD:
            key = would_key(ladder.enforce_action(outcome.action), outcome.reason)
            h.would[key] = h.would.get(key, 0) + 1
    elif isinstance(outcome, RestartWaiting):
        h.restart_waiting = outcome.waiting and h.restart_in_progress
    elif isinstance(outcome, RestartEnded):
        h.restart_in_progress, h.restart_waiting = outcome.keep_unready, False
        h.edge = edges.restart_ended(h.edge, outcome.at, outcome.done, outcome.rung != RUNG_POD, outcome.detail,
                                     outcome.reported_only, outcome.recorded)
        if not outcome.done:
            # Nothing was restarted: the process, its evidence and its service go on as they were,
            # and the restart budget is not spent.
            kind = RESTART_REPORTED if outcome.reported_only else RESTART_FAILED
            # A shadow restart keeps its lasting evidence (`policy.lasting`): said once until a restart.
            why = outcome.lasting or "" if outcome.reported_only else ""
            h.actions.append(ActionRecord(outcome.at, kind, outcome.reason, why=why))
            return h
        h.actions.append(ActionRecord(outcome.at, "restart", outcome.reason, outcome.rung))
        # Evidence older than this is about a process that is gone; the new one starts anew.
        h.epoch = outcome.at
        if outcome.rung == RUNG_WORKER:
            h.gone_instance = outcome.instance_id
        else:
            h.untold.clear()  # every worker is a new process now
        h.served_at = None
    elif isinstance(outcome, RestartCancelled):
        h.restart_in_progress, h.restart_waiting = False, False
        if outcome.renewed_at is not None:
            h.epoch = max(h.epoch, outcome.renewed_at)
            h.actions.append(ActionRecord(outcome.at, RESTART_NOT_NEEDED, outcome.reason or "", RUNG_CONTAINER))
    elif isinstance(outcome, RestartHeld):
        h.restart_in_progress, h.restart_waiting = False, False
        # Only the latest hold matters: a long wait for a slot must not push real restarts out of the log.
        if h.actions and h.actions[-1].action == RESTART_HELD and h.actions[-1].reason == outcome.reason:
            h.actions.pop()
        h.actions.append(ActionRecord(outcome.at, RESTART_HELD, outcome.reason, why=outcome.why))
    elif isinstance(outcome, WorkloadRestarts):
        h.workload_read_at = outcome.at
        h.replicas = outcome.replicas
        h.edge = replace(h.edge, budget_read_error=outcome.error)
        h.workload_restarts = None if outcome.restarts is None else tuple(
            replace(r, at=outcome.at - (outcome.wall_now - r.at)) for r in outcome.restarts)
    elif isinstance(outcome, CacheFlushRequested):
        h.actions.append(ActionRecord(outcome.at, "empty_cache", outcome.reason))
    elif isinstance(outcome, AdmissionRequested) and h.ladder is not None:
        h.ladder = replace(h.ladder, pending=outcome.change.limit)
    elif isinstance(outcome, AdmissionAnswered) and h.ladder is not None:
        h.ladder = ladder_answered(h.ladder, outcome.change, outcome.at, outcome.ok, admission)
    return h


def would_key(action: str, reason: str) -> str:
    return f"{action}:{reason}"


def would(h: History, now: float, action: str, reason: str, detail: dict[str, Any]) -> DecisionRecord:
    """The record of a shadow decision the edge took (a quarantine, a taint): folded as any decision's."""
    return DecisionRecord(round(now - h.started_at, 3), action, reason, WOULD, detail)


# -- the admission ladder's record ---------------------------------------------------------------


def observe_ladder(lad: Ladder | None, sample: TorchSample, settings: AdmissionSettings) -> Ladder | None:
    """Fold one allocator sample in: a new process, or an operator's change, sets a new ceiling."""
    if not sample.reachable or sample.admission_limit <= 0:
        return lad
    limit = sample.admission_limit
    if lad is None or lad.instance_id != sample.instance_id:
        return Ladder(sample.instance_id, sample.admission_mode or "slots", ceiling=limit, limit=limit, base=limit,
                      wait=settings.recover_after, changed_at=sample.at, ooms=sample.ooms, seen_at=sample.at)
    elapsed = sample.at - (sample.at if lad.seen_at is None else lad.seen_at)
    lad = replace(lad, seen_at=sample.at)
    if sample.ooms > lad.ooms:
        lad = replace(lad, ooms=sample.ooms, oom_at=sample.at, used=0.0)
    elif sample.ooms < lad.ooms:
        lad = replace(lad, ooms=sample.ooms)
    elif lad.pending is None and limit == lad.limit and _in_full_use(lad, sample):
        lad = replace(lad, used=lad.used + elapsed)
    if lad.pending is not None:
        if limit == lad.pending:
            return replace(lad, pending=None)
        return lad  # taken before our change landed
    if limit != lad.limit and sample.at > lad.changed_at:
        # Someone else set it (an operator through the control API): that is the new ceiling, and
        # what failed above or below the old one says nothing about it.
        return Ladder(lad.instance_id, lad.mode, ceiling=limit, limit=limit, base=limit, wait=settings.recover_after,
                      changed_at=sample.at, ooms=lad.ooms, oom_at=lad.oom_at, seen_at=sample.at)
    return _confirmed(lad, settings)


def _in_full_use(lad: Ladder, sample: TorchSample) -> bool:
    """Whether the limit binds: as many sequences in flight as it allows (slots), or requests
    waiting for budget (bytes, where a sequence weighs less than the worst case the limit counts).
    Fewer in flight, as while the server's own OOM recovery holds its batch down, is no evidence."""
    return sample.queued > 0 if lad.mode == "bytes" else sample.inflight >= lad.limit


def _confirmed(lad: Ladder, settings: AdmissionSettings) -> Ladder:
    """A limit in full use and quiet for the longest remembered wait holds: it is the new base, and
    the failures at or below it are forgiven. A probe that merely held one wait forgives nothing."""
    if lad.used < ladder.confirm_after(lad, settings):
        return lad
    if lad.base == lad.limit and all(f.limit > lad.limit for f in lad.failed):
        return lad
    kept = tuple(f for f in lad.failed if f.limit > lad.limit)
    lad = replace(lad, base=lad.limit, failed=kept)
    return replace(lad, wait=ladder.wait_for(lad, ladder.next_up(lad), settings))


def ladder_answered(lad: Ladder, change: ladder.Change, at: float, ok: bool, settings: AdmissionSettings) -> Ladder:
    """The server's answer to our change (the sample that shows it in force clears `pending`)."""
    if not ok:
        return replace(lad, pending=None)
    if change.action == ladder.GROW:
        grown = replace(lad, limit=change.limit, changed_at=at, used=0.0)
        return replace(grown, wait=ladder.wait_for(grown, ladder.next_up(grown), settings))
    # The limit in force failed: remember it, and probing back to it waits twice as long as before.
    wait = min(settings.max_wait, 2 * ladder.wait_for(lad, lad.limit, settings))
    failed = (*(f for f in lad.failed if f.limit != lad.limit), FailedLimit(lad.limit, wait, at))
    # A cut starts a new base; a step back from probation stays above the old one.
    shrunk = replace(lad, limit=change.limit, base=min(lad.base, change.limit), failed=failed, changed_at=at,
                     used=0.0)
    return replace(shrunk, wait=ladder.wait_for(shrunk, ladder.next_up(shrunk), settings))
