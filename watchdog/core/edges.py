"""What the sidecar's edges said, folded: the facts the executor, the keep-out and the loop learn
from the Kubernetes API, the workload's ledger, the kubelet and the server's control API.

Each fact lives here, in the history (`History.edge`), rather than in the objects that perform the
effects: those keep their clients and read the fold back, so `/status`, the metrics and a replay all
see the same facts, and an edge's rule (when an episode is over, when a slot goes back, how long a
backoff is) is a pure function a trace can drive. `fold` returns a new record: nothing is changed in
place. Pure: no I/O and no clock.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any

from gpu_watchdog.watchdog.core import quarantine
from gpu_watchdog.watchdog.core.escalation import Suspect
from gpu_watchdog.watchdog.core.fleet import FleetView, OwnPod
from gpu_watchdog.watchdog.core.settings import PlacementSettings
from gpu_watchdog.watchdog.core.timing import (
    ESCALATION_RETRY_MAX_S,
    ESCALATION_RETRY_S,
    NOT_RECORDED_HOLD_S,
    POD_GPUS_RETRY_MAX_S,
    POD_GPUS_RETRY_S,
)

# The failures whose evidence was read lately, kept to tell a restart asked again (held, blocked).
EVIDENCE_KEPT = 64


@dataclass(frozen=True)
class NotRecorded:
    """The last restart wanted was not carried out for want of its Event: why, and when."""

    detail: str
    at: float


@dataclass(frozen=True)
class Evidence:
    """One failure's evidence as read (reason, process) and what was in flight (None: unreadable)."""

    reason: str
    instance_id: str | None
    inflight: tuple[str, ...] | None


@dataclass(frozen=True)
class Refused:
    """A failure whose record the workload's records refused, and when (tried again after a while)."""

    reason: str
    instance_id: str | None
    at: float


@dataclass(frozen=True)
class InPlace:
    """A worker (0: the watched target) restarted in place that holds our slot until it serves again,
    with the process it replaced (None: any answer after the restart is the new process's)."""

    worker: int
    instance_id: str | None


@dataclass(frozen=True)
class EdgeFacts:
    """Everything the edges said that the sidecar remembers."""

    nvml_available: bool = False
    canary: dict[str, Any] = field(default_factory=dict)  # the canary's route (and model) as last used
    loop_lag: dict[str, float] | None = None  # the sidecar's own event-loop lag: last, p99, max
    # Restarts: the last one that failed, and an episode of Events refused.
    restart_failed: str | None = None
    not_recorded: NotRecorded | None = None
    # The workload's restart Events: why they could not be read, and those dated in the future.
    budget_read_error: str | None = None
    ignored_records: tuple[tuple[str, float], ...] = ()
    replicas: int | None = None  # the last count read (a count briefly unreadable has not changed)
    replicas_error: str | None = None
    # The kubelet's PodResources: why it did not answer, and how many times it refused.
    pod_gpus_error: str | None = None
    pod_gpus_tries: int = 0
    # The Node's escalation: our GPUs reported suspect, and the backoff after a refused call.
    suspects: tuple[Suspect, ...] = ()
    escalation_retry_at: float = 0.0
    escalation_failures: int = 0
    escalation_said: tuple[str, ...] = ()
    # The workload's ledger as last seen, and our part in it.
    fleet: FleetView = field(default_factory=lambda: FleetView(lease=""))
    own_pod: OwnPod | None = None  # read once: a pod's creation and template never change
    acting: tuple[int, ...] = ()  # the workers whose restart is under way now (one at a time)
    slot_taken_at: float | None = None
    in_place: tuple[InPlace, ...] = ()
    slot_for_pod: bool = False  # our slot is for our pod's replacement, which gives it back itself
    give_back_pending: bool | None = None  # a give-back that failed: tried again as it was first asked
    came_back: bool = False  # our pod's first serving was told to the ledger
    came_back_failed: bool = False
    held_since: float = 0.0
    held_episode: tuple[str, str] | None = None  # (why, reason) of the hold now
    held_anew: bool = False  # the hold last told began a new episode (recorded once)
    breakers_said: tuple[float, ...] = ()
    # The query of death: the workload's records (the Lease's, else this pod's own), what was read.
    records: quarantine.Records = field(default_factory=quarantine.Records)
    records_error: str | None = None
    evidence: tuple[Evidence, ...] = ()
    refused: tuple[Refused, ...] = ()
    pushed: tuple[str, ...] | None = None  # the fingerprints our server last got
    pushed_to: str | None = None  # the server process the list last reached
    worker_pushed_to: dict[int, str] = field(default_factory=dict)  # the same, for each other worker
    # Requests our servers served that a shadow quarantine would have refused (policy.enforce): the
    # total, and each worker's count as it last said it (a process that starts again counts from 0).
    would_refuse: int = 0
    would_refuse_said: dict[int, int] = field(default_factory=dict)
    # The stacks last taken before a hang's restart, by worker (0: the watched target).
    stacks: dict[int, Stacks] = field(default_factory=dict)
    # Cards kept out of placement: what was done lately, and the last edge error.
    placement_recent: tuple[dict[str, Any], ...] = ()
    placement_error: str | None = None
    placement_said: tuple[str, ...] = ()
    # Answers checked: the fleet's agreement on a reference as last read (`correctness.describe`).
    correctness: dict[str, Any] = field(default_factory=dict)


# -- the edges' outcomes ----------------------------------------------------------------------------


@dataclass(frozen=True)
class NvmlOpened:
    available: bool


@dataclass(frozen=True)
class CanaryDescribed:
    describe: dict[str, Any]


@dataclass(frozen=True)
class LoopLag:
    """The sidecar's own event-loop lag over its recent probes, in seconds."""

    at: float
    last_s: float
    p99_s: float
    max_s: float
    samples: int


@dataclass(frozen=True)
class RecordsIgnored:
    """Restart records dated in the future at a read (pod, time): not counted."""

    ignored: tuple[tuple[str, float], ...]


@dataclass(frozen=True)
class ReplicasRead:
    replicas: int | None  # None: unreadable (the last count stands)
    error: str | None = None


@dataclass(frozen=True)
class SuspectReported:
    suspect: Suspect


@dataclass(frozen=True)
class SuspectWithdrawn:
    """A suspect taken before its report, the report refused: reported again at the next decision."""

    uuid: str


@dataclass(frozen=True)
class EscalationFailed:
    at: float
    key: str  # the step and the status (or error type): said once per kind


@dataclass(frozen=True)
class EscalationLooked:
    """The Events were read and every suspect among them reported: the backoff starts again."""


@dataclass(frozen=True)
class FleetSeen:
    view: FleetView


@dataclass(frozen=True)
class OwnPodRead:
    own: OwnPod


@dataclass(frozen=True)
class Acting:
    worker: int
    on: bool


@dataclass(frozen=True)
class SlotTaken:
    at: float
    worker: int


@dataclass(frozen=True)
class Held:
    """Our restart held by the ledger (a FLEET_HOLDS name) for `reason`, with what the ledger said."""

    at: float
    why: str
    reason: str
    detail: dict[str, Any]


@dataclass(frozen=True)
class HoldEnded:
    """No restart is wanted any more: the hold is over."""


@dataclass(frozen=True)
class InPlaceServed:
    """A worker restarted in place serves again (a new process)."""

    worker: int


@dataclass(frozen=True)
class SlotGivenBack:
    pass


@dataclass(frozen=True)
class SlotNotGivenBack:
    restarted: bool  # as it was asked: tried again so


@dataclass(frozen=True)
class CameBack:
    told: bool  # False: the ledger could not be told (tried again at the next canary served)


@dataclass(frozen=True)
class BreakerSaid:
    opened_at: float


@dataclass(frozen=True)
class EvidenceRead:
    evidence: Evidence
    process: str | None = None  # the process the server named: its evidence is known by it too


@dataclass(frozen=True)
class EvidenceRefused:
    refused: Refused


@dataclass(frozen=True)
class RecordsSeen:
    """The workload's records as read or written (None: unreadable, the last read stands)."""

    records: quarantine.Records | None
    error: str | None = None


@dataclass(frozen=True)
class QuarantinePushed:
    worker: int
    instance_id: str | None
    fingerprints: tuple[str, ...]


@dataclass(frozen=True)
class Stacks:
    """Where a hung process stood before its restart: every thread's stack from its control API (kept in
    its termination log too), or, for a server without one, its metrics page at the stall (`source`
    metrics: the readings recorded beside this)."""

    worker: int
    instance_id: str | None
    reason: str
    at: float
    source: str  # control | metrics
    stuck: str | None = None  # "file:line in function (thread)"
    termination_log: str | None = None
    threads: tuple[tuple[str, tuple[str, ...]], ...] = ()  # (name, frames, innermost first)
    error: str | None = None


@dataclass(frozen=True)
class StacksTaken:
    stacks: Stacks


@dataclass(frozen=True)
class WouldRefuseCounted:
    """A server's count of requests it served that a shadow quarantine entry would have refused."""

    worker: int
    count: int


@dataclass(frozen=True)
class PlacementDone:
    record: dict[str, Any]  # at, action, card, node, evidence, target
    kept: int


@dataclass(frozen=True)
class PlacementSaid:
    key: str  # an episode said once (capped, a card not known)
    said: bool = True  # False: it is over, said again when it begins again


@dataclass(frozen=True)
class PlacementFailed:
    """A placement step failed (`error`; None: the next one succeeded), said once per `key` (kind)."""

    error: str | None
    key: str | None = None


@dataclass(frozen=True)
class CorrectnessSeen:
    """The fleet's agreement on a reference answer, as last read or written (`correctness.describe`)."""

    describe: dict[str, Any]


EdgeOutcome = (NvmlOpened | CanaryDescribed | LoopLag | RecordsIgnored | ReplicasRead | SuspectReported
               | SuspectWithdrawn | EscalationFailed | EscalationLooked | FleetSeen | OwnPodRead | Acting | SlotTaken
               | Held | HoldEnded | InPlaceServed | SlotGivenBack | SlotNotGivenBack | CameBack | BreakerSaid
               | EvidenceRead | EvidenceRefused | RecordsSeen | QuarantinePushed | PlacementDone | PlacementSaid
               | PlacementFailed | CorrectnessSeen | WouldRefuseCounted | StacksTaken)
EDGE_OUTCOMES: tuple[type[Any], ...] = tuple(EdgeOutcome.__args__)


def fold(e: EdgeFacts, o: Any) -> EdgeFacts:
    """One edge outcome folded in: a new record."""
    if isinstance(o, NvmlOpened):
        return replace(e, nvml_available=o.available)
    if isinstance(o, CanaryDescribed):
        return replace(e, canary=dict(o.describe))
    if isinstance(o, LoopLag):
        return replace(e, loop_lag={"last_s": o.last_s, "p99_s": o.p99_s, "max_s": o.max_s, "samples": o.samples})
    if isinstance(o, RecordsIgnored):
        return replace(e, ignored_records=o.ignored)
    if isinstance(o, ReplicasRead):
        return replace(e, replicas=e.replicas if o.error is not None else o.replicas, replicas_error=o.error)
    if isinstance(o, SuspectReported):
        return replace(e, suspects=(*(s for s in e.suspects if s.uuid != o.suspect.uuid), o.suspect))
    if isinstance(o, SuspectWithdrawn):
        return replace(e, suspects=tuple(s for s in e.suspects if s.uuid != o.uuid))
    if isinstance(o, EscalationFailed):
        return replace(e, escalation_retry_at=o.at + escalation_backoff(e),
                       escalation_failures=e.escalation_failures + 1, escalation_said=_once(e.escalation_said, o.key))
    if isinstance(o, EscalationLooked):
        return replace(e, escalation_failures=0)
    if isinstance(o, FleetSeen):
        return replace(e, fleet=o.view)
    if isinstance(o, OwnPodRead):
        return replace(e, own_pod=o.own)
    if isinstance(o, Acting):
        acting = (*e.acting, o.worker) if o.on else tuple(k for k in e.acting if k != o.worker)
        return replace(e, acting=acting)
    if isinstance(o, SlotTaken):
        return replace(e, held_since=0.0, slot_taken_at=o.at, in_place=_without(e.in_place, o.worker),
                       fleet=replace(e.fleet, held=None, held_detail={}, slot_held=True))
    if isinstance(o, Held):
        episode = (o.why, o.reason)
        anew = e.held_episode != episode
        return replace(e, held_anew=anew, held_episode=episode,
                       held_since=o.at if anew and not e.held_since else e.held_since,
                       fleet=replace(e.fleet, held=o.why, held_detail=dict(o.detail)))
    if isinstance(o, HoldEnded):
        return replace(e, held_since=0.0, held_episode=None, fleet=replace(e.fleet, held=None, held_detail={}))
    if isinstance(o, InPlaceServed):
        return replace(e, in_place=_without(e.in_place, o.worker))
    if isinstance(o, SlotGivenBack):
        return replace(e, give_back_pending=None, in_place=(), slot_for_pod=False,
                       fleet=replace(e.fleet, slot_held=False))
    if isinstance(o, SlotNotGivenBack):
        return replace(e, give_back_pending=o.restarted)
    if isinstance(o, CameBack):
        return replace(e, came_back=o.told, came_back_failed=e.came_back_failed or not o.told)
    if isinstance(o, BreakerSaid):
        return replace(e, breakers_said=(*e.breakers_said, o.opened_at)[-EVIDENCE_KEPT:])
    if isinstance(o, EvidenceRead):
        keys = {(o.evidence.reason, o.evidence.instance_id)}
        if o.process is not None:
            keys.add((o.evidence.reason, o.process))
        kept = tuple(v for v in e.evidence if (v.reason, v.instance_id) not in keys)
        new = tuple(Evidence(r, i, o.evidence.inflight) for r, i in sorted(keys, key=lambda k: str(k[1])))
        refused = tuple(r for r in e.refused if (r.reason, r.instance_id) not in keys) \
            if o.process is not None else e.refused
        return replace(e, evidence=(*kept, *new)[-EVIDENCE_KEPT:], refused=refused)
    if isinstance(o, EvidenceRefused):
        r = o.refused
        return replace(e, refused=(*(x for x in e.refused if (x.reason, x.instance_id) != (r.reason, r.instance_id)),
                                   r)[-EVIDENCE_KEPT:])
    if isinstance(o, RecordsSeen):
        return replace(e, records=e.records if o.records is None else o.records, records_error=o.error)
    if isinstance(o, QuarantinePushed):
        if o.worker:
            if o.instance_id is None:
                return e
            return replace(e, worker_pushed_to={**e.worker_pushed_to, o.worker: o.instance_id})
        return replace(e, pushed=o.fingerprints, pushed_to=e.pushed_to if o.instance_id is None else o.instance_id)
    if isinstance(o, StacksTaken):
        return replace(e, stacks={**e.stacks, o.stacks.worker: o.stacks})
    if isinstance(o, WouldRefuseCounted):
        last = e.would_refuse_said.get(o.worker, 0)
        grown = o.count - last if o.count >= last else o.count
        return replace(e, would_refuse=e.would_refuse + grown, would_refuse_said={**e.would_refuse_said,
                                                                                   o.worker: o.count})
    if isinstance(o, PlacementDone):
        return replace(e, placement_recent=(*e.placement_recent, o.record)[-o.kept:])
    if isinstance(o, PlacementSaid):
        others = tuple(k for k in e.placement_said if k != o.key)
        return replace(e, placement_said=(*others, o.key) if o.said else others)
    if isinstance(o, PlacementFailed):
        return replace(e, placement_error=o.error,
                       placement_said=e.placement_said if o.key is None else _once(e.placement_said, o.key))
    if isinstance(o, CorrectnessSeen):
        return replace(e, correctness=dict(o.describe))
    raise TypeError(f"not an edge outcome: {type(o).__name__}")


def _once(said: tuple[str, ...], key: str) -> tuple[str, ...]:
    """The keys said so far, with `key` (each kind is said once)."""
    return said if key in said else (*said, key)


def _without(in_place: tuple[InPlace, ...], worker: int) -> tuple[InPlace, ...]:
    return tuple(p for p in in_place if p.worker != worker)


# -- the rules over those facts ---------------------------------------------------------------------


def restart_ended(e: EdgeFacts, at: float, done: bool, in_place: bool, detail: str | None, reported_only: bool,
                  recorded: bool | None) -> EdgeFacts:
    """A restart (ours, or a worker's in place) ended: the failure and the episode of Events refused;
    an in-place one done holds our slot until the target serves again, a pod's until its replacement does."""
    failed = None if done else (e.restart_failed if reported_only or detail is None else detail)
    not_recorded = NotRecorded(detail or "", at) if recorded is False else None if recorded else e.not_recorded
    out = replace(e, restart_failed=failed, not_recorded=not_recorded)
    if done and e.fleet.slot_held:
        if in_place:
            out = replace(out, in_place=(*_without(e.in_place, 0), InPlace(0, None)))
        else:
            out = replace(out, slot_for_pod=True)
    return out


def worker_restarted(e: EdgeFacts, worker: int, instance_id: str | None, done: bool, detail: str | None,
                     recorded: bool | None, at: float) -> EdgeFacts:
    """Another worker's rung ended: told to exit (our slot held until it serves again, a process other
    than `instance_id`), or not, its Event refused (`recorded` False) or written."""
    not_recorded = NotRecorded(detail or "", at) if recorded is False else None if recorded else e.not_recorded
    out = replace(e, not_recorded=not_recorded)
    if done and e.fleet.slot_held:
        out = replace(out, in_place=(*_without(e.in_place, worker), InPlace(worker, instance_id)))
    return out


def not_recorded_now(e: EdgeFacts, now: float) -> str | None:
    """Why the last restart wanted was not carried out for want of its Event; None: no such episode."""
    if e.not_recorded is None or now - e.not_recorded.at >= NOT_RECORDED_HOLD_S:
        return None
    return e.not_recorded.detail


def pod_gpus_wait(tries: int) -> float:
    """How long to wait before asking the kubelet again after `tries` refusals: doubled each time."""
    return float(min(POD_GPUS_RETRY_S * 2 ** max(0, tries - 1), POD_GPUS_RETRY_MAX_S))


def escalation_backoff(e: EdgeFacts) -> float:
    """The wait after the next refused look: doubled after each one, up to a bound."""
    return float(min(ESCALATION_RETRY_S * 2 ** e.escalation_failures, ESCALATION_RETRY_MAX_S))


def in_place_served(e: EdgeFacts, worker: int, instance_id: str | None) -> bool:
    """Whether `worker`, restarted in place, now serves as a new process."""
    p = next((p for p in e.in_place if p.worker == worker), None)
    return p is not None and (p.instance_id is None or instance_id != p.instance_id)


def push_due(e: EdgeFacts, worker: int, ok: bool, instance_id: str | None) -> bool:
    """Whether `worker` (0: the watched target), whose canary answered (`ok`) from process
    `instance_id`, gets the workload's quarantine now rather than at the next sync: a new process must
    not serve a request that killed the one before it. An unnamed process is pushed at the sync."""
    if not ok or instance_id is None:
        return False
    return instance_id != (e.pushed_to if worker == 0 else e.worker_pushed_to.get(worker))


def slot_back_due(e: EdgeFacts) -> bool:
    """Every worker restarted in place serves again and no restart of ours is under way: our slot goes
    back (one for our pod's replacement is given back by that pod)."""
    return e.fleet.slot_held and not e.in_place and not e.acting and not e.slot_for_pod


def evidence_seen(e: EdgeFacts, reason: str, instance_id: str | None) -> Evidence | None:
    return next((v for v in e.evidence if (v.reason, v.instance_id) == (reason, instance_id)), None)


def refused_at(e: EdgeFacts, reason: str, instance_id: str | None) -> float | None:
    return next((r.at for r in e.refused if (r.reason, r.instance_id) == (reason, instance_id)), None)


def quarantine_status(e: EdgeFacts, enabled: bool, lease: bool, wall_now: float) -> dict[str, Any]:
    return {"enabled": enabled, "records": "lease" if lease else "this sidecar",
            "entries": [quarantine.describe(q, wall_now) for q in e.records.quarantined if wall_now < q.until],
            "failures": len(e.records.failures), "error": e.records_error,
            "pushed": None if e.pushed is None else list(e.pushed)}



def placement_status(e: EdgeFacts, s: PlacementSettings) -> dict[str, Any]:
    return {"strategy": s.strategy, "effect": s.effect, "max_nodes": s.max_nodes, "max_percent": s.max_percent,
            "recent": list(e.placement_recent), "error": e.placement_error}


def stacks_taken(e: EdgeFacts, worker: int, reason: str, instance_id: str | None) -> Stacks | None:
    """The stacks of this process taken for this restart already (a restart asked again, held)."""
    st = e.stacks.get(worker)
    return st if st is not None and (st.reason, st.instance_id) == (reason, instance_id) else None


def stacks_detail(st: Stacks) -> dict[str, Any]:
    """What a restart's Event and log line say of the stacks: where it was stuck, and where they are."""
    if st.source == "metrics":
        return {"stacks": "none (not our control API): the server's metrics page at the stall is in the flight"
                          " recording"}
    if st.error is not None:
        return {"stacks": f"not read: {st.error[:120]}"}
    where = "the flight recording" + (" and the inference container's termination log" if st.termination_log
                                      else "")
    return {"stuck": st.stuck, "stacks": where}
