"""The fleet's rules on traces: slots, the breaker, the ledger as stored, and the budget that grows
with the replicas while one lineage's restart loop stays bounded."""

from __future__ import annotations

import json

import pytest

from gpu_watchdog.watchdog.core import fleet
from gpu_watchdog.watchdog.core.fleet import BREAKER_OPEN, GRANTED, UNAVAILABLE_LIMIT, Ledger, LedgerError
from gpu_watchdog.watchdog.core.history import History
from gpu_watchdog.watchdog.core.names import HANG, MAX_AGE, RUNG_CONTAINER, RUNG_POD
from gpu_watchdog.watchdog.core.policy import budget_blocker, budget_remaining, workload_allowance
from gpu_watchdog.watchdog.core.samples import ActionRecord, PastRestart
from gpu_watchdog.watchdog.edge.config import FleetSettings, PolicySettings, RestartBudgetSettings

S = FleetSettings()


def take(ledger: Ledger, pod: str, now: float, replicas: int = 8, reason: str = HANG,
         rung: str = RUNG_POD, settings: FleetSettings = S) -> tuple[Ledger, fleet.Verdict]:
    return fleet.take(settings, ledger, replicas, pod, reason, rung, now)


@pytest.mark.parametrize(("value", "replicas", "slots"), [
    ("25%", 8, 2), ("25%", 40, 10), ("25%", 2, 1), ("25%", 1, 1), ("25%", None, 1), ("25%", 7, 1),
    ("50%", 3, 1), ("100%", 5, 5), ("3", 2, 3), ("1", 40, 1)])
def test_max_unavailable_is_a_count_or_a_share_rounded_down_and_at_least_one(
        value: str, replicas: int | None, slots: int) -> None:
    assert fleet.unavailable_slots(FleetSettings(max_unavailable=value), replicas) == slots


def test_no_more_than_max_unavailable_restart_at_once_and_a_freed_slot_is_taken() -> None:
    ledger = Ledger()
    granted = []
    for i in range(8):  # every replica asks at once
        ledger, verdict = take(ledger, f"p{i}", 100.0 + i * 0.01)
        granted.append(verdict.outcome)
    assert granted == [GRANTED, GRANTED] + [UNAVAILABLE_LIMIT] * 6
    _, held = take(ledger, "p5", 101.0)
    assert held.detail["restarting"] == ["p0", "p1"] and held.detail["max_unavailable"] == 2
    # A replacement serves: that replica is back and the next one may go.
    ledger, slot = fleet.replaced(ledger, "p1-new", started_at=105.0)
    assert slot is not None and slot.pod == "p1"
    ledger, verdict = take(ledger, "p5", 110.0)
    assert verdict.granted and sorted(s.pod for s in ledger.slots) == ["p0", "p5"]


def test_each_replacement_gives_back_the_slot_taken_just_before_it_was_created() -> None:
    ledger, _ = take(Ledger(), "a", 0.0)
    ledger, _ = take(ledger, "b", 100.0)
    ledger, slot = fleet.replaced(ledger, "b2", started_at=105.0)  # b's replacement serves first
    assert slot is not None and slot.pod == "b"
    ledger, slot = fleet.replaced(ledger, "a2", started_at=5.0)
    assert slot is not None and slot.pod == "a" and ledger.slots == ()
    assert [(r.pod, r.returned_as) for r in ledger.restarts] == [("a", "a2"), ("b", "b2")]


def test_a_statefulset_replacement_of_the_same_name_gives_back_its_predecessors_slot() -> None:
    ledger, _ = take(Ledger(), "llm-0", 100.0)
    mine, slot = fleet.replaced(ledger, "llm-0", started_at=104.0)  # the new llm-0, created after
    assert slot is not None and slot.pod == "llm-0" and mine.slots == ()
    assert fleet.replaced(ledger, "llm-0", started_at=90.0)[1] is None  # the old llm-0 itself


def test_asking_again_with_a_slot_is_granted_without_a_second_slot() -> None:
    ledger, _ = take(Ledger(), "p0", 100.0)
    again, verdict = take(ledger, "p0", 101.0)
    assert verdict.granted and len(again.slots) == 1 and len(again.restarts) == 1


def test_a_slot_lapses_after_its_bound_and_a_restart_that_did_not_happen_is_not_the_fleets() -> None:
    ledger, _ = take(Ledger(), "p0", 100.0)
    ledger, _ = take(ledger, "p1", 100.0)
    assert not take(ledger, "p2", 100.0 + S.slot_timeout - 1)[1].granted
    assert take(ledger, "p2", 100.0 + S.slot_timeout)[1].granted  # both lapsed
    back = fleet.give_back(ledger, "p1", restarted=False)
    assert [s.pod for s in back.slots] == ["p0"] and [r.pod for r in back.restarts] == ["p0"]
    kept = fleet.give_back(ledger, "p1", restarted=True)  # an in-place restart whose target serves again
    assert [s.pod for s in kept.slots] == ["p0"] and [r.pod for r in kept.restarts] == ["p0", "p1"]


def test_a_replacement_gives_back_only_a_pod_slot_taken_before_it_started() -> None:
    ledger, _ = take(Ledger(), "p0", 100.0, rung=RUNG_CONTAINER)  # in place: p0 gives it back itself
    ledger, _ = take(ledger, "p1", 500.0)
    assert fleet.replaced(ledger, "old", started_at=50.0)[1] is None  # a pod older than any slot
    same, slot = fleet.replaced(ledger, "p1", started_at=400.0)  # a pod never replaces itself
    assert slot is None and same == ledger
    ledger, slot = fleet.replaced(ledger, "p1-new", started_at=510.0)
    assert slot is not None and slot.pod == "p1"
    assert [r.returned_as for r in ledger.restarts] == [None, "p1-new"]


def every_replica_fails(replicas: int, settings: FleetSettings = S, serves_after: float = 3.0,
                        fails_after: float = 3.0, counted: bool = False,
                        ) -> tuple[Ledger, list[tuple[float, str, str]], int, int]:
    """A fault on every replica at once; each replacement serves `serves_after` seconds after its
    restart was granted (giving the slot back) and fails the same way `fails_after` later. Every failing
    replica asks each second. `counted`: each ask comes with the cluster's census (the restarted pod
    gone, its replacement Ready only while it serves), as the sidecar's does. Returns the ledger, every
    (time, pod, outcome), the restarts carried out and the most slots in use at once."""
    ledger, log, done, most = Ledger(), [], 0, 0
    failing = {f"p{i}": 0.0 for i in range(replicas)}  # pod -> failing since
    coming: list[tuple[float, float, str]] = []  # (serves at, fails at, replacement)
    served: set[str] = set()
    now = 1000.0
    while fleet.breaker_open(ledger) is None and now < 1600:
        for serves_at, fails_at, new in list(coming):
            if serves_at <= now and new not in served:
                served.add(new)
                ledger, _ = fleet.replaced(ledger, new, started_at=serves_at - 1)
            if fails_at <= now:
                failing[new] = fails_at
                coming.remove((serves_at, fails_at, new))
        for pod in sorted(failing):
            seen = fleet.Census(replicas, tuple(
                [fleet.PodSeen(p, False) for p in failing]
                + [fleet.PodSeen(new, serves_at <= now) for serves_at, _, new in coming])) if counted else None
            ledger, verdict = fleet.take(settings, ledger, replicas, pod, HANG, RUNG_POD, now, census=seen)
            log.append((now, pod, verdict.outcome))
            most = max(most, len(ledger.slots))
            if verdict.granted:
                done += 1
                del failing[pod]
                new = f"{pod.split('-')[0]}-g{done}"
                coming.append((now + serves_after, now + serves_after + fails_after, new))
        now += 1.0
    return ledger, log, done, most


@pytest.mark.parametrize("counted", [False, True], ids=["ledger", "census"])
def test_every_replica_failing_opens_the_breaker_when_restarted_ones_come_back_failing(counted: bool) -> None:
    ledger, log, done, most = every_replica_fails(8, counted=counted)
    breaker = fleet.breaker_open(ledger)
    assert breaker is not None and breaker.reason == HANG
    assert most <= 2  # never more than max_unavailable (25 % of 8) restarting at once
    # Every replica failed (four restarted, four waiting for a slot) and two lineages that were
    # restarted came back failing the same way: the restart does not cure.
    # Asked in order, the last comeback to ask opens it (with the census, p7's replacement: p1's, asking
    # while p7 was out by its restart, was held).
    assert breaker.restarted == tuple(f"p{i}" for i in range(8))
    assert breaker.opened_by == ("p7-g2" if counted else "p1-g2")
    assert done == 5  # the first comeback is given one more try; the second tells
    assert log[-1][2] == BREAKER_OPEN
    # Now every replica is held, whatever it asks for.
    for pod in ("p6", "p7"):
        assert take(ledger, pod, log[-1][0] + 1, reason=MAX_AGE)[1].outcome == BREAKER_OPEN


def test_a_fault_a_restart_cures_restarts_every_replica_two_at_a_time() -> None:
    ledger, log, done, most = every_replica_fails(8, fails_after=10_000.0)
    assert fleet.breaker_open(ledger) is None and done == 8 and most == 2
    held = [pod for _, pod, outcome in log if outcome == UNAVAILABLE_LIMIT]
    assert held and set(held) <= {f"p{i}" for i in range(8)}


def test_independent_faults_on_many_replicas_never_open_the_breaker() -> None:
    ledger = Ledger()
    for i in range(8):  # eight replicas fail one after another, each replacement serves and stays well
        ledger, verdict = take(ledger, f"p{i}", 100.0 + 60 * i)
        assert verdict.granted
        ledger, _ = fleet.replaced(ledger, f"p{i}-new", started_at=101.0 + 60 * i)
    assert fleet.breaker_open(ledger) is None


def test_a_single_replica_that_keeps_failing_is_never_the_fleets_fault() -> None:
    ledger = Ledger()
    pod = "only"
    for i in range(4):
        ledger, verdict = take(ledger, pod, 100.0 + 60 * i, replicas=1)
        assert verdict.granted, i
        new = f"only-{i}"
        ledger, _ = fleet.replaced(ledger, new, started_at=101.0 + 60 * i)
        pod = new
    assert fleet.breaker_open(ledger) is None  # the lineage's loop bound (the budget) stops it instead


def test_the_breaker_closes_on_a_reset_or_a_quiet_window_and_opens_again_if_the_fault_stays() -> None:
    ledger, _, _, _ = every_replica_fails(8)
    b = fleet.breaker_open(ledger)
    assert b is not None
    reset = fleet.reset_breaker(ledger, b.opened_at + 10)
    assert fleet.breaker_open(reset) is None
    assert take(reset, "p7", b.opened_at + 11)[1].outcome in (GRANTED, UNAVAILABLE_LIMIT)
    # Held restarts keep it open (the fault is still there); a whole window without one closes it.
    held, _ = take(ledger, "p7", b.opened_at + 1000)
    assert fleet.breaker_open(fleet.prune(S, held, b.opened_at + S.window + 10)) is not None
    quiet = fleet.prune(S, held, b.opened_at + 1000 + S.window)
    assert fleet.breaker_open(quiet) is None


def test_the_ledger_round_trips_and_anything_else_is_refused() -> None:
    ledger, _, _, _ = every_replica_fails(8)
    assert fleet.parse(fleet.dump(ledger)) == ledger
    assert fleet.parse(None) == Ledger() and fleet.parse("") == Ledger()
    for garbage in ("{", "[]", json.dumps({"v": 2}), json.dumps({"v": 1, "slots": [{"pod": 1}]}),
                    json.dumps({"v": 1, "slots": "x"}), json.dumps({"v": 1, "breaker": {"restarted": "x"}}),
                    json.dumps({"v": 1, "restarts": [{"pod": "a", "reason": "hang", "at": "nan"}]})):
        with pytest.raises(LedgerError):
            fleet.parse(garbage)


def test_the_ledger_stays_bounded() -> None:
    ledger = Ledger()
    for i in range(fleet.MAX_RESTARTS_KEPT + 50):
        ledger, _ = take(ledger, f"p{i}", 100.0 + i, replicas=1000, settings=FleetSettings(max_unavailable="100%"))
    assert len(ledger.restarts) == fleet.MAX_RESTARTS_KEPT
    assert len(fleet.dump(ledger)) < 64 * 1024


# -- the budget: the workload's allowance grows with its replicas, a lineage's loop stays bounded ----


def policy(max_restarts: int = 3, per_replica: float = 1.0) -> PolicySettings:
    return PolicySettings(restart_budget=RestartBudgetSettings(max_restarts=max_restarts, per_replica=per_replica))


def fleet_history(replicas: int | None, restarts: list[PastRestart], pod: str = "me", node: str = "node-me",
                  gpus: tuple[str, ...] | None = None) -> History:
    h = History(started_at=0.0, pod=pod, node=node, replicas=replicas, pod_gpus=gpus)
    h.workload_restarts, h.workload_read_at = tuple(restarts), 100.0
    return h


@pytest.mark.parametrize(("replicas", "allowance"), [(None, 3), (1, 3), (2, 3), (8, 8), (40, 40)])
def test_the_workload_allowance_grows_with_its_replicas(replicas: int | None, allowance: int) -> None:
    assert workload_allowance(policy(), replicas) == allowance
    assert workload_allowance(policy(per_replica=0.5), 40) == 20


def test_four_independent_faults_in_eight_replicas_are_all_restarted() -> None:
    """Today's measurement: the fourth restart was blocked in a fleet of seven healthy replicas."""
    past = [PastRestart(10.0 + i, f"p{i}", f"node-{i}") for i in range(3)]
    h = fleet_history(8, past)
    assert budget_remaining(policy(), h, 100.0, from_events=True) == 3  # lineage bound; 5 left for the fleet


def test_forty_replicas_get_forty_restarts_an_hour_two_replicas_three() -> None:
    past = [PastRestart(float(i), f"p{i}", f"node-{i}") for i in range(39)]
    assert budget_remaining(policy(), fleet_history(40, past), 100.0, from_events=True) == 1
    assert budget_remaining(policy(), fleet_history(40, [*past, PastRestart(50.0, "x", "n")]), 100.0, True) == 0
    two = [PastRestart(1.0, "a", "node-a"), PastRestart(2.0, "b", "node-b")]
    assert budget_remaining(policy(), fleet_history(2, two), 100.0, from_events=True) == 1


def test_one_lineage_restarting_in_a_loop_is_stopped_while_the_fleet_has_room() -> None:
    # Three restarts on our node (each a new pod of the Deployment) in the window: a loop.
    past = [PastRestart(10.0 * i, f"gen{i}", "node-me") for i in range(3)]
    h = fleet_history(8, past)
    assert budget_remaining(policy(), h, 100.0, from_events=True) == 0
    assert budget_blocker(policy(), h, 100.0, from_events=True) == "restart_loop"
    # The same count spread over other nodes is no loop of ours.
    elsewhere = fleet_history(8, [PastRestart(10.0 * i, f"gen{i}", f"node-{i}") for i in range(3)])
    assert budget_remaining(policy(), elsewhere, 100.0, from_events=True) == 3


def test_a_lineage_is_the_gpu_where_both_name_theirs() -> None:
    ours = ("GPU-a",)
    past = [PastRestart(float(i), f"gen{i}", "node-me", ("GPU-b",)) for i in range(3)]
    h = fleet_history(8, past, gpus=ours)  # same node, another GPU: another lineage
    assert budget_remaining(policy(), h, 100.0, from_events=True) == 3
    same_gpu = fleet_history(8, [PastRestart(float(i), f"gen{i}", "node-x", ours) for i in range(3)], gpus=ours)
    assert budget_remaining(policy(), same_gpu, 100.0, from_events=True) == 0


def test_our_own_restarts_count_for_our_lineage_even_where_the_events_lost_them() -> None:
    h = fleet_history(40, [])
    for at in (101.0, 102.0, 103.0):
        h.actions.append(ActionRecord(at, "restart", HANG, RUNG_CONTAINER))
    assert budget_remaining(policy(), h, 110.0, from_events=True) == 0
    assert budget_blocker(policy(), h, 110.0, from_events=True) == "restart_loop"


def test_unreadable_events_still_spend_the_budget() -> None:
    h = fleet_history(40, [])
    h.workload_restarts = None
    assert budget_remaining(policy(), h, 100.0, from_events=True) == 0
    assert budget_blocker(policy(), h, 100.0, from_events=True) == "restart_budget_unknown"


def test_two_bad_replicas_looping_in_a_healthy_fleet_never_open_the_breaker() -> None:
    ledger, pods, now = Ledger(), {"p0": "p0", "p1": "p1"}, 100.0
    for round_ in range(6):  # each comes back failing, again and again (bad cards): the loop bound's job
        for key, pod in list(pods.items()):
            ledger, verdict = take(ledger, pod, now)
            assert verdict.granted, (round_, pod)
            new = f"{key}-{round_}"
            ledger, _ = fleet.replaced(ledger, new, started_at=now + 1)
            pods[key] = new
            now += 5
    assert fleet.breaker_open(ledger) is None


def test_replicas_waiting_for_a_slot_count_as_failing_and_leave_when_they_serve() -> None:
    ledger, _ = take(Ledger(), "p0", 100.0, settings=FleetSettings(max_unavailable="1"))
    ledger, verdict = take(ledger, "p1", 100.5, settings=FleetSettings(max_unavailable="1"))
    assert verdict.outcome == UNAVAILABLE_LIMIT and [w.pod for w in ledger.waiting] == ["p1"]
    again, _ = take(ledger, "p1", 102.0, settings=FleetSettings(max_unavailable="1"))
    assert again == ledger  # asking again writes nothing
    assert fleet.failed_for(S, ledger, HANG, 103.0) == ["p0", "p1"]
    recovered = fleet.give_back(ledger, "p1", restarted=False)  # p1's target serves again on its own
    assert recovered.waiting == () and fleet.failed_for(S, recovered, HANG, 103.0) == ["p0"]
    assert fleet.failed_for(S, ledger, MAX_AGE, 103.0) == []  # another reason is another fault


def test_after_a_reset_only_new_failures_count_and_one_comeback_does_not_reopen_it() -> None:
    ledger, log, _, _ = every_replica_fails(8)
    b = fleet.breaker_open(ledger)
    assert b is not None
    at = log[-1][0] + 1
    reset = fleet.reset_breaker(ledger, at)
    assert fleet.breaker_open(reset) is None and reset.breaker is None
    # A pod that had come back failing asks again: it is a comeback, but what came before the reset
    # is no evidence, so it gets its restart instead of reopening the breaker at once.
    again, verdict = take(reset, b.opened_by, at + 1)
    assert verdict.granted and fleet.breaker_open(again) is None


def test_an_open_breaker_holds_its_own_reason_and_planned_restarts_only() -> None:
    ledger, log, _, _ = every_replica_fails(8)
    b = fleet.breaker_open(ledger)
    assert b is not None and b.reason == HANG
    at = log[-1][0] + 120
    assert take(ledger, "px", at, reason=MAX_AGE)[1].outcome == BREAKER_OPEN
    other, verdict = take(ledger, "px", at, reason="context_loss")
    assert verdict.outcome in (GRANTED, UNAVAILABLE_LIMIT)
    assert other.breaker == ledger.breaker  # another fault does not keep this one open
    held, _ = take(ledger, "py", at, reason=HANG)
    assert held.breaker is not None and held.breaker.held_at == at


def test_one_bad_card_and_one_transient_fault_in_two_replicas_do_not_open_the_breaker() -> None:
    ledger, _ = take(Ledger(), "a", 100.0, replicas=2)  # a transient fault, cured
    ledger, _ = fleet.replaced(ledger, "a2", started_at=101.0)
    ledger, _ = take(ledger, "b", 200.0, replicas=2)  # a bad card: it comes back failing, again and again
    ledger, _ = fleet.replaced(ledger, "b2", started_at=201.0)
    ledger, verdict = take(ledger, "b2", 300.0, replicas=2)
    assert verdict.granted and fleet.breaker_open(ledger) is None
    ledger, _ = fleet.replaced(ledger, "b3", started_at=301.0)
    ledger, verdict = take(ledger, "b3", 400.0, replicas=2)
    assert verdict.granted and fleet.breaker_open(ledger) is None  # one lineage only: the loop bound's job


def test_entries_dated_in_the_future_are_not_believed() -> None:
    now = 1000.0
    forged = Ledger(slots=(fleet.Slot("x", HANG, RUNG_POD, now + 1e9), fleet.Slot("y", HANG, RUNG_POD, now + 1e9)),
                    breaker=fleet.Breaker(HANG, now + 1e9, now + 1e9, 8, ("a", "b"), "a"))
    ledger, verdict = take(forged, "p0", now)
    assert verdict.granted and [s.pod for s in ledger.slots] == ["p0"] and ledger.breaker is None
    near = Ledger(slots=(fleet.Slot("x", HANG, RUNG_POD, now + 30),))  # within the clock skew: believed
    assert [s.pod for s in fleet.prune(S, near, now).slots] == ["x"]


def test_percentages_are_rounded_as_written() -> None:
    assert fleet.unavailable_slots(FleetSettings(max_unavailable="29%"), 100) == 29
    assert workload_allowance(policy(per_replica=0.07), 100) == 7


def test_a_scale_up_pod_that_serves_first_is_growth_not_the_replacement() -> None:
    """4 replicas wanted when a's slot was taken; scaled to 5 while a's replacement loads. The new pod
    serves first: it returns nothing (counted as growth), the next replica's hang is held, and the
    slot goes back when a's replacement serves, in either order of the two."""
    for order in (("grown", "a2"), ("a2", "grown")):
        ledger, _ = fleet.take(S, Ledger(), 4, "a", HANG, RUNG_POD, 100.0, template="h1")
        assert ledger.slots[0].replicas == 4 and ledger.slots[0].template == "h1"
        ledger, slot = fleet.replaced(ledger, order[0], 110.0, template="h1", replicas=5)
        assert slot is None and ledger.slots[0].replicas == 5
        ledger, verdict = fleet.take(FleetSettings(max_unavailable="1"), ledger, 5, "b", HANG, RUNG_POD, 120.0,
                                     template="h1")
        assert verdict.outcome == UNAVAILABLE_LIMIT
        ledger, slot = fleet.replaced(ledger, order[1], 111.0, template="h1", replicas=5)
        assert slot is not None and slot.pod == "a" and ledger.slots == ()
        assert [r.returned_as for r in ledger.restarts] == [order[1]]


def test_a_scale_up_by_two_needs_three_pods_serving_before_the_slot_goes_back() -> None:
    ledger, _ = fleet.take(S, Ledger(), 4, "a", HANG, RUNG_POD, 100.0, template="h1")
    for n, pod in enumerate(("g1", "g2")):
        ledger, slot = fleet.replaced(ledger, pod, 110.0 + n, template="h1", replicas=6)
        assert slot is None
    ledger, slot = fleet.replaced(ledger, "a2", 112.0, template="h1", replicas=6)
    assert slot is not None and slot.pod == "a"


def test_a_pod_of_another_template_never_returns_a_slot() -> None:
    """A rollout's new pods replace the pods the rollout removes, not ours."""
    ledger, _ = fleet.take(S, Ledger(), 4, "a", HANG, RUNG_POD, 100.0, template="old")
    ledger, slot = fleet.replaced(ledger, "new-1", 110.0, template="new", replicas=4)
    assert slot is None and len(ledger.slots) == 1
    ledger, slot = fleet.replaced(ledger, "a2", 111.0, template="old", replicas=4)
    assert slot is not None and slot.pod == "a"


def test_a_slot_of_a_ledger_written_before_templates_were_kept_still_goes_back() -> None:
    old = json.dumps({"v": 1, "slots": [{"pod": "a", "reason": HANG, "rung": RUNG_POD, "at": 100.0}],
                      "restarts": [], "waiting": [], "breaker": None, "reset_at": None})
    ledger = fleet.parse(old)
    assert ledger.slots[0].template is None and ledger.slots[0].replicas is None
    _, slot = fleet.replaced(ledger, "a2", 110.0, template="h1", replicas=5)
    assert slot is not None and slot.pod == "a"
    assert fleet.parse(fleet.dump(fleet.take(S, Ledger(), 4, "a", HANG, RUNG_POD, 1.0, template="h")[0])) \
        .slots[0] == fleet.Slot("a", HANG, RUNG_POD, 1.0, "h", 4)
    with pytest.raises(LedgerError, match="replicas"):
        fleet.parse(old.replace('"at": 100.0', '"at": 100.0, "replicas": -1'))


def test_a_pod_created_while_the_restart_waited_is_not_its_replacement() -> None:
    """Slot taken at 100 with 4 replicas wanted; scaled up and back down while the eviction waited for
    its disruption budget, a pod made then (at 105) serves. Before the ledger knew when the pod went,
    that pod gave the slot back and the next hang was granted: two replicas down with
    max_unavailable 1. Now no pod replaces a marked slot before `acted`, and only one created after
    the eviction was asked (at 130) does."""
    one = FleetSettings(max_unavailable="1")
    ledger, _ = fleet.take(one, Ledger(), 4, "a", HANG, RUNG_POD, 100.0, template="h1", marks=True)
    assert ledger.slots[0].marked and ledger.slots[0].acted_at is None
    ledger, slot = fleet.replaced(ledger, "grown", 105.0, template="h1", replicas=4)
    assert slot is None and len(ledger.slots) == 1
    ledger = fleet.acted(ledger, "a", 130.0)
    ledger, slot = fleet.replaced(ledger, "grown", 105.0, template="h1", replicas=4)
    assert slot is None
    _, verdict = fleet.take(one, ledger, 4, "b", HANG, RUNG_POD, 131.0, template="h1", marks=True)
    assert verdict.outcome == UNAVAILABLE_LIMIT
    # Within the clocks' skew of the eviction's ask, and after it: the replacement.
    ledger, slot = fleet.replaced(ledger, "a2", 130.0 - fleet.CLOCK_SKEW_S / 2, template="h1", replicas=4)
    assert slot is not None and slot.pod == "a" and ledger.slots == ()
    # A slot its sidecar does not mark (a ledger of an older sidecar) goes back as before.
    ledger, _ = fleet.take(one, Ledger(), 4, "a", HANG, RUNG_POD, 100.0, template="h1")
    assert not ledger.slots[0].marked
    _, slot = fleet.replaced(ledger, "grown", 105.0, template="h1", replicas=4)
    assert slot is not None


def test_when_the_pod_went_is_kept_in_the_ledger_and_checked() -> None:
    ledger, _ = fleet.take(S, Ledger(), 4, "a", HANG, RUNG_POD, 100.0, template="h1", marks=True)
    ledger = fleet.acted(ledger, "a", 130.5)
    assert fleet.parse(fleet.dump(ledger)).slots == ledger.slots
    text = fleet.dump(ledger)
    with pytest.raises(LedgerError, match="acted_at"):
        fleet.parse(text.replace('"acted_at":130.5', '"acted_at":"soon"'))
    # In-place slots are the sidecar's own to give back: never marked.
    ledger, _ = fleet.take(S, Ledger(), 4, "a", HANG, RUNG_CONTAINER, 100.0, marks=True)
    assert not ledger.slots[0].marked


def test_a_replacement_stamped_in_whole_seconds_by_a_clock_behind_ours_still_counts() -> None:
    """Our clock 1.9 s ahead (within CLOCK_SKEW_S), the eviction asked at 100.3 by it: the replacement,
    created 0.5 s later, is stamped 98 by the API server's clock, in whole seconds."""
    ledger, _ = fleet.take(S, Ledger(), 4, "a", HANG, RUNG_POD, 90.0, template="h1", marks=True)
    ledger = fleet.acted(ledger, "a", 100.3)
    _, slot = fleet.replaced(ledger, "a2", float(int(100.3 + 0.5 - 1.9)), template="h1", replicas=4)
    assert slot is not None and slot.pod == "a"


def test_a_pod_gone_already_unmarks_its_slot() -> None:
    """Removed by someone else (whenever): its replacement may be older than any mark of ours."""
    ledger, _ = fleet.take(S, Ledger(), 4, "a", HANG, RUNG_POD, 100.0, template="h1", marks=True)
    ledger = fleet.acted(ledger, "a", None)
    assert not ledger.slots[0].marked and ledger.slots[0].acted_at is None
    _, slot = fleet.replaced(ledger, "a2", 101.0, template="h1", replicas=4)
    assert slot is not None and slot.pod == "a"


# -- availability counted from the cluster (the census), as a PodDisruptionBudget counts it ----------------------

ONE = FleetSettings(max_unavailable="1")


def census(desired: int, ready: str = "", unready: str = "", terminating: str = "") -> fleet.Census:
    """`desired` replicas; pods named by letters: Ready, not Ready, and going away."""
    return fleet.Census(desired, tuple([fleet.PodSeen(p, True) for p in ready]
                                       + [fleet.PodSeen(p, False) for p in unready]
                                       + [fleet.PodSeen(p, False, terminating=True) for p in terminating]))


def ask(ledger: Ledger, pod: str, seen: fleet.Census, now: float = 100.0,
        settings: FleetSettings = ONE) -> tuple[Ledger, fleet.Verdict]:
    return fleet.take(settings, ledger, None, pod, HANG, RUNG_POD, now, census=seen)


def test_a_lease_deleted_mid_restart_is_no_licence_a_replacement_still_loading_is_counted() -> None:
    ledger, verdict = ask(Ledger(), "a", census(4, ready="bcd", unready="a"))
    assert verdict.granted and [s.pod for s in ledger.slots] == ["a"]
    # The Lease is deleted (an operator's cleanup, an etcd restore): the ledger reads empty, but the
    # cluster shows a's replacement (e) still loading.
    _, held = ask(Ledger(), "b", census(4, ready="cd", unready="be", terminating="a"))
    assert held.outcome == UNAVAILABLE_LIMIT and held.detail["unavailable"] == 2
    # It serves: b may go.
    _, verdict = ask(Ledger(), "b", census(4, ready="cde", unready="b"))
    assert verdict.granted and verdict.detail["unavailable"] == 1


def test_pods_made_by_others_count_whoever_made_them_a_drain_a_surge_a_scale_up() -> None:
    drained = census(4, ready="acd", unready="x")  # b drained by someone else; x stands in, loading
    assert ask(Ledger(), "a", drained)[1].outcome == UNAVAILABLE_LIMIT
    surge = census(8, ready="abcdef", unready="uv", terminating="gh")  # maxSurge 2, maxUnavailable 2
    assert ask(Ledger(), "a", surge, settings=FleetSettings(max_unavailable="2"))[1].outcome == UNAVAILABLE_LIMIT
    grown = census(6, ready="abcd", unready="ef")  # scaled from 4 to 6, the new pods loading
    assert ask(Ledger(), "a", grown)[1].outcome == UNAVAILABLE_LIMIT
    assert ask(Ledger(), "a", census(6, ready="abcdef"))[1].granted


def test_a_restart_asked_that_the_cluster_does_not_show_yet_is_counted() -> None:
    ledger, _ = ask(Ledger(), "a", census(4, ready="abcd"))  # a still Ready: its eviction not yet done
    _, held = ask(ledger, "b", census(4, ready="abcd"))
    assert held.outcome == UNAVAILABLE_LIMIT and held.detail["restarting"] == ["a"]


def test_a_failure_its_sidecar_saw_before_the_kubelet_did_is_not_serving() -> None:
    """8 replicas wanted, 9 pods (a scale-down not done yet), max_unavailable 1; found by the
    simulation once its kubelet probed readiness as the chart sets it. z's restart was granted and b,
    hung, waits for a slot; z's slot is back (z gone, its replacement i still loading), and b's Ready
    condition still says True (two failed probes, 5 s apart, before the kubelet says otherwise). c's
    hang must wait: counting b as serving made the budget's count 1 (7 of 8 serving once c goes) and
    let c go with i loading and b hung: two out because of restarts, 6 serving."""
    ledger, _ = ask(Ledger(), "z", census(8, ready="bcdefghxz"))
    ledger, waits = ask(ledger, "b", census(8, ready="bcdefghxz"))
    assert waits.outcome == UNAVAILABLE_LIMIT and [w.pod for w in ledger.waiting] == ["b"]
    ledger = fleet.give_back(ledger, "z", restarted=True)
    seen = census(8, ready="bcdefghx", unready="i")
    _, held = ask(ledger, "c", seen)
    assert held.outcome == UNAVAILABLE_LIMIT and held.detail["failing_waiting"] == ["b"]
    assert held.detail["serving"] == 6 and held.detail["unavailable"] == 2
    # Once i serves, c may go: b is out by its own fault, not by a restart.
    _, verdict = ask(ledger, "c", census(8, ready="bcdefghxi"))
    assert verdict.granted


def test_a_slot_whose_pod_is_gone_holds_nobody() -> None:
    """A scale-down removed the pod holding a slot (or a replacement gave back nothing, its node's
    clock being off): the next hang is not held for slot_timeout, the census counts what stands."""
    ledger, _ = ask(Ledger(), "a", census(4, ready="abcd"))
    _, verdict = ask(ledger, "b", census(3, ready="bcd"), now=110.0)  # scaled to 3, a removed
    assert verdict.granted and ledger.slots[0].pod == "a"
    # Gone and replaced by one still loading: held by the census, not by the slot.
    _, held = ask(ledger, "b", census(4, ready="bcd", unready="e", terminating="a"), now=110.0)
    assert held.outcome == UNAVAILABLE_LIMIT and held.detail["restarting"] == []


def test_replacements_that_came_back_failing_while_the_slots_were_taken_do_not_hold_the_fleet_for_good() -> None:
    """Eight replicas hung at once, as a fleet saw it: the first two restarted, and their replacements
    served and hung again while the next two restarts held both slots. Held then, they were left out of
    the waiting list, so every replica counted them as out by a restart: no one was granted a slot again,
    the breaker (which needs one more lineage restarted and back failing) never opened, and the fleet
    stayed down and held for good. Waiting as any failing replica does, one of them goes, and the next
    one that comes back failing opens the breaker."""
    pods = {p: False for p in "abcdefgh"}  # pod -> Ready
    ledger, now = Ledger(), 100.0

    def ask_all() -> list[tuple[str, str]]:
        nonlocal ledger
        seen = fleet.Census(8, tuple(fleet.PodSeen(p, ready) for p, ready in pods.items()))
        outcomes = []
        for p in sorted(p for p, ready in pods.items() if not ready):
            ledger, verdict = fleet.take(S, ledger, None, p, HANG, RUNG_POD, now, census=seen)
            outcomes.append((p, verdict.outcome))
        return outcomes

    def restart_and_serve(old: str, new: str) -> None:
        nonlocal ledger
        del pods[old]
        pods[new] = True
        ledger, slot = fleet.replaced(ledger, new, started_at=now)
        assert slot is not None  # one of the two taken at the same time: either is the lineage

    for _ in range(2):
        ask_all()
    first = sorted(s.pod for s in ledger.slots)
    assert len(first) == 2
    now += 5
    for old in first:
        restart_and_serve(old, old + "2")
    assert [p for p, outcome in ask_all() if outcome == GRANTED] and len(ledger.slots) == 2
    for old in first:
        pods[old + "2"] = False  # back failing while two others hold both slots
    now += 2
    assert dict(ask_all())[first[0] + "2"] == UNAVAILABLE_LIMIT
    now += 5
    taken = sorted(s.pod for s in ledger.slots)
    for old in taken:
        restart_and_serve(old, old + "2")
    for old in taken:
        pods[old + "2"] = False  # back failing too: nothing in the fleet serves
    for _ in range(6):
        now += 2
        ask_all()
        if fleet.breaker_open(ledger) is not None:
            break
    breaker = fleet.breaker_open(ledger)
    assert breaker is not None, fleet.dump(ledger)
    assert breaker.opened_by.endswith("2") and len(breaker.restarted) == 8


def test_replicas_that_already_cannot_serve_go_one_at_a_time() -> None:
    """Two replicas hung and unready, each waiting: one goes first (the other is out by its fault, not
    by a restart), the other waits until the first one's replacement serves."""
    seen = census(4, ready="cd", unready="ab")
    ledger, first = ask(Ledger(), "a", seen)
    assert first.outcome == UNAVAILABLE_LIMIT  # b has not asked yet: counted as out
    ledger, second = ask(ledger, "b", seen)
    assert second.granted and second.detail["failing_waiting"] == ["a"]
    _, again = ask(ledger, "a", census(4, ready="cd", unready="ae", terminating="b"))
    assert again.outcome == UNAVAILABLE_LIMIT
    ledger = fleet.give_back(ledger, "b", restarted=True)
    assert ask(ledger, "a", census(4, ready="cde", unready="a"))[1].granted


def test_without_a_census_the_ledgers_slots_alone_count() -> None:
    ledger, _ = take(Ledger(), "a", 100.0, replicas=4, settings=ONE)
    assert take(ledger, "b", 101.0, replicas=4, settings=ONE)[1].outcome == UNAVAILABLE_LIMIT


def test_the_view_after_a_read_names_the_slots_and_the_breaker_and_keeps_the_last_on_no_read() -> None:
    view = fleet.FleetView(lease="gpu-watchdog-llm")
    ledger, _ = take(Ledger(), "a", 100.0)
    seen = fleet.view_of(view, S, 8, ledger)
    assert seen.restarting == ("a",) and seen.max_unavailable == 2 and seen.breaker is None
    unread = fleet.view_of(seen, S, 8, None, error="timeout")
    assert unread.restarting == ("a",) and unread.error == "timeout"


def test_a_slot_granted_is_counted_again_at_the_act_and_a_drain_since_then_holds_it() -> None:
    """The simulation's trace: 4 replicas, max_unavailable 1. a's replacement (e) still loads when b
    hangs; c, d and f serve, so b's slot is granted (3 of 4 serve once b goes). In b's wait before the
    act, c is drained by someone else and its stand-in (g) loads: b going now would leave 2 of 4
    serving with two out because of restarts. Counted again at the act, b is held."""
    ledger, granted = ask(Ledger(), "b", census(4, ready="cdf", unready="be", terminating="a"))
    assert granted.granted
    assert fleet.recount(ONE, ledger, census(4, ready="cdf", unready="be", terminating="a"), "b").granted
    drained = fleet.recount(ONE, ledger, census(4, ready="df", unready="beg", terminating="ac"), "b")
    assert drained.outcome == UNAVAILABLE_LIMIT and drained.detail["unavailable"] == 2
    assert drained.detail["serving"] == 2 and drained.detail["recounted"] is True
    # g serves: b may go.
    assert fleet.recount(ONE, ledger, census(4, ready="dfg", unready="be", terminating="ac"), "b").granted
