"""Active memory that stays up at idle is reported (log, /status, metrics) and never acted on.

The inference process here is a stand-in on loopback that answers the control API with CUDA
allocator figures: a machine without a GPU has no allocator to produce them (the hardware edge).
The figures tell a leak: 10 GiB of weights, bursts of requests, and idle active memory that
ends up 8 GiB above where it started on an 80 GiB card.
"""

from __future__ import annotations

import asyncio
from typing import Any

from aiohttp import web
from prometheus_client import generate_latest
from structlog.testing import capture_logs

from gpu_watchdog.watchdog.runtime.app import Watchdog
from tests.integration.loopback import serve_everything, settings
from tests.integration.sidecar_stand_ins import RecordingRestarter

GiB = 1 << 30


def memory(active_gib: float, inflight: int) -> dict[str, Any]:
    return {"device": "cuda", "uuid": "GPU-standin", "total_bytes": 80 * GiB, "active_bytes": int(active_gib * GiB),
            "allocated_bytes": int(active_gib * GiB), "reserved_bytes": int(active_gib * GiB) + GiB,
            "inactive_split_bytes": 0, "alloc_retries": 0, "num_ooms": 0, "fragmentation_ratio": 0.05,
            "injected": False, "uptime_s": 100.0, "poisoned": False, "poison_reason": None,
            "instance_id": "standin-1", "inflight": inflight, "queued": 0,
            "admission": {"limit": 4}}


async def test_growth_of_idle_active_memory_is_reported_not_acted_on() -> None:
    # idle 10 GiB -> busy -> idle 14 -> busy -> idle 18 GiB: +8 GiB = 10 % of the card.
    story = [(10, 0), (30, 3), (14, 0), (34, 4), (18, 0)]
    hits = {"memory": 0, "empty_cache": 0}

    async def handler(request: web.Request) -> web.StreamResponse:
        if request.path.endswith("/memory"):
            active, inflight = story[min(hits["memory"], len(story) - 1)]
            hits["memory"] += 1
            return web.json_response(memory(active, inflight))
        if request.path.endswith("/canary"):
            return web.json_response({"ok": True, "latency_s": 0.01, "error_class": None})
        if request.path.endswith("/empty_cache"):
            hits["empty_cache"] += 1
        return web.json_response({"error": "unexpected"}, status=404)

    async with serve_everything(handler) as url:
        restarter = RecordingRestarter()
        wd = Watchdog(settings(url), restarter, token="t")
        with capture_logs() as logged:
            await wd.start(serve_http=False)
            try:
                for _ in range(100):
                    if hits["memory"] > len(story):
                        break
                    await asyncio.sleep(0.05)
                status = wd.status()
            finally:
                await wd.stop()

    # One line when the growth reaches the mark (second idle sample: +4 GiB = 5 %), not one per sample.
    [line] = [e for e in logged if e["event"] == "idle_memory_growth"]
    assert line["log_level"] == "warning" and line["action"] == "none"
    assert line["growth_bytes"] == 4 * GiB and line["baseline_bytes"] == 10 * GiB and line["growth_ratio"] == 0.05
    idle = status["idle_memory"]
    assert idle["baseline_bytes"] == 10 * GiB and idle["current_bytes"] == 18 * GiB
    assert idle["growth_bytes"] == 8 * GiB and idle["growing"] is True
    assert idle["idle_samples"] >= 3
    metrics = generate_latest(wd.metrics.registry).decode()
    assert 'gpu_watchdog_idle_memory_growth_bytes{device="cuda"} 8.589934592e+09' in metrics
    assert 'gpu_watchdog_idle_memory_growth_ratio{device="cuda"} 0.1' in metrics
    # A suspected leak is reported, never acted on: no restart, no cache flush.
    assert restarter.calls == [] and hits["empty_cache"] == 0
    assert not any(d["reason"] == "memory_pressure" for d in status["last_decisions"])
