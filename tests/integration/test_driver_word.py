"""The driver's word through the whole sidecar, against kmock's Kubernetes API and the real client:
a recovery action the GPU reports is told to its Node at once, and a GPU our pod's status reports
unhealthy restarts the pod."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest
from kubernetes import client

from gpu_watchdog.watchdog.core.policy import Decision
from gpu_watchdog.watchdog.edge.config import from_mapping
from gpu_watchdog.watchdog.edge.effects.node import NodeReporter
from gpu_watchdog.watchdog.edge.effects.restart import DrainHandle, RestartOutcome
from gpu_watchdog.watchdog.runtime.app import Watchdog
from tests.integration.kmock_api import NODE, NS, OURS, POD, objects
from tests.integration.sidecar_stand_ins import NoNvml
from tests.unit.fake_nvml import FakeNvml


class ProcessRestarter:
    """Restarts the process it owns (as `up` does): every decision it was handed, in order."""

    strategy = "local"

    def __init__(self) -> None:
        self.decisions: list[Decision] = []

    async def restart(self, decision: Decision, drain: DrainHandle) -> RestartOutcome:
        self.decisions.append(decision)
        return RestartOutcome(True, "restarted", rung="process")

    async def target_served(self, at_wall: float) -> None:
        return None

    async def record_event(self, decision: Decision, action: str, prefix: str = "") -> str | None:
        return None  # no cluster


def settings(**kubernetes: Any) -> Any:
    return from_mapping({
        "target": {"openai_url": "http://127.0.0.1:9", "metrics_url": None},
        "sampling": {"nvml_interval": "50ms"},
        "canary": {"interval": "1h", "timeout": "1s"},
        "restart": {"strategy": "none"},
        "policy": {"escalation": {"restarts": 2, "window": "24h", "node_condition": False}},
        "kubernetes": {"pod_name": POD, "namespace": NS, "node_name": NODE, **kubernetes},
        "server": {"host": "127.0.0.1", "port": 0},
    })


async def test_one_recovery_action_fault_gives_one_node_event_at_once(kmock: Any, api: client.ApiClient) -> None:
    gpu = FakeNvml()
    gpu.visible = [OURS]
    gpu.used = {OURS: 2**30}
    gpu.recovery[OURS] = 1  # NVML_GPU_RECOVERY_ACTION_GPU_RESET
    restarter = ProcessRestarter()
    wd = Watchdog(settings(), restarter, nvml_backend=gpu, pod_gpus=lambda: (OURS,),  # type: ignore[arg-type]
                  node=NodeReporter(api, NS, NODE, 5.0, node_condition=False))
    await wd.start(serve_http=False)
    try:
        await asyncio.sleep(1.0)
        status = wd.status()
    finally:
        await wd.stop()
    # No restart Events were there to read back: the report came from the driver's word alone.
    [ev] = [e for e in objects(kmock, "events") if e["reason"] == "GPUSuspect"]
    assert ev["regarding"] == {"kind": "Node", "apiVersion": "v1", "name": NODE} and ev["type"] == "Warning"
    assert OURS in ev["note"] and "the driver says GPU_RESET" in ev["note"] and "reset_gpu" in ev["note"]
    assert [s["uuid"] for s in status["gpu_suspect"]] == [OURS] and "gpu_suspect" in status["states"]
    # The card still says so after each restart: restarted again within the budget, never reported twice.
    assert len(restarter.decisions) >= 2
    assert {(d.detail["evidence"], d.detail["recovery_action"]) for d in restarter.decisions} == {
        ("recovery_action", "GPU_RESET")}
    assert status["last_samples"]["gpus"][0]["recovery_action"] == 1


def kubeconfig(tmp_path: Path, url: str) -> str:
    """A real kubeconfig file pointing the client at kmock, as an operator's would point it at a cluster."""
    path = tmp_path / "kubeconfig"
    path.write_text(f"""apiVersion: v1
kind: Config
clusters: [{{name: kmock, cluster: {{server: "{url}"}}}}]
users: [{{name: tester, user: {{token: not-checked}}}}]
contexts: [{{name: kmock, context: {{cluster: kmock, user: tester, namespace: {NS}}}}}]
current-context: kmock
""")
    return str(path)


def pod_with_gpu(health: str | None) -> dict[str, Any]:
    inference: dict[str, Any] = {"name": "inference", "image": "gpu-watchdog-inference", "imageID": "sha256:1",
                                 "ready": True, "restartCount": 0}
    if health is not None:
        inference["allocatedResourcesStatus"] = [
            {"name": "nvidia.com/gpu", "resources": [{"resourceID": OURS, "health": health}]}]
    return {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": POD, "namespace": NS},
            "spec": {"containers": [{"name": "inference", "image": "gpu-watchdog-inference"},
                                    {"name": "watchdog", "image": "gpu-watchdog"}]},
            "status": {"phase": "Running", "containerStatuses": [
                inference, {"name": "watchdog", "image": "gpu-watchdog", "imageID": "sha256:2", "ready": True,
                            "restartCount": 0}]}}


@pytest.mark.parametrize("health", ["Unhealthy", "Healthy", None])
async def test_a_gpu_our_pods_status_reports_unhealthy_restarts_the_pod(kmock: Any, api: client.ApiClient,
                                                                       tmp_path: Path, health: str | None) -> None:
    kmock.objects["v1/pods", NS, POD] = pod_with_gpu(health)
    restarter = ProcessRestarter()
    wd = Watchdog(settings(kubeconfig=kubeconfig(tmp_path, str(kmock.url).rstrip("/"))), restarter,
                  nvml_backend=NoNvml(), pod_gpus=lambda: (OURS,))  # type: ignore[arg-type]
    await wd.start(serve_http=False)
    try:
        await asyncio.sleep(1.0)
    finally:
        await wd.stop()
    if health != "Unhealthy":
        assert restarter.decisions == []  # healthy, or nothing known: never a restart
        return
    [d] = restarter.decisions  # read once (every 30 s): one restart
    assert (d.reason, d.rung, d.detail["evidence"], d.detail["resource_id"], d.detail["container"]) == (
        "context_loss", "pod", "device_health", OURS, "inference")
