"""The fleet's restart rules: slots (at most `max_unavailable` replicas restarting at once) and the
breaker for faults a restart does not cure, over the ledger every replica of a workload shares.

Pure: a ledger in, a new ledger and a verdict out. Times are wall-clock seconds, since the ledger is
written by many pods' sidecars. The ledger lives in a Lease (`watchdog.edge.effects.fleet`), written with
optimistic concurrency, so a verdict is only true once the ledger it came with is stored: two sidecars
can never both take the last slot.

Slot: taken before a restart (either rung), given back when the restarted target serves again (the
same sidecar, after an in-place restart), when the pod that replaced it serves for the first time
(see `replaced`), when the restart did not happen, or after `slot_timeout`. A pod that serves for the
first time is not always a replacement: a scale-up or a rollout creates pods too, and one of those
giving back a slot whose replacement is still loading would let a second replica go down. So a slot
remembers the pod template it was taken from and the replicas wanted then: a pod of another template
returns nothing, and each pod beyond the replicas wanted at the slot is counted as growth first.

Breaker: a restart for a reason is a *comeback* when the pod asking is one a restart for that reason
brought back (the same pod, or the replacement that gave back the slot): the restart did not cure.
When a comeback is asked, two lineages at least have come back failing, and more than `breaker` of
the replicas have failed for that reason within `window` (restarted, or waiting for a slot to be),
the fault is the fleet's, not a pod's: restarts for that reason (and planned ones) stop fleet-wide,
reporting only, until an operator resets the breaker (what came before is then no evidence) or a
whole window passes in which no sidecar wanted a restart for that reason.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field, replace
from typing import Any

from gpu_watchdog.watchdog.core import lease_text
from gpu_watchdog.watchdog.core.names import FLEET_BREAKER_OPEN, FLEET_UNAVAILABLE_LIMIT, MAX_AGE, RUNG_POD
from gpu_watchdog.watchdog.core.settings import FleetSettings
from gpu_watchdog.watchdog.core.timing import CLOCK_SKEW_S, CREATED_ROUNDING_S, FUTURE_S, HELD_NOTE_EVERY_S

LEDGER_ANNOTATION = "gpu-watchdog.io/ledger"
LEDGER_VERSION = 1
MAX_RESTARTS_KEPT = 256  # the ledger is one annotation (256 KiB for all of them together)

# A pod's template, as its controller labels it: a Deployment's ReplicaSet, a StatefulSet's revision.
TEMPLATE_LABELS = ("pod-template-hash", "controller-revision-hash")

GRANTED, UNAVAILABLE_LIMIT, BREAKER_OPEN = "granted", FLEET_UNAVAILABLE_LIMIT, FLEET_BREAKER_OPEN


class LedgerError(ValueError):
    """The ledger's annotation is not one we wrote: nothing it says can be trusted."""


@dataclass(frozen=True)
class Slot:
    pod: str
    reason: str
    rung: str
    at: float
    # The pod's template (`pod-template-hash`, a StatefulSet's `controller-revision-hash`): only a pod
    # of the same template replaces it. None: not known (a ledger written before it was kept).
    template: str | None = None
    # The workload's replicas wanted when it was taken, plus the new pods counted as growth since.
    replicas: int | None = None
    # When the pod's eviction (or deletion) that was accepted was asked (wall clock): its replacement
    # is created after it, and a pod created while the restart waited (for its disruption budget, a
    # drain) is a scale-up's or a rollout's, not the replacement. None: not known (the slot's time stands).
    acted_at: float | None = None
    # Its sidecar tells the ledger when the pod goes (`acted`) before it goes: until then no pod
    # replaces it. False: a slot written by a sidecar that does not (any pod created after it may).
    marked: bool = False


@dataclass(frozen=True)
class OwnPod:
    """What a sidecar knows of its own pod for the ledger: when it was created, from which template."""

    created_at: float | None
    template: str | None


@dataclass(frozen=True)
class FleetRestart:
    pod: str
    reason: str
    at: float
    comeback: bool = False
    # The pod that came back in its place and gave its slot back (a replacement), if any.
    returned_as: str | None = None


@dataclass(frozen=True)
class Breaker:
    reason: str
    opened_at: float
    # The last time a sidecar wanted a restart the breaker held back: the fault is still there.
    held_at: float
    replicas: int
    restarted: tuple[str, ...]  # the pods that had failed for the reason in the window when it opened
    opened_by: str


@dataclass(frozen=True)
class Ledger:
    slots: tuple[Slot, ...] = ()
    restarts: tuple[FleetRestart, ...] = ()
    # Replicas whose restart waits for a slot: failing too, for the breaker's count.
    waiting: tuple[Slot, ...] = ()
    breaker: Breaker | None = None
    # Every breaker opened before this (an operator's reset) is closed.
    reset_at: float | None = None


@dataclass(frozen=True)
class PodSeen:
    """One pod of the workload as the API server lists it."""

    name: str
    ready: bool  # its Ready condition is True
    terminating: bool = False  # its deletion was accepted (`metadata.deletionTimestamp`)


@dataclass(frozen=True)
class Census:
    """What the cluster says of the workload, read just before a slot is asked for: the replicas its
    controller wants and every pod its selector matches. Availability is counted from this, the way a
    PodDisruptionBudget counts it, never from the ledger's memory of which pod replaced which (a Lease
    can vanish, a node's clock can be off, and pods come and go that no sidecar restarted)."""

    desired: int
    pods: tuple[PodSeen, ...]

    def find(self, name: str) -> PodSeen | None:
        return next((p for p in self.pods if p.name == name), None)

    def present(self, name: str) -> bool:
        """A pod of that name is there and not going away."""
        seen = self.find(name)
        return seen is not None and not seen.terminating


def out_after(census: Census, ledger: Ledger, pod: str) -> tuple[int, dict[str, Any]]:
    """How many of the workload's replicas would be out once `pod` goes, and the figures behind it:
    the smaller of two counts, each enough on its own to keep `max_unavailable`.

    - As a PodDisruptionBudget counts: the desired replicas less those serving once `pod` goes
      (Ready, not terminating, holding no slot and not waiting for one: a restart asked for, or a
      failure its own sidecar has seen, shows in the pod's Ready condition only after the kubelet's
      next failed probes, up to `periodSeconds x failureThreshold` later).
    - Out by restarts: every other pod that does not serve, the ones being restarted (a slot's pod
      going away included) and whoever else made them (a replacement loading, a drain's stand-in, a
      rollout's surge, a scale-up), plus the replicas not created yet, plus `pod`. Not counted are
      the replicas that already cannot serve and wait for a slot of their own (in the ledger's
      waiting list, Ready or not yet unready): they are out by their fault, not by a restart, and one of them must be
      let go first (two hung replicas would otherwise each wait for the other, for good)."""
    held = {s.pod for s in ledger.slots}
    waiting = {w.pod for w in ledger.waiting}
    others = [p for p in census.pods if p.name != pod]
    serving = [p for p in others if p.ready and not p.terminating and p.name not in held and p.name not in waiting]
    failing = [p for p in others if not p.terminating and p.name in waiting and p.name not in held]
    not_serving = [p for p in others if p not in serving and p not in failing
                   and (not p.terminating or p.name in held)]
    missing = max(0, census.desired - sum(1 for p in census.pods if not p.terminating))
    budget = census.desired - len(serving)
    by_restarts = len(not_serving) + missing + 1
    return max(0, min(budget, by_restarts)), {
        "desired": census.desired, "serving": len(serving), "not_serving": sorted(p.name for p in not_serving),
        "failing_waiting": sorted(p.name for p in failing)}


@dataclass(frozen=True)
class Verdict:
    outcome: str  # GRANTED | UNAVAILABLE_LIMIT | BREAKER_OPEN
    detail: dict[str, Any] = field(default_factory=dict)
    # The breaker opened with this verdict: said once, fleet-wide (an Event on the workload).
    opened: bool = False

    @property
    def granted(self) -> bool:
        return self.outcome == GRANTED


# -- the ledger as stored ------------------------------------------------------------------------


def dump(ledger: Ledger) -> str:
    data = {
        "v": LEDGER_VERSION,
        "slots": [vars(s) for s in ledger.slots],
        "restarts": [vars(r) for r in ledger.restarts[-MAX_RESTARTS_KEPT:]],
        "waiting": [vars(w) for w in ledger.waiting],
        "breaker": None if ledger.breaker is None else {**vars(ledger.breaker),
                                                        "restarted": list(ledger.breaker.restarted)},
        "reset_at": ledger.reset_at,
    }
    return json.dumps(data, sort_keys=True, separators=(",", ":"))


def _num(d: dict[str, Any], key: str) -> float:
    v = d.get(key)
    if isinstance(v, bool) or not isinstance(v, int | float) or not math.isfinite(v):
        raise LedgerError(f"{key}: expected a number, got {v!r}")
    return float(v)


def _str(d: dict[str, Any], key: str, optional: bool = False) -> Any:
    v = d.get(key)
    if optional and v is None:
        return None
    if not isinstance(v, str):
        raise LedgerError(f"{key}: expected a string, got {v!r}")
    return v


def _dicts(data: dict[str, Any], key: str) -> list[dict[str, Any]]:
    v = data.get(key, [])
    if not isinstance(v, list) or not all(isinstance(x, dict) for x in v):
        raise LedgerError(f"{key}: expected a list of objects")
    return v


def _slot(s: dict[str, Any]) -> Slot:
    replicas = s.get("replicas")
    if replicas is not None and (isinstance(replicas, bool) or not isinstance(replicas, int) or replicas < 0):
        raise LedgerError(f"replicas: expected a count, got {replicas!r}")
    return Slot(_str(s, "pod"), _str(s, "reason"), _str(s, "rung"), _num(s, "at"),
                _str(s, "template", optional=True), replicas,
                None if s.get("acted_at") is None else _num(s, "acted_at"), s.get("marked") is True)


def parse(text: str | None) -> Ledger:
    """The ledger in a Lease's annotation; an absent one is empty. Raises LedgerError on anything else."""
    if text is None or text == "":
        return Ledger()
    data = lease_text.opened(text, LEDGER_VERSION, "a ledger", LedgerError)
    slots = tuple(_slot(s) for s in _dicts(data, "slots"))
    waiting = tuple(_slot(s) for s in _dicts(data, "waiting"))
    restarts = tuple(FleetRestart(_str(r, "pod"), _str(r, "reason"), _num(r, "at"), bool(r.get("comeback")),
                                  _str(r, "returned_as", optional=True)) for r in _dicts(data, "restarts"))
    b = data.get("breaker")
    breaker = None
    if b is not None:
        if not isinstance(b, dict) or not isinstance(b.get("restarted"), list):
            raise LedgerError("breaker: expected an object")
        replicas = b.get("replicas")
        if isinstance(replicas, bool) or not isinstance(replicas, int):
            raise LedgerError(f"breaker.replicas: expected an integer, got {replicas!r}")
        breaker = Breaker(_str(b, "reason"), _num(b, "opened_at"), _num(b, "held_at"), replicas,
                          tuple(str(p) for p in b["restarted"]), _str(b, "opened_by"))
    reset_at = None if data.get("reset_at") is None else _num(data, "reset_at")
    return Ledger(slots, restarts, waiting, breaker, reset_at)


# -- the rules -----------------------------------------------------------------------------------


def unavailable_slots(settings: FleetSettings, replicas: int | None) -> int:
    """`max_unavailable` as a count: a percentage of the replicas rounded down (as a Deployment's
    maxUnavailable is), at least 1. Replicas not known count as one."""
    value = settings.max_unavailable
    if value.endswith("%"):
        # 29 % of 100 is 29, not 28.999...: round the product before flooring it.
        return max(1, math.floor(round(float(value[:-1]) * max(1, replicas or 1) / 100.0, 6)))
    return max(1, int(value))


def breaker_open(ledger: Ledger) -> Breaker | None:
    b = ledger.breaker
    if b is None or (ledger.reset_at is not None and ledger.reset_at >= b.opened_at):
        return None
    return b


def prune(settings: FleetSettings, ledger: Ledger, now: float) -> Ledger:
    """Slots past their bound, restarts outside the window, entries dated in the future, and a
    breaker whose fault has been gone a whole window (no restart held back by it), dropped."""
    def live(at: float, bound: float) -> bool:
        return now - bound < at <= now + FUTURE_S

    slots = tuple(s for s in ledger.slots if live(s.at, settings.slot_timeout))
    restarts = tuple(r for r in ledger.restarts if live(r.at, settings.window))
    waiting = tuple(w for w in ledger.waiting if live(w.at, settings.slot_timeout))
    breaker = breaker_open(ledger)
    if breaker is not None and (now - breaker.held_at >= settings.window or breaker.held_at > now + FUTURE_S
                                or breaker.opened_at > now + FUTURE_S):
        breaker = None
    # A reset is remembered for a window: what came before it is no evidence until it is outside anyway.
    reset_at = ledger.reset_at if ledger.reset_at is not None and now - ledger.reset_at < settings.window else None
    return Ledger(slots, restarts, waiting, breaker, reset_at)


def _counted(settings: FleetSettings, ledger: Ledger, at: float, now: float) -> bool:
    """Within the window, and after an operator's reset: what came before a reset is not evidence."""
    return now - at < settings.window and (ledger.reset_at is None or at > ledger.reset_at)


def is_comeback(settings: FleetSettings, ledger: Ledger, pod: str, reason: str, now: float) -> bool:
    """Whether `pod` is one a restart for `reason` brought back within the window."""
    return any(r.reason == reason and _counted(settings, ledger, r.at, now) and pod in (r.pod, r.returned_as)
               for r in ledger.restarts)


def lineage_of(ledger: Ledger, pod: str, reason: str) -> str:
    """The first pod of `pod`'s chain of restarts for `reason` (itself when it has none)."""
    seen = {pod}
    while True:
        before = next((r for r in reversed(ledger.restarts) if r.reason == reason and r.returned_as == pod), None)
        if before is None or before.pod in seen:
            return pod
        pod = before.pod
        seen.add(pod)


def failed_for(settings: FleetSettings, ledger: Ledger, reason: str, now: float) -> list[str]:
    """The replicas that failed for `reason` within the window: restarted (one per lineage of
    comebacks) or waiting for a slot."""
    restarted = [r.pod for r in ledger.restarts if r.reason == reason and not r.comeback
                 and _counted(settings, ledger, r.at, now)]
    # A replacement that came back failing waits under its own name: its lineage is the one replica.
    waiting = [lineage_of(ledger, w.pod, reason) for w in ledger.waiting
               if w.reason == reason and _counted(settings, ledger, w.at, now)]
    return sorted({*restarted, *waiting})


def came_back_failing(settings: FleetSettings, ledger: Ledger, reason: str, now: float) -> set[str]:
    """The lineages a restart for `reason` did not cure: one of their pods came back failing."""
    return {lineage_of(ledger, r.pod, reason) for r in ledger.restarts
            if r.reason == reason and r.comeback and _counted(settings, ledger, r.at, now)}


def breaker_holds(breaker: Breaker, reason: str) -> bool:
    """An open breaker holds restarts for its own reason and planned ones (a fleet in trouble is no
    time to age replicas out); another fault on one replica still gets its restart, slots permitting."""
    return reason in (breaker.reason, MAX_AGE)


def live_slots(ledger: Ledger, census: Census | None) -> tuple[Slot, ...]:
    """The slots that still stand for a restart under way: a slot whose pod the cluster no longer shows
    (evicted, deleted by a drain or a scale-down, its sidecar gone with it) holds nobody; the pods
    that stand in for it are counted by the census instead."""
    if census is None:
        return ledger.slots
    return tuple(s for s in ledger.slots if census.present(s.pod))


def take(settings: FleetSettings, ledger: Ledger, replicas: int | None, pod: str, reason: str, rung: str,
         now: float, *, template: str | None = None, marks: bool = False,
         census: Census | None = None) -> tuple[Ledger, Verdict]:
    """Ask for a slot to restart `pod` for `reason`: granted (and the restart recorded), held for want
    of a slot, or held by the breaker (which this ask may open). `marks`: the asker tells the ledger
    when its pod goes (`acted`) before it goes, so that no pod replaces it until then.

    `census`: what the cluster says of the workload now. With it, a slot is granted only while the
    replicas out once `pod` goes (`out_after`) stay within `max_unavailable`, and only slots whose pod
    is still there count against it (`live_slots`); the sidecar always passes one (it holds rather
    than guess when the pods cannot be listed). None: the ledger's slots alone (its own rules on traces)."""
    ledger = prune(settings, ledger, now)
    if census is not None:
        replicas = census.desired
    limit = unavailable_slots(settings, replicas)
    live = live_slots(ledger, census)
    figures: dict[str, Any] = {"replicas": replicas, "max_unavailable": limit,
                               "unavailable": len(live)}
    out: int | None = None
    if census is not None:
        out, counted = out_after(census, ledger, pod)
        figures = {**figures, "unavailable": out, **counted}
    open_breaker = breaker_open(ledger)
    if open_breaker is not None and breaker_holds(open_breaker, reason):
        # Only its own fault keeps it open: the quiet window is about that fault.
        if reason == open_breaker.reason and now - open_breaker.held_at >= HELD_NOTE_EVERY_S:
            ledger = replace(ledger, breaker=replace(open_breaker, held_at=now))
        return ledger, Verdict(BREAKER_OPEN, {**figures, **_breaker_detail(open_breaker)})
    mine = next((s for s in ledger.slots if s.pod == pod), None)
    if mine is not None:
        return ledger, Verdict(GRANTED, {**figures, "slot_taken_at": mine.at})  # asked again after a retry
    comeback = is_comeback(settings, ledger, pod, reason, now)
    failed = failed_for(settings, ledger, reason, now)
    uncured = came_back_failing(settings, ledger, reason, now) | {lineage_of(ledger, pod, reason)} if comeback \
        else set()
    # A fault on one replica is never the fleet's (two lineages at least must have come back failing),
    # and without the replica count nothing is a share.
    if open_breaker is None and comeback and replicas is not None and replicas >= 2 and len(uncured) >= 2 \
            and len(failed) >= 2 and len(failed) > settings.breaker * replicas:
        b = Breaker(reason, now, now, replicas, tuple(failed), pod)
        return replace(ledger, breaker=b), Verdict(BREAKER_OPEN, {**figures, **_breaker_detail(b)}, opened=True)
    if len([s for s in live if s.pod != pod]) >= limit or (out is not None and out > limit):
        # A comeback waits too (its lineage is counted once by the breaker): a replica that cannot serve
        # and waits is out by its fault, not by a restart, and left uncounted it would hold every other
        # replica's slot, and so the restart that lets the breaker see a second lineage, for good.
        if not any(w.pod == pod and now - w.at < settings.slot_timeout / 2 for w in ledger.waiting):
            waiting = (*(w for w in ledger.waiting if w.pod != pod), Slot(pod, reason, rung, now, template, replicas))
            ledger = replace(ledger, waiting=waiting)
        return ledger, Verdict(UNAVAILABLE_LIMIT, {**figures, "restarting": sorted(s.pod for s in live)})
    ledger = replace(ledger, slots=(*ledger.slots, Slot(pod, reason, rung, now, template, replicas,
                                                        marked=marks and rung == RUNG_POD)),
                     waiting=tuple(w for w in ledger.waiting if w.pod != pod),
                     restarts=(*ledger.restarts, FleetRestart(pod, reason, now, comeback))[-MAX_RESTARTS_KEPT:])
    return ledger, Verdict(GRANTED, {**figures, "unavailable": len(live) + 1 if out is None else out,
                                     "comeback": comeback})


def recount(settings: FleetSettings, ledger: Ledger, census: Census, pod: str) -> Verdict:
    """Right before `pod` goes, its slot held and its wait over: the replicas out once it goes,
    counted again from what the cluster shows now. Others may have gone since the slot was granted (a
    node drain, a scale-down, another pod's eviction): a slot granted seconds ago is no licence for
    what the cluster shows at the act. Granted, or held for want of a slot."""
    limit = unavailable_slots(settings, census.desired)
    out, counted = out_after(census, ledger, pod)
    figures = {"replicas": census.desired, "max_unavailable": limit, "unavailable": out, **counted,
               "recounted": True}
    return Verdict(GRANTED if out <= limit else UNAVAILABLE_LIMIT, figures)


def _breaker_detail(b: Breaker) -> dict[str, Any]:
    return {"breaker_reason": b.reason, "breaker_opened_at": b.opened_at, "breaker_failed": list(b.restarted),
            "breaker_replicas": b.replicas, "breaker_opened_by": b.opened_by}


def leave_waiting(ledger: Ledger, pod: str) -> Ledger:
    """`pod` no longer waits for a slot (its target serves again: no restart is wanted)."""
    return replace(ledger, waiting=tuple(w for w in ledger.waiting if w.pod != pod))


def give_back(ledger: Ledger, pod: str, restarted: bool) -> Ledger:
    """`pod`'s slot back (and its place among the waiting): its target serves again, or (`restarted`
    false) the restart did not happen, which then is no restart of the fleet's either."""
    slots = tuple(s for s in ledger.slots if s.pod != pod)
    waiting = tuple(w for w in ledger.waiting if w.pod != pod)
    restarts = ledger.restarts
    if not restarted:
        mine = [s for s in ledger.slots if s.pod == pod]
        if mine:
            taken = mine[-1]
            restarts = tuple(r for r in restarts if not (r.pod == pod and r.at == taken.at))
    return replace(ledger, slots=slots, restarts=restarts, waiting=waiting)


def acted(ledger: Ledger, pod: str, at: float | None) -> Ledger:
    """Our pod's eviction (or deletion) is asked at `at` (told before it is asked; again after a try
    the API refused): only a pod created after it (within CLOCK_SKEW_S) replaces it. None: our pod was
    gone already, removed by someone else whenever: its slot goes back as an unmarked one does."""
    return replace(ledger, slots=tuple(
        (replace(s, acted_at=at) if at is not None else replace(s, acted_at=None, marked=False))
        if s.pod == pod and s.rung == RUNG_POD else s for s in ledger.slots))


def replaced(ledger: Ledger, pod: str, started_at: float, *, template: str | None = None,
             replicas: int | None = None) -> tuple[Ledger, Slot | None]:
    """A pod whose target serves for the first time (created at `started_at`, of pod template
    `template`, the workload wanting `replicas` now): the pod-rung slot it replaced given back, the
    newest of those taken before the pod was created from its template. A StatefulSet's replacement
    has its predecessor's name: a slot of that name counts where it was taken before the pod was created.

    Not every new pod is a replacement. One of another template (a rollout's) returns nothing, nor one
    created before the slot's eviction was asked (`acted`: a scale-up's while the restart waited). Where
    more replicas are wanted now than when a slot was taken, the pod may be one of the new ones: it
    is counted as growth by every such slot (each then waits for one pod more) and returns nothing;
    the pods beyond the growth return the slots. Counted in either order, a slot goes back only once
    as many pods served as were created since it was taken. Unknown on either side (None) matches.
    None when there is none."""
    candidates = sorted((s for s in ledger.slots if s.rung == RUNG_POD
                         and (s.at <= started_at + CLOCK_SKEW_S if s.template is None else s.at < started_at)
                         and (s.acted_at - CLOCK_SKEW_S - CREATED_ROUNDING_S < started_at if s.acted_at is not None
                              else not s.marked)
                         and (s.pod != pod or s.at < started_at)
                         and (template is None or s.template is None or s.template == template)),
                        key=lambda s: s.at)
    if not candidates:
        return ledger, None
    growth = [s for s in candidates if replicas is not None and s.replicas is not None and replicas > s.replicas]
    if growth:
        grown = {id(s) for s in growth}
        slots = tuple(replace(s, replicas=(s.replicas or 0) + 1) if id(s) in grown else s for s in ledger.slots)
        return replace(ledger, slots=slots), None
    slot = candidates[-1]
    restarts = tuple(replace(r, returned_as=pod) if r.pod == slot.pod and r.at == slot.at else r
                     for r in ledger.restarts)
    return replace(ledger, slots=tuple(s for s in ledger.slots if s is not slot), restarts=restarts), slot


@dataclass(frozen=True)
class FleetView:
    """What a sidecar last knew of its workload's ledger, for `/status` and the metrics."""

    lease: str
    replicas: int | None = None
    max_unavailable: int = 1
    restarting: tuple[str, ...] = ()  # the pods holding a slot
    breaker: Breaker | None = None
    held: str | None = None  # why our restart is held now (a FLEET_HOLDS name), None: it is not
    held_detail: dict[str, Any] = field(default_factory=dict)
    error: str | None = None  # the ledger could not be read or written
    slot_held: bool = False


def reset_breaker(ledger: Ledger, now: float) -> Ledger:
    """An operator's reset: restarts may go on, and what came before it is no longer evidence (the
    breaker opens again if the fault is still there: two lineages come back failing again)."""
    return replace(ledger, breaker=None, reset_at=now)


def view_of(view: FleetView, settings: FleetSettings, replicas: int | None, ledger: Ledger | None,
            error: str | None = None) -> FleetView:
    """The view after a read or write of the ledger (None: not read; the last figures stand)."""
    out = replace(view, replicas=replicas, max_unavailable=unavailable_slots(settings, replicas), error=error)
    if ledger is not None:
        out = replace(out, restarting=tuple(sorted(sl.pod for sl in ledger.slots)), breaker=breaker_open(ledger))
    return out
