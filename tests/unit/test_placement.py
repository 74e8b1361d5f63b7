"""Keeping a sick card out of the next placement, on traces through the pure rules (`watchdog.core.placement`):
what is evidence about the card, the repeat offender over days, the bound, expiry, and taints of others."""

from __future__ import annotations

import dataclasses
import math
import re

import pytest

from gpu_watchdog.watchdog.core import placement
from gpu_watchdog.watchdog.core.names import CONTEXT_LOSS, HANG
from gpu_watchdog.watchdog.core.placement import Card, Records, RecordsError, Remediation, Taint
from gpu_watchdog.watchdog.core.settings import PlacementSettings

DAY = placement.DAY_S
T0 = 1_780_000_000.0 - (1_780_000_000.0 % DAY) + 3600  # 01:00 UTC of some day
S = PlacementSettings(strategy="device")
DRA = Card("gpu.nvidia.com/node-a/gpu-1", "node-a", "gpu.nvidia.com", "node-a", "gpu-1")
PLUGIN = Card("GPU-1f2e3d4c", "node-b")


def fold(settings: PlacementSettings, faults: list[tuple[float, str, int | None]], card: Card = DRA,
         records: Records | None = None) -> Records:
    """The records after each fault of `card` was remembered, in order (a trace through the fold)."""
    out = records or Records()
    for at, reason, xid in faults:
        out = placement.remember(settings, out, Remediation(card.id, card.node, at, reason, xid), at)
    return out


# -- what is evidence about the card -------------------------------------------------------------------------

@pytest.mark.parametrize(("detail", "says"), [
    ({"evidence": "recovery_action", "recovery_action": "GPU_RESET"}, "recovery action GPU_RESET"),
    ({"evidence": "device_health", "message": "XID 79"}, "Unhealthy (XID 79)"),
    ({"evidence": "gpu_lost"}, "lost"),
    ({"evidence": "xid", "xid": 79, "node_action": "reboot"}, "Xid 79 needs reboot"),
])
def test_the_drivers_and_the_kubelets_word_are_about_the_card(detail: dict[str, object], says: str) -> None:
    found = placement.card_evidence(CONTEXT_LOSS, detail)
    assert found is not None and says in found


@pytest.mark.parametrize(("reason", "detail"), [
    (CONTEXT_LOSS, {"evidence": "canary", "error": "CUDA error: an illegal memory access"}),
    (CONTEXT_LOSS, {"evidence": "poisoned_flag"}),
    (HANG, {"evidence": "recovery_action", "recovery_action": "GPU_RESET"}),
    ("fragmentation", {}),
])
def test_a_process_fault_or_another_reason_is_not_about_the_card(reason: str, detail: dict[str, object]) -> None:
    assert placement.card_evidence(reason, detail) is None


def test_the_card_is_the_one_the_evidence_names_else_our_only_one() -> None:
    other = dataclasses.replace(DRA, id="gpu.nvidia.com/node-a/gpu-0", device="gpu-0")
    assert placement.evidence_card({"resource_id": DRA.id}, [other, DRA]) == DRA
    # A shared device plugin's ID carries ::N after the UUID.
    assert placement.evidence_card({"resource_id": f"{PLUGIN.id}::3"}, [PLUGIN]) == PLUGIN
    assert placement.evidence_card({}, [PLUGIN]) == PLUGIN
    # Named, and not ours, among several: no card is known (never a guess on a pod with two GPUs).
    assert placement.evidence_card({"uuid": "GPU-elsewhere"}, [other, DRA]) is None
    assert placement.evidence_card({}, [other, DRA]) is None
    assert placement.evidence_card({"uuid": "GPU-x"}, []) is None


# -- memory past the Event TTL: the repeat offender ----------------------------------------------------------

def test_a_card_remediated_on_two_days_is_suspect_at_its_first_fault_of_the_third() -> None:
    records = fold(S, [(T0, CONTEXT_LOSS, None), (T0 + 2 * DAY + 5, HANG, None)])
    third = T0 + 4 * DAY
    assert placement.repeat_days(S, records, DRA.id, third) == [int(T0 // DAY), int(T0 // DAY) + 2]
    assert placement.repeat_offender(S, records, DRA.id, third)
    # On the second day it was not yet: one day before it.
    assert not placement.repeat_offender(S, fold(S, [(T0, CONTEXT_LOSS, None)]), DRA.id, T0 + 2 * DAY)
    # Another card's history is not this one's.
    assert not placement.repeat_offender(S, records, "gpu.nvidia.com/node-a/gpu-0", third)


def test_many_faults_on_one_day_are_one_day() -> None:
    records = fold(S, [(T0 + i * 60, CONTEXT_LOSS, None) for i in range(20)])
    assert not placement.repeat_offender(S, records, DRA.id, T0 + DAY)
    assert placement.repeat_days(S, records, DRA.id, T0 + DAY) == [int(T0 // DAY)]


def test_identical_xids_count_once_a_day() -> None:
    # One node logged ~800,000 Xid 95 entries, 29 distinct: one fault is one fault however often it is said.
    records = fold(S, [(T0 + i, CONTEXT_LOSS, 95) for i in range(800)] + [(T0 + 900, CONTEXT_LOSS, 79)])
    assert [(r.xid, r.at) for r in records.remediations] == [(95, T0), (79, T0 + 900)]
    records = fold(S, [(T0 + DAY, CONTEXT_LOSS, 95)], records=records)
    assert len(records.remediations) == 3


def test_what_is_older_than_the_memory_is_forgotten() -> None:
    records = fold(S, [(T0, CONTEXT_LOSS, None), (T0 + DAY, CONTEXT_LOSS, None)])
    eight_days_on = T0 + 8 * DAY + 7200
    assert not placement.repeat_offender(S, records, DRA.id, eight_days_on)  # T0's day is past 7 days
    kept = placement.remember(S, records, Remediation(DRA.id, DRA.node, eight_days_on, CONTEXT_LOSS), eight_days_on)
    assert [r.at for r in kept.remediations] == [eight_days_on]
    longer = dataclasses.replace(S, memory=30 * DAY)
    assert placement.repeat_offender(longer, records, DRA.id, eight_days_on)


# -- the taint and its bound -------------------------------------------------------------------------------------

def taint_of(card: Card, at: float = T0, settings: PlacementSettings = S) -> Taint:
    wanted = placement.plan(settings, card, "pod-1", "the kubelet reports the device Unhealthy", at)
    assert wanted is not None
    return wanted


def test_a_taints_record_expires_with_the_taint_the_cluster_holds_not_a_fraction_before() -> None:
    """A node entry states its expiry in whole seconds, rounded up: a record expiring half a second
    earlier was lifted while the node's taint still held (the simulation's bound counted it out, a third
    node was tainted with a cap of 2)."""
    node = dataclasses.replace(S, strategy="node")
    t = taint_of(PLUGIN, at=T0 + 0.5, settings=node)
    assert t.until == float(math.ceil(T0 + 0.5 + node.ttl))
    [entry] = placement.with_node_taint([], t, "0123abcd", T0 + 0.5) or []
    assert placement.node_entries(entry["value"]) == {"0123abcd": int(t.until)}
    records = Records(taints=(t,))
    assert placement.expired(records, t.until - 0.1) == []  # the entry is in force: so is its record
    assert placement.expired(records, t.until) == [t]
    assert placement.without_node_taint([entry], "0123abcd", t.until) == []  # and both go together


def test_a_dra_card_gets_its_device_a_plugin_card_its_node_only_where_the_node_is_allowed() -> None:
    t = taint_of(DRA)
    assert (t.kind, t.effect, t.until) == (placement.DEVICE, "NoSchedule", T0 + S.ttl)
    assert t.target.startswith("gpu-watchdog-node-a-gpu-1-")
    assert placement.plan(S, PLUGIN, "pod-1", "x", T0) is None  # strategy device: the node is not ours to taint
    node = dataclasses.replace(S, strategy="node", effect="PreferNoSchedule")
    t = taint_of(PLUGIN, settings=node)
    assert (t.kind, t.target, t.effect) == (placement.NODE, "node-b", "PreferNoSchedule")
    # A device taint has no PreferNoSchedule: NoSchedule stands in.
    assert taint_of(DRA, settings=node).effect == "NoSchedule"


@pytest.mark.parametrize(("max_nodes", "percent", "scope", "cap"), [
    (2, 50, 1, 1), (2, 50, 3, 2), (2, 50, 10, 2), (10, 50, 5, 3), (10, 25, 8, 2), (1, 100, 40, 1), (5, 1, 3, 1),
])
def test_the_bound_is_max_nodes_and_a_share_rounded_up(max_nodes: int, percent: float, scope: int, cap: int) -> None:
    assert placement.cap(PlacementSettings(max_nodes=max_nodes, max_percent=percent), scope) == cap


def cards(n: int) -> list[Card]:
    return [Card(f"gpu.nvidia.com/node-{i}/gpu-0", f"node-{i}", "gpu.nvidia.com", f"node-{i}", "gpu-0")
            for i in range(n)]


def test_every_card_failing_at_once_taints_no_more_than_the_cap() -> None:
    records, outcomes = Records(), []
    for card in cards(8):
        records, verdict = placement.take(S, records, taint_of(card), scope=8, now=T0)
        outcomes.append(verdict.outcome)
    assert outcomes == ["tainted", "tainted"] + ["capped"] * 6
    assert len(records.taints) == 2 == placement.cap(S, 8)


def test_one_card_is_tainted_once_and_an_expired_taint_counts_until_lifted() -> None:
    first, second = cards(2)
    records, _ = placement.take(S, Records(), taint_of(first), scope=2, now=T0)
    again, verdict2 = placement.take(S, records, taint_of(first, T0 + 60), scope=2, now=T0 + 60)
    assert verdict2.outcome == "already" and again == records
    late = T0 + S.ttl + 1
    assert placement.expired(records, late) == list(records.taints)
    # Expired but still placed: it counts against a bound of one.
    one = dataclasses.replace(S, max_nodes=1)
    assert placement.take(one, records, taint_of(second, late), scope=2, now=late)[1].outcome == "capped"
    # Renewed in place when the same card is due again: still one taint.
    renewed, verdict3 = placement.take(S, records, taint_of(first, late), scope=2, now=late)
    assert verdict3.outcome == "tainted" and len(renewed.taints) == 1 and renewed.taints[0].until == late + S.ttl


def test_a_card_tainted_again_after_its_lift_is_a_repeat() -> None:
    [card] = cards(1)
    records, verdict = placement.take(S, Records(), taint_of(card), scope=1, now=T0)
    assert verdict.taint is not None and not verdict.taint.repeat
    lifted = placement.lifted(S, records, verdict.taint, T0 + S.ttl, "expired")
    assert lifted.taints == () and [x.target for x in lifted.lifts] == [verdict.taint.target]
    _, again = placement.take(S, lifted, taint_of(card, T0 + 2 * DAY), scope=1, now=T0 + 2 * DAY)
    assert again.outcome == "tainted" and again.taint is not None and again.taint.repeat
    _, much_later = placement.take(S, lifted, taint_of(card, T0 + 30 * DAY), scope=1, now=T0 + 30 * DAY)
    assert much_later.taint is not None and not much_later.taint.repeat


def test_find_names_a_node_a_rule_or_a_card() -> None:
    first, second = cards(2)
    records, _ = placement.take(S, Records(), taint_of(first), scope=4, now=T0)
    records, _ = placement.take(S, records, taint_of(second), scope=4, now=T0)
    assert [t.card for t in placement.find(records, "node-1")] == [second.id]
    assert [t.card for t in placement.find(records, placement.device_rule_name(first))] == [first.id]
    assert [t.card for t in placement.find(records, first.id)] == [first.id]
    assert placement.find(records, "node-9") == []


def test_the_bound_never_outgrows_the_records() -> None:
    wide = PlacementSettings(strategy="device", max_nodes=64, max_percent=100)
    records, outcomes = Records(), []
    for card in cards(70):
        records, verdict = placement.take(wide, records, taint_of(card, settings=wide), scope=70, now=T0)
        outcomes.append(verdict.outcome)
    assert outcomes.count("tainted") == placement.TAINTS_KEPT == len(records.taints)
    assert outcomes[placement.TAINTS_KEPT:] == ["capped"] * 6


def test_a_capped_episode_is_the_workloads_until_a_lift() -> None:
    first, second = cards(2)
    one = dataclasses.replace(S, max_nodes=1)
    records, verdict = placement.take(one, Records(), taint_of(first), scope=2, now=T0)
    assert not records.capped(one, T0)
    records, _ = placement.take(one, records, taint_of(second), scope=2, now=T0 + 5)
    assert records.capped(one, T0 + 6) and not records.capped(one, T0 + 5 + one.ttl)
    assert verdict.taint is not None
    assert not placement.lifted(one, records, verdict.taint, T0 + 60, "operator").capped(one, T0 + 61)


def test_a_lift_removes_only_the_record_it_lifted() -> None:
    [card] = cards(1)
    records, verdict = placement.take(S, Records(), taint_of(card), scope=1, now=T0)
    assert verdict.taint is not None
    late = T0 + S.ttl + 1
    renewed, again = placement.take(S, records, taint_of(card, late), scope=1, now=late)
    assert again.previous == verdict.taint
    # Another sidecar renewed it meanwhile: the expired record is not there to lift, the renewal stands.
    assert placement.lifted(S, renewed, verdict.taint, late, "pod-2") == renewed
    # A renewal that could not be placed puts the expired record back (still placed: still to be lifted).
    assert again.taint is not None
    assert placement.forget(renewed, again.taint, again.previous) == records
    # A lift the cluster refused: the record back, unless the target has one again.
    gone = placement.lifted(S, records, verdict.taint, late, "pod-2")
    assert placement.restore(gone, verdict.taint).taints == records.taints
    assert placement.restore(renewed, verdict.taint) == renewed


def test_no_execute_is_placed_as_no_schedule_and_escalated_after_the_restart() -> None:
    hard = dataclasses.replace(S, effect="NoExecute")
    t = taint_of(DRA, settings=hard)
    assert t.effect == "NoSchedule"
    up = placement.escalated(hard, t)
    assert up is not None and up.effect == "NoExecute" and up.target == t.target
    assert placement.escalated(S, t) is None
    records, _ = placement.take(hard, Records(), t, scope=2, now=T0)
    assert placement.changed(records, t, up) == (dataclasses.replace(records, taints=(up,)), True)
    assert placement.changed(records, up, t) == (records, False)  # not there: nothing


@pytest.mark.parametrize("card", [DRA, PLUGIN, Card("d.example.com/pool/with/slashes/dev-1", "n", "d.example.com",
                                                    "pool/with/slashes", "dev-1")])
def test_the_card_is_known_again_from_its_record(card: Card) -> None:
    node = dataclasses.replace(S, strategy="node")
    t = taint_of(card, settings=node)
    assert placement.card_of(t) == card


def test_a_kubelets_long_message_is_cut_in_the_records() -> None:
    wanted = placement.plan(S, DRA, "pod-1", "x" * 5000, T0)
    assert wanted is not None and len(wanted.evidence) == placement.EVIDENCE_KEPT


def test_a_node_carries_one_taint_of_the_workload_whatever_the_card() -> None:
    """A node takes one taint per key and effect: the workload's entry in it stands for all its cards there."""
    node = dataclasses.replace(S, strategy="node")
    a, b = Card("GPU-a", "node-b"), Card("GPU-b", "node-b")
    records, first = placement.take(node, Records(), taint_of(a, settings=node), scope=4, now=T0)
    # The other card of the same node while it is in force: that node is kept out already.
    same, already = placement.take(node, records, taint_of(b, T0 + 60, settings=node), scope=4, now=T0 + 60)
    assert already.outcome == "already" and same == records
    late = T0 + node.ttl + 1
    # After it expired: renewed in place, one record, one node.
    records, second = placement.take(node, records, taint_of(b, late, settings=node), scope=4, now=late)
    assert second.outcome == "tainted" and second.previous == first.taint and second.tainted == 1
    assert [t.card for t in records.taints] == ["GPU-b"]
    assert second.taint is not None
    records = placement.lifted(node, records, second.taint, late + node.ttl, "pod-1")
    # Swept for ten minutes: a sidecar that read the records before the lift may have put it back.
    [back] = placement.swept(records, late + node.ttl + 60)
    assert (back.kind, back.target, back.node) == (placement.NODE, "node-b", "node-b")
    assert placement.swept(records, late + node.ttl + placement.LIFT_SWEEP_S + 1) == []
    assert placement.watched_nodes(records, late + node.ttl + 60) == {"node-b"}


# -- the node's taints: whose and until when, never another's ---------------------------------------------------

A_OWNER, B_OWNER = placement.owner_of("serving", "llm"), placement.owner_of("serving", "embedder")
NODE_S = dataclasses.replace(S, strategy="node")


def test_a_nodes_taints_keep_everyone_elses() -> None:
    taint = taint_of(PLUGIN, settings=NODE_S)
    theirs = [{"key": "nvidia.com/gpu", "effect": "NoSchedule"},
              {"key": placement.NODE_TAINT_KEY, "value": "GPU-an-operators", "effect": "PreferNoSchedule"}]
    added = placement.with_node_taint(theirs, taint, A_OWNER, T0)
    assert added is not None and added[:2] == theirs
    until = placement.node_expiry(taint.until)
    assert added[2] == {"key": placement.NODE_TAINT_KEY, "value": f"{A_OWNER}-{until}", "effect": "NoSchedule"}
    assert placement.node_held(added, A_OWNER) == [("NoSchedule", until)]
    assert placement.with_node_taint(added, taint, A_OWNER, T0) is None  # there already
    assert placement.without_node_taint(added, A_OWNER, T0, force=True) == theirs
    assert placement.without_node_taint(added, A_OWNER, T0) is None  # in force: stays
    assert placement.without_node_taint(added, A_OWNER, until) == theirs  # past its expiry: lifted
    assert placement.without_node_taint(theirs, A_OWNER, until, PLUGIN.id, force=True) is None  # none of ours
    # An operator's taint of our key and effect: ours cannot go beside it (one per key and effect).
    with pytest.raises(placement.NotOurs):
        placement.with_node_taint([{**theirs[1], "effect": "NoSchedule"}], taint, A_OWNER, T0)


def test_a_workloads_expiry_never_lifts_the_taint_another_still_holds() -> None:
    a = taint_of(PLUGIN, settings=NODE_S)
    b = dataclasses.replace(taint_of(PLUGIN, T0 + 3600, settings=NODE_S), card="GPU-other")
    both = placement.with_node_taint([], a, A_OWNER, T0)
    assert both is not None
    both = placement.with_node_taint(both, b, B_OWNER, T0 + 3600)
    assert both is not None and len(both) == 1  # one taint per key and effect: shared
    [shared] = both
    assert placement.node_entries(shared["value"]) == {A_OWNER: placement.node_expiry(a.until),
                                                       B_OWNER: placement.node_expiry(b.until)}
    assert LABEL_VALUE.match(shared["value"]) and len(shared["value"]) <= 63
    # A's expiry: B's entry is in force, the taint stays as it is (theirs to lift).
    assert placement.without_node_taint(both, A_OWNER, a.until + 1) is None
    # An operator's clear for A: A's entry out, B's kept.
    kept = placement.without_node_taint(both, A_OWNER, T0 + 7200, force=True)
    assert kept is not None and placement.node_entries(kept[0]["value"]) == {B_OWNER: placement.node_expiry(b.until)}
    # B's expiry: nothing in force, the taint goes (B lifts it; A, whose entry is in it, may too).
    assert placement.without_node_taint(both, B_OWNER, b.until + 1) == []
    assert placement.without_node_taint(both, A_OWNER, b.until + 1) == []
    # A third workload with no entry never touches it, whenever.
    assert placement.without_node_taint(both, placement.owner_of("x", "y"), b.until + 1, force=True) is None
    # Renewing drops the expired entries of others, never shortens one in force.
    renewed = placement.with_node_taint(both, dataclasses.replace(a, until=b.until + 60), A_OWNER, a.until + 1)
    assert renewed is not None and placement.node_entries(renewed[0]["value"]) == {
        A_OWNER: placement.node_expiry(b.until + 60), B_OWNER: placement.node_expiry(b.until)}


def test_a_full_taint_keeps_the_latest_expiries() -> None:
    entries = {placement.owner_of("ns", f"w{i}"): 1_780_000_000 + i for i in range(5)}
    value = placement.node_value(entries)
    assert len(value) <= 63 and LABEL_VALUE.match(value)
    kept = placement.node_entries(value)
    assert kept is not None and sorted(kept.values()) == [1_780_000_002, 1_780_000_003, 1_780_000_004]


def test_a_taint_of_the_previous_format_is_still_lifted_and_renewed_in_the_new() -> None:
    taint = taint_of(PLUGIN, settings=NODE_S)
    old = [{"key": placement.NODE_TAINT_KEY, "value": PLUGIN.id, "effect": "NoSchedule"}]
    assert placement.node_entries(PLUGIN.id) is None
    assert placement.without_node_taint(old, A_OWNER, T0, PLUGIN.id) == []  # a record names its card
    assert placement.without_node_taint(old, A_OWNER, T0) is None  # no record: whose, nobody can say
    renewed = placement.with_node_taint(old, taint, A_OWNER, T0)
    assert renewed is not None and placement.node_held(renewed, A_OWNER) == [
        ("NoSchedule", placement.node_expiry(taint.until))]


def test_the_records_are_rebuilt_from_what_the_cluster_holds() -> None:
    """The Lease's records lost: the taints the cluster shows of ours are recorded again, so the bound holds
    and each is lifted at its expiry; an expired one is the cluster sweep's, a lately lifted one a race's."""
    two = cards(3)
    found = [taint_of(c) for c in two[:2]]
    rebuilt = placement.adopt(Records(), found, T0 + 60)
    assert [t.target for t in rebuilt.taints] == [t.target for t in found]
    assert placement.take(S, rebuilt, taint_of(two[2], T0 + 60), scope=3, now=T0 + 60)[1].outcome == "capped"
    assert placement.adopt(rebuilt, found, T0 + 60) == rebuilt  # already recorded
    assert placement.adopt(Records(), found, T0 + S.ttl) == Records()  # expired: not recorded again
    gone = placement.lifted(S, rebuilt, rebuilt.taints[0], T0 + 120, "operator")
    assert [t.target for t in placement.adopt(gone, found, T0 + 180).taints] == [found[1].target]


# -- names the cluster accepts ----------------------------------------------------------------------------------

DNS_SUBDOMAIN = re.compile(r"^[a-z0-9]([-a-z0-9.]*[a-z0-9])?$")
LABEL_VALUE = re.compile(r"^([A-Za-z0-9][-A-Za-z0-9_.]*[A-Za-z0-9])?$")


@pytest.mark.parametrize("card", [
    DRA, Card("gpu.nvidia.com/Node_A/GPU 7", "Node_A", "gpu.nvidia.com", "Node_A", "GPU 7"),
    Card("d/" + "p" * 300 + "/g", "n", "d", "p" * 300, "g"),
])
def test_rule_names_are_dns_subdomains_and_differ_per_card(card: Card) -> None:
    name = placement.device_rule_name(card)
    assert DNS_SUBDOMAIN.match(name) and len(name) <= 253
    assert name == placement.device_rule_name(card)  # every sidecar names it alike
    assert name != placement.device_rule_name(dataclasses.replace(card, id=card.id + "x", device="other"))


@pytest.mark.parametrize("text", ["GPU-1f2e3d4c-aaaa", "MIG-GPU-x/1/2", "-" + "a" * 80 + "-", "gpu.nvidia.com/a/b"])
def test_taint_values_are_label_values(text: str) -> None:
    value = placement.label_value(text)
    assert LABEL_VALUE.match(value) and len(value) <= 63


# -- the annotation ------------------------------------------------------------------------------------------------

def test_the_records_survive_the_lease() -> None:
    records, verdict = placement.take(S, fold(S, [(T0, CONTEXT_LOSS, 79)]), taint_of(DRA), scope=2, now=T0)
    assert verdict.taint is not None
    records = placement.lifted(S, records, verdict.taint, T0 + 5, "operator")
    records, _ = placement.take(S, records, taint_of(DRA, T0 + 9), scope=2, now=T0 + 9)
    assert placement.parse(placement.dump(records)) == records
    assert placement.parse(None) == Records() == placement.parse("")


@pytest.mark.parametrize(("text", "says"), [
    ("{", "not JSON"), ('{"v": 2}', "version 1"), ('{"v": 1, "taints": {}}', "taints"),
    ('{"v": 1, "taints": [{"kind": "pod"}]}', "kind"),
    ('{"v": 1, "remediations": [{"card": "c", "node": "n", "at": "soon", "reason": "hang"}]}', "at"),
    ('{"v": 1, "remediations": [{"card": "c", "node": "n", "at": 1, "reason": "hang", "xid": "95"}]}', "xid"),
])
def test_records_that_are_not_ours_are_refused_by_name(text: str, says: str) -> None:
    with pytest.raises(RecordsError, match=says):
        placement.parse(text)
