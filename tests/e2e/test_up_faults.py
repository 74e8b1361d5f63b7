"""`gpu-watchdog up --fault-injection`: every fault the watchdog reacts to, end to end, on CPU."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import requests

from tests.e2e.up_stack import SHORT, Stack
from tests.helpers import free_port, json_lines, metric, spawn, wait_for, wait_http


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    tmp = tmp_path_factory.mktemp("up")
    config = tmp / "watchdog.yaml"
    recording = tmp / "flight.jsonl"
    config.write_text(SHORT + f"recorder: {{path: {recording}}}\n")
    port, control_port, watchdog_port = free_port(), free_port(), free_port()
    token = "e2e-token"
    proc = spawn(["up", "--fault-injection", "--device", "cpu", "--host", "127.0.0.1", "--port", str(port),
                  "--control-port", str(control_port), "--watchdog-port", str(watchdog_port),
                  "--config", str(config)], tmp / "up.log", env={"GPU_WATCHDOG_TOKEN": token})
    s = Stack(proc, port, control_port, watchdog_port)
    s.token = token
    try:
        wait_http(s.watchdog + "/readyz", proc, timeout=120)
        yield s
    finally:
        code = proc.stop(timeout=20)
        # Ctrl-C / SIGTERM stops both processes cleanly.
        assert code == 0, proc.log()[-3000:]
        assert any(e.get("event") == "shutdown" for e in json_lines(proc.log()))
        replayed_identically(recording)


def replayed_identically(recording: Path) -> None:
    """The stack's flight recording, through `gpu-watchdog replay`, gives every decision it took again."""
    done = subprocess.run([sys.executable, "-m", "gpu_watchdog", "replay", str(recording)], capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    printed = [json.loads(line) for line in done.stdout.splitlines()]
    summary = printed[-1]
    assert summary["kind"] == "summary" and summary["identical"], summary
    restarts = {p["reason"] for p in printed if p["kind"] == "decision" and p["action"] == "restart"}
    assert summary["ticks"] > 100 and restarts, (summary, restarts)


def test_both_processes_come_up_and_serve(stack: Stack) -> None:
    assert stack.serving()
    status = requests.get(stack.watchdog + "/status", timeout=5).json()
    assert status["strategy"] == "local"  # up always restarts its own child
    assert "nvml_unavailable" in status["states"]  # no driver here: a state, not a crash
    assert metric(stack.watchdog + "/metrics", "gpu_watchdog_state", {"state": "nvml_unavailable"}) == 1.0
    assert metric(stack.watchdog + "/metrics", "gpu_watchdog_canary_success") == 1.0


def test_oom_is_cleaned_without_restart(stack: Stack) -> None:
    before = stack.restarts("context_loss") + stack.restarts("hang")
    stack.fault("oom", count=1)
    wait_for(lambda: stack.flushes("oom") >= 1, 15, "empty_cache for oom")
    wait_for(stack.ready, 15, "watchdog ready again")
    assert stack.serving()
    assert stack.restarts("context_loss") + stack.restarts("hang") == before


def test_fragmentation_that_empty_cache_fixes_is_not_restarted(stack: Stack) -> None:
    stack.fault("fragmentation", ratio=0.6)
    wait_for(lambda: stack.flushes("fragmentation_drift") >= 1, 15, "empty_cache for fragmentation")
    wait_for(lambda: metric(stack.watchdog + "/metrics", "gpu_watchdog_fragmentation_ratio") == 0.0, 15,
             "fragmentation back to 0")
    assert stack.restarts("fragmentation_drift") == 0


def test_context_loss_restarts_and_serves_again(stack: Stack) -> None:
    stack.fault("context_loss")
    wait_for(lambda: stack.restarts("context_loss") >= 1, 60, "restart for context_loss")
    wait_for(stack.serving, 60, "model serving again")
    wait_for(stack.ready, 30, "watchdog ready again")


def test_hang_restarts_and_serves_again(stack: Stack) -> None:
    stack.fault("hang")
    wait_for(lambda: stack.restarts("hang") >= 1, 60, "restart for hang")
    wait_for(stack.serving, 60, "model serving again")
    wait_for(stack.ready, 30, "watchdog ready again")


def test_sticky_fragmentation_restarts_after_the_attempts(stack: Stack) -> None:
    stack.fault("fragmentation", ratio=0.6, sticky=True)
    wait_for(lambda: stack.restarts("fragmentation_drift") >= 1, 60, "restart for fragmentation drift")
    assert stack.flushes("fragmentation_drift") >= 1 + 2  # one from the earlier test, then both attempts
    wait_for(stack.serving, 60, "model serving again")


def test_budget_exhausted_stops_further_restarts(stack: Stack) -> None:
    assert metric(stack.watchdog + "/metrics", "gpu_watchdog_restart_budget_remaining") == 0.0
    total = sum(stack.restarts(r) for r in ("context_loss", "hang", "fragmentation_drift", "max_age"))
    assert total == 3
    wait_for(stack.ready, 30, "watchdog ready")
    stack.fault("hang")
    wait_for(lambda: any(d["outcome"] == "blocked_by_budget"
                         for d in requests.get(stack.watchdog + "/status", timeout=5).json()["last_decisions"]),
             30, "blocked restart decision")
    assert sum(stack.restarts(r) for r in ("context_loss", "hang", "fragmentation_drift", "max_age")) == 3
    assert metric(stack.watchdog + "/metrics", "gpu_watchdog_state", {"state": "budget_exhausted"}) == 1.0
    assert not stack.ready()  # the model cannot serve, and the pod says so
    stack.fault("clear")
    wait_for(stack.ready, 30, "ready after the hang cleared")
    events = json_lines(stack.proc.log())
    blocked = [e for e in events if e.get("event") == "restart_blocked"]
    assert blocked and blocked[0]["reason"] == "hang"
    decisions = [e for e in events if e.get("event") == "decision" and e.get("action") == "restart"]
    assert [d["reason"] for d in decisions] == ["context_loss", "hang", "fragmentation_drift"]


def test_log_lines_are_json_with_a_component(stack: Stack) -> None:
    events = json_lines(stack.proc.log())
    assert {e.get("component") for e in events} >= {"up", "inference"}
    assert all("timestamp" in e and "level" in e for e in events)
