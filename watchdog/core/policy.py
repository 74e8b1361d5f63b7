"""The decision rules: a pure function of (settings, history, now) -> decisions with a reason.

No I/O and no clock of its own: everything it knows comes in through its arguments, so every
rule is tested on recorded traces.
"""

from __future__ import annotations

import hashlib
import math
import random
from collections.abc import Iterable
from dataclasses import dataclass, field, replace
from statistics import median
from typing import Any

from gpu_watchdog.watchdog.core import correctness, ladder, xid_catalog
from gpu_watchdog.watchdog.core.history import History
from gpu_watchdog.watchdog.core.names import (
    ANSWERED_ERRORS,
    CANARY_FAILING,
    CONTEXT_LOSS,
    CORRUPT,
    DRAINING,
    ENFORCE_ALL,
    FRAGMENTATION_DRIFT,
    HANG,
    HEALTHY,
    MAX_AGE,
    MEMORY_PRESSURE,
    OOM,
    PLACEMENT,
    PROGRESS_UNKNOWN,
    QUARANTINE,
    RECOVERED,
    RUNG_CONTAINER,
    RUNG_POD,
    RUNG_WORKER,
    SATURATED,
    STARTING,
    STARTUP_TIMEOUT,
    UNSERVABLE,
)
from gpu_watchdog.watchdog.core.samples import (
    RESTART_FAILED,
    RESTART_HELD,
    RESTART_NOT_NEEDED,
    RESTART_REPORTED,
    ActionRecord,
    CanarySample,
    PastRestart,
    ServerSample,
    TorchSample,
    XidEvent,
)
from gpu_watchdog.watchdog.core.settings import CanarySettings, PolicySettings
from gpu_watchdog.watchdog.core.timing import FLEET_RETRY_S, RESTART_RETRY_MAX_S, RESTART_RETRY_S

# Xid classes, derived from the catalog's immediate actions (`watchdog.core.xid_catalog`). App faults
# kill the process's context and a new process cures them; hardware ones need the GPU reset or the
# node rebooted (the pod restarts away from the card and the Node hears of it); ECC errors are either,
# by their bucket; the rest never restart.
XID_CRITICAL = frozenset(x.code for x in xid_catalog.CATALOG.values() if xid_catalog.REMEDY[x.bucket].restart)
XID_ECC = frozenset(x for x in XID_CRITICAL if xid_catalog.CATALOG[x].ecc)
XID_HARDWARE = frozenset(x for x in XID_CRITICAL - XID_ECC
                         if xid_catalog.REMEDY[xid_catalog.CATALOG[x].bucket].node_action)
XID_APP_FAULT = XID_CRITICAL - XID_ECC - XID_HARDWARE
XID_WARN_ONLY = frozenset(xid_catalog.CATALOG) - XID_CRITICAL


# What the target server's work counter did across a stretch of time. NO_METRICS: no reading
# covers it. UNKNOWN: the counter was readable before and its page has since failed or timed out,
# which is no evidence of a hang (a saturated server answers its page late too). NO_EVIDENCE:
# unknown for longer than `hang.no_evidence_after`, after which the timeouts alone decide.
ADVANCED, FLAT, RESET, UNDECIDED, NO_METRICS = "advanced", "flat", "reset", "undecided", "no_metrics"
UNKNOWN, NO_EVIDENCE = "unknown", "no_evidence"



@dataclass(frozen=True)
class Decision:
    action: str  # restart | empty_cache
    reason: str
    detail: dict[str, Any] = field(default_factory=dict)
    drain: bool = True
    allowed: bool = True
    blocked_by: str | None = None
    instance_id: str | None = None
    # The cheapest cure that may still work (restart.strategy container honours it; the others
    # always restart the pod, or the process they own).
    rung: str = RUNG_CONTAINER
    # Performed (`policy.enforce` names its action or reason), or shadow: reported, nothing done.
    enforced: bool = True


def enforced(settings: PolicySettings, action: str, reason: str) -> bool:
    """Whether `policy.enforce` has `action` (a decision's, or quarantine, placement) performed for
    `reason`. The quarantine and placement answer to their own names only: a reason enforced restarts
    for it, and keeps the card and the requests it blames in shadow until they are named too."""
    e = settings.enforce
    action = ladder.enforce_action(action)
    if ENFORCE_ALL in e or action in e:
        return True
    return action not in (QUARANTINE, PLACEMENT) and reason in e


def _enforce(settings: PolicySettings, decisions: list[Decision]) -> list[Decision]:
    return [d if enforced(settings, d.action, d.reason) else replace(d, enforced=False) for d in decisions]


def workload_allowance(settings: PolicySettings, replicas: int | None) -> int:
    """The workload's restarts per window: it grows with the replicas, and is never below one
    lineage's bound. Replicas not known count as one (the smallest allowance)."""
    b = settings.restart_budget
    # 0.07 x 100 is 7, not 7.000000000000001: round the product before taking its ceiling.
    return max(b.max_restarts, math.ceil(round(b.per_replica * max(1, replicas or 1), 6)))


def same_lineage(h: History, r: PastRestart) -> bool:
    """Whether a past restart is of our lineage, the unit a restart loop is bounded in: the same pod
    (a StatefulSet's slot, or our own in-place restarts), the same GPU where both name theirs, else
    the same node."""
    if h.pod and r.pod == h.pod:
        return True
    ours = our_gpus(h)
    if ours and r.gpus:
        return bool(set(ours) & set(r.gpus))
    return bool(h.node) and r.node == h.node


def _budget_left(settings: PolicySettings, history: History, now: float) -> tuple[int, int]:
    """(the workload's restarts left, our lineage's restarts left), counted from the Events read back."""
    b = settings.restart_budget
    window = b.window
    own = history.restarts_within(now, window)
    assert history.workload_restarts is not None and history.workload_read_at is not None
    read_at = history.workload_read_at
    # Read back: every generation's restarts up to the read; ours since are not in it yet.
    past = [r for r in history.workload_restarts if now - r.at < window]
    since = [a for a in own if a.at > read_at]
    # Belt and braces: what this sidecar did itself counts even where the Events lost it.
    workload_used = max(len(past) + len(since), len(own))
    lineage_used = max(len([r for r in past if same_lineage(history, r)]) + len(since), len(own))
    return (workload_allowance(settings, history.replicas) - workload_used, b.max_restarts - lineage_used)


def budget_remaining(settings: PolicySettings, history: History, now: float, from_events: bool = False) -> int:
    """Restarts left in the window. `from_events`: the budget is the workload's (growing with its
    replicas) and our lineage's, counted across pod generations from the restart Events read back;
    while they cannot be read it is spent (fail safe)."""
    if from_events:
        if history.workload_restarts is None or history.workload_read_at is None:
            return 0
        return max(0, min(_budget_left(settings, history, now)))
    used = len(history.restarts_within(now, settings.restart_budget.window))
    return max(0, settings.restart_budget.max_restarts - used)


def budget_blocker(settings: PolicySettings, history: History, now: float, from_events: bool) -> str:
    """Which bound holds a restart back: the workload's allowance, or one lineage's restart loop."""
    if from_events and (history.workload_restarts is None or history.workload_read_at is None):
        return "restart_budget_unknown"
    if from_events:
        workload_left, lineage_left = _budget_left(settings, history, now)
        if lineage_left <= 0 < workload_left:
            return "restart_loop"
    return "restart_budget"


def decide(settings: PolicySettings, history: History, now: float, budget_from_events: bool = False) -> list[Decision]:
    """What to do now for the watched target, each decision enforced or shadow (`policy.enforce`)."""
    return _enforce(settings, _decide(settings, history, now, budget_from_events))


def _decide(settings: PolicySettings, history: History, now: float, budget_from_events: bool) -> list[Decision]:
    if history.restart_in_progress:
        return []
    restart = _restart_rule(settings, history, now)
    if restart is not None and _held_back(history, restart.reason, now, lasting(restart)):
        restart = None
    if restart is not None:
        restart = replace(restart, rung=rung_for(settings, history, restart, now))
        if budget_remaining(settings, history, now, budget_from_events) <= 0:
            restart = Decision(restart.action, restart.reason, restart.detail, restart.drain, allowed=False,
                               blocked_by=budget_blocker(settings, history, now, budget_from_events),
                               instance_id=restart.instance_id)
            # A blocked restart must not hide a cache flush or a lower limit that may still help.
            return [restart, *_cache_rules(settings, history, now), *_admission_rule(settings, history, now)]
        return [restart]
    return [*_cache_rules(settings, history, now), *_admission_rule(settings, history, now)]


def other_workers(settings: PolicySettings, h: History, now: float, budget_from_events: bool = False
                  ) -> list[Decision]:
    """The other workers' restarts to carry out now (rung `worker`): those `hung_workers` finds, less
    those held back in their own episode (as `_held_back` holds the target's), blocked where the
    budget is spent (the budget is the pod's: every worker's restarts count in it)."""
    out: list[Decision] = []
    for decision in hung_workers(settings, h):
        k = int(decision.detail["worker"])
        actions = h.worker_actions.get(k, ())
        done = [a.at for a in actions if a.action == "restart"]
        served = [c.at for c in h.worker_canaries.get(k, ()) if c.served]
        epoch = max(done[-1] if done else float("-inf"), whole_restart_at(h))
        if _held_back_in(actions, served, epoch, decision.reason, now):
            continue
        if budget_remaining(settings, h, now, budget_from_events) <= 0:
            decision = replace(decision, allowed=False,
                               blocked_by=budget_blocker(settings, h, now, budget_from_events))
        out.append(decision)
    return _enforce(settings, out)


def hung_workers(settings: PolicySettings, h: History) -> list[Decision]:
    """The service's other workers (k >= 1, `target.workers`) the evidence says are hung: one whose
    own canaries timed out `hang.consecutive_timeouts` times in a row, after it had served; a new
    process of it cures it while the others serve. Judged by its canaries: they run on the slot
    each worker keeps for them, so a worker that is only busy still answers one. A poisoned worker
    is not decided for: it exits by itself once its state was read, and its server replaces it."""
    n = settings.hang.consecutive_timeouts
    since = whole_restart_at(h)
    out: list[Decision] = []
    for k, kept in sorted(h.worker_canaries.items()):
        canaries = [c for c in kept if c.at >= since]
        run: list[CanarySample] = []
        for c in reversed(canaries):
            if c.error_class != "timeout":
                break
            run.append(c)
        if len(run) < n or not any(c.served for c in canaries):  # before it served: still loading
            continue
        detail: dict[str, Any] = {"worker": k, "evidence": "worker_canary", "consecutive_timeouts": n,
                                  "last_latency_s": round(run[0].latency_s, 3)}
        gpu = _worker_gpu(h, k)
        if gpu:
            detail["gpus"] = [gpu]
        # The process that served (a canary that timed out names none): the one told to leave, and
        # the one its failure's record is about.
        served = next(c.instance_id for c in reversed(canaries) if c.served)
        out.append(Decision("restart", HANG, detail, drain=False, instance_id=served or run[0].instance_id,
                            rung=RUNG_WORKER))
    return out


def whole_restart_at(h: History) -> float:
    """The last restart of every worker at once (the container, the pod, the child process): what the
    other workers said before it, and the restarts of theirs that failed, are about processes gone."""
    return max((a.at for a in h.actions if a.action == "restart" and a.rung != RUNG_WORKER), default=float("-inf"))


def _worker_gpu(h: History, k: int) -> str | None:
    """The GPU worker k last said it runs on: its restart's Event names it, for the node's count."""
    if h.workers is None:
        return None
    return next((w.memory.uuid for w in h.workers.workers if w.worker == k and w.memory.uuid), None)


def worker_restart_wanted(settings: PolicySettings, h: History, now: float, budget_from_events: bool = False
                          ) -> bool:
    """Another worker still wants a restart that could be carried out: hung, not only reported
    (that waits for it to serve again), and within the budget. A fleet hold lasts while one does."""
    if budget_remaining(settings, h, now, budget_from_events) <= 0:
        return False
    for decision in hung_workers(settings, h):
        k = int(decision.detail["worker"])
        served = [c.at for c in h.worker_canaries.get(k, ()) if c.served]
        since = served[-1] if served else float("-inf")
        if not any(a.action == RESTART_REPORTED and a.at > since for a in h.worker_actions.get(k, ())):
            return True
    return False


def hold_over(settings: PolicySettings, h: History, now: float, budget_from_events: bool = False) -> bool:
    """A fleet hold (of the watched target's restart or another worker's) is over: no restart is under
    way and neither the target nor any other worker still wants one that could be carried out."""
    return h.edge.fleet.held is not None and not h.restart_in_progress \
        and wanted_restart(settings, h, now) is None \
        and not worker_restart_wanted(settings, h, now, budget_from_events)


def wanted_restart(settings: PolicySettings, history: History, now: float) -> Decision | None:
    """The restart the evidence calls for now, whether or not it is held back or budgeted."""
    return _restart_rule(settings, history, now)


def rung_for(settings: PolicySettings, h: History, decision: Decision, now: float) -> str:
    """The watched worker of several first, then the container in place; the pod when in place cannot cure.

    A lost GPU, one the kubelet reports unhealthy, or one the driver says needs more than a new process
    (its recovery action, or an Xid whose catalog action resets the GPU or reboots the node) is not
    cured on the same card; and `in_place.max_restarts` in-place restarts for the same reason within
    its window that did not cure (it came back) send the next one to the pod.
    """
    d = decision.detail
    if d.get("evidence") in ("gpu_lost", "device_health", "recovery_action") or d.get("node_action"):
        return RUNG_POD
    window = settings.in_place.window

    def spent(rung: str) -> bool:
        # A container that came back in place by itself before our act was an in-place restart too.
        kinds = ("restart", RESTART_NOT_NEEDED) if rung == RUNG_CONTAINER else ("restart",)
        done = [a for a in h.actions if a.action in kinds and a.rung == rung
                and a.reason == decision.reason and now - a.at < window]
        return len(done) >= settings.in_place.max_restarts

    # The watched worker of several poisoned or hung (its canary, its poisoned flag): that process's
    # fault, cured by a new one of it while the others serve. An Xid names a GPU and a stall is the
    # whole server's counter: the container, as for one worker.
    if decision.reason == CORRUPT and d.get("after_restart"):
        return RUNG_POD  # wrong again after a new process on this card: the card, not the process
    own = d.get("evidence") in ("canary", "poisoned_flag") or (decision.reason == HANG and "evidence" not in d)
    if h.worker_count > 1 and decision.reason in (CONTEXT_LOSS, HANG) and own and not spent(RUNG_WORKER):
        return RUNG_WORKER
    return RUNG_POD if spent(RUNG_CONTAINER) else RUNG_CONTAINER


# Evidence a served canary does not end: a card the kubelet or the driver calls sick, a lost GPU, an
# Xid, the process's age, drift the flushes did not cure. Only a restart does.
LASTING_EVIDENCE = ("device_health", "gpu_lost", "recovery_action", "xid")


def lasting(d: Decision) -> str | None:
    """What a restart reported and not performed keeps as its evidence (`ActionRecord.why`) where that
    evidence lasts through serving; None where a served canary ends its episode."""
    evidence = d.detail.get("evidence")
    if evidence in LASTING_EVIDENCE:
        return str(evidence)
    return d.reason if d.reason in (MAX_AGE, FRAGMENTATION_DRIFT) else None


def _held_back(h: History, reason: str, now: float, evidence: str | None = None) -> bool:
    """A restart of the target for `reason` that was decided and not carried out, in this same episode."""
    return _held_back_in(h.actions, [c.at for c in h.canaries if c.served], h.epoch, reason, now, evidence)


def _held_back_in(actions: Iterable[ActionRecord], served: list[float], epoch: float, reason: str,
                  now: float, lasting: str | None = None) -> bool:
    """One process's restart for `reason` decided and not carried out, in this same episode
    (`served`: when it served a canary; `epoch`: its last restart).

    Reported only (strategy `none`, or shadow): said once, not again until it serves again; a shadow
    one for `lasting` evidence (a sick card, the process's age) that serving does not clear, not again
    until a restart. Held by the fleet: asked again after the hold's own interval. Failed: tried again
    after a backoff that doubles with each failure, not at every tick.
    """
    episode_start = served[-1] if served else float("-inf")
    ours = [a for a in actions if a.reason == reason]
    if any(a.action == RESTART_REPORTED and (a.at > episode_start or (lasting is not None and a.why == lasting
                                                                        and a.at >= epoch)) for a in ours):
        return True
    held = [a for a in ours if a.action == RESTART_HELD]
    if held and now - held[-1].at < FLEET_RETRY_S.get(held[-1].why, RESTART_RETRY_S):
        return True
    # Failures count for this process whether or not it serves meanwhile: a restart refused while
    # the server goes on serving (a disruption budget, an API that will not record it) must not
    # be asked again at the next canary.
    failures = [a for a in ours if a.action == RESTART_FAILED and a.at >= epoch]
    if not failures:
        return False
    return now - failures[-1].at < min(RESTART_RETRY_S * 2 ** (len(failures) - 1), RESTART_RETRY_MAX_S)


def _admission_rule(settings: PolicySettings, h: History, now: float) -> list[Decision]:
    change = ladder.decide(settings.admission, h, now)
    if change is None:
        return []
    reason = OOM if change.action == ladder.SHRINK else RECOVERED
    return [Decision(change.action, reason, {**change.detail, "limit": change.limit},
                     instance_id=h.ladder.instance_id if h.ladder is not None else None)]


def _latest_instance(history: History) -> str | None:
    samples = history.torch_since_epoch()
    if samples:
        return samples[-1].instance_id
    canaries = history.canaries_since_epoch()
    return canaries[-1].instance_id if canaries else None


def _restart_rule(settings: PolicySettings, h: History, now: float) -> Decision | None:
    decision = _cure_rule(settings, h, now)
    ours = our_gpus(h)
    if decision is not None and decision.reason in (CONTEXT_LOSS, HANG, CORRUPT) and ours:
        # Named in the restart's Event, so that restarts that do not cure one GPU can be counted.
        return replace(decision, detail={**decision.detail, "gpus": list(ours)})
    return decision


def _cure_rule(settings: PolicySettings, h: History, now: float) -> Decision | None:
    context_loss = _context_loss(h)
    if context_loss is not None:
        return context_loss
    if h.served_at is None:
        # Loading a model can take many minutes: a server that has not served yet is starting,
        # whatever its canaries say, until the startup timeout.
        return _startup_timeout(settings, h, now)
    return (
        _hang(settings, h, now)
        or _stall(settings, h)
        or _corrupt(settings, h, now)
        or _unservable(settings, h, now)
        or _fragmentation_restart(settings, h, now)
        or _max_age(settings, h, now)
    )


# -- what the target is doing ------------------------------------------------------------------


def _work_samples(h: History) -> list[ServerSample]:
    return [s for s in h.server_since_epoch() if s.progress is not None]


def progress_since(h: History, start: float) -> tuple[str, dict[str, Any]]:
    """Did the server's work counter advance between `start` and its latest reading?

    Measured between readings taken after `start` where there are two, so that tokens made just
    before a stop do not pass for progress after it; from the last reading before `start`
    otherwise. NO_METRICS when nothing was read since `start` (no page, or it went dark with the
    server): the canary alone must then decide. UNDECIDED while a single reading covers it.
    """
    samples = _work_samples(h)
    during = [s for s in samples if s.at >= start]
    if not during:
        return NO_METRICS, {}
    before = [s for s in samples if s.at < start]
    ref = during[0] if len(during) >= 2 or not before else before[-1]
    last = during[-1]
    assert ref.progress is not None and last.progress is not None
    figures = {"server": last.server, "progress_from": ref.progress, "progress_to": last.progress,
               "over_s": round(last.at - ref.at, 3)}
    if last.progress > ref.progress:
        return ADVANCED, figures
    if last.progress < ref.progress:
        return RESET, figures  # the server process was replaced: its counters start again
    if last.at <= ref.at:
        return UNDECIDED, figures
    return FLAT, figures


def progress_during(settings: PolicySettings, h: History, start: float, now: float) -> tuple[str, dict[str, Any]]:
    """`progress_since`, with NO_METRICS told apart: a server whose counter was readable before and
    whose page has failed since is UNKNOWN (no evidence either way), and NO_EVIDENCE once that has
    lasted `hang.no_evidence_after`. A server that never exposed a counter stays NO_METRICS."""
    verdict, figures = progress_since(h, start)
    readings = _work_samples(h)
    last = readings[-1] if readings else h.last_progress
    if verdict != NO_METRICS or last is None:
        return verdict, figures
    dark_s = now - last.at
    figures = {"server": last.server, "last_progress": last.progress, "last_reading_s_ago": round(dark_s, 3),
               "no_evidence_after_s": settings.hang.no_evidence_after}
    return (NO_EVIDENCE if dark_s >= settings.hang.no_evidence_after else UNKNOWN), figures


def _timeout_run(h: History) -> list[CanarySample]:
    """The trailing canaries that timed out, oldest first."""
    run: list[CanarySample] = []
    for c in reversed(h.canaries_since_epoch()):
        if c.error_class != "timeout":
            break
        run.append(c)
    return run[::-1]


def saturated(h: History) -> tuple[bool, dict[str, Any]]:
    """Canaries time out while the server keeps producing tokens: busy, not hung."""
    run = _timeout_run(h)
    if not run:
        return False, {}
    verdict, figures = progress_since(h, run[0].started_at)
    return verdict == ADVANCED, {"canary_timeouts": len(run), **figures}


def progress_unknown(settings: PolicySettings, h: History, now: float) -> tuple[bool, dict[str, Any]]:
    """Canaries time out and the work counter, readable before, cannot be read now: not a hang yet."""
    run = _timeout_run(h)
    if not run:
        return False, {}
    verdict, figures = progress_during(settings, h, run[0].started_at, now)
    return verdict == UNKNOWN, {"canary_timeouts": len(run), **figures}


def target_state(h: History, settings: PolicySettings, now: float) -> str | None:
    """STARTING until the first successful canary since the last restart; then HEALTHY, DRAINING,
    SATURATED, PROGRESS_UNKNOWN or CANARY_FAILING by the last canary."""
    if h.served_at is None:
        return STARTING
    last = h.canaries[-1] if h.canaries else None
    if last is None:
        return None
    if last.ok:
        return DRAINING if last.draining else HEALTHY
    if saturated(h)[0]:
        return SATURATED
    return PROGRESS_UNKNOWN if progress_unknown(settings, h, now)[0] else CANARY_FAILING


def serviceable(h: History, settings: PolicySettings, now: float) -> bool:
    """What `/readyz` says: the model served since the last restart and serves now, or is only busy.

    A saturated pod stays in the Service: taking it out only pushes its load onto the others
    until every replica leaves. So does one whose progress is unknown (its metrics page timed out
    with its canary, as a saturated server's does), for at most `hang.no_evidence_after`: missing
    evidence is no reason to act, in either direction, until it has been missing that long.
    """
    return not h.restart_acting and target_state(h, settings, now) in (
        HEALTHY, SATURATED, PROGRESS_UNKNOWN)


def canary_delay(settings: CanarySettings, policy: PolicySettings, h: History, now: float) -> float:
    """Seconds from one canary's start to the next.

    After a timeout, confirm at once (every `timeout`) until a success or the hang threshold,
    so a hang is decided in about interval + n x timeout; while the target starts, look as often,
    so readiness follows the model's load closely. Healthy or saturated: every `interval`.
    """
    fast = min(settings.interval, settings.timeout)
    if h.served_at is None:
        return fast
    run = _timeout_run(h)
    if run and len(run) < policy.hang.consecutive_timeouts and not saturated(h)[0]:
        return fast
    if progress_unknown(policy, h, now)[0]:
        return fast  # keep looking: the next canary or reading may settle it
    return settings.interval


def our_gpus(h: History) -> tuple[str, ...] | None:
    """The GPUs this pod's server uses: from the kubelet, else the one the bundled server names."""
    if h.pod_gpus:
        return h.pod_gpus
    uuid = h.torch_uuid()
    return (uuid,) if uuid else None


def gpus_unknown(h: History) -> bool:
    """NVML sees several GPUs and nothing says which are the pod's: any of them may be another pod's."""
    return our_gpus(h) is None and h.gpus_visible > 1


def xid_is_ours(h: History, uuid: str | None) -> bool | None:
    """Whether an Xid on `uuid` concerns this pod's GPUs; None when that cannot be told."""
    if gpus_unknown(h):
        return None
    ours = our_gpus(h)
    # One GPU in sight (or none named), or an event that names no GPU: it is ours.
    return ours is None or uuid is None or uuid in ours


def _our_xids(h: History) -> list[tuple[XidEvent, xid_catalog.Xid, xid_catalog.Remedy]]:
    """This process's Xids on our GPUs that the catalog says restart, with its row and remedy."""
    out = []
    for ev in h.xids:
        row = xid_catalog.lookup(ev.xid)
        if ev.at < h.epoch or row is None or not xid_catalog.REMEDY[row.bucket].restart:
            continue  # unknown to the catalog, or one it says never to restart for (IGNORE, ...)
        if not xid_is_ours(h, ev.uuid):
            continue  # another pod's GPU, or one that may be: never a restart for it
        out.append((ev, row, xid_catalog.REMEDY[row.bucket]))
    return out


def _xid_restart(h: History, ev: XidEvent, row: xid_catalog.Xid, remedy: xid_catalog.Remedy) -> Decision:
    kind = "ecc" if row.ecc else "hardware" if remedy.node_action else "app_fault"
    detail: dict[str, Any] = {"evidence": "xid", "xid": ev.xid, "class": kind, "uuid": ev.uuid, "bucket": row.bucket}
    if remedy.node_action:
        detail["node_action"] = remedy.node_action
    return Decision("restart", CONTEXT_LOSS, detail, drain=False, instance_id=_latest_instance(h))


def _gpu_needs_more(h: History) -> Decision | None:
    """One of our GPUs that the driver (its recovery action, an Xid's catalog action) or the kubelet
    (the device's health in our pod's status) says a new process cannot cure."""
    for gpu in h.gpus:
        action = xid_catalog.recovery_action(gpu.recovery_action)
        if action is not None and gpu.at >= h.epoch:
            return Decision("restart", CONTEXT_LOSS, {"evidence": "recovery_action", "recovery_action": action.name,
                                                      "node_action": action.node_action, "uuid": gpu.uuid},
                            drain=False, instance_id=_latest_instance(h))
    for ev, row, remedy in _our_xids(h):
        if remedy.node_action:
            return _xid_restart(h, ev, row, remedy)
    health = h.device_health
    if health is not None and health.at >= h.epoch:
        for dev in health.devices:
            if dev.health == "Unhealthy":
                return Decision("restart", CONTEXT_LOSS, {
                    "evidence": "device_health", "resource": dev.resource, "resource_id": dev.resource_id,
                    "container": dev.container, "message": dev.message, "uuid": dev.uuid},
                    drain=False, instance_id=_latest_instance(h))
    return None


def _context_loss(h: History) -> Decision | None:
    # Evidence that the GPU itself needs more than a new process comes first: it decides the rung,
    # and the Node is told at once, whatever the canary says about the same fault.
    needs_more = _gpu_needs_more(h)
    if needs_more is not None:
        return needs_more
    canaries = h.canaries_since_epoch()
    if canaries and canaries[-1].error_class == "fatal_cuda":
        c = canaries[-1]
        return Decision("restart", CONTEXT_LOSS, {"evidence": "canary", "error": c.error}, drain=False,
                        instance_id=c.instance_id)
    torch = h.torch_since_epoch()
    # Not once a new process has served since: the poisoned one exited (its container restarted in
    # place), and its last reading is about a process that is gone.
    if torch and torch[-1].poisoned and h.served_anew(torch[-1].instance_id, torch[-1].at) is None:
        t = torch[-1]
        return Decision("restart", CONTEXT_LOSS, {"evidence": "poisoned_flag", "error": t.poison_reason},
                        drain=False, instance_id=t.instance_id)
    for gpu in h.gpus:
        if gpu.lost and gpu.at >= h.epoch:
            return Decision("restart", CONTEXT_LOSS, {"evidence": "gpu_lost", "uuid": gpu.uuid}, drain=False,
                            instance_id=_latest_instance(h))
    xids = _our_xids(h)  # what is left of them: Xids a new process cures (RESTART_APP)
    return _xid_restart(h, *xids[0]) if xids else None


def _startup_timeout(settings: PolicySettings, h: History, now: float) -> Decision | None:
    since = max(h.started_at, h.epoch)
    if now - since < settings.startup_timeout:
        return None
    last = h.canaries[-1] if h.canaries else None
    return Decision("restart", STARTUP_TIMEOUT,
                    {"starting_s": round(now - since, 1), "startup_timeout_s": settings.startup_timeout,
                     "last_canary": None if last is None else last.error_class}, drain=True,
                    instance_id=_latest_instance(h))


def _hang(settings: PolicySettings, h: History, now: float) -> Decision | None:
    n = settings.hang.consecutive_timeouts
    run = _timeout_run(h)
    if len(run) < n:
        return None
    recent = run[-n:]
    # The canary is work itself: a server that produced no token for it nor for anyone across
    # these timeouts is stuck, whatever its gauges say (a stopped engine keeps its last values).
    # Where the counter went dark with the canary, nothing is known until it has been dark for
    # `no_evidence_after`; a server that never exposed one is judged by its timeouts alone.
    verdict, figures = progress_during(settings, h, recent[0].started_at, now)
    if verdict not in (FLAT, NO_METRICS, NO_EVIDENCE):
        return None
    detail = {"consecutive_timeouts": n, "last_latency_s": recent[-1].latency_s, "server_progress": verdict,
              **figures}
    # A hung kernel never finishes, so there is nothing to drain.
    return Decision("restart", HANG, detail, drain=False,
                    instance_id=recent[-1].instance_id or _latest_instance(h))


def _stall(settings: PolicySettings, h: History) -> Decision | None:
    """Requests running or waiting, and not one token for any of them for `stall.window`."""
    samples = _work_samples(h)
    if not samples or samples[-1].pending <= 0:
        return None
    last = samples[-1]
    start = last
    for s in reversed(samples):
        if s.progress != last.progress or s.pending <= 0:
            break
        start = s
    if last.at - start.at < settings.stall.window:
        return None
    answered = [c for c in h.canaries_since_epoch() if c.at >= start.at]
    if not last.requests_waiting and answered and answered[-1].ok:
        # Nothing waits and the server answers its canary: it serves. A counter of answered requests
        # (the agent's, a `progress_metric`) stays flat under one long request; that is no hang.
        return None
    return Decision("restart", HANG,
                    {"evidence": "stall", "server": last.server, "requests_running": last.requests_running,
                     "requests_waiting": last.requests_waiting, "progress": last.progress,
                     "flat_s": round(last.at - start.at, 1)}, drain=False, instance_id=_latest_instance(h))


def _corrupt(settings: PolicySettings, h: History, now: float) -> Decision | None:
    """`correctness.consecutive` probes in a row deviating from the fleet's agreed reference: the
    process computes wrong. Probes not compared (no agreed reference, no answer) are no evidence either
    way; a match ends the run. Wrong again after an in-place restart for it within `in_place.window`:
    `after_restart`, the card is the suspect (the pod's rung, and the card kept out or reported)."""
    c = settings.correctness
    if not c.enabled:
        return None
    compared = [p for p in h.probes_since_epoch() if p.result == correctness.MATCH
                or p.result in correctness.DEVIATIONS]
    run: list[Any] = []
    for p in reversed(compared):
        if p.result == correctness.MATCH:
            break
        run.append(p)
    if len(run) < c.consecutive:
        return None
    run.reverse()
    # Ours in place, or any of our lineage's (the same card, else node) read back from the workload's
    # Events: a pod restarted for it lands on the same card again as often as not.
    again = [a.at for a in h.actions if a.action == "restart" and a.reason == CORRUPT and a.rung != RUNG_POD
             and now - a.at < settings.in_place.window]
    again += [r.at for r in h.workload_restarts or () if r.reason == CORRUPT and same_lineage(h, r)
              and now - r.at < settings.in_place.window and r.at not in again]
    detail: dict[str, Any] = {"evidence": "probes", "consecutive": len(run),
                              "deviations": [p.result for p in run[-c.consecutive:]], "differed": run[-1].detail}
    if again:
        detail["after_restart"] = len(again)
    return Decision("restart", CORRUPT, detail, drain=True, instance_id=run[-1].instance_id or _latest_instance(h))


def _unservable(settings: PolicySettings, h: History, now: float) -> Decision | None:
    """Every canary answered with an error for `unservable.window`: the pod stays unready forever otherwise."""
    run: list[CanarySample] = []
    for c in reversed(h.canaries_since_epoch()):
        if c.ok or c.error_class not in ANSWERED_ERRORS:
            break
        run.append(c)
    if not run or now - run[-1].at < settings.unservable.window:
        return None
    return Decision("restart", UNSERVABLE,
                    {"failing_s": round(now - run[-1].at, 1), "canaries": len(run), "last_error": run[0].error},
                    drain=True, instance_id=_latest_instance(h))


def _sample_signals(settings: PolicySettings, prev: TorchSample | None, cur: TorchSample) -> dict[str, Any]:
    """Fragmentation evidence in one allocator sample (against the one before it); empty when none."""
    signals: dict[str, Any] = {}
    if cur.reserved_bytes <= 0:
        return signals
    if cur.fragmentation_ratio >= settings.fragmentation.ratio:
        signals["fragmentation_ratio"] = round(cur.fragmentation_ratio, 4)
        signals["reserved_bytes"] = cur.reserved_bytes
        signals["allocated_bytes"] = cur.allocated_bytes
    if prev is not None and cur.alloc_retries > prev.alloc_retries:
        signals["alloc_retries_delta"] = cur.alloc_retries - prev.alloc_retries
    if cur.injected and signals:
        signals["injected"] = True
    return signals


def _drift_signals(settings: PolicySettings, h: History) -> dict[str, Any]:
    """Evidence of fragmentation in the latest figures; empty when there is none."""
    f = settings.fragmentation
    signals: dict[str, Any] = {}
    torch = h.torch_since_epoch()
    if torch:
        signals = _sample_signals(settings, torch[-2] if len(torch) >= 2 else None, torch[-1])
    if f.latency_factor > 0:
        oks = [c.latency_s for c in h.canaries_since_epoch() if c.ok]
        if len(oks) >= 8:
            baseline = median(oks[:5])
            current = median(oks[-3:])
            if baseline > 0 and current >= f.latency_factor * baseline:
                signals["canary_latency_s"] = round(current, 4)
                signals["canary_baseline_s"] = round(baseline, 4)
    return signals


def _episode_start(settings: PolicySettings, h: History) -> float:
    """When the current drift began: just after the last allocator sample that showed none.

    A flush that cured an earlier episode must not count against this one, or a pod whose
    fragmentation empty_cache keeps fixing would eventually be restarted for it.
    """
    samples = h.torch_since_epoch()
    for i in range(len(samples) - 1, -1, -1):
        prev = samples[i - 1] if i > 0 else None
        if not _sample_signals(settings, prev, samples[i]):
            return samples[i].at
    return h.epoch


def _fragmentation_attempts(settings: PolicySettings, h: History, now: float) -> list[float]:
    window = settings.fragmentation.window
    start = max(h.epoch, _episode_start(settings, h))
    return [a.at for a in h.actions
            if a.action == "empty_cache" and a.reason == FRAGMENTATION_DRIFT and a.at >= start
            and now - a.at < window]


def _fresh_after(h: History, at: float) -> TorchSample | None:
    """The first reachable allocator sample taken after `at`: the effect of an action."""
    for t in h.torch:
        if t.reachable and t.at > at:
            return t
    return None


def _fragmentation_restart(settings: PolicySettings, h: History, now: float) -> Decision | None:
    signals = _drift_signals(settings, h)
    if not signals:
        return None
    attempts = _fragmentation_attempts(settings, h, now)
    if len(attempts) < settings.fragmentation.empty_cache_attempts:
        return None
    if _fresh_after(h, attempts[-1]) is None:
        return None  # the last flush's effect is not observed yet
    return Decision("restart", FRAGMENTATION_DRIFT,
                    {**signals, "empty_cache_attempts": len(attempts)}, drain=True, instance_id=_latest_instance(h))


def max_age_jitter(pod_name: str, most: float) -> float:
    """This pod's share of max_age added as jitter, in [0, most], fixed by its name.

    Replicas started together must not all reach max_age at once; a pod's sidecar that restarts
    keeps its pod's share."""
    seed = hashlib.sha256(pod_name.encode()).digest()
    return random.Random(seed).uniform(0.0, most)


def _max_age(settings: PolicySettings, h: History, now: float) -> Decision | None:
    if settings.max_age <= 0:
        return None
    torch = h.torch_since_epoch()
    age = torch[-1].uptime_s + (now - torch[-1].at) if torch else now - max(h.started_at, h.epoch)
    limit = settings.max_age * (1.0 + h.jitter)
    if age < limit:
        return None
    return Decision("restart", MAX_AGE, {"age_s": round(age, 1), "max_age_s": round(limit, 1)}, drain=True,
                    instance_id=_latest_instance(h))


def _cache_rules(settings: PolicySettings, h: History, now: float) -> list[Decision]:
    torch = h.torch_since_epoch()
    if not torch:
        return []
    last = torch[-1]
    flushes = [a.at for a in h.actions if a.action == "empty_cache"]
    last_flush = flushes[-1] if flushes else None
    if last_flush is not None and last.at <= last_flush:
        return []  # wait for figures taken after the last flush
    signals = _drift_signals(settings, h)
    if signals and len(_fragmentation_attempts(settings, h, now)) < settings.fragmentation.empty_cache_attempts:
        return [Decision("empty_cache", FRAGMENTATION_DRIFT, signals, instance_id=last.instance_id)]
    cooled = last_flush is None or now - last_flush >= settings.memory_pressure.cooldown
    if not cooled:
        return []
    # OOMs since the figures the last flush was decided on, not only since the previous sample: one
    # that came during the cooldown is still flushed once it is over.
    seen = [t for t in torch[:-1] if last_flush is not None and t.at <= last_flush]
    baseline = seen[-1] if seen else (torch[-2] if len(torch) >= 2 else None)
    if baseline is not None and last.ooms > baseline.ooms:
        return [Decision("empty_cache", OOM, {"ooms": last.ooms, "new_ooms": last.ooms - baseline.ooms},
                         instance_id=last.instance_id)]
    if last.total_bytes > 0 and last.reserved_bytes / last.total_bytes >= settings.memory_pressure.reserved_ratio:
        return [Decision("empty_cache", MEMORY_PRESSURE,
                         {"reserved_bytes": last.reserved_bytes, "total_bytes": last.total_bytes,
                          "reserved_ratio": round(last.reserved_bytes / last.total_bytes, 4)},
                         instance_id=last.instance_id)]
    return []
