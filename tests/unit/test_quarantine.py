"""The query-of-death rule on traces: the culprit quarantined, bystanders never."""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest

from gpu_watchdog.watchdog.core.quarantine import (
    ANNOTATION_BUDGET,
    FAILURES_KEPT,
    INFLIGHT_KEPT,
    LIFTS_KEPT,
    MAX_TIED,
    MAX_TOGETHER,
    Failure,
    Quarantined,
    Records,
    RecordsError,
    active,
    clear,
    cleared_in,
    decide,
    describe,
    dump,
    failure_from,
    held_against,
    lift,
    lift_records,
    lost,
    parse,
    record,
    server_entries,
    suspects,
)
from gpu_watchdog.watchdog.core.timing import FUTURE_S
from gpu_watchdog.watchdog.edge.config import QuarantineSettings

# The rules as decided, in force at once: the wait for the replicas' word is tested on its own below.
S = QuarantineSettings(confirm=0.0)


def failure(at: float, pod: str, inflight: tuple[str, ...], newest: str | None = None,
            completed: tuple[str, ...] = (), process: str = "p1") -> Failure:
    return Failure(at, pod, process, "context_loss", inflight, newest, completed)


def test_the_request_that_killed_two_pods_is_quarantined_for_its_ttl() -> None:
    fs = [failure(100, "a", ("qod", "x1"), newest="qod"), failure(130, "b", ("qod", "y1"), newest="qod")]
    [q] = decide(S, fs, [], 131.0)
    assert q.fingerprint == "qod" and q.until == 131.0 + S.ttl and q.pods == ["a", "b"]
    assert q.active(131.0) and not q.active(131.0 + S.ttl)


def test_one_failure_or_one_process_twice_is_not_enough() -> None:
    assert decide(S, [failure(100, "a", ("qod",), "qod")], [], 101.0) == []
    same = [failure(100, "a", ("qod",), "qod"), failure(110, "a", ("qod",), "qod")]
    assert decide(S, same, [], 111.0) == []
    again = [failure(100, "a", ("qod",), "qod"), failure(110, "a", ("qod",), "qod", process="p2")]
    assert [q.fingerprint for q in decide(S, again, [], 111.0)] == ["qod"]  # restarted in place, killed again


def test_a_bystander_in_flight_at_both_failures_waits_with_the_culprit_for_the_failure_that_tells_them_apart() -> None:
    # A long request retried by its client was in flight at both failures too: being the newest
    # arrival counts for nothing, so at two failures neither is taken...
    fs = [failure(100, "a", ("long", "qod"), newest="qod"), failure(130, "b", ("long", "qod"), newest="qod")]
    assert suspects(S, fs, 131.0) == []
    # ...and the third, which the bystander is not at, takes the culprit alone.
    fs.append(failure(160, "c", ("qod", "other"), newest="other"))
    assert [fp for fp, _ in suspects(S, fs, 161.0)] == ["qod"]


def test_a_bystander_in_flight_at_one_failure_only_is_never_quarantined() -> None:
    fs = [failure(100, "a", ("qod", "innocent"), newest="qod"), failure(130, "b", ("qod",), newest="qod")]
    assert [q.fingerprint for q in decide(S, fs, [], 131.0)] == ["qod"]


def test_a_fingerprint_that_completed_somewhere_is_no_culprit() -> None:
    fs = [failure(100, "a", ("qod", "retried"), newest="retried"),
          failure(130, "b", ("qod", "retried"), newest="qod", completed=("retried",))]
    assert [q.fingerprint for q in decide(S, fs, [], 131.0)] == ["qod"]


def test_failures_outside_the_window_are_not_evidence() -> None:
    fs = [failure(100, "a", ("qod",), "qod"), failure(100 + S.window + 1, "b", ("qod",), "qod")]
    assert decide(S, fs, [], 100 + S.window + 2) == []


def test_a_killer_with_decoys_of_its_own_is_refused_with_them_at_the_third_failure() -> None:
    """Eight long decoys in flight beside the killer at every failure, a fresh one-off sent after it
    as the newest each time: they tie, one failure more is waited for, then all that tie are taken."""
    decoys = tuple(f"decoy{i}" for i in range(8))
    fs = [failure(100 + 30 * n, pod, ("qod", *decoys, f"one-off-{n}"), newest=f"one-off-{n}")
          for n, pod in enumerate("ab")]
    assert decide(S, fs, [], 131.0) == []
    fs.append(failure(160, "c", ("qod", *decoys, "one-off-2"), newest="one-off-2"))
    assert sorted(q.fingerprint for q in decide(S, fs, [], 161.0)) == sorted(("qod", *decoys))


def test_more_alike_than_max_tied_are_none_of_them_taken() -> None:
    """Retried requests that each met three failures, but not the same three (every replica failing
    at once, their clients retrying them): more than MAX_TIED is no one request's doing."""
    many = [f"fp{i}" for i in range(MAX_TIED + 1)]
    # Each at three of four failures, each missing from another one.
    fs = [failure(100 + 30 * n, pod, tuple(fp for i, fp in enumerate(many) if i % 4 != n))
          for n, pod in enumerate("abcd")]
    assert decide(S, fs, [], 201.0) == []
    # Bystanders come and go: the next failure has the culprit alone of them.
    fs.append(failure(210, "e", ("fp7", "new-bystander")))
    assert [q.fingerprint for q in decide(S, fs, [], 211.0)] == ["fp7"]


def test_a_killer_with_decoys_up_to_the_admission_limit_is_taken_with_them() -> None:
    """Its client sends the killer with 61 decoys of its own each time (the bundled server's admission
    limit on a CPU: 64 in one step, with a one-off and a request answered elsewhere): all were in flight
    together at the very same failures, and are taken together once they tie at one failure more than
    needed; more than MAX_TOGETHER are not."""
    group = (*(f"decoy{i}" for i in range(61)), "qod")
    fs = [failure(100 + 30 * n, pod, (*group, "answered", f"one-off{n}")) for n, pod in enumerate("abc")]
    assert decide(S, fs[:2], [], 131.0) == []
    taken = decide(S, fs, [], 161.0, cleared=["answered"])
    assert sorted(q.fingerprint for q in taken) == sorted(group)
    records, _ = record(S, Records(tuple(fs[:2])), fs[2], 161.0)
    assert len(dump(records)) <= ANNOTATION_BUDGET
    too_many = tuple(f"decoy{i}" for i in range(MAX_TOGETHER + 1))
    assert decide(S, [failure(100 + 30 * n, pod, too_many) for n, pod in enumerate("abc")], [], 161.0) == []
    # A client that varies its decoys (each missing from one try) leaves the killer alone at the most.
    apart = [failure(100 + 30 * n, pod, tuple(fp for i, fp in enumerate(group) if fp == "qod" or i % 3 != n))
             for n, pod in enumerate("abc")]
    assert [q.fingerprint for q in decide(S, apart, [], 161.0)] == ["qod"]


def test_a_group_of_the_largest_size_fits_the_annotations_budget() -> None:
    group = tuple(f"{i:016x}" for i in range(MAX_TOGETHER))
    records = Records()
    for n, pod in enumerate("abc"):
        failed = Failure(100.0 + 30 * n, f"model-6f7c9d8b5-{pod}xk2p", f"{n:032x}", "context_loss", group,
                         group[-1], (), tuple(f"{i:016x}"[::-1] for i in range(MAX_TOGETHER)))
        records, new = record(S, records, failed, 100.0 + 30 * n)
    assert len(new) == MAX_TOGETHER and len(dump(records)) <= ANNOTATION_BUDGET


def test_a_popular_request_sent_right_after_the_killer_is_never_framed() -> None:
    """The newest arrival before each fault is the popular request the killer's client sends after
    it. At two failures nothing is taken; by the third, a replica that answered the popular request
    cleared it, and the killer is taken alone."""
    fs = [failure(100 + 30 * n, pod, ("qod", "popular"), newest="popular") for n, pod in enumerate("abc")]
    assert decide(S, fs[:2], [], 131.0) == []
    records = Records(tuple(fs[:2]))
    records, removed = clear(S, records, ["popular", "unrelated"], "d", 140.0)
    assert removed == [] and [(c.fingerprint, c.pod) for c in records.cleared] == [("popular", "d")]
    records, new = record(S, records, fs[2], 161.0)
    assert [q.fingerprint for q in new] == ["qod"]
    # Not cleared, the two tie and both are taken at the third failure: cleared afterwards (answered
    # by a replica that had not the list yet), its entry is removed.
    both, _ = record(S, Records(tuple(fs[:2])), fs[2], 161.0)
    assert sorted(q.fingerprint for q in active(both, 161.0)) == ["popular", "qod"]
    after, removed = clear(S, both, ["popular"], "d", 170.0)
    assert [q.fingerprint for q in removed] == ["popular"]
    assert [q.fingerprint for q in active(after, 170.0)] == ["qod"]
    assert parse(dump(after)) == after
    # A clear is for the window: a later failure of the popular request alone cannot count against it.
    assert "popular" not in held_against(S, after, 171.0)


def test_a_failure_dated_a_little_ahead_by_another_clock_still_counts() -> None:
    fs = [failure(100, "a", ("qod",), "qod"), failure(131.5, "b", ("qod",), "qod")]
    assert [q.fingerprint for q in decide(S, fs, [], 130.0)] == ["qod"]


def test_a_lift_holds_until_a_new_failure_and_nothing_happens_when_off() -> None:
    fs = [failure(100, "a", ("qod",), "qod"), failure(130, "b", ("qod",), "qod")]
    current = decide(S, fs, [], 131.0)
    lifted = lift(current, "qod", 140.0)
    assert not lifted[0].active(141.0)
    assert decide(S, fs, lifted, 150.0) == lifted  # the same evidence does not quarantine it again
    # Only failures after the lift count: one more is not enough, two are.
    one = decide(S, [*fs, failure(200, "c", ("qod",), "qod")], lifted, 201.0)
    assert [q for q in one if q.active(201.0)] == []
    two = decide(S, [*fs, failure(200, "c", ("qod",), "qod"), failure(210, "d", ("qod",), "qod")], lifted, 211.0)
    assert [q.fingerprint for q in two if q.active(211.0)] == ["qod"]
    assert lift(lifted, "qod", 300.0) == lifted  # lifting again keeps the first lift's time
    assert decide(QuarantineSettings(enabled=False), fs, [], 131.0) == []


def test_records_add_each_failure_once_and_quarantine_on_the_second_pod() -> None:
    first = failure(100, "a", ("qod", "x"), newest="qod", completed=("done-1", "x"))
    records, new = record(S, Records(), first, 100.0)
    assert new == [] and len(records.failures) == 1
    # Only completions that clear a fingerprint seen in a failure are kept: the annotation stays small.
    assert records.failures[0].completed == ("x",)
    again, new = record(S, records, first, 101.0)
    assert again is records and new == []
    records, new = record(S, records, failure(130, "b", ("qod",), newest="qod"), 130.0)
    assert [q.fingerprint for q in new] == ["qod"] and [q.fingerprint for q in active(records, 131.0)] == ["qod"]
    # Another failure with it in flight does not quarantine it anew.
    records, new = record(S, records, failure(140, "c", ("qod",), newest="qod"), 140.0)
    assert new == [] and len(records.quarantined) == 1


def test_records_keep_only_the_window_and_a_bounded_number_of_failures() -> None:
    records = Records()
    for i in range(FAILURES_KEPT + 10):
        records, _ = record(S, records, failure(float(i), f"pod-{i}", (f"fp{i}",), process=f"p{i}"), float(i))
    assert len(records.failures) == FAILURES_KEPT
    records, _ = record(S, records, failure(10_000.0, "late", ("z",)), 10_000.0)
    assert [f.pod for f in records.failures] == ["late"]


def test_the_lease_annotation_round_trips_and_rejects_what_is_not_ours() -> None:
    records, _ = record(S, Records(), failure(100, "a", ("qod",), "qod"), 100.0)
    records, _ = record(S, records, failure(130, "b", ("qod",), "qod"), 130.0)
    records, was = lift_records(records, "qod", 140.0)
    assert was and parse(dump(records)) == records and parse(None) == Records()
    for bad in ("{", "[]", '{"v": 2}', '{"v": 1, "failures": [{"at": "x"}]}',
                '{"v": 1, "quarantined": [{"fingerprint": 3}]}'):
        with pytest.raises(RecordsError):
            parse(bad)
    assert lift_records(records, "qod", 150.0)[1] is False  # lifted already


def test_a_failure_from_the_servers_report_prefers_what_was_in_flight_at_the_failure() -> None:
    report = {"instance_id": "i1", "inflight": [], "newest": "late", "completed": ["ok"],
              "at_failure": {"inflight": ["qod", "x"], "newest": "qod", "at": 1.0}}
    f = failure_from(report, "pod-a", "context_loss", 200.0)
    assert (f.process, f.inflight, f.newest, f.completed) == ("i1", ("qod", "x"), "qod", ("ok",))
    hung = failure_from({"instance_id": "i2", "inflight": ["h"], "newest": "h", "completed": [], "at_failure": None},
                        "pod-a", "hang", 200.0)
    assert hung.inflight == ("h",) and hung.reason == "hang"
    for bad in (None, {"inflight": []}, {"instance_id": "i", "inflight": "qod"}):
        with pytest.raises(RecordsError):
            failure_from(bad, "pod-a", "hang", 1.0)
    entries = server_entries(record(S, record(S, Records(), failure(1, "a", ("q",), "q"), 1.0)[0],
                                    failure(2, "b", ("q",), "q"), 2.0)[0], 3.0)
    assert entries == [{"fingerprint": "q", "until": 2.0 + S.ttl, "failures": 2, "pods": ["a", "b"]}]


SHORT_TTL = QuarantineSettings(ttl=600.0, window=3600.0, confirm=0.0)


def test_a_lift_holds_past_the_entrys_ttl_until_new_evidence_after_it() -> None:
    fs = [failure(100, "a", ("qod",), "qod"), failure(130, "b", ("qod",), "qod")]
    [q] = decide(SHORT_TTL, fs, [], 131.0)
    lifted = lift([q], "qod", 200.0)
    # The entry is past its TTL, the failures it covered still inside the window: no new evidence, no quarantine.
    later = 131.0 + SHORT_TTL.ttl + 60
    assert later < 200.0 + SHORT_TTL.window and not any(x.active(later) for x in lifted)
    again = decide(SHORT_TTL, fs, lifted, later)
    assert [x for x in again if x.active(later)] == []
    assert [(x.fingerprint, x.lifted_at) for x in again] == [("qod", 200.0)]  # what the lift needs, kept
    # Through the records too: a failure of any request decides again, and the lift still holds.
    records = Records(tuple(fs), tuple(lifted))
    records, new = record(SHORT_TTL, records, failure(later, "c", ("other",), "other"), later)
    assert new == [] and active(records, later) == []
    assert parse(dump(records)) == records
    # New evidence after the lift: one failure is not enough, a second on another pod is.
    records, new = record(SHORT_TTL, records, failure(later + 10, "a", ("qod",), "qod", process="p2"), later + 10)
    assert new == [] and active(records, later + 10) == []
    records, new = record(SHORT_TTL, records, failure(later + 20, "b", ("qod",), "qod", process="p2"), later + 20)
    assert [x.fingerprint for x in new] == ["qod"]
    [back] = active(records, later + 21)
    assert [f.at for f in back.failures] == [later + 10, later + 20]  # only the evidence after the lift
    # Once the covered failures have left the window (and the 60 s a stamp may lie ahead), the lift is
    # no longer kept.
    gone = 200.0 + SHORT_TTL.window + FUTURE_S
    assert decide(SHORT_TTL, fs, lifted, gone - 1) != [] and decide(SHORT_TTL, fs, lifted, gone) == []


def test_lifts_kept_past_their_ttl_are_bounded_and_carry_no_evidence() -> None:
    current: list[Quarantined] = []
    for i in range(LIFTS_KEPT + 5):
        fs = tuple(failure(float(i), pod, (f"fp{i}",), process=f"p{i}") for pod in ("a", "b"))
        current.append(Quarantined(f"fp{i}", float(i), float(i) + 1, fs, lifted_at=float(i) + 0.5))
    kept = decide(SHORT_TTL, [], current, 1000.0)
    assert [q.fingerprint for q in kept] == [f"fp{i}" for i in range(5, LIFTS_KEPT + 5)]  # the newest lifts
    assert all(q.failures == () for q in kept)


def test_an_entry_goes_when_a_failure_recorded_after_it_shows_its_process_had_answered_it() -> None:
    """Failures are recorded in any order: the third, which took both, came before the fourth,
    whose process had answered the popular one before the killer reached it."""
    fs = [failure(100 + 10 * n, pod, ("qod", "popular"), newest="popular", process=f"{pod}-1")
          for n, pod in enumerate("abc")]
    records, new = Records(), []
    for f in fs:
        records, new = record(S, records, f, 131.0)
    assert sorted(q.fingerprint for q in new) == ["popular", "qod"]
    late = failure(125, "d", ("qod", "popular"), completed=("popular",), process="d-1")
    records, _ = record(S, records, late, 132.0)
    assert [q.fingerprint for q in active(records, 132.0)] == ["qod"]


# -- a killer that varies, its input, and the evidence of answers ---------------------------------


def tried(at: float, pod: str, requests: list[tuple[str, str]], completed: tuple[str, ...] = (),
          process: str = "p1", forgot_until: float | None = None) -> Failure:
    """A failure with each request in flight as (its fingerprint, its input fingerprint)."""
    return Failure(at, pod, process, "context_loss", tuple(fp for fp, _ in requests), None, completed,
                   tuple(i for _, i in requests), forgot_until)


def without_inputs(fs: list[Failure]) -> list[Failure]:
    """The same failures as a server without input fingerprints reported them."""
    return [dataclasses.replace(f, inputs=()) for f in fs]


def test_a_killer_that_changes_its_settings_at_every_try_is_quarantined_as_its_input() -> None:
    # Another temperature, then another seed: two fingerprints, one input.
    fs = [tried(100, "a", [("k-temp", "K")]), tried(130, "b", [("k-seed", "K")])]
    assert decide(S, without_inputs(fs), [], 131.0) == []  # each try its own fingerprint: never enough
    [q] = decide(S, fs, [], 131.0)
    assert (q.fingerprint, q.input, q.pods) == ("K", True, ["a", "b"])
    records = Records(tuple(fs), (q,))
    assert server_entries(records, 132.0) == [{"fingerprint": "K", "until": 131.0 + S.ttl, "failures": 2,
                                               "pods": ["a", "b"]}]
    assert parse(dump(records)) == records and describe(q, 132.0)["input"] is True
    # Spellings alternating (prompt and messages, text and token ids) are one input too: two failures.
    alternating = [tried(100 + 10 * n, pod, [(f"spelling-{n % 2}", "K")]) for n, pod in enumerate("abcd")]
    assert [q.fingerprint for q in decide(S, alternating[:2], [], 121.0)] == ["K"]


def test_an_innocent_in_flight_beside_a_killer_that_varies_is_never_framed() -> None:
    innocent = ("story", "story-input")
    fs = [tried(100, "a", [("k1", "K"), innocent]), tried(130, "b", [("k2", "K"), innocent])]
    # Without input fingerprints the innocent stood alone at two failures and was taken.
    assert [q.fingerprint for q in decide(S, without_inputs(fs), [], 131.0)] == ["story"]
    # With them, the killer's input is at as many failures as the innocent: nothing yet...
    assert decide(S, fs, [], 131.0) == []
    # ...and the next failure, which the innocent is not at, takes the killer's input alone.
    fs.append(tried(160, "c", [("k3", "K"), ("one-off", "one-off-input")]))
    assert [(q.fingerprint, q.input) for q in decide(S, fs, [], 161.0)] == [("K", True)]


def test_an_innocent_retried_onto_another_replica_by_its_client_is_never_framed() -> None:
    innocent = ("story", "story-input")
    records, new = record(S, Records(), tried(100, "a", [("k1", "K"), innocent]), 100.0)
    assert new == []
    # Its client retries it on pod b, where the killer, retried with another seed, lands too.
    records, new = record(S, records, tried(130, "b", [("k2", "K"), innocent]), 130.0)
    assert new == [] and active(records, 131.0) == []
    # Retried once more, it is answered on pod c: no suspect anywhere, by its request or its input.
    records, _ = clear(S, records, ["story", "story-input"], "c", 135.0)
    assert {"story", "story-input"} <= cleared_in(S, records, 136.0)
    records, new = record(S, records, tried(160, "c", [("k3", "K")]), 160.0)
    assert [q.fingerprint for q in new] == ["K"] and "story" not in {q.fingerprint for q in records.quarantined}


def test_the_same_text_sent_beside_the_killer_with_other_settings_is_not_framed() -> None:
    """A hostile setting kills, not the text: its twin with benign settings was in flight at both
    failures too. Neither covers the other, so each stands for itself and they tie; the killer's
    setting alone is taken at the failure that tells them apart, and its twin stays served."""
    fs = [tried(100 + 30 * n, pod, [("hostile", "T"), ("benign", "T")]) for n, pod in enumerate("ab")]
    assert decide(S, fs, [], 131.0) == []
    fs.append(tried(160, "c", [("hostile", "T")]))
    assert [(q.fingerprint, q.input) for q in decide(S, fs, [], 161.0)] == [("hostile", False)]
    # Answered somewhere, the text is no killer: its requests stand for themselves.
    twice = [tried(100 + 30 * n, pod, [(f"hostile-{n}", "T")]) for n, pod in enumerate("ab")]
    assert decide(S, twice, [], 131.0, cleared=["T"]) == []


def test_a_request_refused_already_still_counts_toward_its_input() -> None:
    """The killer quarantined by its fingerprint (the same settings twice) comes back with another
    seed: one failure more, and its input is refused, every spelling of it."""
    records = Records()
    for at, pod in ((100.0, "a"), (130.0, "b")):
        records, _ = record(S, records, tried(at, pod, [("k1", "K")]), at)
    assert [(q.fingerprint, q.input) for q in active(records, 131.0)] == [("k1", False)]
    records, new = record(S, records, tried(160, "c", [("k2", "K")]), 160.0)
    assert [(q.fingerprint, q.input) for q in new] == [("K", True)]
    # A lift of the input holds until new evidence after it: one try more is not enough, two are.
    records, was = lift_records(records, "K", 170.0)
    assert was and "K" not in {q.fingerprint for q in active(records, 171.0)}
    records, new = record(S, records, tried(180, "d", [("k3", "K")]), 180.0)
    assert new == []
    records, new = record(S, records, tried(190, "e", [("k4", "K")]), 190.0)
    assert [q.fingerprint for q in new] == ["K"]


def test_a_success_forgotten_within_the_window_quarantines_nothing_until_it_has_left_it() -> None:
    """A failing process that had to forget an answer younger than the window (past its bound) may
    have answered any suspect: the rule refuses to quarantine rather than frame one."""
    fs = [failure(100, "a", ("qod",), "qod"), dataclasses.replace(failure(130, "b", ("qod",), "qod"),
                                                                   forgot_until=120.0)]
    assert decide(S, fs, [], 131.0) == []
    assert [q.fingerprint for q in decide(S, fs, [], 120.0 + S.window + 1)] == []  # the failures left too
    old = [failure(100, "a", ("qod",), "qod"), dataclasses.replace(failure(130, "b", ("qod",), "qod"),
                                                                    forgot_until=130.0 - S.window - 1)]
    assert [q.fingerprint for q in decide(S, old, [], 131.0)] == ["qod"]
    # The records' own: a clear forgotten for the budget.
    assert decide(S, old, [], 131.0, forgot_until=125.0) == []


def test_an_answer_is_kept_for_the_window_however_many_come_after_it() -> None:
    """An innocent in flight at a failure, answered elsewhere, then hundreds of other answers: its
    answer still holds for the window (a count of 256 dropped it, and the innocent, alone at the next
    failure beside a killer that changed its settings, was taken)."""
    records, _ = record(S, Records(), failure(100, "a", ("k1", "innocent")), 100.0)
    others = [f"other-{i}" for i in range(400)]
    for n in range(0, len(others), 20):  # in flight at other failures (of other requests) meanwhile
        records, _ = record(S, records, failure(100, f"o{n}", tuple(others[n:n + 20])), 100.0)
    records, _ = clear(S, records, ["innocent"], "c", 101.0)
    for i, fp in enumerate(others):
        records, _ = clear(S, records, [fp], "c", 102.0 + i)
    assert "innocent" in cleared_in(S, records, 600.0)
    records, new = record(S, records, failure(600, "b", ("k2", "innocent")), 600.0)
    assert new == [] and records.quarantined == ()
    assert "innocent" not in cleared_in(S, records, 101.0 + S.window)  # for the window, not for ever


def test_the_records_budget_drops_old_evidence_first_and_never_a_success_silently() -> None:
    # Fingerprints as long as the server's (16 hex digits): three full failures are over the budget.
    big = [(f"{n:02x}{i:014x}", f"{n + 8:02x}{i:014x}") for n in range(3) for i in range(INFLIGHT_KEPT)]
    records = Records()
    for n, pod in enumerate("abc"):
        at = 100.0 + n
        records, _ = record(S, records, tried(at, pod, big[n * INFLIGHT_KEPT:(n + 1) * INFLIGHT_KEPT]), at)
        assert len(dump(records)) <= ANNOTATION_BUDGET
    assert [f.pod for f in records.failures] == ["c"]  # the oldest evidence went first
    # Every request of the newest failure answered somewhere: more clears than the budget holds. The
    # oldest go, remembered as forgotten: nothing new is quarantined while that is inside the window.
    records, _ = clear(S, records, [fp for pair in big[2 * INFLIGHT_KEPT:] for fp in pair], "d", 110.0)
    assert len(dump(records)) <= ANNOTATION_BUDGET and records.forgot_until == 110.0
    assert parse(dump(records)) == records
    records, new = record(S, records, tried(120, "e", [("qod", "Q")]), 120.0)
    records, new = record(S, records, tried(130, "f", [("qod", "Q")]), 130.0)
    assert new == []
    # Once the forgotten answer has left the window, the next failure decides on all of them.
    later = 110.0 + S.window + 1
    records, new = record(S, records, tried(later, "g", [("qod", "Q")]), later)
    assert [q.fingerprint for q in new] == ["qod"]


def test_a_failure_carries_the_servers_inputs_and_what_it_had_forgotten() -> None:
    report: dict[str, Any] = {
        "instance_id": "i1", "inflight": [], "inputs": [], "completed": ["ok"], "forgot_until": None,
        "at_failure": {"inflight": ["qod", "x"], "inputs": ["Q", ""], "newest": "x", "at": 1.0,
                       "completed": ["ok", "ok-input"], "forgot_until": 0.5}}
    f = failure_from(report, "pod-a", "context_loss", 2.0)
    assert (f.inflight, f.inputs, f.completed, f.forgot_until) == (("qod", "x"), ("Q", ""), ("ok", "ok-input"), 0.5)
    assert f.requests() == [("qod", "Q"), ("x", "x")]  # none given: the request stands for its input
    assert "Q" in held_against(S, Records((f,)), 2.0)
    with pytest.raises(RecordsError, match="inputs"):
        failure_from({**report, "at_failure": {**report["at_failure"], "inputs": ["Q"]}}, "pod-a", "hang", 2.0)
    records = Records((f,), forgot_until=3.0)
    assert parse(dump(records)) == records


def test_a_lift_forgives_the_failures_on_record_whatever_their_stamps() -> None:
    """Two failures recorded by a node whose clock ran 30 s ahead, lifted by an operator whose clock is
    right: stamped after the lift, they are still the evidence it forgave (the Lease's order decides),
    and one new failure after it is not enough to quarantine the request again."""
    ahead = [failure(130, "a", ("qod",), "qod"), failure(131, "b", ("qod",), "qod")]
    records, new = Records(), []
    for f in ahead:
        records, new = record(S, records, f, f.at)
    assert [q.fingerprint for q in new] == ["qod"]
    records, was = lift_records(records, "qod", 105.0)
    assert was and parse(dump(records)) == records
    [q] = records.quarantined
    assert q.lifted_over == ("a/p1", "b/p1")
    records, new = record(S, records, failure(110, "c", ("qod",), "qod"), 110.0)
    assert new == [] and active(records, 110.0) == []
    records, new = record(S, records, failure(112, "d", ("qod",), "qod"), 112.0)
    assert [q.fingerprint for q in new] == ["qod"]  # two failures after the lift: new evidence


def test_an_entry_is_in_force_at_once_whatever_its_writers_clock_said() -> None:
    fs = [failure(100, "a", ("qod",), "qod"), failure(101, "b", ("qod",), "qod")]
    [q] = decide(S, fs, [], 160.0)  # written by a node 60 s ahead
    assert q.since == 160.0 and q.active(100.0)


def test_records_lost_with_their_lease_quarantine_nothing_new_for_a_window() -> None:
    """The Lease deleted: the answers it held are gone. Two failures of a request then quarantine it
    only once a window has passed since the loss (until then it may be one that was answered)."""
    records = lost(1000.0)
    assert records.forgot_until == 1000.0 and parse(dump(records)) == records
    for at, pod in ((1001.0, "a"), (1002.0, "b")):
        records, new = record(S, records, failure(at, pod, ("qod",), "qod"), at)
        assert new == []
    after = 1000.0 + S.window + 1
    records, new = record(S, records, failure(after - 2, "c", ("qod",), "qod"), after)
    assert [q.fingerprint for q in new] == ["qod"]


def test_a_new_entry_waits_for_the_replicas_word_then_every_replica_refuses_it() -> None:
    """Decided at the third failure with the killer and the request beside it tied: both wait
    `confirm`, served meanwhile and held against (a replica that answers one says so); the one a
    replica answered goes before anyone refused it, the other is in force from then until its TTL."""
    s = QuarantineSettings()
    fs = [failure(100 + 30 * n, pod, ("qod", "innocent")) for n, pod in enumerate("abc")]
    records, _ = record(s, Records(tuple(fs[:2])), fs[2], 161.0)
    pending = [q for q in records.quarantined if q.pending(161.0)]
    assert sorted(q.fingerprint for q in pending) == ["innocent", "qod"]
    assert all(q.in_force_at == 161.0 + s.confirm and q.until == q.in_force_at + s.ttl for q in pending)
    assert server_entries(records, 161.0) == [] and {"qod", "innocent"} <= held_against(s, records, 165.0)
    records, removed = clear(s, records, ["innocent"], "d", 166.0)
    assert [q.fingerprint for q in removed] == ["innocent"]
    assert [e["fingerprint"] for e in server_entries(records, 161.0 + s.confirm - 0.5)] == []
    assert [e["fingerprint"] for e in server_entries(records, 161.0 + s.confirm)] == ["qod"]
    assert server_entries(records, 161.0 + s.confirm + s.ttl) == []
    assert parse(dump(records)) == records


def test_the_failures_decision_names_its_entries_while_they_wait() -> None:
    s = QuarantineSettings()
    records = Records((failure(100, "a", ("qod",)),))
    records, new = record(s, records, failure(130, "b", ("qod",)), 131.0)
    assert [(q.fingerprint, q.pending(131.0), q.active(131.0)) for q in new] == [("qod", True, False)]
    # Another failure while it waits: it stays as decided, not decided again.
    records, again = record(s, records, failure(135, "c", ("qod",)), 136.0)
    assert again == [] and [q.in_force_at for q in records.quarantined] == [131.0 + s.confirm]
    # An operator's lift while it waits: never in force.
    lifted, was = lift_records(records, "qod", 137.0)
    assert was and server_entries(lifted, 131.0 + s.confirm + 1) == []
