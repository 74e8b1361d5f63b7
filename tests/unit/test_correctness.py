"""Answers checked, on traces: how an answer is compared with the reference, how the fleet agrees one,
and the `corrupt` rule (consecutive deviations, never one, never without a reference; wrong again after
a restart on the same card: the card)."""

from __future__ import annotations

import dataclasses

import pytest

from gpu_watchdog.watchdog.core import correctness, escalation, placement
from gpu_watchdog.watchdog.core.correctness import Answer, Step, Submission
from gpu_watchdog.watchdog.core.names import CORRUPT, RUNG_CONTAINER, RUNG_POD
from gpu_watchdog.watchdog.core.samples import CanarySample, ProbeSample
from gpu_watchdog.watchdog.core.settings import CorrectnessSettings, EscalationSettings
from gpu_watchdog.watchdog.core.state import RestartBegun, RestartEnded
from gpu_watchdog.watchdog.edge.config import from_mapping
from tests.traces import Trace

C = CorrectnessSettings(enabled=True)
P1, P2 = correctness.probe_id("one"), correctness.probe_id("two")


def answer(probe: str, *steps: tuple[str, float, float | None]) -> Answer:
    return Answer(probe, tuple(Step(t, lp, m) for t, lp, m in steps))


GOOD = (answer(P1, ("5", -0.1, 4.0), ("6", -0.2, 3.0), ("7", -0.3, 0.5)),
        answer(P2, ("9", -0.05, 5.0), ("1", -0.4, 1.0)))
# Wrong from boot: the first token of P1 is another one, with a confident log-probability.
BAD = (answer(P1, ("8", -0.2, 3.0), ("6", -0.2, 3.0), ("7", -0.3, 0.5)), GOOD[1])


def vote(card: str, answers: tuple[Answer, ...] = GOOD, at: float = 0.0) -> Submission:
    return Submission(card, f"pod-{card}", at, answers)


# -- comparing one answer -----------------------------------------------------------------------------------

def test_the_same_answer_within_the_tolerance_matches() -> None:
    near = answer(P1, ("5", -0.3, 3.5), ("6", -0.5, 2.0), ("7", -0.1, 0.9))
    assert correctness.compare(C, GOOD[0], near).result == correctness.MATCH


def test_a_different_token_where_the_margin_was_wide_is_a_deviation_saying_what_differed() -> None:
    c = correctness.compare(C, GOOD[0], BAD[0])
    assert c.deviation and c.result == correctness.TOKEN
    assert dict(c.detail) == {"probe": P1, "step": 0, "expected": "5", "got": "8", "margin": 4.0}


def test_a_different_token_where_the_margin_was_narrow_is_not_and_nothing_after_it_is_compared() -> None:
    # Step 2's margin (0.5 nats) is below 2: a kernel differing in the last bits may flip it.
    flipped = answer(P1, ("5", -0.1, 4.0), ("6", -0.2, 3.0), ("3", -0.9, 0.1))
    assert correctness.compare(C, GOOD[0], flipped).result == correctness.MATCH
    narrow_first = answer(P1, ("5", -0.1, 1.0), ("6", -0.2, 3.0))
    other = answer(P1, ("4", -0.1, 1.0), ("1", -9.0, 3.0))
    assert correctness.compare(C, narrow_first, other).result == correctness.MATCH


def test_a_log_probability_off_by_more_than_the_tolerance_is_a_deviation() -> None:
    off = answer(P1, ("5", -0.1, 4.0), ("6", -0.9, 3.0))
    c = correctness.compare(C, GOOD[0], off)
    assert c.result == correctness.LOGPROB and c.detail["step"] == 1 and c.detail["tolerance"] == 0.5


def test_a_non_finite_value_is_a_deviation() -> None:
    nan = answer(P1, ("5", float("nan"), None))
    assert correctness.compare(C, GOOD[0], nan).result == correctness.NONFINITE


def test_greedy_text_alone_is_compared_where_the_server_gives_no_log_probabilities() -> None:
    ref = correctness.from_openai(P1, {"text": " Paris"})
    assert correctness.compare(C, ref, correctness.from_openai(P1, {"text": " Paris"})).result == correctness.MATCH
    assert correctness.compare(C, ref, correctness.from_openai(P1, {"text": " Lyon"})).result == correctness.TOKEN


def test_answers_as_servers_give_them() -> None:
    control = correctness.from_control(P1, {"tokens": [5, 6], "top": [[[5, -0.1], [2, -4.1]], [[6, -0.2], [1, -3.2]]]})
    assert control.steps == (Step("5", -0.1, pytest.approx(4.0)), Step("6", -0.2, pytest.approx(3.0)))
    openai = correctness.from_openai(P1, {"text": " a b", "logprobs": {
        "tokens": [" a", " b"], "token_logprobs": [-0.1, -0.2],
        "top_logprobs": [{" a": -0.1, " c": -3.1}, {" b": -0.2, " d": -0.3}]}})
    assert [(s.token, s.margin) for s in openai.steps] == [(" a", pytest.approx(3.0)), (" b", pytest.approx(0.1))]
    with pytest.raises(ValueError):
        correctness.from_control(P1, {"tokens": [5], "top": "garbage"})
    with pytest.raises(ValueError):
        correctness.from_openai(P1, {"index": 0})


# -- the fleet's agreement -------------------------------------------------------------------------------------

def test_a_card_wrong_from_its_first_answer_never_becomes_the_reference() -> None:
    records = correctness.Records()
    key = correctness.reference_key("m", "NVIDIA H100", "abc")
    # The bad card answers first, and alone: nothing is agreed.
    records, agreement = correctness.submit(C, records, key, vote("bad", BAD, 1.0), 1.0)
    assert agreement.reference is None and "1 card(s) answered, 2 needed" in agreement.why
    # A good card answers: one against one is no majority.
    records, agreement = correctness.submit(C, records, key, vote("good-1", GOOD, 2.0), 2.0)
    assert agreement.reference is None and "1 card(s) answered alike, 2 needed" in agreement.why
    # A second good card: two of three agree, and the reference is theirs.
    records, agreement = correctness.submit(C, records, key, vote("good-2", GOOD, 3.0), 3.0)
    assert agreement.reference is not None and agreement.reference.cards == ("good-1", "good-2")
    assert agreement.cards == 3 and agreement.agreeing == 2
    assert agreement.reference.answers == GOOD
    # Kept as agreed: bad cards answering later cannot vote it away.
    for i in range(4):
        records, agreement = correctness.submit(C, records, key, vote(f"bad-{i}", BAD, 4.0 + i), 4.0 + i)
    assert agreement.reference is not None and agreement.reference.answers == GOOD
    assert correctness.parse(correctness.dump(records)) == records


def test_no_majority_agrees_nothing() -> None:
    records = correctness.Records()
    other = (answer(P1, ("2", -0.1, 4.0)), GOOD[1])
    for card, answers in (("c", BAD), ("d", other), ("a", GOOD), ("b", GOOD)):
        records, agreement = correctness.submit(C, records, "k", vote(card, answers), 1.0)
    assert agreement.reference is None and "no majority" in agreement.why  # 2 of 4 is not more than half


def test_one_vote_per_card_however_many_pods_it_ran() -> None:
    key = "m|cpu|t"
    records = correctness.Records()
    for i in range(3):  # the same bad card, restarted three times
        records, agreement = correctness.submit(C, records, key, Submission("bad", f"pod-{i}", float(i), BAD), i)
    records, agreement = correctness.submit(C, records, key, vote("good-1"), 5.0)
    assert agreement.reference is None and agreement.cards == 2


def test_a_model_or_template_change_starts_a_new_reference() -> None:
    records = correctness.Records()
    old = correctness.reference_key("m", "cpu", "v1")
    for card in ("a", "b"):
        records, _ = correctness.submit(C, records, old, vote(card), 1.0)
    new = correctness.reference_key("m", "cpu", "v2")
    records, agreement = correctness.submit(C, records, new, vote("a", BAD), 2.0)
    assert agreement.reference is None
    assert records.entry(old) is not None and records.entry(old).reference is not None  # type: ignore[union-attr]


def test_records_that_are_not_ours_are_refused() -> None:
    with pytest.raises(correctness.RecordsError):
        correctness.parse('{"version": 7}')
    with pytest.raises(correctness.RecordsError):
        correctness.parse("not json")


# -- the rule ----------------------------------------------------------------------------------------------------

def settings_on() -> object:
    return from_mapping({"restart": {"strategy": "container"}, "policy": {"correctness": {"enabled": True}}})


def serving(trace: Trace, at: float = 1.0, instance: str = "p1") -> None:
    trace.fold(CanarySample(at, True, 0.01, None, instance_id=instance))


def probe(at: float, result: str, instance: str = "p1") -> ProbeSample:
    return ProbeSample(at, result, {"probe": P1, "step": 0, "expected": "5", "got": "8"}, instance)


def restarts(trace: Trace) -> list[tuple[float, str, str]]:
    return [(at, d.reason, d.rung) for at, d in trace.decided if d.action == "restart"]


def test_one_deviation_never_acts_and_a_match_ends_the_run() -> None:
    trace = Trace(settings_on())  # type: ignore[arg-type]
    serving(trace)
    trace.run([(10.0, probe(10.0, correctness.TOKEN)), (20.0, probe(20.0, correctness.MATCH)),
               (30.0, probe(30.0, correctness.LOGPROB)), (40.0, probe(40.0, correctness.MATCH))])
    assert restarts(trace) == []


def test_without_an_agreed_reference_nothing_acts_however_long() -> None:
    trace = Trace(settings_on())  # type: ignore[arg-type]
    serving(trace)
    trace.run([(10.0 * i, ProbeSample(10.0 * i, correctness.NO_REFERENCE, {"why": "no majority"}, "p1"))
               for i in range(1, 20)])
    trace.run([(300.0, probe(300.0, correctness.UNANSWERED)), (310.0, probe(310.0, correctness.UNANSWERED))])
    assert restarts(trace) == []


def test_consecutive_deviations_restart_the_process_then_the_card_when_it_comes_back_wrong() -> None:
    s = settings_on()
    trace = Trace(s)  # type: ignore[arg-type]
    serving(trace)
    # Probes not compared in between (no answer) neither break the run nor add to it.
    trace.run([(10.0, probe(10.0, correctness.TOKEN)), (15.0, probe(15.0, correctness.UNANSWERED)),
               (20.0, probe(20.0, correctness.NONFINITE))])
    [(at, reason, rung)] = restarts(trace)
    assert (at, reason, rung) == (20.0, CORRUPT, RUNG_CONTAINER)
    [(_, d)] = trace.decided
    assert d.drain and d.detail["deviations"] == ["token", "nonfinite"] and "after_restart" not in d.detail
    assert placement.card_evidence(d.reason, d.detail) is None  # the process first, not the card
    trace.fold(RestartBegun(21.0), RestartEnded(22.0, CORRUPT, True, keep_unready=False, rung=RUNG_CONTAINER))
    # The new process on the same card: wrong again.
    serving(trace, 30.0, "p2")
    trace.run([(40.0, probe(40.0, correctness.TOKEN, "p2")), (50.0, probe(50.0, correctness.TOKEN, "p2"))])
    assert restarts(trace)[1:] == [(50.0, CORRUPT, RUNG_POD)]
    d = trace.decided[-1][1]
    assert d.detail["after_restart"] == 1
    assert "again after a restart" in (placement.card_evidence(d.reason, d.detail) or "")


def test_the_rule_is_off_unless_enabled() -> None:
    trace = Trace(from_mapping({"restart": {"strategy": "none"}}))
    serving(trace)
    trace.run([(10.0 * i, probe(10.0 * i, correctness.TOKEN)) for i in range(1, 5)])
    assert restarts(trace) == []


def test_restarts_for_corruption_that_did_not_cure_make_the_card_suspect() -> None:
    rs = [escalation.RestartRecord(100.0 * i, CORRUPT, ("GPU-1",), f"pod-{i}") for i in range(2)]
    [suspect] = escalation.suspects(EscalationSettings(), rs, 300.0, ("GPU-1",))
    assert suspect.uuid == "GPU-1" and suspect.reasons == [CORRUPT]
    # Not the query of death's: a corrupt answer is no request's fault.
    assert CORRUPT not in escalation.CURING_REASONS


def test_settings_never_allow_acting_on_one_deviation_or_one_card() -> None:
    from gpu_watchdog.watchdog.edge.config import ConfigError

    with pytest.raises(ConfigError) as err:
        from_mapping({"restart": {"strategy": "none"}, "policy": {"correctness": {"consecutive": 1, "quorum": 1}}})
    assert "policy.correctness.consecutive" in str(err.value) and "policy.correctness.quorum" in str(err.value)
    assert dataclasses.replace(C, consecutive=3).consecutive == 3


# -- the agent: the app's own answer -------------------------------------------------------------------------

async def test_the_agent_answers_a_probe_with_the_apps_own_function_and_compares_like_any_other() -> None:
    from gpu_watchdog.contract import CanaryProbe
    from gpu_watchdog.inference.agent import Agent, AgentSettings

    agent = Agent(AgentSettings())
    probe = CanaryProbe("one", 2, 2)
    refused = await agent.canary(5.0, probe)
    assert not refused.ok and "register_probe" in (refused.error or "")

    @agent.register_probe
    def answer(prompt: str, n: int, k: int) -> dict[str, object]:
        return {"tokens": [" a", " b"][:n], "top": [[[" a", -0.1], [" c", -3.0]], [[" b", -0.2], [" d", -2.9]]][:n]}

    result = await agent.canary(5.0, probe)
    assert result.ok and result.answer is not None
    got = correctness.from_control(P1, result.answer)
    assert correctness.compare(C, got, got).result == correctness.MATCH
    # Tokens alone (an app without log-probabilities): the greedy tokens are compared.
    alone = correctness.from_control(P1, {"tokens": [" a", " x"]})
    assert correctness.compare(C, alone, correctness.from_control(P1, {"tokens": [" a", " y"]})).result == \
        correctness.TOKEN
    # The plain canary is unchanged.
    assert not (await agent.canary(5.0)).ok
