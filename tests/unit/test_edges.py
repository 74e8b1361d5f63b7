"""What the edges said, folded: the facts the executor and the keep-out read back instead of keeping,
and the rules over them, driven by traces (every input through `state.reduce`, as the sidecar folds)."""

from __future__ import annotations

from gpu_watchdog.watchdog.core import edges, quarantine, recording
from gpu_watchdog.watchdog.core.edges import (
    Acting,
    BreakerSaid,
    EscalationFailed,
    EscalationLooked,
    Evidence,
    EvidenceRead,
    EvidenceRefused,
    FleetSeen,
    Held,
    HoldEnded,
    InPlaceServed,
    Refused,
    SlotGivenBack,
    SlotNotGivenBack,
    SlotTaken,
)
from gpu_watchdog.watchdog.core.fleet import FleetView
from gpu_watchdog.watchdog.core.names import FLEET_UNAVAILABLE_LIMIT, HANG, RUNG_CONTAINER, RUNG_POD, RUNG_WORKER
from gpu_watchdog.watchdog.core.samples import WorkerRestarted
from gpu_watchdog.watchdog.core.settings import Settings
from gpu_watchdog.watchdog.core.state import PodGpus, RestartEnded, WorkloadRestarts
from tests.traces import Trace

LEASE = FleetView(lease="gpu-watchdog-demo")


def ledgered() -> Trace:
    return Trace(Settings()).fold(FleetSeen(LEASE))


def test_a_hold_is_one_episode_per_why_and_reason_and_its_wait_counts_from_its_start() -> None:
    t = ledgered().fold(Held(10.0, FLEET_UNAVAILABLE_LIMIT, HANG, {"restarting": ["p1"]}))
    assert t.history.edge.held_anew and t.history.edge.held_since == 10.0
    assert t.history.edge.fleet.held == FLEET_UNAVAILABLE_LIMIT
    t.fold(Held(25.0, FLEET_UNAVAILABLE_LIMIT, HANG, {"restarting": ["p1"]}))
    assert not t.history.edge.held_anew and t.history.edge.held_since == 10.0  # asked again: the same episode
    t.fold(SlotTaken(40.0, 0))
    e = t.history.edge
    assert e.fleet.slot_held and e.fleet.held is None and e.held_since == 0.0 and e.slot_taken_at == 40.0
    t.fold(HoldEnded(), Held(50.0, FLEET_UNAVAILABLE_LIMIT, HANG, {}))
    assert t.history.edge.held_anew and t.history.edge.held_since == 50.0


def test_an_in_place_restart_holds_the_slot_until_a_new_process_serves() -> None:
    t = ledgered().fold(Acting(0, True), SlotTaken(1.0, 0),
                        RestartEnded(2.0, HANG, True, False, rung=RUNG_CONTAINER, instance_id="p-1"), Acting(0, False))
    e = t.history.edge
    assert [p.worker for p in e.in_place] == [0] and not e.slot_for_pod
    assert edges.in_place_served(e, 0, "p-2") and not edges.slot_back_due(e)
    t.fold(InPlaceServed(0))
    assert edges.slot_back_due(t.history.edge)
    t.fold(SlotGivenBack())
    assert not t.history.edge.fleet.slot_held and not edges.slot_back_due(t.history.edge)


def test_a_pods_restart_leaves_its_slot_to_the_replacement_and_a_restart_under_way_keeps_it() -> None:
    t = ledgered().fold(Acting(0, True), SlotTaken(1.0, 0))
    assert not edges.slot_back_due(t.history.edge)  # the restart is under way
    t.fold(RestartEnded(2.0, HANG, True, True, rung=RUNG_POD), Acting(0, False))
    assert t.history.edge.slot_for_pod and not edges.slot_back_due(t.history.edge)


def test_a_workers_restart_waits_for_a_process_other_than_the_one_told_to_leave() -> None:
    t = ledgered().fold(Acting(1, True), SlotTaken(1.0, 1),
                        WorkerRestarted(2.0, 1, HANG, "w1-a", detail="told", recorded=True), Acting(1, False))
    e = t.history.edge
    assert not edges.in_place_served(e, 1, "w1-a") and edges.in_place_served(e, 1, "w1-b")
    assert not edges.in_place_served(e, 0, "p-1")  # the target never restarted


def test_a_give_back_that_failed_is_tried_again_as_it_was_first_asked() -> None:
    t = ledgered().fold(SlotTaken(1.0, 0), SlotNotGivenBack(False))
    assert t.history.edge.give_back_pending is False and t.history.edge.fleet.slot_held
    t.fold(SlotGivenBack())
    assert t.history.edge.give_back_pending is None and not t.history.edge.fleet.slot_held


def test_events_refused_are_an_episode_over_once_one_is_written_or_none_was_tried_for_long() -> None:
    t = Trace(Settings()).fold(RestartEnded(100.0, HANG, False, False, detail="403 Forbidden", recorded=False))
    assert edges.not_recorded_now(t.history.edge, 101.0) == "403 Forbidden"
    assert t.history.edge.restart_failed == "403 Forbidden"
    assert edges.not_recorded_now(t.history.edge, 100.0 + edges.NOT_RECORDED_HOLD_S) is None
    # A try that never reached the Event (a disruption budget's 429s) says nothing of it.
    t.fold(RestartEnded(200.0, HANG, False, False, detail="gave up: 429"))
    assert edges.not_recorded_now(t.history.edge, 201.0) == "403 Forbidden"
    t.fold(RestartEnded(300.0, HANG, True, False, detail="evicted", recorded=True))
    assert edges.not_recorded_now(t.history.edge, 301.0) is None and t.history.edge.restart_failed is None


def test_a_workers_refused_event_is_the_same_episode() -> None:
    t = Trace(Settings()).fold(WorkerRestarted(5.0, 1, HANG, "w1", "restart_failed", detail="403", recorded=False))
    assert edges.not_recorded_now(t.history.edge, 6.0) == "403"
    t.fold(WorkerRestarted(9.0, 1, HANG, "w1", detail="told", recorded=True))
    assert edges.not_recorded_now(t.history.edge, 10.0) is None
    assert t.history.edge.restart_failed is None  # a worker's rung never says the pod's restart failed


def test_the_kubelet_and_the_escalation_back_off_doubling_and_the_budget_error_is_the_last_reads() -> None:
    t = Trace(Settings()).fold(PodGpus(None, "refused"), PodGpus(None, "refused"))
    assert t.history.edge.pod_gpus_error == "refused" and t.history.edge.pod_gpus_tries == 2
    assert [edges.pod_gpus_wait(n) for n in (1, 2, 3, 12)] == [5.0, 10.0, 20.0, edges.POD_GPUS_RETRY_MAX_S]
    t.fold(PodGpus(("GPU-a",)))
    assert t.history.edge.pod_gpus_error is None and t.history.pod_gpus == ("GPU-a",)
    t.fold(EscalationFailed(100.0, "list_events:403"), EscalationFailed(200.0, "list_events:403"))
    e = t.history.edge
    assert e.escalation_retry_at == 200.0 + 2 * edges.ESCALATION_RETRY_S and e.escalation_said == ("list_events:403",)
    t.fold(EscalationLooked())
    assert edges.escalation_backoff(t.history.edge) == edges.ESCALATION_RETRY_S
    t.fold(WorkloadRestarts(10.0, 1e9, None, error="403: forbidden"))
    assert t.history.edge.budget_read_error == "403: forbidden"
    t.fold(WorkloadRestarts(20.0, 1e9, ()))
    assert t.history.edge.budget_read_error is None


def test_evidence_is_known_by_the_decisions_process_and_by_the_one_the_server_named() -> None:
    t = Trace(Settings()).fold(EvidenceRefused(Refused(HANG, "p-1", 5.0)))
    assert edges.refused_at(t.history.edge, HANG, "p-1") == 5.0
    t.fold(EvidenceRead(Evidence(HANG, "p-1", ("aaaa",)), process="p-1b"))
    e = t.history.edge
    seen = [edges.evidence_seen(e, HANG, process) for process in ("p-1", "p-1b")]
    assert [None if v is None else v.inflight for v in seen] == [("aaaa",), ("aaaa",)]
    assert edges.refused_at(e, HANG, "p-1") is None  # recorded: no longer refused
    for k in range(edges.EVIDENCE_KEPT + 5):
        t.fold(EvidenceRead(Evidence(HANG, f"q-{k}", None)), BreakerSaid(float(k)))
    assert len(t.history.edge.evidence) == edges.EVIDENCE_KEPT
    assert len(t.history.edge.breakers_said) <= edges.EVIDENCE_KEPT


def test_folding_returns_a_new_record_and_every_edge_input_is_recorded_and_read_back() -> None:
    t = ledgered()
    before = t.history.edge
    t.fold(SlotTaken(1.0, 0), edges.RecordsSeen(quarantine.Records(), "409"))
    assert not before.fleet.slot_held and t.history.edge is not before  # nothing changed in place
    replayed = Trace(Settings())
    for line in t.lines[1:]:
        replayed.fold(recording.decode_input(line["type"], line["v"]))
    assert replayed.history.edge == t.history.edge


def test_a_worker_rung_ended_without_a_slot_holds_nothing() -> None:
    t = Trace(Settings()).fold(WorkerRestarted(2.0, 1, HANG, "w1", detail="told", recorded=True),
                               RestartEnded(3.0, HANG, True, False, rung=RUNG_WORKER))
    assert t.history.edge.in_place == () and not t.history.edge.slot_for_pod


def test_a_new_process_gets_the_quarantine_at_once_and_the_same_one_at_the_sync() -> None:
    from gpu_watchdog.watchdog.core.edges import QuarantinePushed

    t = Trace(Settings())
    e = t.history.edge
    assert edges.push_due(e, 0, True, "p1") and edges.push_due(e, 2, True, "w2")
    assert not edges.push_due(e, 0, False, "p1")  # it did not answer: nothing reached yet
    assert not edges.push_due(e, 0, True, None)  # a process that names none waits for the sync
    t.fold(QuarantinePushed(0, "p1", ()), QuarantinePushed(2, "w2", ()))
    e = t.history.edge
    assert not edges.push_due(e, 0, True, "p1") and not edges.push_due(e, 2, True, "w2")
    assert edges.push_due(e, 0, True, "p2") and edges.push_due(e, 2, True, "w3")
    assert edges.push_due(e, 1, True, "w2")  # another worker's process is not the one pushed


def test_a_hold_is_over_once_no_restart_is_under_way_or_wanted() -> None:
    from gpu_watchdog.watchdog.core import policy
    from gpu_watchdog.watchdog.core.samples import CanarySample
    from gpu_watchdog.watchdog.core.state import RestartBegun

    s = Settings().policy
    t = ledgered()
    assert not policy.hold_over(s, t.history, 10.0)  # nothing held
    t.fold(Held(10.0, FLEET_UNAVAILABLE_LIMIT, HANG, {"restarting": ["p1"]}),
           CanarySample(10.0, True, 0.05, None, instance_id="p1"))
    assert policy.hold_over(s, t.history, 11.0)  # it serves: nothing wants a restart
    t.fold(RestartBegun(11.0))
    assert not policy.hold_over(s, t.history, 11.5)  # one under way keeps the hold
