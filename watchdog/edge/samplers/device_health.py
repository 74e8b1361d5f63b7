"""Our pod's GPUs' health as the kubelet reports it in the pod's own status (KEP-4680).

`status.containerStatuses[].allocatedResourcesStatus`: `[{name: "nvidia.com/gpu", resources: [{resourceID,
health: Healthy | Unhealthy | Unknown}]}]`, filled by the kubelet from the device plugin's health (feature
gate `ResourceHealthStatus`: alpha in Kubernetes 1.31, beta in 1.36), read from the pod's JSON as the API
sends it. A DRA device is reported under its claim
(`claim:<claim>/<request>`) with the ID `<driver>/<pool>/<device>`; a GPU driver's are ours. Read with
the `get` on our own pod the sidecar has already; where the field is absent nothing is known, which is
never a restart.
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import Callable
from typing import Any

from gpu_watchdog import logs
from gpu_watchdog.watchdog.core.names import GPU_DRIVERS
from gpu_watchdog.watchdog.core.samples import DeviceHealth, DeviceHealthSample
from gpu_watchdog.watchdog.core.settings import Settings
from gpu_watchdog.watchdog.edge.kube.kube import load_api_client, pod_path
from gpu_watchdog.watchdog.edge.samplers.pod_resources import GPU_RESOURCE_PREFIX

log = logs.get("watchdog.device_health")

CLAIM_PREFIX = "claim:"  # a DRA device's entry (KEP-4680)


def is_gpu(resource: str, resource_id: str) -> bool:
    """A device-plugin GPU (nvidia.com/gpu, a MIG slice) or a GPU driver's DRA device."""
    if resource.startswith(GPU_RESOURCE_PREFIX):
        return True
    return resource.startswith(CLAIM_PREFIX) and resource_id.split("/", 1)[0] in GPU_DRIVERS


def device_health(pod: dict[str, Any], at: float) -> DeviceHealthSample:
    """The GPU devices of every container of `pod` (the API's JSON) with their health, as read at `at`."""
    statuses = (pod.get("status") or {}).get("containerStatuses") or []
    devices = [
        DeviceHealth(container=str(c.get("name") or ""), resource=str(r.get("name") or ""),
                     resource_id=str(d.get("resourceID") or ""), health=str(d.get("health") or "Unknown"),
                     message=None if d.get("message") is None else str(d["message"]))
        for c in statuses if isinstance(c, dict)
        for r in c.get("allocatedResourcesStatus") or [] if isinstance(r, dict)
        for d in r.get("resources") or [] if isinstance(d, dict) and is_gpu(str(r.get("name") or ""),
                                                                             str(d.get("resourceID") or ""))
    ]
    return DeviceHealthSample(at=at, read=True, devices=tuple(devices))


class DeviceHealthSampler:
    """Reads our pod through the API (blocking, in a thread); says once what changed."""

    def __init__(self, read_pod: Callable[[], Any], clock: Callable[[], float], interval: float) -> None:
        self.read_pod = read_pod
        self.clock = clock
        self.interval = interval  # the kubelet updates the status when the plugin's health changes
        self._error: str | None = None
        self._health: dict[str, str] = {}

    async def sample(self) -> DeviceHealthSample:
        try:
            pod = await asyncio.to_thread(self.read_pod)
        except Exception as exc:  # 403, timeouts, garbage: nothing learnt this time
            error = f"{getattr(exc, 'status', None) or type(exc).__name__}: {str(exc)[:200]}"
            if error != self._error:
                log.warning("device_health_unreadable", error=error, retry_in_s=self.interval)
            self._error = error
            return DeviceHealthSample(at=self.clock(), read=False, error=error)
        self._error = None
        sample = device_health(pod, self.clock())
        health = {d.resource_id: d.health for d in sample.devices}
        if health != self._health:
            log.info("device_health", devices=[{"container": d.container, "resource_id": d.resource_id,
                                                "health": d.health, "message": d.message} for d in sample.devices])
        self._health = health
        return sample


def pod_reader(settings: Settings) -> Callable[[], Any] | None:
    """A blocking read of our own pod where the Kubernetes API is configured (in a cluster, or a kubeconfig
    named in the settings) and our pod is named; None elsewhere (`gpu-watchdog up`, a laptop)."""
    k = settings.kubernetes
    if not (k.pod_name and k.namespace) or (k.kubeconfig is None and not os.environ.get("KUBERNETES_SERVICE_HOST")):
        return None
    api = load_api_client(k.kubeconfig, k.request_timeout)
    pod = pod_path(k.namespace, k.pod_name)
    return lambda: api.get(pod, timeout=k.request_timeout)
