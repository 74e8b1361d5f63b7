"""A hang's evidence for the query of death: what was in flight when the engine's loop stopped
advancing, frozen by the server then (`StallRule`, `RequestBook.stalled`), and preferred by the
sidecar for a hang (`quarantine.failure_from`)."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace
from typing import Any

import pytest

from gpu_watchdog.inference.screen import REPORTED, STALL_AFTER_S, RequestBook, StallRule
from gpu_watchdog.inference.service import InferenceService
from gpu_watchdog.watchdog.core.names import CONTEXT_LOSS, HANG
from gpu_watchdog.watchdog.core.quarantine import RecordsError, failure_from


def trace(rule: StallRule, clock: list[float], samples: list[tuple[float, int, bool]]) -> list[bool]:
    out = []
    for t, forwards, busy in samples:
        clock[0] = t
        out.append(rule.observe(forwards, busy))
    return out


def test_the_stall_rule_on_a_trace_of_progress_samples() -> None:
    clock = [0.0]
    rule = StallRule(now=lambda: clock[0])
    assert rule.after_s == STALL_AFTER_S
    # Advancing with work in flight, however long: no stall.
    assert trace(rule, clock, [(float(t), t, True) for t in range(30)]) == [False] * 30
    # Flat with work: a stall once STALL_AFTER_S has passed since the last pass, not before.
    assert trace(rule, clock, [(30.0, 29, True), (29.0 + STALL_AFTER_S - 0.5, 29, True)]) == [False, False]
    assert trace(rule, clock, [(29.0 + STALL_AFTER_S, 29, True), (40.0, 29, True)]) == [True, True]
    # The work leaving a wedged loop does not end the stall; the loop advancing again does.
    assert trace(rule, clock, [(41.0, 29, False), (42.0, 30, True), (43.0, 30, True)]) == [True, False, False]

    idle = StallRule(now=lambda: clock[0])
    # Flat with no work in flight: idle, never a stall.
    assert not any(trace(idle, clock, [(100.0 + t, 7, False) for t in range(60)]))
    # Work arriving after a long idle time: the wait starts with the work, not with the last pass.
    assert trace(idle, clock, [(160.0, 7, True), (161.0, 7, True), (160.0 + STALL_AFTER_S, 7, True)]) == [
        False, False, True]


def test_the_stall_snapshot_keeps_a_request_that_left_after_it() -> None:
    book = RequestBook("i1")
    assert book.report()["at_stall"] is None
    done = book.begin("bystander")
    book.end(done, ok=True)
    killer, other = book.begin("killer"), book.begin("other")
    frozen = book.stalled()
    assert frozen["inflight"] == ["other", "killer"] and frozen["newest"] == "other"
    assert frozen["completed"] == ["bystander"] and isinstance(frozen["at"], float)
    book.end(killer, ok=False)  # the client gave up: gone from what is in flight, not from the snapshot
    for i in range(REPORTED + 3):
        book.begin(f"retry{i}")  # retried meanwhile: the oldest REPORTED are reported in flight
    report = book.report()
    assert "killer" not in report["inflight"] and report["at_stall"] == frozen
    assert len(report["inflight"]) == REPORTED and report["inflight"][-1] == "other"
    assert report["at_stall"]["inflight"] == ["other", "killer"]
    assert book.stalled() == frozen  # once per stall: the first call wins
    assert report["at_failure"] is None  # a stall is not a lost context
    assert book.resumed() is True and book.report()["at_stall"] is None
    assert book.resumed() is False
    book.end(other, ok=True)
    # The next stall takes its own: the oldest REPORTED in flight, newest first.
    assert book.stalled()["inflight"] == [f"retry{i}" for i in reversed(range(REPORTED))]


def test_the_server_watch_freezes_at_a_stall_and_drops_it_when_the_loop_advances() -> None:
    clock = [0.0]
    book = RequestBook("i1")
    state = {"forwards": 5}
    reports: list[dict[str, Any]] = []
    ticket = book.begin("killer")
    # What happens before each sample, at its time: the loop wedges at 5 passes with work in flight.
    script: list[tuple[float, dict[str, int]]] = [
        (0.0, {}), (2.0, {}), (STALL_AFTER_S, {}), (STALL_AFTER_S + 1, {}), (STALL_AFTER_S + 2, {"forwards": 6})]

    def probe() -> SimpleNamespace:
        reports.append(book.report())
        if len(reports) == 4:
            book.end(ticket, ok=False)  # the client left during the stall
        if not script:
            raise asyncio.CancelledError  # the end of the trace ends the watch
        clock[0], change = script.pop(0)
        state.update(change)
        return SimpleNamespace(forward_batches=state["forwards"])

    engine = SimpleNamespace(probe=probe, inflight=1, queued=0)  # the wedged request stays in the loop
    service = SimpleNamespace(engine=engine, guard=SimpleNamespace(screen=SimpleNamespace(book=book)))
    with pytest.raises(asyncio.CancelledError):
        asyncio.run(InferenceService.watch_progress(service, StallRule(now=lambda: clock[0]), every=0))  # type: ignore[arg-type]
    # Read before each sample: nothing frozen until the stall, then the killer kept once it has left.
    stalls = [r["at_stall"] for r in reports]
    assert stalls[:3] == [None, None, None]
    assert stalls[3] is not None and stalls[3]["inflight"] == ["killer"]
    assert stalls[4] is not None and stalls[4]["inflight"] == ["killer"] and reports[4]["inflight"] == []
    assert stalls[5] is None  # the loop advanced: the stall is over, no evidence


def report(**frozen: Any) -> dict[str, Any]:
    return {"instance_id": "i1", "inflight": ["retried"], "newest": "retried", "completed": ["ok"], **frozen}


STALL = {"inflight": ["killer", "x"], "newest": "killer", "at": 10.0, "completed": ["done"]}


def test_a_hang_is_recorded_from_what_was_in_flight_at_the_stall() -> None:
    f = failure_from(report(at_failure=None, at_stall=STALL), "pod-a", HANG, 200.0)
    assert (f.process, f.reason, f.inflight, f.newest, f.completed) == (
        "i1", HANG, ("killer", "x"), "killer", ("done",))
    # Another reason ignores a stall: what is in flight now (the reason's own evidence).
    lost = failure_from(report(at_failure=None, at_stall=STALL), "pod-a", CONTEXT_LOSS, 200.0)
    assert (lost.inflight, lost.newest, lost.completed) == (("retried",), "retried", ("ok",))
    # No stall seen (an older server, the agent): what is in flight now.
    for answer in (report(), report(at_stall=None)):
        assert failure_from(answer, "pod-a", HANG, 200.0).inflight == ("retried",)
    # A lost context's snapshot still wins where there is one.
    lost_too = report(at_failure={"inflight": ["q"], "newest": "q", "at": 1.0}, at_stall=STALL)
    assert failure_from(lost_too, "pod-a", HANG, 200.0).inflight == ("q",)
    # Without its own completions, the report's.
    assert failure_from(report(at_stall={"inflight": ["k"], "newest": None}), "p", HANG, 1.0).completed == ("ok",)


@pytest.mark.parametrize("bad", [{"inflight": "killer"}, {"inflight": [1]}, {"inflight": [], "newest": 3},
                                 {"inflight": [], "completed": "ok"}])
def test_a_garbled_stall_snapshot_is_no_record(bad: dict[str, Any]) -> None:
    with pytest.raises(RecordsError):
        failure_from(report(at_stall=bad), "pod-a", HANG, 1.0)
