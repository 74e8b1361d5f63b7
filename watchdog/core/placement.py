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
  by an operator; a card tainted again within `memory` after a lift is a repeat;
- each taint also says in the cluster whose it is and until when (a DeviceTaintRule in its annotations,
  a node's taint in its value: `<owner>-<expiry>` entries, one per workload holding it), so that what
  the records lost is found again (`adopt`), lifted once past (I9), and never lifted while another
  workload's entry in it is not.
"""

from __future__ import annotations

import hashlib
import json
import math
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, replace
from typing import Any

from gpu_watchdog.watchdog.core import lease_text
from gpu_watchdog.watchdog.core.names import CONTEXT_LOSS, CORRUPT, HANG
from gpu_watchdog.watchdog.core.settings import DEVICE_EFFECTS, PlacementSettings
from gpu_watchdog.watchdog.core.timing import FUTURE_S, LIFT_SWEEP_S

ANNOTATION = "gpu-watchdog.io/placement"  # on the workload's Lease, beside the fleet's ledger
DEVICE_TAINT_KEY = "gpu-watchdog.io/suspect"  # a DeviceTaintRule's taint
NODE_TAINT_KEY = "gpu-watchdog.io/gpu-suspect"  # a node's taint; its value: `<owner>-<expiry>` entries
MANAGED_BY = ("app.kubernetes.io/managed-by", "gpu-watchdog")
EVIDENCE_ANNOTATION = "gpu-watchdog.io/evidence"
UNTIL_ANNOTATION = "gpu-watchdog.io/until"
POD_ANNOTATION = "gpu-watchdog.io/pod"
WORKLOAD_ANNOTATION = "gpu-watchdog.io/workload"
NAMESPACE_ANNOTATION = "gpu-watchdog.io/namespace"  # the workload's: two namespaces may hold an `llm` each
CARD_ANNOTATION = "gpu-watchdog.io/card"
NODE_ANNOTATION = "gpu-watchdog.io/node"
DEVICE, NODE = "device", "node"
VERSION = 1
DAY_S = 86400.0
TAINTS_KEPT = 64  # policy.placement.max_nodes's bound: the annotation stays small
EVIDENCE_KEPT = 256  # characters of a taint's evidence in the records (a kubelet's message is anyone's text)
REMEDIATIONS_KEPT = 256  # within `memory`, newest kept
LIFTS_KEPT = 64
# `None`: a device taint that keeps nothing out and evicts nothing; the API reports how many pods it
# would evict (KEP-5055), the shadow of a placement (`policy.enforce`).
SHADOW_EFFECT = "None"
EFFECT_RANK = {SHADOW_EFFECT: -1, "PreferNoSchedule": 0, "NoSchedule": 1, "NoExecute": 2}
# Restarts meant to cure the card's state; a card restarted for its age or memory is not sick.
CURING = (CONTEXT_LOSS, HANG, CORRUPT)
# A node taint's value holds one `<owner>-<expiry>` entry per workload that holds it: the owner the first 8
# hex digits of sha256("namespace/workload"), the expiry in epoch seconds. A node takes one taint per key and
# effect, so workloads share it; 3 entries (59 characters) fit a label value's 63.
OWNER_LEN = 8
ENTRIES_KEPT = 3
_ENTRY = re.compile(r"^([0-9a-f]{8})-([0-9]{10})$")


class RecordsError(ValueError):
    """The Lease's placement annotation is not ours."""


class NotOurs(RuntimeError):
    """Where our taint would go, one we did not place: a node taint of our key and effect (a node takes one
    per key and effect, so ours cannot be added beside it), or a DeviceTaintRule by our name."""


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
    if reason == CORRUPT and detail.get("after_restart"):
        return "its answers deviated from the fleet's reference again after a restart on this card"
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


def plan(settings: PlacementSettings, card: Card, pod: str, evidence: str, now: float,
         shadow: bool = False) -> Taint | None:
    """The taint that keeps `card` out: its device's where DRA names it, its node's where the strategy
    allows a node (`node`); None where neither may be tainted (a device-plugin GPU under `device`).
    `shadow`: a device's taint of effect None (the API counts what it would evict); a node has no such
    effect, and its taint is only reported."""
    # A whole second, as the cluster states it (a node entry's expiry, a rule's annotation): the record and
    # the taint expire together, so no taint is in force for the fraction of a second past its record.
    until, evidence = float(node_expiry(now + settings.ttl)), evidence[:EVIDENCE_KEPT]
    if card.dra:
        # NoExecute evicts whatever uses the device, our pod included, bypassing its Event and its
        # disruption budget: it keeps placements away first (NoSchedule), and becomes NoExecute once
        # our own restart was accepted (`escalated`).
        return Taint(DEVICE, device_rule_name(card), card.id, card.node, pod, now, until, evidence,
                     SHADOW_EFFECT if shadow else "NoSchedule")
    if settings.strategy in ("node", "none") and card.node:
        return Taint(NODE, card.node, card.id, card.node, pod, now, until, evidence, settings.effect)
    return None


def escalated(settings: PlacementSettings, taint: Taint) -> Taint | None:
    """The taint as it stands once our pod's restart was accepted: a device's NoExecute where asked
    (None: nothing to change)."""
    effect = device_effect(settings)
    if taint.kind != DEVICE or effect == taint.effect or taint.effect == SHADOW_EFFECT:
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
    """One taint in the cluster: a rule's name, or a node's taint (the workload's entry in it: a node takes
    one taint per key and effect, whatever its card)."""
    if a.kind == NODE:
        return (b.kind, b.target) == (NODE, a.target)
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
    repeat = any((lift.kind, lift.target) == (wanted.kind, wanted.target)
                 and (wanted.kind == NODE or lift.card == wanted.card)
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


def adopt(records: Records, found: Iterable[Taint], now: float) -> Records:
    """The records rebuilt from what the cluster shows of the workload (`found`: its rules and node
    entries): one not expired that no record stands for, and not lifted within `LIFT_SWEEP_S` (a lift
    racing the read that found it), is recorded again, so that it counts against the bound and is
    lifted at its expiry like any other."""
    out = records
    for t in found:
        if t.until <= now or recorded(out, t) is not None:
            continue
        if any((lift.kind, lift.target) == (t.kind, t.target) and now - lift.at < LIFT_SWEEP_S
               for lift in out.lifts):
            continue
        out = replace(out, taints=(*out.taints, t)[-TAINTS_KEPT:])
    return out


def watched_nodes(records: Records, now: float) -> set[str]:
    """The nodes whose taints of ours the records name: tainted, or lifted lately (a put-back to sweep)."""
    return ({t.target for t in records.taints if t.kind == NODE}
            | {lift.target for lift in records.lifts if lift.kind == NODE and now - lift.at < LIFT_SWEEP_S})


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


def owner_of(namespace: str, workload: str) -> str:
    """The workload's name in a node taint's value: 8 hex digits of sha256("namespace/workload")."""
    return hashlib.sha256(f"{namespace}/{workload}".encode()).hexdigest()[:OWNER_LEN]


def node_entries(value: Any) -> dict[str, int] | None:
    """A node taint value's `<owner>-<expiry>` entries (None: not of that form: the previous format's
    card, or anyone else's value)."""
    if not isinstance(value, str) or not value:
        return None
    out: dict[str, int] = {}
    for part in value.split("."):
        m = _ENTRY.match(part)
        if m is None:
            return None
        out[m.group(1)] = max(out.get(m.group(1), 0), int(m.group(2)))
    return out


def node_value(entries: Mapping[str, int]) -> str:
    """The entries as a taint value: the latest `ENTRIES_KEPT` expiries (a dropped one is shorter than
    each kept one: the taint stays at least as long as it asked)."""
    kept = sorted(entries.items(), key=lambda e: (-e[1], e[0]))[:ENTRIES_KEPT]
    return ".".join(f"{o}-{u:010d}" for o, u in sorted(kept))


def node_expiry(until: float) -> int:
    return math.ceil(until)


def _ours_by_card(t: Mapping[str, Any], card: str | None) -> bool:
    """A taint of the previous format (its value the card), ours where a record names that card."""
    return bool(card) and t.get("key") == NODE_TAINT_KEY and t.get("value") == label_value(card or "")


def with_node_taint(taints: list[dict[str, Any]], taint: Taint, owner: str, now: float) -> list[dict[str, Any]] | None:
    """The node's taints with our entry until `taint.until` in our key's taint of `taint.effect` (None:
    there already, as late). The other workloads' entries are kept (their expired ones dropped), never
    shortened; ours is never shortened either. A taint of the previous format for that card becomes ours
    in the new one; one of our key and effect that no workload of ours placed raises NotOurs."""
    until = node_expiry(taint.until)
    if until <= now:
        return None  # expired: never put back
    out = list(taints)
    for i, t in enumerate(out):
        if t.get("key") != NODE_TAINT_KEY or t.get("effect") != taint.effect:
            continue
        entries = node_entries(t.get("value"))
        if entries is None:
            if not _ours_by_card(t, taint.card):
                raise NotOurs(f"node {taint.node}: the taint {NODE_TAINT_KEY}={t.get('value')}:{taint.effect}"
                              " is not gpu-watchdog's")
            entries = {}
        if entries.get(owner, 0) >= until:
            return None
        kept = {o: u for o, u in entries.items() if u > now}
        kept[owner] = max(entries.get(owner, 0), until)
        out[i] = {"key": NODE_TAINT_KEY, "value": node_value(kept), "effect": taint.effect}
        return out
    return [*out, {"key": NODE_TAINT_KEY, "value": node_value({owner: until}), "effect": taint.effect}]


def without_node_taint(taints: list[dict[str, Any]], owner: str, now: float, card: str | None = None,
                       force: bool = False) -> list[dict[str, Any]] | None:
    """The node's taints with ours lifted (None: nothing to change). A taint of our key holding our
    entry goes once no entry in it is in force (ours past its expiry, or `force`: an operator's clear;
    the others' past theirs): while another workload's entry is, it stays as it is (only an operator's
    clear takes our entry out of it). A taint of the previous format goes where a record names its
    card. Never another's: a taint without our entry or our card, whatever its key, is left."""
    out: list[dict[str, Any]] = []
    changed = False
    for t in taints:
        entries = node_entries(t.get("value")) if t.get("key") == NODE_TAINT_KEY else None
        if entries is None or owner not in entries:
            if _ours_by_card(t, card):
                changed = True
                continue
            out.append(t)
            continue
        if entries[owner] > now and not force:
            out.append(t)  # ours, in force: a later placement stands
            continue
        live = {o: u for o, u in entries.items() if o != owner and u > now}
        if not live:
            changed = True
            continue
        if force:
            out.append({**t, "value": node_value(live)})
            changed = True
        else:
            out.append(t)  # another workload holds it: theirs to lift
    return out if changed else None


def node_held(taints: list[dict[str, Any]], owner: str) -> list[tuple[str, int]]:
    """Our entries on a node: (effect, expiry) of each taint of our key that holds one."""
    out = []
    for t in taints:
        entries = node_entries(t.get("value")) if t.get("key") == NODE_TAINT_KEY else None
        if entries is not None and owner in entries:
            out.append((str(t.get("effect")), entries[owner]))
    return out


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
