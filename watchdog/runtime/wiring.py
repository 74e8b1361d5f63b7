"""From a config file to a running watchdog: the restarter and the Kubernetes parts its settings
call for, then the loop until a signal."""

from __future__ import annotations

import asyncio
import dataclasses
import signal
import time
from typing import TYPE_CHECKING

from gpu_watchdog import logs
from gpu_watchdog.watchdog.core.timing import WORKLOAD_TRIES
from gpu_watchdog.watchdog.edge.config import ConfigError, Settings, workload_of
from gpu_watchdog.watchdog.edge.effects.node import NodeReporter
from gpu_watchdog.watchdog.edge.effects.restart import ReportOnlyRestarter, Restarter
from gpu_watchdog.watchdog.edge.executor import FleetLedger
from gpu_watchdog.watchdog.edge.kube.kube_api import KubeApi
from gpu_watchdog.watchdog.runtime.app import Watchdog

if TYPE_CHECKING:
    from gpu_watchdog.watchdog.edge.effects.placement import Placer

log = logs.get("watchdog")


def _kube_reachable(settings: Settings) -> bool:
    """Evict and delete need the Kubernetes API; `container` uses it where it has it (its Events, the
    workload's budget, the pod rung) and works without it, on a verdict file alone."""
    k = settings.kubernetes
    if settings.restart.strategy in ("evict", "delete"):
        return True
    return settings.restart.strategy == "container" and bool(k.pod_name and k.namespace)




def api_client(settings: Settings) -> KubeApi | None:
    """The sidecar's one Kubernetes API client, where restarts go through Kubernetes (else None): every
    part that talks to the cluster shares it, and with it the API server's clock its answers teach
    (`KubeApi.now`), which the workload's records are stamped by."""
    return _api(settings, None) if _kube_reachable(settings) else None


def _api(settings: Settings, api: KubeApi | None) -> KubeApi:
    """`api` where the caller shares one, else a client of its own."""
    if api is not None:
        return api
    from gpu_watchdog.watchdog.edge.kube.kube import load_api_client

    k = settings.kubernetes
    return load_api_client(k.kubeconfig, k.request_timeout)


def resolve_workload(settings: Settings) -> str:
    """The restart budget's key: `kubernetes.workload` where an operator set it; else our pod's
    controller, read from the API at start; the pod's name pattern only where the pod cannot be read."""
    k = settings.kubernetes
    if k.workload or not _kube_reachable(settings):
        return workload_of(settings)
    from gpu_watchdog.watchdog.edge.kube.kube import PodActions, load_api_client

    error = ""
    for attempt in range(WORKLOAD_TRIES):
        try:
            api = load_api_client(k.kubeconfig, k.request_timeout)
            workload = PodActions(api, k.pod_name, k.namespace, k.request_timeout).owner_workload()
        except Exception as exc:  # 403, timeouts, an API not yet reachable: try again, then the name
            error = f"{getattr(exc, 'status', None) or type(exc).__name__}: {str(exc)[:200]}"
            if attempt + 1 < WORKLOAD_TRIES:
                time.sleep(2**attempt)
            continue
        log.info("workload", workload=workload, source="ownerReferences")
        return workload
    fallback = workload_of(settings)
    log.warning("workload_unknown", error=error, workload=fallback, source="pod name", tries=WORKLOAD_TRIES)
    return fallback


def build_restarter(settings: Settings, workload: str | None = None, api: KubeApi | None = None) -> Restarter:
    from gpu_watchdog.watchdog.edge.effects.restart import ContainerRestarter, KubeRestarter
    from gpu_watchdog.watchdog.edge.kube.kube import PodActions

    strategy = settings.restart.strategy
    if strategy == "none":
        return ReportOnlyRestarter()
    if strategy == "local":
        raise ConfigError(["restart.strategy: local only works under `gpu-watchdog up`, which owns the process"])
    k = settings.kubernetes
    pod: KubeRestarter | None = None
    if _kube_reachable(settings):
        api = _api(settings, api)
        # The pod rung of `container` evicts, as `evict` does.
        pod_settings = dataclasses.replace(settings.restart, strategy="evict") if strategy == "container" \
            else settings.restart
        pod = KubeRestarter(PodActions(api, k.pod_name, k.namespace, k.request_timeout, wall_clock=api.now),
                            pod_settings, workload=workload if workload is not None else workload_of(settings),
                            node=k.node_name or None, wall_clock=api.now)
    if strategy == "container":
        return ContainerRestarter(settings.restart.verdict_file, pod)
    assert pod is not None
    return pod


def build_node_reporter(settings: Settings, api: KubeApi | None = None) -> NodeReporter | None:
    """Only where restarts go through Kubernetes: the Events to read back are written there."""
    if not _kube_reachable(settings):
        return None
    k = settings.kubernetes
    e = settings.policy.escalation
    return NodeReporter(_api(settings, api), k.namespace, k.node_name, k.request_timeout, e.node_condition,
                        e.node_event)


def build_ledger(settings: Settings, workload: str, api: KubeApi | None = None) -> FleetLedger | None:
    """The workload's Lease, where restarts go through Kubernetes: its replicas always, and its slots
    and breaker where `policy.fleet.enabled`."""
    if not _kube_reachable(settings):
        return None
    from gpu_watchdog.watchdog.edge.effects.fleet import LeaseLedger, lease_name

    k = settings.kubernetes
    api = _api(settings, api)
    return LeaseLedger(api, k.namespace, lease_name(workload, settings.policy.fleet.lease_name), workload, k.pod_name,
                       k.request_timeout, wall_clock=api.now)


def build_placer(settings: Settings, workload: str, api: KubeApi | None = None) -> Placer | None:
    """Where placement is on (policy.placement.strategy other than off) and restarts go through Kubernetes."""
    if settings.policy.placement.strategy == "off" or not _kube_reachable(settings):
        return None
    return placer_for(settings, workload, api)


def placer_for(settings: Settings, workload: str, api: KubeApi | None = None) -> Placer:
    from gpu_watchdog.watchdog.edge.effects.placement import Placer

    k = settings.kubernetes
    return Placer(_api(settings, api), k.namespace, k.pod_name, k.node_name, workload, k.request_timeout)


async def run_until_signal(watchdog: Watchdog) -> None:
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    await watchdog.start()
    await stop.wait()
    # Stopping never acts: no drain, no restart, just leave; what our server answered is said first
    # (a scale-down or a rollout removes the pod, and with it the only word that a suspect was answered).
    await watchdog.executor.leaving()
    await watchdog.stop()
