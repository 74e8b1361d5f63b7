"""The query-of-death rule on traces: the culprit quarantined, bystanders never."""

from __future__ import annotations

import pytest

from gpu_watchdog.watchdog.config import QuarantineSettings
from gpu_watchdog.watchdog.quarantine import (
    FAILURES_KEPT,
    LIFTS_KEPT,
    MAX_TIED,
    Failure,
    Quarantined,
    Records,
    RecordsError,
    active,
    clear,
    decide,
    dump,
    failure_from,
    held_against,
    lift,
    lift_records,
    parse,
    record,
    server_entries,
    suspects,
)

S = QuarantineSettings()


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
    many = tuple(f"fp{i}" for i in range(MAX_TIED + 1))
    fs = [failure(100 + 30 * n, pod, many) for n, pod in enumerate("abc")]
    assert decide(S, fs, [], 161.0) == []
    # Bystanders come and go: the next failure has the culprit alone of them.
    fs.append(failure(190, "d", ("fp7", "new-bystander")))
    assert [q.fingerprint for q in decide(S, fs, [], 191.0)] == ["fp7"]


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


SHORT_TTL = QuarantineSettings(ttl=600.0, window=3600.0)


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
    # Once the covered failures have left the window, the lift is no longer kept.
    gone = 200.0 + SHORT_TTL.window
    assert decide(SHORT_TTL, fs, lifted, gone) == []


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
