"""Real recordings kept as regression traces (tests/fixtures/recordings/, README.md there): each,
recorded from an e2e scenario, replays to the decisions the sidecar took there, and a what-if to
the decisions other settings would have taken, without starting a process."""

from __future__ import annotations

import io
import itertools
import json
from typing import Any

from gpu_watchdog.watchdog.cli.replay import replay_main
from gpu_watchdog.watchdog.core.names import (
    CONTEXT_LOSS,
    FLEET_UNAVAILABLE_LIMIT,
    HANG,
    RUNG_CONTAINER,
    RUNG_WORKER,
    STARTUP_TIMEOUT,
)
from gpu_watchdog.watchdog.core.timing import FLEET_RETRY_S
from tests.unit.replaying import FIXTURES, decisions

# The query of death's fingerprint (the test's marked request), as the sidecar recorded it in flight.
CULPRIT = "e60f16451040c8ca"


def replay(name: str, *sets: str) -> tuple[int, list[dict[str, Any]], str]:
    out, err = io.StringIO(), io.StringIO()
    code = replay_main([str(FIXTURES / name)], None, list(sets), out=out, err=err)
    return code, [json.loads(line) for line in out.getvalue().splitlines()], err.getvalue()


def decided(printed: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The decisions printed, less their evidence."""
    return [{k: v for k, v in p.items() if k not in ("kind", "at", "evidence")} for p in printed
            if p["kind"] == "decision"]


def outcomes(printed: list[dict[str, Any]]) -> list[tuple[str, str, str | None]]:
    return [(p["reason"], p["outcome"], p.get("held")) for p in printed if p["kind"] == "outcome"]


def lines(name: str) -> list[dict[str, Any]]:
    return [json.loads(line) for line in (FIXTURES / name).read_text().splitlines()]


def asked(name: str) -> list[tuple[float, str | None, list[dict[str, Any]]]]:
    """The recorded ticks that decided something: (seconds since the sidecar started, core, decisions)."""
    recorded = lines(name)
    started = recorded[0]["history"]["started_at"]
    return [(round(x["now"] - started, 3), x.get("core"), x["decisions"]) for x in recorded
            if x["kind"] == "tick" and x.get("decisions")]


def test_a_restart_held_by_the_fleet_s_ledger_then_carried_out_replays_identically() -> None:
    """tests/fleet/test_fleet_restarts.py, two replicas hung at once with max_unavailable 1: this is
    the one that waited. Its hang restart was held (`fleet_unavailable_limit`), asked again after
    the hold's interval, held again, then took the slot the other's replacement gave back."""
    code, printed, err = replay("fleet_hold.jsonl")
    assert code == 0 and err == ""
    assert decided(printed) == [{"t": 2.361, "action": "restart", "reason": HANG, "rung": RUNG_CONTAINER,
                                 "drain": False}]
    assert outcomes(printed) == [(HANG, "started", None), (HANG, FLEET_UNAVAILABLE_LIMIT, FLEET_UNAVAILABLE_LIMIT),
                                 (HANG, "done", None)]
    summary = printed[-1]
    assert summary["kind"] == "summary" and summary["identical"] and summary["ticks"] == 45
    # Asked three times (held, held, carried out), printed once: one episode.
    assert summary["recorded_decisions"] == 3 and summary["decisions"] == 1
    times = [t for t, _, _ in asked("fleet_hold.jsonl")]
    assert times == [2.361, 4.564, 7.065]
    assert all(b - a >= FLEET_RETRY_S[FLEET_UNAVAILABLE_LIMIT] for a, b in itertools.pairwise(times))


def test_what_if_the_hang_needed_three_timeouts_the_held_restart_is_decided_at_its_first_ask_again() -> None:
    """Three timeouts instead of two: not decided at the second timeout, decided at the third, which is
    the tick the recorded sidecar asked its held restart again: the rest is as recorded. With 50
    timeouts, never decided: each of the three asks differs."""
    code, printed, err = replay("fleet_hold.jsonl", "policy.hang.consecutive_timeouts=3")
    assert code == 0 and err.startswith("what-if: different decisions at 1 of 45")
    [decision] = [p for p in printed if p["kind"] == "decision"]
    assert (decision["t"], decision["reason"], decision["evidence"]["consecutive_timeouts"]) == (4.564, HANG, 3)
    summary = printed[-1]
    assert not summary["identical"] and summary["differing_ticks"] == 1
    assert summary["differences"][0]["t"] == 2.361 and summary["differences"][0]["replayed"] == []
    code, printed, _ = replay("fleet_hold.jsonl", "policy.hang.consecutive_timeouts=50")
    assert code == 0 and decisions(printed) == []
    assert not printed[-1]["identical"] and [d["t"] for d in printed[-1]["differences"]] == [2.361, 4.564, 7.065]
    # What the edge recorded stays what it did: the outcomes are the recording's inputs.
    assert [o for _, o, _ in outcomes(printed)] == ["started", FLEET_UNAVAILABLE_LIMIT, "done"]


def test_the_query_of_death_s_second_failure_replays_identically_with_what_was_in_flight() -> None:
    """tests/fleet/test_query_of_death.py: the second replica the marked request killed (its sidecar
    recorded the failure, the second of the workload's, and quarantined the request). Its
    context_loss restart was held while the first replica restarted, asked again every 2 s, until
    its container, restarted by the kubelet, served again and no restart was wanted."""
    code, printed, err = replay("query_of_death.jsonl")
    assert code == 0 and err == ""
    [decision] = [p for p in printed if p["kind"] == "decision"]
    assert (decision["t"], decision["reason"], decision["rung"], decision["drain"]) == (15.473, CONTEXT_LOSS,
                                                                                         RUNG_CONTAINER, False)
    assert decision["evidence"]["evidence"] == "canary"
    assert "illegal memory access" in decision["evidence"]["error"]
    assert outcomes(printed) == [(CONTEXT_LOSS, "started", None),
                                 (CONTEXT_LOSS, FLEET_UNAVAILABLE_LIMIT, FLEET_UNAVAILABLE_LIMIT)]
    summary = printed[-1]
    assert summary["identical"] and summary["ticks"] == 475 and summary["recorded_decisions"] == 4
    assert [t for t, _, _ in asked("query_of_death.jsonl")] == [15.473, 17.583, 19.624, 21.665]
    # What was in flight at the failure (what the sidecar wrote in the ledger): the marked request alone.
    records = [x["v"] for x in lines("query_of_death.jsonl") if x.get("type") == "DecisionRecord"]
    held = [r for r in records if r["outcome"] == FLEET_UNAVAILABLE_LIMIT]
    assert [r["detail"]["inflight"] for r in held] == [[CULPRIT]]


def test_what_if_a_shorter_startup_timeout_restarts_the_loading_server_and_the_hang_rule_changes_nothing() -> None:
    """The model loaded for about 10 s: a 5 s startup timeout restarts it at 5.1 s, before it served
    (decided at every tick after, as the recorded world never restarted it); the context loss is
    still decided. A context loss is not a hang: the hang rule's settings leave it as recorded."""
    code, printed, err = replay("query_of_death.jsonl", "policy.startup_timeout=5s")
    assert code == 0 and err.startswith("what-if: different decisions at")
    assert [(d["t"], d["reason"], d["drain"]) for d in decided(printed)] == [(5.091, STARTUP_TIMEOUT, True),
                                                                            (15.473, CONTEXT_LOSS, False)]
    summary = printed[-1]
    assert not summary["identical"]
    first = summary["differences"][0]
    assert first["t"] == 5.091 and first["recorded"] == [] and first["replayed"][0]["reason"] == STARTUP_TIMEOUT
    code, printed, err = replay("query_of_death.jsonl", "policy.hang.consecutive_timeouts=50")
    assert code == 0 and printed[-1]["identical"] and decisions(printed) == [("restart", CONTEXT_LOSS)]
    assert err == "what-if: the same decisions as the recording\n"


def test_another_worker_s_hang_replays_to_the_worker_rung() -> None:
    """tests/fleet/test_fleet_workers.py (in-process sidecar, recorder added by record_in_process.py):
    a real `serve --workers 2`, worker 1 hung by fault injection. The workers core decided worker
    1's restart after two timeouts; it was recorded, carried out, and the new process served."""
    start = lines("worker_restart.jsonl")[0]
    assert start["settings"]["target"]["workers"] == 2
    code, printed, err = replay("worker_restart.jsonl")
    assert code == 0 and err == ""
    assert decided(printed) == [{"t": 2.32, "action": "restart", "reason": HANG, "rung": RUNG_WORKER,
                                 "drain": False, "worker": 1}]
    [decision] = [p for p in printed if p["kind"] == "decision"]
    assert decision["evidence"] == {"worker": 1, "evidence": "worker_canary", "consecutive_timeouts": 2,
                                    "last_latency_s": 1.001}
    assert outcomes(printed) == [(HANG, "started", None), (HANG, "done", None)]
    summary = printed[-1]
    assert summary["identical"] and summary["ticks"] == 158 and summary["recorded_decisions"] == 1
    assert [(t, core) for t, core, _ in asked("worker_restart.jsonl")] == [(2.32, "workers")]
    assert any(x.get("type") == "WorkerRestarted" for x in lines("worker_restart.jsonl"))


def test_what_if_a_worker_s_hang_needed_three_timeouts_it_is_not_restarted() -> None:
    """Restarted after its second timeout, worker 1's new process served: the third timeout never came."""
    code, printed, err = replay("worker_restart.jsonl", "policy.hang.consecutive_timeouts=3")
    assert code == 0 and decisions(printed) == []
    summary = printed[-1]
    assert not summary["identical"] and summary["differing_ticks"] == 1
    [difference] = summary["differences"]
    assert difference["t"] == 2.32 and difference["replayed"] == []
    assert difference["recorded"] == [{"action": "restart", "reason": HANG, "rung": RUNG_WORKER, "drain": False,
                                       "worker": 1}]
    assert err.startswith("what-if: different decisions at 1 of 158")
