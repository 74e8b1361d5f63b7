"""Restarts that do not cure, read back from the namespace's Events through the real client and kmock."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
from kubernetes import client

from gpu_watchdog.watchdog.core import edges
from gpu_watchdog.watchdog.core.policy import Decision
from gpu_watchdog.watchdog.edge.config import from_mapping
from gpu_watchdog.watchdog.edge.effects.node import NodeReporter
from gpu_watchdog.watchdog.edge.effects.restart import annotations_for, event_reason, note_for
from gpu_watchdog.watchdog.edge.kube.kube import PodActions
from gpu_watchdog.watchdog.runtime.app import Watchdog
from tests.integration.kmock_api import NODE, NS, OTHER, OURS, POD, objects
from tests.integration.sidecar_stand_ins import NoNvml, Restarter


def earlier_restart(api: client.ApiClient, pod_name: str, reason: str, gpu: str, xid: int | None = None) -> None:
    """What an earlier sidecar wrote when it restarted its pod (the same code path)."""
    detail: dict[str, Any] = {"evidence": "xid" if xid else "canary", "gpus": [gpu]}
    if xid:
        detail["xid"] = xid
    d = Decision("restart", reason, detail)
    PodActions(api, pod_name, NS, 5).record_event(pod_name, NS, event_reason(reason), note_for(d), "Evict",
                                                    annotations=annotations_for(d))


def watchdog(api: client.ApiClient, condition: bool) -> Watchdog:
    settings = from_mapping({
        "target": {"openai_url": "http://127.0.0.1:9", "metrics_url": None},
        "canary": {"interval": "1h", "timeout": "1s"},
        "restart": {"strategy": "none"},
        "policy": {"escalation": {"restarts": 2, "window": "24h", "node_condition": condition}},
        "kubernetes": {"pod_name": POD, "namespace": NS, "node_name": NODE},
        "server": {"host": "127.0.0.1", "port": 0},
    })
    node = NodeReporter(api, NS, NODE, 5.0, condition)
    return Watchdog(settings, Restarter(done=True), nvml_backend=NoNvml(),  # type: ignore[arg-type]
                    pod_gpus=lambda: (OURS,), node=node)


async def run(wd: Watchdog, seconds: float = 0.5) -> dict[str, Any]:
    await wd.start(serve_http=False)
    try:
        await asyncio.sleep(seconds)
        return wd.status()
    finally:
        await wd.stop()


async def test_two_restarts_for_our_gpu_make_it_suspect_on_the_node(kmock: Any, api: client.ApiClient) -> None:
    # Another replica, the same card, earlier; then ours (as the real restarter writes them).
    await asyncio.to_thread(earlier_restart, api, "model-1", "context_loss", OURS, 79)
    await asyncio.to_thread(earlier_restart, api, POD, "hang", OURS)
    patches = kmock[f"patch /api/v1/nodes/{NODE}/status"] << 200 << {
        "apiVersion": "v1", "kind": "Node", "metadata": {"name": NODE}}
    status = await run(watchdog(api, condition=False))
    assert status["gpu_suspect"] == [{"uuid": OURS, "restarts": 2, "reasons": ["context_loss", "hang"],
                                      "xids": [79], "driver_says": None, "node_action": None,
                                      "answers": None}]
    assert "gpu_suspect" in status["states"]
    [ev] = [e for e in objects(kmock, "events") if e["reason"] == "GPUSuspect"]
    assert ev["type"] == "Warning" and ev["metadata"]["namespace"] == "default"
    assert ev["regarding"] == {"kind": "Node", "apiVersion": "v1", "name": NODE}
    assert OURS in ev["note"] and "Xid 79" in ev["note"] and "context_loss, hang" in ev["note"]
    assert len(patches) == 0  # the Node condition is opt-in


async def test_with_the_condition_on_the_node_status_is_patched(kmock: Any, api: client.ApiClient) -> None:
    await asyncio.to_thread(earlier_restart, api, POD, "hang", OURS)
    await asyncio.to_thread(earlier_restart, api, POD, "context_loss", OURS)
    kmock.objects["v1/nodes", None, NODE] = {"apiVersion": "v1", "kind": "Node", "metadata": {"name": NODE},
                                              "status": {"conditions": [{"type": "Ready", "status": "True"}]}}
    patches = kmock[f"patch /api/v1/nodes/{NODE}/status"]
    wd = watchdog(api, condition=True)
    await run(wd)
    assert wd.metrics.registry.get_sample_value("gpu_watchdog_gpu_suspect", {"uuid": OURS}) == 1.0
    [req] = list(patches)
    assert "strategic-merge-patch" in req.headers.get("Content-Type", "")
    [cond] = req.data["status"]["conditions"]
    assert (cond["type"], cond["status"], cond["reason"]) == ("GPUSuspect", "True", "RepeatedGPURestarts")
    assert OURS in cond["message"] and cond["lastTransitionTime"].endswith("Z")
    node = kmock.objects["v1/nodes", None, NODE]
    conditions = {c["type"]: c["status"] for c in dict(getattr(node, "raw", None) or node)["status"]["conditions"]}
    assert conditions["GPUSuspect"] == "True"


async def test_restarts_for_another_gpu_or_for_age_are_nothing(kmock: Any, api: client.ApiClient) -> None:
    await asyncio.to_thread(earlier_restart, api, "model-1", "hang", OTHER)
    await asyncio.to_thread(earlier_restart, api, "model-1", "context_loss", OTHER)
    await asyncio.to_thread(earlier_restart, api, POD, "hang", OURS)  # one alone is not a pattern
    status = await run(watchdog(api, condition=True))
    assert status["gpu_suspect"] == [] and "gpu_suspect" not in status["states"]
    assert [e for e in objects(kmock, "events") if e["reason"] == "GPUSuspect"] == []


async def test_a_403_on_listing_events_is_reported_once_never_a_crash(kmock: Any, api: client.ApiClient,
                                                                   monkeypatch: pytest.MonkeyPatch,
                                                                   capsys: pytest.CaptureFixture[str]) -> None:
    forbidden = kmock[f"get /apis/events.k8s.io/v1/namespaces/{NS}/events"] << 403 << {
        "kind": "Status", "code": 403, "message": "events is forbidden: cannot list resource"}
    # The backoff would hold the next look for 30 s.
    monkeypatch.setattr(edges, "ESCALATION_RETRY_S", 0.0)
    wd = watchdog(api, condition=False)
    await wd.start(serve_http=False)
    try:
        await asyncio.sleep(0.3)
        await wd.escalate("hang")
        ok, _ = wd.healthy()
        assert ok and wd.suspects == {}
    finally:
        await wd.stop()
    assert len(forbidden) == 2
    assert capsys.readouterr().out.count("escalation_failed") == 1
