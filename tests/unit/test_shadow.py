"""Shadow and enforcement one rule at a time (`policy.enforce`), on traces: which decisions the core
says to perform and which only to report, the restart procedure of a shadow restart (no slot, no
budget, said once per episode), the shadow of a flush, an admission change, a quarantine and a taint."""

from __future__ import annotations

import dataclasses

import pytest

from gpu_watchdog.inference.screen import Entry, QuarantinedRequest, Screen, parse_entry
from gpu_watchdog.watchdog.core import placement, policy, procedure, quarantine
from gpu_watchdog.watchdog.core.names import (
    CONTEXT_LOSS,
    HANG,
    MEMORY_PRESSURE,
    PLACEMENT,
    QUARANTINE,
    RESTART,
    RUNG_POD,
    RUNG_WORKER,
    WOULD,
)
from gpu_watchdog.watchdog.core.policy import Decision
from gpu_watchdog.watchdog.core.procedure import EVIDENCE, KEEP_OUT, Facts
from gpu_watchdog.watchdog.core.samples import CanarySample, DecisionRecord, TorchSample, WorkerCanaries
from gpu_watchdog.watchdog.core.settings import Settings
from gpu_watchdog.watchdog.core.state import RestartEnded, would
from gpu_watchdog.watchdog.edge.config import ConfigError, from_mapping
from tests.traces import Trace

GiB = 2**30


def enforcing(value: object) -> Settings:
    return from_mapping({"restart": {"strategy": "none"}, "policy": {"enforce": value}})


def ok(at: float) -> CanarySample:
    return CanarySample(at=at, ok=True, latency_s=0.05, error_class=None, instance_id="i1")


def timeout(at: float) -> CanarySample:
    return CanarySample(at=at, ok=False, latency_s=10.0, error_class="timeout", error="timeout", instance_id="i1")


def fatal(at: float) -> CanarySample:
    return CanarySample(at=at, ok=False, latency_s=0.1, error_class="fatal_cuda", error="illegal address",
                        instance_id="i1")


def hung(trace: Trace, start: float) -> Trace:
    return trace.fold(ok(start), *(timeout(start + 10 * i) for i in range(1, 4)))


@pytest.mark.parametrize(("value", "expected"), [
    ("all", ("all",)), ("shadow", ("shadow",)), ([], ("shadow",)), (["hang", "empty_cache", "hang"],
                                                                     ("hang", "empty_cache"))])
def test_enforce_takes_all_shadow_or_a_list_of_actions_and_reasons(value: object, expected: tuple[str, ...]) -> None:
    assert enforcing(value).policy.enforce == expected


@pytest.mark.parametrize(("value", "said"), [
    (["hang", "reboot"], "'reboot'"), (["all", "hang"], "stand alone"), (3, "expected all, shadow")])
def test_a_bad_enforce_names_its_key_path(value: object, said: str) -> None:
    with pytest.raises(ConfigError) as err:
        enforcing(value)
    assert any(e.startswith("policy.enforce:") and said in e for e in err.value.errors), err.value.errors


def test_the_default_enforces_everything_as_before() -> None:
    s = Settings().policy
    assert all(policy.enforced(s, a, r) for a in (RESTART, "empty_cache", "shrink_admission", QUARANTINE, PLACEMENT)
               for r in (HANG, CONTEXT_LOSS, ""))


def test_a_reason_enforced_restarts_for_it_alone_and_keeps_the_quarantine_and_placement_dark() -> None:
    s = enforcing(["hang"]).policy
    assert policy.enforced(s, RESTART, HANG) and not policy.enforced(s, RESTART, CONTEXT_LOSS)
    assert not policy.enforced(s, QUARANTINE, HANG) and not policy.enforced(s, PLACEMENT, HANG)
    s = enforcing(["admission", "quarantine"]).policy
    assert policy.enforced(s, "grow_admission", "recovered") and policy.enforced(s, QUARANTINE, CONTEXT_LOSS)
    assert not policy.enforced(s, RESTART, HANG) and not policy.enforced(s, "empty_cache", MEMORY_PRESSURE)


def test_a_hang_in_shadow_is_decided_as_in_earnest_and_marked_shadow_in_the_recording() -> None:
    earnest = hung(Trace(Settings()), 0.0).tick(31.0)
    trace = hung(Trace(enforcing("shadow")), 0.0)
    [d] = trace.tick(31.0)
    assert [dataclasses.replace(d, enforced=True)] == earnest
    assert not d.enforced and trace.lines[-1]["decisions"][0]["shadow"] is True
    # Enforced for hangs only: the same hang is performed, a lost context still only said.
    [d] = hung(Trace(enforcing(["hang"])), 0.0).tick(31.0)
    assert d.enforced
    [d] = Trace(enforcing(["hang"])).fold(ok(0.0), fatal(5.0)).tick(6.0)
    assert d.reason == CONTEXT_LOSS and not d.enforced


def test_a_shadow_restart_takes_no_slot_and_spends_no_budget_and_is_said_once_per_episode() -> None:
    s = enforcing("shadow")
    trace = hung(Trace(s), 0.0)
    [d] = trace.tick(31.0)
    p = procedure.begin(s.policy, trace.history, 0, d, 31.0, from_events=False)
    kinds = []
    while (step := procedure.next_step(s.policy, trace.history, p, Facts(now=31.0, strategy="evict"))) is not None:
        kinds.append(step.kind)
        p = procedure.advance(p, step)
    assert kinds == [procedure.STACKS, EVIDENCE, procedure.WOULD]
    budget = policy.budget_remaining(s.policy, trace.history, 31.0)
    # What the edge folds for it (`restarting.Restarts._would`).
    trace.fold(DecisionRecord(31.0, RESTART, HANG, WOULD), RestartEnded(31.0, HANG, False, False, True, d.rung))
    assert policy.budget_remaining(s.policy, trace.history, 32.0) == budget == 3
    assert trace.history.would == {"restart:hang": 1}
    # Still hung: said once, not at every tick.
    assert trace.fold(timeout(41.0)).tick(42.0) == []
    # It served, then hung again: a new episode, said again.
    hung(trace, 50.0)
    [again] = trace.tick(81.0)
    assert again.reason == HANG and not again.enforced


def test_a_shadow_pod_restart_keeps_the_card_out_in_shadow_first_and_another_worker_s_is_only_said() -> None:
    s = enforcing("shadow")
    d = Decision("restart", CONTEXT_LOSS, {"evidence": "device_health"}, drain=False, rung=RUNG_POD, enforced=False)
    trace = Trace(s)
    p = procedure.begin(s.policy, trace.history, 0, d, 10.0, from_events=False)
    kinds = []
    while (step := procedure.next_step(s.policy, trace.history, p, Facts(now=10.0, strategy="evict",
                                                                         keep_out=True))) is not None:
        kinds.append(step.kind)
        p = procedure.advance(p, step)
    assert kinds == [EVIDENCE, KEEP_OUT, procedure.WOULD]
    trace = Trace(s, worker_count=2)
    for c in (ok(0.0), *(timeout(10.0 * i) for i in range(1, 4))):
        trace.fold(WorkerCanaries(c.at, ((1, c),)))
    [w] = trace.tick(31.0, core="workers")
    assert w.rung == RUNG_WORKER and not w.enforced
    p = procedure.begin(s.policy, trace.history, 1, w, 31.0, from_events=False)
    for kind in (procedure.STACKS, EVIDENCE):
        p = procedure.advance(p, procedure.Step(kind, w))
    step = procedure.next_step(s.policy, trace.history, p, Facts(now=31.0, strategy="evict"))
    assert step is not None and step.kind == procedure.WOULD


def test_a_shadow_flush_is_paced_as_a_real_one() -> None:
    trace = Trace(enforcing(["hang"]))
    full = TorchSample(at=1.0, reachable=True, device="cuda", total_bytes=80 * GiB, reserved_bytes=70 * GiB,
                       allocated_bytes=69 * GiB, instance_id="i1")
    [d] = trace.fold(full).tick(1.0)
    assert (d.action, d.reason, d.enforced) == ("empty_cache", MEMORY_PRESSURE, False)


def test_the_records_of_shadow_decisions_count_by_action_and_reason() -> None:
    trace = Trace(enforcing("shadow"))
    trace.fold(would(trace.history, 5.0, QUARANTINE, CONTEXT_LOSS, {"fingerprint": "ab"}),
               DecisionRecord(6.0, "shrink_admission", "oom", WOULD),
               DecisionRecord(7.0, "grow_admission", "recovered", WOULD),
               DecisionRecord(8.0, RESTART, HANG, "started"))
    assert trace.history.would == {"quarantine:context_loss": 1, "admission:oom": 1, "admission:recovered": 1}


def test_a_shadow_taint_of_a_device_has_effect_none_and_never_escalates() -> None:
    s = from_mapping({"restart": {"strategy": "evict"}, "kubernetes": {"pod_name": "pod-a", "namespace": "serving"},
                      "policy": {"placement": {"strategy": "device", "effect": "NoExecute"}}}).policy.placement
    card = placement.Card("gpu.nvidia.com/node-a/gpu-0", "node-a", "gpu.nvidia.com", "node-a", "gpu-0")
    taint = placement.plan(s, card, "pod-a", "unhealthy", 100.0, shadow=True)
    assert taint is not None and taint.effect == placement.SHADOW_EFFECT
    assert placement.escalated(s, taint) is None
    real = placement.plan(s, card, "pod-a", "unhealthy", 100.0)
    assert real is not None and real.effect == "NoSchedule" and placement.escalated(s, real) is not None


def test_a_shadow_quarantine_is_served_and_said_by_the_server() -> None:
    records = quarantine.Records(quarantined=(quarantine.Quarantined("ab12", 10.0, 1000.0, ()),))
    [entry] = quarantine.server_entries(records, 20.0, refuse=False)
    assert entry["enforce"] is False and parse_entry(entry).enforce is False
    screen = Screen("i1", "model")
    screen.quarantine.replace([Entry("ab12", 4_000_000_000.0, 2, ("p1",), enforce=False),
                               Entry("cd34", 4_000_000_000.0, 2, ("p1",))])
    screen.check("ab12")  # served
    with pytest.raises(QuarantinedRequest):
        screen.check("cd34")
    assert screen.describe()["would_refuse"] == 1 and screen.describe()["refused"] == 1
    assert screen.describe()["entries"][0]["enforce"] is False


def test_a_sick_card_in_shadow_is_said_once_while_the_server_goes_on_serving() -> None:
    """A card's fault that serving does not clear: one report until a restart, not one per canary."""
    from gpu_watchdog.watchdog.core.samples import DeviceHealth, DeviceHealthSample

    trace = Trace(enforcing("shadow")).fold(ok(0.0))
    sick = DeviceHealthSample(at=1.0, read=True, devices=(DeviceHealth("inference", "nvidia.com/gpu", "GPU-1",
                                                                       "Unhealthy", "XID 79"),))
    [d] = trace.fold(sick).tick(1.0)
    assert d.reason == CONTEXT_LOSS and not d.enforced
    trace.fold(DecisionRecord(1.0, RESTART, CONTEXT_LOSS, WOULD),
               RestartEnded(1.0, CONTEXT_LOSS, False, False, True, lasting=policy.lasting(d)))
    for at in (2.0, 3.0, 4.0):
        assert trace.fold(ok(at)).tick(at) == []
    assert trace.history.would == {"restart:context_loss": 1}
    # A lost context the canary sees in another episode is no longer the card's: said once more.
    trace.fold(sick.__class__(at=5.0, read=True), fatal(5.0))
    [again] = trace.tick(5.0)
    assert again.reason == CONTEXT_LOSS and again.detail["evidence"] == "canary"


def test_the_summary_names_each_shadow_action_its_count_its_cost_and_what_held_others_back() -> None:
    from gpu_watchdog.watchdog.core.edges import WouldRefuseCounted
    from gpu_watchdog.watchdog.core.replay import Replay
    from gpu_watchdog.watchdog.core.report import Report, render

    lines = []
    for pod in ("llm-a", "llm-b"):
        trace = Trace(enforcing("shadow"), pod=pod)
        hung(trace, 0.0).tick(31.0)
        trace.fold(DecisionRecord(31.0, RESTART, HANG, WOULD), RestartEnded(31.0, HANG, False, False, True),
                   DecisionRecord(40.0, "empty_cache", MEMORY_PRESSURE, WOULD),
                   DecisionRecord(50.0, RESTART, CONTEXT_LOSS, "blocked_by_budget"),
                   WouldRefuseCounted(0, 3), WouldRefuseCounted(0, 1))  # a new process counts from 0 again
        trace.tick(51.0)
        lines += trace.lines
    replay = Replay(lambda recorded: from_mapping(dict(recorded)), report=Report())
    for line in lines:
        replay.feed(line)
    report = replay.summary_report()
    assert report["would"] == [{"action": "empty_cache", "reason": MEMORY_PRESSURE, "count": 2, "pods": 2},
                               {"action": RESTART, "reason": HANG, "count": 2, "pods": 2}]
    assert report["cost"]["restarts"] == 2 and report["cost"]["requests_refused"] == 8
    assert report["held_back"] == [{"action": RESTART, "reason": CONTEXT_LOSS, "by": "blocked_by_budget", "count": 2}]
    assert [(p["pod"], p["would"]) for p in report["pods"]] == [
        ("llm-a", {"empty_cache:memory_pressure": 1, "restart:hang": 1}),
        ("llm-b", {"empty_cache:memory_pressure": 1, "restart:hang": 1})]
    page = render(report)
    assert "restart      hang" in page and "2 restart(s), 8 request(s) refused" in page
