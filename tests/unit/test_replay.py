"""`gpu-watchdog replay`: a recording folded through the same core gives the sidecar's decisions again,
and other settings what it would have decided; a recording that is not one is refused by its line."""

from __future__ import annotations

import io
import json
from pathlib import Path
from typing import Any

from gpu_watchdog.watchdog.cli.replay import replay_main
from gpu_watchdog.watchdog.core.names import HANG
from gpu_watchdog.watchdog.core.samples import CanarySample, ServerSample
from gpu_watchdog.watchdog.core.settings import RestartBudgetSettings, Settings
from gpu_watchdog.watchdog.core.state import RestartBegun, RestartEnded
from tests.traces import Trace, with_policy
from tests.unit.replaying import FIXTURES, decisions


def ok(at: float) -> CanarySample:
    return CanarySample(at=at, ok=True, latency_s=0.01, error_class=None, instance_id="i1")


def timeout(at: float) -> CanarySample:
    return CanarySample(at=at, ok=False, latency_s=10.0, error_class="timeout", error="timeout", instance_id="i1")


def flat(at: float) -> ServerSample:
    return ServerSample(at=at, reachable=True, server="bundled", requests_running=0, requests_waiting=0,
                        generated_tokens=500.0, progress=500.0)


def hang_trace(settings: Settings, timeouts: int = 6) -> Trace:
    """A server that served, then stopped answering its canary with its token counter flat."""
    t = Trace(settings)
    t.run([(1.0, ok(1.0)), (2.0, flat(2.0))])
    for i in range(timeouts):
        at = 40.0 + 30 * i
        t.run([(at - 5, flat(at - 5)), (at, timeout(at))])
        if t.decided and t.decided[-1][1].action == "restart":
            t.fold(RestartBegun(at))
            break
    return t


def replay(tmp_path: Path, lines: list[dict[str, Any]] | str, *args: str) -> tuple[int, list[dict[str, Any]], str]:
    path = tmp_path / "flight.jsonl"
    path.write_text(lines if isinstance(lines, str) else "".join(json.dumps(x) + "\n" for x in lines))
    sets = [a.removeprefix("--set=") for a in args if a.startswith("--set=")]
    out, err = io.StringIO(), io.StringIO()
    code = replay_main([str(path)], None, sets, out=out, err=err)
    return code, [json.loads(line) for line in out.getvalue().splitlines()], err.getvalue()


def test_a_recording_replays_to_the_decisions_the_core_took_there(tmp_path: Path) -> None:
    t = hang_trace(Settings())
    assert [(d.action, d.reason) for _, d in t.decided] == [("restart", HANG)]
    code, printed, err = replay(tmp_path, t.lines)
    assert code == 0 and err == ""
    assert decisions(printed) == [("restart", HANG)]
    [decision] = [p for p in printed if p["kind"] == "decision"]
    assert decision["t"] == 100.0 and decision["drain"] is False and decision["at"] == "2027-01-15T08:01:40.000Z"
    summary = printed[-1]
    assert summary["kind"] == "summary" and summary["identical"] and summary["recorded_decisions"] == 1


def test_what_if_more_timeouts_were_needed_shows_the_restart_not_taken(tmp_path: Path) -> None:
    t = hang_trace(Settings())
    code, printed, err = replay(tmp_path, t.lines, "--set=policy.hang.consecutive_timeouts=5")
    assert code == 0 and decisions(printed) == []
    summary = printed[-1]
    assert not summary["identical"] and summary["differing_ticks"] == 1
    assert summary["differences"][0]["recorded"][0]["reason"] == HANG and summary["differences"][0]["replayed"] == []
    assert err.startswith("what-if: different decisions at 1 of")


def test_a_restart_blocked_at_every_tick_is_one_decision(tmp_path: Path) -> None:
    s = with_policy(Settings(), restart_budget=RestartBudgetSettings(max_restarts=1))
    t = Trace(s)
    t.run([(1.0, ok(1.0)), (2.0, flat(2.0))])
    t.fold(RestartBegun(3.0), RestartEnded(at=3.0, reason=HANG, done=True, keep_unready=False))
    t.run([(4.0, ok(4.0)), (5.0, flat(5.0))])
    for i in range(5):
        at = 40.0 + 30 * i
        t.run([(at - 5, flat(at - 5)), (at, timeout(at)), (at + 1, None), (at + 2, None)])
    blocked = [d for _, d in t.decided if d.action == "restart"]
    assert len(blocked) > 5 and not any(d.allowed for d in blocked)
    code, printed, _ = replay(tmp_path, t.lines)
    [line] = [p for p in printed if p["kind"] == "decision"]
    assert code == 0 and line["blocked_by"] == blocked[0].blocked_by and printed[-1]["identical"]


def test_the_recording_of_a_real_hang_replays_identically_and_its_what_if() -> None:
    """Recorded from `gpu-watchdog up --fault-injection` (a hang injected, the child restarted)."""
    path = str(FIXTURES / "up_hang_restart.jsonl")
    out, err = io.StringIO(), io.StringIO()
    assert replay_main([path], None, [], out=out, err=err) == 0
    printed = [json.loads(line) for line in out.getvalue().splitlines()]
    assert decisions(printed) == [("restart", HANG)] and printed[-1]["identical"] and printed[-1]["ticks"] > 50
    assert [p["outcome"] for p in printed if p["kind"] == "outcome"] == ["started", "done"]
    out = io.StringIO()
    assert replay_main([path], None, ["policy.hang.consecutive_timeouts=5"], out=out, err=io.StringIO()) == 0
    what_if = [json.loads(line) for line in out.getvalue().splitlines()]
    assert decisions(what_if) == [] and not what_if[-1]["identical"]


def test_a_garbled_or_cut_line_is_named_and_what_came_before_is_printed(tmp_path: Path) -> None:
    lines = hang_trace(Settings()).lines
    text = "".join(json.dumps(x) + "\n" for x in lines)
    cut = text + '{"kind": "in", "type": "CanarySample", "v": {"at": 3'
    code, printed, err = replay(tmp_path, cut)
    assert code == 1 and decisions(printed) == [("restart", HANG)]
    assert f"flight.jsonl:{len(lines) + 1}: not a JSON line" in err and "cut short" in err
    garbled = text.replace('"type": "CanarySample"', '"type": "Telepathy"', 1)
    code, printed, err = replay(tmp_path, garbled)
    assert code == 1 and "unknown input type 'Telepathy'" in err and "Traceback" not in err
    code, _, err = replay(tmp_path, "".join(json.dumps(x) + "\n" for x in lines[1:]))
    assert code == 1 and "flight.jsonl:1: a recording begins with a start line" in err
    newer = [{**lines[0], "version": 99}, *lines[1:]]
    code, _, err = replay(tmp_path, newer)
    assert code == 1 and "version 99" in err


def test_settings_that_do_not_load_are_refused_by_key(tmp_path: Path) -> None:
    lines = hang_trace(Settings()).lines
    code, _, err = replay(tmp_path, lines, "--set=policy.hang.consecutive_timeout=5")
    assert code == 2 and "policy.hang.consecutive_timeout: unknown key" in err
    code, _, err = replay(tmp_path, lines, "--set=policy.hang.consecutive_timeouts=0")
    assert code == 2 and "policy.hang.consecutive_timeouts: must be at least 1" in err
    out, err2 = io.StringIO(), io.StringIO()
    assert replay_main([str(tmp_path / "flight.jsonl")], None, ["no-equals-sign"], out=out, err=err2) == 2
    assert "--set takes KEY=VALUE" in err2.getvalue()
    assert replay_main([str(tmp_path / "missing.jsonl")], None, [], out=out, err=err2) == 2
    assert "cannot read" in err2.getvalue()
