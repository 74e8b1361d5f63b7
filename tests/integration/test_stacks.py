"""Stacks before the kill: a hang of the bundled server, and of the agent's example app, on real
processes. The sidecar decides the hang, asks the process for every thread's stack first (`POST
/control/stacks`), and the stuck frame is named in the process's termination log, in the sidecar's
flight recording and in what its restart says."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import yaml

from gpu_watchdog.inference import stacks
from tests.helpers import (
    ROOT,
    Proc,
    Server,
    free_port,
    json_lines,
    spawn,
    spawn_python,
    start_server,
    wait_for,
    wait_http,
)

pytestmark = pytest.mark.timeout(240)


def sidecar(tmp_path: Path, target: Server, token: str, metrics_url: str | None) -> tuple[Proc, Path, int]:
    """A real `gpu-watchdog run` that reports restarts only (strategy none), recording."""
    port = free_port()
    recording = tmp_path / "flight.jsonl"
    config = tmp_path / "watchdog.yaml"
    config.write_text(yaml.safe_dump({
        "target": {"control_url": target.control, "token_file": None, "metrics_url": metrics_url},
        "canary": {"interval": "300ms", "timeout": "1s"},
        "policy": {"hang": {"consecutive_timeouts": 2, "no_evidence_after": "1s"}},
        "restart": {"strategy": "none"}, "server": {"host": "127.0.0.1", "port": port},
        "recorder": {"path": str(recording)}}))
    proc = spawn(["run", "--config", str(config)], tmp_path / "watchdog.log", env={"GPU_WATCHDOG_TOKEN": token})
    wait_http(f"http://127.0.0.1:{port}/readyz", proc, timeout=60)
    return proc, recording, port


def recorded_stacks(recording: Path) -> list[dict[str, Any]]:
    out = []
    for line in recording.read_text().splitlines() if recording.exists() else []:
        try:
            item = json.loads(line)
        except ValueError:
            continue  # a line being written
        if item.get("kind") == "in" and item.get("type") == "StacksTaken":
            out.append(item["v"]["stacks"])
    return out


def hang_is_named(target: Server, tmp_path: Path, token: str, metrics_url: str | None, termination: Path) -> None:
    wd, recording, _ = sidecar(tmp_path, target, token, metrics_url)
    try:
        target.fault("hang")
        [taken] = wait_for(lambda: recorded_stacks(recording), 60, "the hang's stacks in the flight recording")
        # The stuck frame: the engine's (or the app's worker's) wait on the hung kernel, named in the recording...
        assert taken["source"] == "control" and taken["error"] is None, taken
        assert "faults.py" in taken["stuck"] and " in " in taken["stuck"], taken
        stuck_thread = next(frames for name, frames in taken["threads"] if taken["stuck"].endswith(f"({name})"))
        assert any("faults.py" in f for f in stuck_thread)
        # ... in the process's termination log, which outlives it (the kubelet keeps it in the pod's status) ...
        text = termination.read_text()
        assert text.startswith("gpu-watchdog inference: stacks for hang; stuck in ") and "faults.py" in text
        assert len(text.encode()) <= stacks.TERMINATION_MAX
        # ... and in what the restart says (its log line; its Event's note where there is a cluster).
        decided = wait_for(lambda: [e for e in json_lines(wd.log()) if e.get("event") == "restart_finished"
                                    or (e.get("event") == "decision" and e.get("action") == "restart")], 30,
                           "the restart decided")
        assert decided[0]["detail"]["stuck"] == taken["stuck"], decided[0]
        # Once per process: the restart reported only, then still hung, takes no second dump.
        assert len(recorded_stacks(recording)) == 1
    finally:
        target.fault("clear")
        wd.stop()


def test_a_hang_of_the_bundled_server_leaves_where_it_was_stuck(tmp_path: Path) -> None:
    termination = tmp_path / "termination-log"
    srv = start_server(tmp_path, "--fault-injection", env={"GPU_WATCHDOG_TERMINATION_LOG": str(termination)})
    try:
        hang_is_named(srv, tmp_path, srv.token, srv.url + "/metrics", termination)
    finally:
        srv.proc.stop()


def test_a_hang_of_the_agents_example_app_leaves_where_it_was_stuck(tmp_path: Path) -> None:
    termination = tmp_path / "termination-log"
    token = "stacks-agent-token"
    port, control_port = free_port(), free_port()
    proc = spawn_python([str(ROOT / "examples/fastapi_service/app.py"), "--port", str(port), "--control-port",
                         str(control_port), "--fault-injection"], tmp_path / "app.log",
                        env={"GPU_WATCHDOG_TOKEN": token, "GPU_WATCHDOG_TERMINATION_LOG": str(termination)})
    app = Server(port, control_port, token, proc)
    try:
        wait_http(f"http://127.0.0.1:{port}/healthz", proc, timeout=120)
        hang_is_named(app, tmp_path, token, None, termination)
    finally:
        proc.stop()
