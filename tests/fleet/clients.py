"""The real `kubernetes` client pointed at the emulator, and the objects and refusals the tests send and
read through it: the emulator's own tests and the scheduler's reach the cluster the same way a sidecar
does."""

from __future__ import annotations

from typing import Any

import pytest
from kubernetes import client

from tests.fleet.cluster import Cluster

NS = "serving"
DRA = "resource.k8s.io"
MANAGED = {"app.kubernetes.io/managed-by": "gpu-watchdog"}


def api_of(cluster: Cluster) -> client.ApiClient:
    cfg = client.Configuration()
    cfg.host = str(cluster.url).rstrip("/")
    cfg.retries = 0
    return client.ApiClient(cfg)


# The client's models type every field Optional; the tests read answers they just checked the status of.
def coordination(cluster: Cluster) -> Any:
    return client.CoordinationV1Api(api_of(cluster))


def core_api(cluster: Cluster) -> Any:
    return client.CoreV1Api(api_of(cluster))


def apps_api(cluster: Cluster) -> Any:
    return client.AppsV1Api(api_of(cluster))


def custom(cluster: Cluster) -> Any:
    return client.CustomObjectsApi(api_of(cluster))


def refusal(call: Any) -> client.ApiException:
    with pytest.raises(client.ApiException) as caught:
        call()
    return caught.value


def taint_rule(name: str, version: str, pool: str = "node-a", device: str = "gpu-0",
               labels: dict[str, str] | None = None, effect: str = "NoSchedule") -> dict[str, Any]:
    return {"apiVersion": f"{DRA}/{version}", "kind": "DeviceTaintRule",
            "metadata": {"name": name, "labels": dict(MANAGED if labels is None else labels),
                         "annotations": {"gpu-watchdog.io/until": "2026-01-02T00:00:00Z"}},
            "spec": {"deviceSelector": {"driver": "gpu.nvidia.com", "pool": pool, "device": device},
                     "taint": {"key": "gpu-watchdog.io/suspect", "value": device, "effect": effect}}}
