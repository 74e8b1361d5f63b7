"""`gpu_watchdog_restarts_total{reason}` counts each performed restart under its own reason, and only those."""

from __future__ import annotations

import pytest

from gpu_watchdog.watchdog.core.names import RESTART_REASONS
from gpu_watchdog.watchdog.core.policy import Decision
from gpu_watchdog.watchdog.edge.config import from_mapping
from gpu_watchdog.watchdog.runtime.app import Watchdog
from tests.integration.sidecar_stand_ins import NoNvml, Restarter


def watchdog(restarter: Restarter) -> Watchdog:
    settings = from_mapping({
        "target": {"openai_url": "http://127.0.0.1:9", "metrics_url": None},
        "canary": {"interval": "1h", "timeout": "1s"},
        "restart": {"strategy": "none"},
        "server": {"host": "127.0.0.1", "port": 0},
    })
    return Watchdog(settings, restarter, nvml_backend=NoNvml())  # type: ignore[arg-type]


def counts(wd: Watchdog, rung: str = "pod") -> dict[str, float]:
    return {r: wd.metrics.registry.get_sample_value("gpu_watchdog_restarts_total", {"reason": r, "rung": rung})
            or 0.0 for r in RESTART_REASONS}


@pytest.mark.parametrize("reason", RESTART_REASONS)
async def test_each_reason_counts_under_its_own_label(reason: str) -> None:
    restarter = Restarter(done=True)
    wd = watchdog(restarter)
    await wd.start(serve_http=False)
    try:
        assert set(counts(wd).values()) == {0.0}  # every reason exported from the start
        await wd.running.restarts.run(0, Decision("restart", reason, {"why": "test"}))
        assert counts(wd) == {r: 1.0 if r == reason else 0.0 for r in RESTART_REASONS}
        assert restarter.calls == [reason]
        assert wd.history.actions[-1].reason == reason and wd.history.served_at is None
    finally:
        await wd.stop()


async def test_a_restart_that_did_not_happen_is_not_counted() -> None:
    wd = watchdog(Restarter(done=False))
    await wd.start(serve_http=False)
    try:
        await wd.running.restarts.run(0, Decision("restart", "hang", {}))
        assert set(counts(wd).values()) == {0.0}
        assert wd.history.edge.restart_failed == "refused"
        assert wd.metrics.registry.get_sample_value(
            "gpu_watchdog_decisions_total", {"action": "restart", "reason": "hang", "outcome": "failed"}) == 1.0
    finally:
        await wd.stop()
