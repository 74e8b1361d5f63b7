"""The restart procedure on traces: which step comes next, for the watched target and for another
worker, from what the steps before answered and what the history (built by folding) says. A hang's
restart takes the process's stacks first (`STACKS`)."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import pytest

from gpu_watchdog.watchdog.core import procedure
from gpu_watchdog.watchdog.core.names import (
    CONTEXT_LOSS,
    FLEET_UNAVAILABLE_LIMIT,
    FRAGMENTATION_DRIFT,
    HANG,
    RUNG_CONTAINER,
    RUNG_POD,
    RUNG_WORKER,
)
from gpu_watchdog.watchdog.core.policy import Decision
from gpu_watchdog.watchdog.core.procedure import (
    BLOCKED,
    EVIDENCE,
    EXIT,
    EXIT_FAILED,
    EXIT_TRIES,
    EXITED,
    FALL_BACK,
    HELD,
    KEEP_OUT,
    NOT_NEEDED,
    READ_BUDGET,
    RECOUNT,
    REPORTED,
    RESTART,
    SLOT_WAIT,
    STACKS,
    SWAP_SLOT,
    TAKE_SLOT,
    Facts,
    Procedure,
    Step,
)
from gpu_watchdog.watchdog.core.samples import CanarySample, WorkerCanaries, WorkerUntold
from gpu_watchdog.watchdog.core.settings import Settings
from gpu_watchdog.watchdog.core.state import RestartBegun, RestartCancelled, WorkloadRestarts
from gpu_watchdog.watchdog.core.timing import SLOT_WAIT_S
from tests.traces import Trace

S = Settings()
Answer = Callable[[Trace, Step], dict[str, Any]]


def target(reason: str = HANG, rung: str = RUNG_POD) -> Decision:
    return Decision("restart", reason, {"evidence": "canary"}, rung=rung, instance_id="p1")


def worker(k: int = 1, instance: str = "w1") -> Decision:
    return Decision("restart", HANG, {"worker": k, "evidence": "worker_canary"}, drain=False, instance_id=instance,
                    rung=RUNG_WORKER)


def walk(trace: Trace, p: Procedure, facts: Facts, answers: dict[str, Answer] | None = None
         ) -> tuple[list[str], Procedure, list[Step]]:
    """The procedure to its end, each step answered by `answers` (default: granted, left, nothing read)."""
    kinds: list[str] = []
    steps: list[Step] = []
    while (step := procedure.next_step(S.policy, trace.history, p, facts)) is not None:
        kinds.append(step.kind)
        steps.append(step)
        answer = (answers or {}).get(step.kind)
        kw = answer(trace, step) if answer is not None else (
            {"exit": procedure.LEFT} if step.kind == EXIT else {})
        p = procedure.advance(p, step, **kw)
        assert len(kinds) < 20, kinds
    return kinds, p, steps


def read_budget(at: float, restarts: tuple[Any, ...] | None = ()) -> Answer:
    def answer(trace: Trace, step: Step) -> dict[str, Any]:
        trace.fold(WorkloadRestarts(at, 1_800_000_000.0 + at, restarts, 4))
        return {}
    return answer


def untold(at: float, error: str = "timed out") -> Answer:
    def answer(trace: Trace, step: Step) -> dict[str, Any]:
        trace.fold(WorkerUntold(at, int(step.decision.detail["worker"]), step.decision.instance_id, error))
        return {"exit": procedure.UNTOLD, "exit_detail": error}
    return answer


def test_the_target_s_pod_restart_records_its_evidence_reads_the_budget_takes_a_slot_and_keeps_the_card_out() -> None:
    trace = Trace(S, budget_from_events=True)
    p = procedure.begin(S.policy, trace.history, 0, target(), 40.0, from_events=True)
    kinds, p, steps = walk(trace, p, Facts(now=40.0, strategy="evict", keep_out=True),
                           {EVIDENCE: lambda t, s: {"inflight": ("fp-a", "fp-b")}, READ_BUDGET: read_budget(40.0)})
    assert kinds == [STACKS, EVIDENCE, READ_BUDGET, TAKE_SLOT, KEEP_OUT, RESTART]
    # What was in flight goes with the restart (its Event names it).
    assert steps[-1].decision.detail["inflight"] == ["fp-a", "fp-b"]
    # In place, the card is not the evidence's: nothing kept out.
    trace = Trace(S, budget_from_events=True)
    p = procedure.begin(S.policy, trace.history, 0, target(rung=RUNG_CONTAINER), 40.0, from_events=True)
    kinds, _, _ = walk(trace, p, Facts(now=40.0, strategy="container", keep_out=True),
                       {READ_BUDGET: read_budget(40.0)})
    assert kinds == [STACKS, EVIDENCE, READ_BUDGET, TAKE_SLOT, RESTART]


def test_evidence_is_recorded_even_where_the_budget_then_blocks_the_restart() -> None:
    trace = Trace(S, budget_from_events=True)
    p = procedure.begin(S.policy, trace.history, 0, target(), 40.0, from_events=True)
    kinds, p, steps = walk(trace, p, Facts(now=40.0, strategy="evict"), {READ_BUDGET: read_budget(40.0, None)})
    assert kinds == [STACKS, EVIDENCE, READ_BUDGET, BLOCKED]
    assert steps[-1].decision.blocked_by == "restart_budget_unknown" and not steps[-1].decision.allowed


def test_a_held_restart_does_nothing_more_and_one_asked_again_reads_the_budget_only_when_stale() -> None:
    trace = Trace(S, budget_from_events=True).fold(WorkloadRestarts(30.0, 1_800_000_030.0, (), 4))
    facts = Facts(now=35.0, strategy="evict", keep_out=True)
    p = procedure.begin(S.policy, trace.history, 0, target(), 35.0, from_events=True, asked_again=True)
    kinds, p, _ = walk(trace, p, facts, {TAKE_SLOT: lambda t, s: {"held": FLEET_UNAVAILABLE_LIMIT}})
    assert kinds == [STACKS, EVIDENCE, TAKE_SLOT, HELD] and p.held == FLEET_UNAVAILABLE_LIMIT
    p = procedure.begin(S.policy, trace.history, 0, target(), 45.0, from_events=True, asked_again=True)
    kinds, _, _ = walk(trace, p, Facts(now=45.0, strategy="evict"), {READ_BUDGET: read_budget(45.0)})
    assert kinds[:4] == [STACKS, EVIDENCE, READ_BUDGET, TAKE_SLOT]


def test_a_reason_no_request_causes_records_no_evidence() -> None:
    trace = Trace(S)
    p = procedure.begin(S.policy, trace.history, 0, target(FRAGMENTATION_DRIFT), 40.0, from_events=False)
    kinds, _, _ = walk(trace, p, Facts(now=40.0, strategy="evict"))
    assert kinds == [TAKE_SLOT, RESTART]


def test_another_worker_is_told_to_exit_after_its_evidence_and_slot() -> None:
    trace = Trace(S, worker_count=2)
    p = procedure.begin(S.policy, trace.history, 1, worker(), 40.0, from_events=False)
    kinds, _, _ = walk(trace, p, Facts(now=40.0, strategy="container"))
    assert kinds == [STACKS, EVIDENCE, TAKE_SLOT, EXIT, EXITED]
    p = procedure.begin(S.policy, trace.history, 1, worker(), 40.0, from_events=False)
    kinds, _, _ = walk(trace, p, Facts(now=40.0, strategy="none"))
    assert kinds == [STACKS, EVIDENCE, REPORTED]  # reported only: neither slot nor exit
    for refused in (procedure.REFUSED, procedure.NOT_RECORDED):
        p = procedure.begin(S.policy, trace.history, 1, worker(), 40.0, from_events=False)
        kinds, p, _ = walk(trace, p, Facts(now=40.0, strategy="container"),
                           {EXIT: lambda t, s, r=refused: {"exit": r, "exit_detail": "no"}})
        assert kinds == [STACKS, EVIDENCE, TAKE_SLOT, EXIT, EXIT_FAILED] and p.exit == refused


def test_a_worker_that_cannot_be_told_twice_running_falls_back_to_the_container() -> None:
    trace = Trace(S, worker_count=2)
    facts = Facts(now=40.0, strategy="container", slot_held=True)
    p = procedure.begin(S.policy, trace.history, 1, worker(), 40.0, from_events=False)
    kinds, _, _ = walk(trace, p, facts, {EXIT: untold(40.0)})
    assert kinds == [STACKS, EVIDENCE, TAKE_SLOT, EXIT, EXIT_FAILED]  # once: tried again after its backoff
    assert trace.history.untold[1].tries == 1
    p = procedure.begin(S.policy, trace.history, 1, worker(), 80.0, from_events=False)
    kinds, p, steps = walk(trace, p, facts, {EXIT: untold(80.0)})
    assert trace.history.untold[1].tries == EXIT_TRIES
    assert kinds == [STACKS, EVIDENCE, TAKE_SLOT, EXIT, FALL_BACK, RESTART]
    act = steps[-1].decision
    assert (act.rung, act.drain, act.detail["exit_tries"], act.detail["exit_error"]) == (
        RUNG_CONTAINER, True, EXIT_TRIES, "timed out")


def test_a_worker_s_fallback_to_the_pod_swaps_its_slot_for_the_pod_s_and_keeps_the_card_out() -> None:
    trace = Trace(S, worker_count=2).fold(WorkerUntold(30.0, 1, "w1", "timed out"))
    p = procedure.begin(S.policy, trace.history, 1, worker(), 40.0, from_events=False)
    kinds, _, steps = walk(trace, p, Facts(now=40.0, strategy="evict", slot_held=True, keep_out=True),
                           {EXIT: untold(40.0)})
    assert kinds == [STACKS, EVIDENCE, TAKE_SLOT, EXIT, FALL_BACK, SWAP_SLOT, TAKE_SLOT, KEEP_OUT, RECOUNT, RESTART]
    # The second slot is the pod's: under evict, the container's rung replaces the pod.
    assert steps[5].decision.rung == RUNG_CONTAINER and procedure.slot_rung(steps[5].decision, "evict") == RUNG_POD
    # The pod's slot refused: held, nothing restarted.
    trace = Trace(S, worker_count=2).fold(WorkerUntold(30.0, 1, "w1", "timed out"))
    p = procedure.begin(S.policy, trace.history, 1, worker(), 40.0, from_events=False)
    answers: dict[str, Answer] = {EXIT: untold(40.0)}
    slots: list[Step] = []

    def second_refused(t: Trace, step: Step) -> dict[str, Any]:
        slots.append(step)
        return {"held": FLEET_UNAVAILABLE_LIMIT if len(slots) == 2 else None}

    kinds, _, _ = walk(trace, p, Facts(now=40.0, strategy="evict", slot_held=True),
                       {**answers, TAKE_SLOT: second_refused})
    assert kinds == [STACKS, EVIDENCE, TAKE_SLOT, EXIT, FALL_BACK, SWAP_SLOT, TAKE_SLOT, HELD]
    # Another worker's in-place restart holds the slot: it is not given back from under it.
    trace = Trace(S, worker_count=2).fold(WorkerUntold(30.0, 1, "w1", "timed out"))
    p = procedure.begin(S.policy, trace.history, 1, worker(), 40.0, from_events=False)
    kinds, _, _ = walk(trace, p, Facts(now=40.0, strategy="evict", slot_held=True, in_place=True), answers)
    assert SWAP_SLOT not in kinds and kinds[-1] == RESTART


def test_a_process_told_in_vain_before_is_not_told_again_and_one_that_served_since_is() -> None:
    trace = Trace(S, worker_count=2).fold(WorkerUntold(30.0, 1, "w1", "timed out"),
                                          WorkerUntold(70.0, 1, "w1", "timed out"))
    p = procedure.begin(S.policy, trace.history, 1, worker(), 100.0, from_events=False)
    assert p.untold is not None and p.decision.rung == RUNG_CONTAINER
    kinds, _, steps = walk(trace, p, Facts(now=100.0, strategy="container", slot_held=True))
    assert kinds == [STACKS, EVIDENCE, TAKE_SLOT, FALL_BACK, RESTART]
    assert steps[1].decision.rung == RUNG_CONTAINER  # its slot is the container's
    # Another process of that worker (or the same one, once it served) is told anew.
    p = procedure.begin(S.policy, trace.history, 1, worker(instance="w2"), 100.0, from_events=False)
    assert p.untold is None
    trace.fold(WorkerCanaries(90.0, ((1, CanarySample(90.0, True, 0.01, None, instance_id="w1")),)))
    p = procedure.begin(S.policy, trace.history, 1, worker(), 100.0, from_events=False)
    assert p.untold is None and 1 not in trace.history.untold
    kinds, _, _ = walk(trace, p, Facts(now=100.0, strategy="container"))
    assert kinds == [STACKS, EVIDENCE, TAKE_SLOT, EXIT, EXITED]


def test_a_worker_s_spent_budget_blocks_after_its_evidence() -> None:
    trace = Trace(S, worker_count=2, budget_from_events=True)
    p = procedure.begin(S.policy, trace.history, 1, worker(), 40.0, from_events=True)
    kinds, _, steps = walk(trace, p, Facts(now=40.0, strategy="container"), {READ_BUDGET: read_budget(40.0, None)})
    assert kinds == [STACKS, EVIDENCE, READ_BUDGET, BLOCKED]
    assert steps[-1].decision.blocked_by == "restart_budget_unknown"


def test_an_exit_answer_the_procedure_does_not_know_is_refused() -> None:
    trace = Trace(S, worker_count=2)
    p = procedure.begin(S.policy, trace.history, 1, worker(), 40.0, from_events=False)
    with pytest.raises(ValueError, match="exit answers one of"):
        procedure.advance(p, Step(EXIT, p.decision), exit="maybe")


def test_a_hang_s_stacks_are_taken_once_for_its_process_and_its_event_says_where_they_are() -> None:
    from gpu_watchdog.watchdog.core import edges

    trace = Trace(S)
    p = procedure.begin(S.policy, trace.history, 0, target(), 40.0, from_events=False)
    said = {"stuck": "engine.py:10 in step (model)", "stacks": "the flight recording"}
    kinds, _, steps = walk(trace, p, Facts(now=40.0, strategy="evict"), {STACKS: lambda t, s: {"stacks": said}})
    assert kinds == [STACKS, EVIDENCE, TAKE_SLOT, RESTART] and steps[-1].decision.detail["stuck"] == said["stuck"]
    # Taken (the edge folds them): a restart asked again (held) neither takes them again nor loses them.
    trace.fold(edges.StacksTaken(edges.Stacks(0, "p1", HANG, 40.0, "control", said["stuck"], None,
                                              (("model", ("engine.py:10 in step",)),))))
    p = procedure.begin(S.policy, trace.history, 0, target(), 45.0, from_events=False, asked_again=True)
    kinds, _, steps = walk(trace, p, Facts(now=45.0, strategy="evict"))
    assert kinds == [EVIDENCE, TAKE_SLOT, RESTART] and steps[-1].decision.detail["stuck"] == said["stuck"]


def test_the_pod_is_replaced_once_its_slot_is_slot_wait_s_old_and_never_waits_in_place() -> None:
    """The replacement must be created after our slot by either clock: the act waits, as a step of its own."""
    trace = Trace(S)
    p = procedure.begin(S.policy, trace.history, 0, target(), 40.0, from_events=False)
    while (step := procedure.next_step(S.policy, trace.history, p, Facts(now=40.0, strategy="evict"))) is not None \
            and step.kind != TAKE_SLOT:
        p = procedure.advance(p, step)
    assert step is not None
    p = procedure.advance(p, step)  # granted at 40.0
    held = Facts(now=41.0, strategy="evict", slot_held=True, slot_taken_at=40.0)
    step = procedure.next_step(S.policy, trace.history, p, held)
    assert step is not None and step.kind == SLOT_WAIT
    assert procedure.slot_wait_left(step.decision, held) == pytest.approx(SLOT_WAIT_S - 1.0)
    later = Facts(now=40.0 + SLOT_WAIT_S, strategy="evict", slot_held=True, slot_taken_at=40.0)
    step = procedure.next_step(S.policy, trace.history, p, later)
    assert step is not None and step.kind == RECOUNT  # the workload counted again right before the act
    counted = procedure.advance(p, step)
    step = procedure.next_step(S.policy, trace.history, counted, later)
    assert step is not None and step.kind == RESTART
    # Too many out since the slot was granted (a drain, a scale-down): held, nothing restarted.
    recounted = procedure.advance(p, procedure.Step(RECOUNT, p.decision), held=FLEET_UNAVAILABLE_LIMIT)
    step = procedure.next_step(S.policy, trace.history, recounted, later)
    assert step is not None and step.kind == HELD
    assert procedure.next_step(S.policy, trace.history, procedure.advance(recounted, step), later) is None
    # A restart in place, or one under no slot, replaces no pod: nothing to wait for.
    for facts in (Facts(now=41.0, strategy="container", slot_held=True, slot_taken_at=40.0),
                  Facts(now=41.0, strategy="evict", slot_held=False, slot_taken_at=40.0)):
        step = procedure.next_step(S.policy, trace.history, p, facts)
        assert step is not None and step.kind == RESTART, facts


def _to_slot_wait(trace: Trace, p: Procedure, at: float) -> Procedure:
    """`p` walked through its slot (granted at `at`) to the slot's wait."""
    facts = Facts(now=at, strategy="delete", slot_held=True, slot_taken_at=at)
    while (step := procedure.next_step(S.policy, trace.history, p, facts)) is not None and step.kind != SLOT_WAIT:
        p = procedure.advance(p, step)
    assert step is not None and step.kind == SLOT_WAIT
    return p


@pytest.mark.parametrize(("ours", "theirs", "went_away", "rung", "expected"), [
    ("p1", "p2", False, RUNG_CONTAINER, NOT_NEEDED),  # another process served: the cure came by itself
    ("p1", "p1", True, RUNG_CONTAINER, RECOUNT),  # the poisoned process still answers: the act goes on
    (None, None, True, RUNG_CONTAINER, NOT_NEEDED),  # no names: the port refused, then it served
    (None, None, False, RUNG_CONTAINER, RECOUNT),  # no names and never away: maybe the same process
    ("p1", "p2", True, RUNG_POD, RECOUNT),  # the card needs more than a new process
], ids=["new-instance", "same-instance", "unnamed-after-away", "unnamed-never-away", "pod-rung"])
def test_a_restart_whose_target_came_back_as_a_new_process_before_the_act_is_not_needed(
        ours: str | None, theirs: str | None, went_away: bool, rung: str, expected: str) -> None:
    """Strategy delete, context loss: the server left on its poisoned context and its container came
    back in place while the pod's restart waited for its slot. Deleting the pod then would replace a
    pod whose new process serves: the restart ends there (`NOT_NEEDED`) and the evidence of the process
    that left is no longer read (the next decision is about the new one)."""
    trace = Trace(S)
    trace.run([(10.0, CanarySample(10.0, False, 0.1, "fatal_cuda", "CUDA error: an illegal memory access",
                                   instance_id=ours))])
    (decided,) = [d for _, d in trace.decided]
    assert decided.reason == CONTEXT_LOSS and decided.rung == RUNG_CONTAINER
    decided = dataclasses.replace(decided, rung=rung)
    p = _to_slot_wait(trace, procedure.begin(S.policy, trace.history, 0, decided, 10.0, from_events=False), 10.5)
    if went_away:
        trace.fold(CanarySample(11.0, False, 0.01, "unreachable", "connection refused"))
    trace.fold(CanarySample(12.5, True, 0.05, None, instance_id=theirs))
    later = Facts(now=10.5 + SLOT_WAIT_S, strategy="delete", slot_held=True, slot_taken_at=10.5)
    step = procedure.next_step(S.policy, trace.history, p, later)
    assert step is not None and step.kind == expected
    if expected == NOT_NEEDED:
        served = procedure.served_anew(trace.history, step.decision, p.begun_at)
        assert served is not None and served.at == 12.5
        assert procedure.next_step(S.policy, trace.history, procedure.advance(p, step), later) is None
        trace.fold(RestartBegun(10.0), RestartCancelled(later.now, renewed_at=served.started_at))
        assert not trace.history.restart_in_progress and trace.tick(later.now + 1) == []


def test_a_canary_answered_before_the_restart_was_decided_says_nothing_of_a_new_process() -> None:
    trace = Trace(S)
    trace.fold(CanarySample(5.0, False, 0.01, "unreachable", "connection refused"),
               CanarySample(6.0, True, 0.05, None, instance_id="p2"))
    decided = Decision("restart", CONTEXT_LOSS, {"evidence": "canary"}, drain=False, instance_id="p1",
                       rung=RUNG_CONTAINER)
    assert procedure.served_anew(trace.history, decided, since=10.0) is None


@pytest.mark.parametrize(("rung", "strategy", "unready"), [
    (RUNG_POD, "evict", True), (RUNG_POD, "delete", True), (RUNG_POD, "container", True),
    (RUNG_CONTAINER, "container", False), (RUNG_POD, "none", False), (RUNG_WORKER, "evict", False)])
def test_only_a_pod_going_away_keeps_its_sidecar_unready(rung: str, strategy: str, unready: bool) -> None:
    assert procedure.keeps_unready(rung, strategy) is unready


def test_a_card_that_poisons_every_new_process_gets_the_pods_rung_after_the_in_place_bound() -> None:
    """Each new process serves a moment and is poisoned again: the container came back in place each
    time (not needed, nothing of ours restarted), which counts toward `in_place.max_restarts` as a cure
    that did not last. Past it the decision's rung is the pod's, which a new process never cancels:
    never a pod left on a card that poisons every process, waiting for a restart that is always
    cancelled."""
    trace = Trace(S)
    rungs: list[str] = []
    t = 10.0
    for n in range(S.policy.in_place.max_restarts + 1):
        trace.run([(t, CanarySample(t, False, 0.1, "fatal_cuda", "CUDA error: an illegal memory access",
                                    instance_id=f"p{n}"))])
        decided = trace.decided[-1][1]
        rungs.append(decided.rung)
        trace.fold(RestartBegun(t))
        p = _to_slot_wait(trace, procedure.begin(S.policy, trace.history, 0, decided, t, from_events=False), t)
        trace.fold(CanarySample(t + 2, True, 0.05, None, instance_id=f"p{n + 1}"))
        later = Facts(now=t + SLOT_WAIT_S, strategy="delete", slot_held=True, slot_taken_at=t)
        step = procedure.next_step(S.policy, trace.history, p, later)
        assert step is not None
        if step.kind == RECOUNT:  # the act goes on
            break
        assert step.kind == NOT_NEEDED
        served = procedure.served_anew(trace.history, step.decision, p.begun_at)
        assert served is not None
        trace.fold(RestartCancelled(later.now, renewed_at=served.started_at, reason=decided.reason))
        t += 60.0
    assert rungs == [RUNG_CONTAINER] * S.policy.in_place.max_restarts + [RUNG_POD]
    assert step.kind == RECOUNT
