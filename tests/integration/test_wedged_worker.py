"""A worker wedged past its own control API: hung, and `POST /control/exit` never answers. Its
restart cannot be told, so after `EXIT_TRIES` failed exits of that process the worker rung falls
back to the container's (the verdict written, as for the watched worker), and is not tried again.

Two real processes of the hostile agent app are the service's two workers (each agent takes the
next free port of one range: worker 0, then worker 1); the real sidecar watches both.
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest
import requests
import structlog

from gpu_watchdog.benchmarks._procs import free_port, free_ports
from gpu_watchdog.watchdog.core import policy
from gpu_watchdog.watchdog.core.history import History
from gpu_watchdog.watchdog.core.names import HANG, MAX_AGE, RUNG_CONTAINER, RUNG_WORKER
from gpu_watchdog.watchdog.core.samples import RESTART_FAILED, WorkerCanaries, WorkerRestarted
from gpu_watchdog.watchdog.core.state import RestartEnded, reduce
from gpu_watchdog.watchdog.core.timing import EXIT_TRIES
from gpu_watchdog.watchdog.edge.config import from_mapping
from gpu_watchdog.watchdog.edge.effects.restart import ContainerRestarter
from gpu_watchdog.watchdog.runtime.app import Watchdog
from tests.helpers import ROOT, async_wait, spawn_python, wait_for, wait_http
from tests.integration.sidecar_stand_ins import NoNvml
from tests.integration.workers import memory
from tests.unit.histories import history, settings, worker_canary

TOKEN = "wedged-token"
APP = str(ROOT / "tests/integration/hostile_agent_app.py")


async def test_a_worker_its_control_api_cannot_tell_to_exit_gets_the_container_s_rung(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # A failed restart is tried again after 30 s: 1 s here, the exits' own 5 s timeouts as they are.
    monkeypatch.setattr(policy, "RESTART_RETRY_S", 1.0)
    base = free_ports(2)
    env = {"GPU_WATCHDOG_TOKEN": TOKEN}
    ports = [free_port(), free_port()]
    workers = []
    try:
        for k, flags in enumerate([(), ("--fault-injection", "--exit-never-answers")]):
            proc = spawn_python([APP, "--port", str(ports[k]), "--control-port", str(base), *flags],
                                tmp_path / f"worker-{k}.log", env=env)
            workers.append(proc)
            await asyncio.to_thread(wait_http, f"http://127.0.0.1:{ports[k]}/ok", proc, 120)
            # Started one after the other: the first holds `base`, the second takes the next port.
            await asyncio.to_thread(wait_for, lambda k=k: _memory(base + k), 60, f"worker {k}'s control API")
        pid1 = memory(base + 1, TOKEN)["pid"]
        verdict = tmp_path / "verdict"
        settings = from_mapping({
            "target": {"control_url": f"http://127.0.0.1:{base}", "token_file": None, "metrics_url": None,
                       "workers": 2},
            "sampling": {"torch_interval": "200ms"}, "canary": {"interval": "300ms", "timeout": "1s"},
            "policy": {"hang": {"consecutive_timeouts": 2}},
            "restart": {"strategy": "container", "verdict_file": str(verdict), "drain_timeout": "2s"},
            "server": {"host": "127.0.0.1", "port": 0},
        })
        wd = Watchdog(settings, ContainerRestarter(str(verdict)), nvml_backend=NoNvml(), token=TOKEN)  # type: ignore[arg-type]
        await wd.start(serve_http=False)
        try:
            with structlog.testing.capture_logs() as logs:
                async def served() -> bool:
                    return wd.history.served_at is not None and any(
                        c.served for c in wd.history.worker_canaries.get(1, ()))

                await async_wait(served, 60, "both workers served a canary")
                r = await asyncio.to_thread(requests.post, f"http://127.0.0.1:{base + 1}/control/fault",
                                            json={"kind": "hang"}, headers={"Authorization": f"Bearer {TOKEN}"},
                                            timeout=10)
                assert r.status_code == 200, r.text

                async def restarted() -> bool:
                    return verdict.exists()

                await async_wait(restarted, 90, "the container's verdict written")
                # Not tried again: worker 1 still hangs, but what it said before the container's
                # restart is about a process gone, and it has not served since.
                await asyncio.sleep(4.0)
            failed = [e for e in logs if e["event"] == "worker_exit_failed"]
            assert len(failed) == EXIT_TRIES and {e["worker"] for e in failed} == {1}
            assert all("timed out" in e["error"] for e in failed)
            [fallback] = [e for e in logs if e["event"] == "worker_unreachable_fallback"]
            assert (fallback["worker"], fallback["tries"], fallback["rung"]) == (1, EXIT_TRIES, RUNG_CONTAINER)
            assert "timed out" in fallback["error"]
            names = [e["event"] for e in logs]
            assert names.index("worker_unreachable_fallback") > max(i for i, n in enumerate(names)
                                                                    if n == "worker_exit_failed")
            finished = [e for e in logs if e["event"] == "restart_finished"]
            assert [(e["reason"], e["rung"], e["done"]) for e in finished] == [(HANG, RUNG_CONTAINER, True)]
            # One failed exit said as a failed restart (backed off); the last one is the fallback's.
            assert len([e for e in logs if e["event"] == "restart_failed"]) == EXIT_TRIES - 1
            assert verdict.read_text().split()[1] == HANG
            # The restart as /status has it, and counted once, on the container's rung.
            restarts = wd.status()["restarts"]
            assert [(r["reason"], r["rung"]) for r in restarts] == [(HANG, RUNG_CONTAINER)]
            registry = wd.metrics.registry
            assert registry.get_sample_value("gpu_watchdog_restarts_total",
                                             {"reason": HANG, "rung": RUNG_CONTAINER}) == 1.0
            assert not registry.get_sample_value("gpu_watchdog_restarts_total", {"reason": HANG, "rung": RUNG_WORKER})
            outcomes = [(d.outcome, d.detail.get("exit_tries")) for d in wd.history.decisions
                        if d.detail.get("worker") == 1]
            assert outcomes[-2:] == [("started", EXIT_TRIES), ("done", EXIT_TRIES)]
            assert not wd.executor.acting() and not wd.history.restart_in_progress
        finally:
            await wd.stop()
        assert workers[1].proc.poll() is None and memory(base + 1, TOKEN)["pid"] == pid1  # never left
    finally:
        for proc in workers:
            await asyncio.to_thread(proc.stop)


def test_after_the_container_s_restart_what_another_worker_said_before_is_about_a_process_gone() -> None:
    s = settings()

    def hung(h: History, at: float, instance: str) -> History:
        h = reduce(h, WorkerCanaries(at, ((1, worker_canary(at, True, instance)),)))
        for t in (at + 5, at + 10, at + 15):
            h = reduce(h, WorkerCanaries(t, ((1, worker_canary(t, False, instance)),)))
        return h

    # Its timeouts before the container restarted (for any reason) are the old process's.
    h = hung(history(worker_count=2), 5, "w1")
    assert len(policy.other_workers(s, h, 20)) == 1
    h = reduce(h, RestartEnded(at=22, reason=MAX_AGE, done=True, keep_unready=False, rung=RUNG_CONTAINER))
    assert policy.other_workers(s, h, 23) == []
    h = reduce(h, WorkerCanaries(25, ((1, worker_canary(25, False, "w1")),)))
    assert policy.other_workers(s, h, 26) == []  # not served since: loading (or the old one, going)
    # Its failed restarts too: two back the next one off for 60 s, but the container's restart ended them.
    h = hung(h, 30, "w2")
    h = reduce(h, WorkerRestarted(46, 1, HANG, "w2", RESTART_FAILED))
    h = reduce(h, WorkerRestarted(46 + policy.RESTART_RETRY_S, 1, HANG, "w2", RESTART_FAILED))
    assert policy.other_workers(s, h, 80) == []
    h = reduce(h, RestartEnded(at=80, reason=HANG, done=True, keep_unready=False, rung=RUNG_CONTAINER,
                               instance_id="w2"))
    h = hung(h, 85, "w3")
    [d] = policy.other_workers(s, h, 100)
    assert (d.detail["worker"], d.instance_id) == (1, "w3")


def _memory(port: int) -> dict[str, Any] | None:
    try:
        return memory(port, TOKEN)
    except (AssertionError, requests.RequestException):
        return None
