"""Keep a sick GPU out of the next placement: which card or node to taint, within what bound, until when.

Pure: the evidence of one restart and the workload's placement records in, the records as they
should be and a verdict out. No I/O, no clock of its own; times are wall-clock seconds, since the
records are shared by every pod of the workload (an annotation of its Lease, written with the same
compare-and-swap as the fleet's ledger).

A pod restart is a blind retry on the same hardware when the evidence is about the card: the
replacement is scheduled wherever a GPU is still advertised, and a failing card usually still is.
So, before the pod rung acts:
- the evidence is about the card when the driver says so (a recovery action, an Xid whose catalog
  action resets the GPU or reboots the node), when the kubelet reports the device Unhealthy, when the
  GPU is lost, when restarts on the same card did not cure it (a GPU suspect), or when the card was
  remediated on `repeat_days` different days within `memory` (a repeat offender: Events expire
  after an hour, these records do not);
- the card is tainted: a DRA device by a DeviceTaintRule on that one device; a device-plugin GPU by
  its node's taint (opt-in: that is the whole node);
- bounded like a breaker: at most `max_nodes` and `max_percent` (rounded up) of the workload's nodes
  or cards tainted by us at once. Many cards failing at once is not many bad cards, so past the cap
  nothing more is tainted and it is said once;
- each taint carries its expiry (`ttl`) and is lifted by any sidecar of the workload once past, or
  by an operator; a card tainted again within `memory` after a lift is a repeat.
"""

from __future__ import annotations

import hashlib
import json
import math
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, replace
from typing import Any

from gpu_watchdog.watchdog import lease_text
from gpu_watchdog.watchdog.names import CONTEXT_LOSS, HANG
from gpu_watchdog.watchdog.settings import DEVICE_EFFECTS, PlacementSettings

ANNOTATION = "gpu-watchdog.io/placement"  # on the workload's Lease, beside the fleet's ledger
DEVICE_TAINT_KEY = "gpu-watchdog.io/suspect"  # a DeviceTaintRule's taint
NODE_TAINT_KEY = "gpu-watchdog.io/gpu-suspect"  # a node's taint; its value is the card
MANAGED_BY = ("app.kubernetes.io/managed-by", "gpu-watchdog")
EVIDENCE_ANNOTATION = "gpu-watchdog.io/evidence"
UNTIL_ANNOTATION = "gpu-watchdog.io/until"
POD_ANNOTATION = "gpu-watchdog.io/pod"
WORKLOAD_ANNOTATION = "gpu-watchdog.io/workload"
NAMESPACE_ANNOTATION = "gpu-watchdog.io/namespace"  # the workload's: two namespaces may hold an `llm` each
CARD_ANNOTATION = "gpu-watchdog.io/card"
DEVICE, NODE = "device", "node"
VERSION = 1
DAY_S = 86400.0
TAINTS_KEPT = 64  # policy.placement.max_nodes's bound: the annotation stays small
EVIDENCE_KEPT = 256  # characters of a taint's evidence in the records (a kubelet's message is anyone's text)
REMEDIATIONS_KEPT = 256  # within `memory`, newest kept
LIFTS_KEPT = 64
# Lifts this recent are checked to be gone from the cluster at each reconcile: a sidecar that read the
# records before a lift may have put the taint back, and nothing else would take it away.
LIFT_SWEEP_S = 600.0
EFFECT_RANK = {"PreferNoSchedule": 0, "NoSchedule": 1, "NoExecute": 2}
FUTURE_S = 60.0  # a record dated this far ahead (another node's clock) is still believed
# Restarts meant to cure the card's state; a card restarted for its age or memory is not sick.
CURING = (CONTEXT_LOSS, HANG)


class RecordsError(ValueError):
    """The Lease's placement annotation is not ours."""


@dataclass(frozen=True)
class Card:
    """One GPU of our pod as the cluster knows it: a DRA device (`driver`/`pool`/`device`), or a
    device plugin's GPU (its UUID) on `node`."""

    id: str  # "driver/pool/device", or the GPU's UUID
    node: str
    driver: str | None = None
    pool: str | None = None
    device: str | None = None

    @property
    def dra(self) -> bool:
        return self.driver is not None and self.pool is not None and self.device is not None


@dataclass(frozen=True)
class Taint:
    """A taint we placed: a DeviceTaintRule (`target` its name) or a node's taint (`target` the node)."""

    kind: str  # DEVICE | NODE
    target: str
    card: str
    node: str
    pod: str
    at: float
    until: float
    evidence: str
    effect: str
    repeat: bool = False  # the same target was tainted and lifted within `memory`


@dataclass(frozen=True)
class Remediation:
    """A curing restart (context loss or hang) of a process on the card, in place or of its pod."""

    card: str
    node: str
    at: float
    reason: str
    xid: int | None = None


@dataclass(frozen=True)
class Lift:
    kind: str
    target: str
    card: str
    at: float
    by: str  # "expired", "operator", or the pod that lifted it


@dataclass(frozen=True)
class Records:
    taints: tuple[Taint, ...] = ()
    remediations: tuple[Remediation, ...] = ()
    lifts: tuple[Lift, ...] = ()
    # The last time a card the evidence blamed was left untainted by the bound; over at the next lift.
    capped_at: float | None = None

    def capped(self, settings: PlacementSettings, now: float) -> bool:
        """A card was left untainted by the bound within `ttl`, and no taint was lifted since."""
        return self.capped_at is not None and now - self.capped_at < settings.ttl


@dataclass(frozen=True)
class Verdict:
    """`outcome`: tainted (the records now hold `taint`: place it), already (an active taint of ours on
    that target: nothing to do), capped (the bound is reached: nothing is tainted)."""

    outcome: str
    taint: Taint | None
    tainted: int  # targets of ours tainted, after this verdict
    cap: int
    previous: Taint | None = None  # the expired taint of the same target this one renews


# -- the evidence ------------------------------------------------------------------------------------------------

def card_evidence(reason: str, detail: Mapping[str, Any]) -> str | None:
    """What in a restart decision says the card itself is at fault (None: nothing; the process may be)."""
    if reason != CONTEXT_LOSS:
        return None
    evidence = detail.get("evidence")
    if evidence == "recovery_action":
        return f"the driver's recovery action {detail.get('recovery_action')}"
    if evidence == "device_health":
        return "the kubelet reports the device Unhealthy" + (f" ({detail['message']})" if detail.get("message") else "")
    if evidence == "gpu_lost":
        return "the GPU is lost"
    if detail.get("node_action"):
        return f"Xid {detail.get('xid')} needs {detail.get('node_action')}"
    return None


def named_card(detail: Mapping[str, Any]) -> str | None:
    """The card a decision's evidence names: a DRA device's `driver/pool/device` or a GPU UUID."""
    for key in ("resource_id", "uuid"):
        if detail.get(key):
            return str(detail[key]).split("::")[0]
    return None


def evidence_card(detail: Mapping[str, Any], cards: Iterable[Card]) -> Card | None:
    """The card a decision's evidence names, among our pod's: a DRA device's `driver/pool/device` or a
    GPU UUID (a device plugin's ID carries `::N` when shared); else our only card; else none known."""
    ours = list(cards)
    named = {str(detail[k]).split("::")[0] for k in ("resource_id", "uuid") if detail.get(k)}  # both may be set
    for card in ours:
        if card.id in named:
            return card
    if named and any(c.dra for c in ours) and len(ours) == 1:
        return ours[0]  # a DRA device named by the NVML UUID its slice carries: our one device
    return ours[0] if len(ours) == 1 and not named else None


def remember(settings: PlacementSettings, records: Records, r: Remediation, now: float) -> Records:
    """A remediation of a card kept for `memory`: one per card, reason and Xid a day (a node logs the
    same Xid by the hundred thousand; one fault is one fault however often it is said)."""
    kept = _recent(settings, records.remediations, now)
    day = _day(r.at)
    if any(k.card == r.card and k.reason == r.reason and k.xid == r.xid and _day(k.at) == day for k in kept):
        return replace(records, remediations=kept)
    return replace(records, remediations=(*kept, r)[-REMEDIATIONS_KEPT:])


def repeat_days(settings: PlacementSettings, records: Records, card: str, now: float) -> list[int]:
    """The days (since the epoch, UTC) other than today the card was remediated on within `memory`."""
    today = _day(now)
    return sorted({_day(r.at) for r in _recent(settings, records.remediations, now)
                   if r.card == card and _day(r.at) != today})


def repeat_offender(settings: PlacementSettings, records: Records, card: str, now: float) -> bool:
    """Remediated on `repeat_days` different days before today: suspect at its first fault of today."""
    return len(repeat_days(settings, records, card, now)) >= settings.repeat_days


# -- the bound and the taints ----------------------------------------------------------------------------------

def cap(settings: PlacementSettings, scope: int) -> int:
    """Targets of the workload we may taint at once: `max_nodes`, and `max_percent` of `scope` (its nodes
    or cards) rounded up, as NVSentinel's breaker rounds."""
    return max(0, min(settings.max_nodes, math.ceil(max(scope, 1) * settings.max_percent / 100.0)))


def device_effect(settings: PlacementSettings) -> str:
    """A device taint's effect: the setting where a device takes it, else NoSchedule (a node's hint
    PreferNoSchedule has no device form)."""
    return settings.effect if settings.effect in DEVICE_EFFECTS else "NoSchedule"


def plan(settings: PlacementSettings, card: Card, pod: str, evidence: str, now: float) -> Taint | None:
    """The taint that keeps `card` out: its device's where DRA names it, its node's where the strategy
    allows a node (`node`); None where neither may be tainted (a device-plugin GPU under `device`)."""
    until, evidence = now + settings.ttl, evidence[:EVIDENCE_KEPT]
    if card.dra:
        # NoExecute evicts whatever uses the device, our pod included, bypassing its Event and its
        # disruption budget: it keeps placements away first (NoSchedule), and becomes NoExecute once
        # our own restart was accepted (`escalated`).
        return Taint(DEVICE, device_rule_name(card), card.id, card.node, pod, now, until, evidence, "NoSchedule")
    if settings.strategy in ("node", "none") and card.node:
        return Taint(NODE, card.node, card.id, card.node, pod, now, until, evidence, settings.effect)
    return None


def escalated(settings: PlacementSettings, taint: Taint) -> Taint | None:
    """The taint as it stands once our pod's restart was accepted: a device's NoExecute where asked
    (None: nothing to change)."""
    effect = device_effect(settings)
    if taint.kind != DEVICE or effect == taint.effect:
        return None
    return replace(taint, effect=effect)


def card_of(taint: Taint) -> Card:
    """The card a taint was placed for, from its record (a DRA id is driver/pool/device; a pool's name
    may itself hold slashes, a driver's and a device's never do)."""
    if taint.kind == DEVICE:
        driver, _, rest = taint.card.partition("/")
        pool, _, device = rest.rpartition("/")
        return Card(taint.card, taint.node, driver, pool, device)
    return Card(taint.card, taint.node)


def same_taint(a: Taint, b: Taint) -> bool:
    """One taint in the cluster: a rule's name, or a node's taint for one card (a node carries one per card)."""
    return (a.kind, a.target, a.card) == (b.kind, b.target, b.card)


def take(settings: PlacementSettings, records: Records, wanted: Taint, scope: int,
         now: float) -> tuple[Records, Verdict]:
    """Room for `wanted` within the bound. A target already tainted by us is not tainted twice (nor
    counted twice); an expired taint not yet lifted still counts: it is still placed."""
    limit = cap(settings, scope)
    targets = {(t.kind, t.target) for t in records.taints}
    same = [t for t in records.taints if same_taint(t, wanted)]
    if same and same[-1].until > now:
        return records, Verdict("already", same[-1], len(targets), limit)
    if not same and (wanted.kind, wanted.target) not in targets and len(targets) >= min(limit, TAINTS_KEPT):
        return replace(records, capped_at=now), Verdict("capped", None, len(targets), limit)
    repeat = any((lift.kind, lift.target, lift.card) == (wanted.kind, wanted.target, wanted.card)
                 and now - lift.at < settings.memory for lift in records.lifts)
    taint = replace(wanted, repeat=repeat)
    # An expired one of the same taint is renewed in place: the cluster holds one taint for it.
    kept = tuple(t for t in records.taints if not same_taint(t, wanted))
    new = replace(records, taints=(*kept, taint))
    return new, Verdict("tainted", taint, len({(t.kind, t.target) for t in new.taints}), limit,
                        same[-1] if same else None)


def expired(records: Records, now: float) -> list[Taint]:
    return [t for t in records.taints if t.until <= now]


def find(records: Records, name: str) -> list[Taint]:
    """Our taints an operator names: a node (every taint of ours on it), a DeviceTaintRule, or a card."""
    return [t for t in records.taints if name in (t.target, t.card, t.node)]


def lifted(settings: PlacementSettings, records: Records, taint: Taint, now: float, by: str) -> Records:
    """`taint` lifted: out of the records, its lift kept for `memory` (a repeat), the bound's episode
    over. Only that very record: one another sidecar renewed meanwhile is theirs, and stays."""
    if taint not in records.taints:
        return records
    taints = tuple(t for t in records.taints if t != taint)
    lifts = tuple(lift for lift in records.lifts if now - lift.at < settings.memory)
    return replace(records, taints=taints, capped_at=None,
                   lifts=(*lifts, Lift(taint.kind, taint.target, taint.card, now, by))[-LIFTS_KEPT:])


def forget(records: Records, taint: Taint, previous: Taint | None = None) -> Records:
    """A taint that could not be placed: out of the records, as if never taken; the expired one it was
    to renew back in its place (still placed, it is still to be lifted)."""
    if taint not in records.taints:
        return records
    kept = tuple(t for t in records.taints if t != taint)
    return replace(records, taints=(*kept, previous) if previous is not None else kept)


def restore(records: Records, taint: Taint) -> Records:
    """A lift that failed in the cluster: its record back, to be lifted again (unless the taint has
    one again: a sidecar renewed it meanwhile, and that record stands for it)."""
    if recorded(records, taint) is not None:
        return records
    return replace(records, taints=(*records.taints, taint))


def changed(records: Records, old: Taint, new: Taint) -> tuple[Records, bool]:
    """`old`'s record replaced by `new` (its effect escalated), and whether it was there to replace."""
    if old not in records.taints:
        return records, False
    return replace(records, taints=tuple(new if t == old else t for t in records.taints)), True


def recorded(records: Records, taint: Taint) -> Taint | None:
    """The record that stands for `taint` in the cluster now (None: none: it was lifted)."""
    return next((t for t in records.taints if same_taint(t, taint)), None)


def swept(records: Records, now: float) -> list[Taint]:
    """Recent lifts with no record standing for them again: each to be gone from the cluster."""
    out = []
    for lift in records.lifts:
        node = lift.target if lift.kind == NODE else ""
        taint = Taint(lift.kind, lift.target, lift.card, node, lift.by, lift.at, lift.at, "lifted", "NoSchedule")
        if now - lift.at < LIFT_SWEEP_S and recorded(records, taint) is None:
            out.append(taint)
    return out


# -- the cluster's names ---------------------------------------------------------------------------------------

_DNS = re.compile(r"[^a-z0-9.-]+")
_LABEL = re.compile(r"[^A-Za-z0-9._-]+")


def device_rule_name(card: Card) -> str:
    """The DeviceTaintRule's name, the same from every sidecar (two that race get AlreadyExists):
    gpu-watchdog-<pool>-<device>-<hash of driver/pool/device>, a DNS subdomain (two drivers' devices of
    one name in one pool never share a rule)."""
    base = _DNS.sub("-", f"gpu-watchdog-{card.pool}-{card.device}".lower()).strip("-.")
    return f"{base[:240].rstrip('-.')}-{hashlib.sha256(card.id.encode()).hexdigest()[:8]}"


def label_value(text: str) -> str:
    """`text` as a label (or taint) value: at most 63 characters of [A-Za-z0-9._-], alphanumeric at both ends."""
    return _LABEL.sub("-", text)[:63].strip("-._")


def with_node_taint(taints: list[dict[str, Any]], taint: Taint) -> list[dict[str, Any]] | None:
    """The node's taints with ours for `taint.card` added (None: there already). Others' are kept as they are."""
    value = label_value(taint.card)
    if any(t.get("key") == NODE_TAINT_KEY and t.get("value") == value for t in taints):
        return None
    return [*taints, {"key": NODE_TAINT_KEY, "value": value, "effect": taint.effect}]


def without_node_taint(taints: list[dict[str, Any]], taint: Taint) -> list[dict[str, Any]] | None:
    """The node's taints without ours for `taint.card` (None: not there). Never another's: a taint with our
    key and another value is someone else's (an operator's, or another card's)."""
    value = label_value(taint.card)
    kept = [t for t in taints if not (t.get("key") == NODE_TAINT_KEY and t.get("value") == value)]
    return None if len(kept) == len(taints) else kept


def describe(t: Taint, now: float) -> dict[str, Any]:
    return {"kind": t.kind, "target": t.target, "card": t.card, "node": t.node, "pod": t.pod, "effect": t.effect,
            "evidence": t.evidence, "repeat": t.repeat, "since": t.at, "until": t.until,
            "expires_in_s": round(t.until - now, 1)}


# -- the annotation ----------------------------------------------------------------------------------------------

def dump(records: Records) -> str:
    return json.dumps({
        "v": VERSION,
        "taints": [{"kind": t.kind, "target": t.target, "card": t.card, "node": t.node, "pod": t.pod, "at": t.at,
                    "until": t.until, "evidence": t.evidence, "effect": t.effect, "repeat": t.repeat}
                   for t in records.taints],
        "remediations": [{"card": r.card, "node": r.node, "at": r.at, "reason": r.reason, "xid": r.xid}
                         for r in records.remediations],
        "lifts": [{"kind": lift.kind, "target": lift.target, "card": lift.card, "at": lift.at, "by": lift.by}
                  for lift in records.lifts],
        "capped_at": records.capped_at,
    }, sort_keys=True, separators=(",", ":"))


def parse(text: str | None) -> Records:
    """The records in the Lease's annotation; absent is empty. Raises RecordsError on anything else."""
    if not text:
        return Records()
    data = lease_text.opened(text, VERSION, "placement records", RecordsError)
    taints = tuple(Taint(_one_of(d, "kind", (DEVICE, NODE)), _str(d, "target"), _str(d, "card"), _str(d, "node"),
                         _str(d, "pod"), _num(d, "at"), _num(d, "until"), _str(d, "evidence"), _str(d, "effect"),
                         bool(d.get("repeat", False)))
                   for d in _objects(data, "taints"))
    remediations = tuple(Remediation(_str(d, "card"), _str(d, "node"), _num(d, "at"), _str(d, "reason"),
                                     _int(d, "xid"))
                         for d in _objects(data, "remediations"))
    lifts = tuple(Lift(_one_of(d, "kind", (DEVICE, NODE)), _str(d, "target"), _str(d, "card"), _num(d, "at"),
                       _str(d, "by"))
                  for d in _objects(data, "lifts"))
    capped_at = data.get("capped_at")
    return Records(taints, remediations, lifts, None if capped_at is None else _num(data, "capped_at"))


def _objects(data: dict[str, Any], key: str) -> list[dict[str, Any]]:
    v = data.get(key, [])
    if not isinstance(v, list) or not all(isinstance(x, dict) for x in v):
        raise RecordsError(f"{key}: expected a list of objects")
    return v


def _str(d: dict[str, Any], key: str) -> str:
    v = d.get(key)
    if not isinstance(v, str):
        raise RecordsError(f"{key}: expected a string, got {v!r}")
    return v


def _one_of(d: dict[str, Any], key: str, allowed: tuple[str, ...]) -> str:
    v = _str(d, key)
    if v not in allowed:
        raise RecordsError(f"{key}: expected one of {', '.join(allowed)}, got {v!r}")
    return v


def _num(d: dict[str, Any], key: str) -> float:
    v = d.get(key)
    if isinstance(v, bool) or not isinstance(v, int | float) or not math.isfinite(v):
        raise RecordsError(f"{key}: expected a number, got {v!r}")
    return float(v)


def _int(d: dict[str, Any], key: str) -> int | None:
    v = d.get(key)
    if v is None:
        return None
    if isinstance(v, bool) or not isinstance(v, int):
        raise RecordsError(f"{key}: expected an integer or null, got {v!r}")
    return v


def _recent(settings: PlacementSettings, rs: tuple[Remediation, ...], now: float) -> tuple[Remediation, ...]:
    return tuple(r for r in rs if now - settings.memory < r.at <= now + FUTURE_S)


def _day(at: float) -> int:
    return int(at // DAY_S)
