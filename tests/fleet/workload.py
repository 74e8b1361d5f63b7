"""One Deployment's pods on the emulator and the Lease its sidecars share as their ledger: the setting of
the tests that run sidecars in process against the fleet's ledger (held restarts, the workers' rung),
so each builds the same workload and reads the same ledger back."""

from __future__ import annotations

import asyncio
from typing import Any

from kubernetes import client

from gpu_watchdog.watchdog.core import fleet
from gpu_watchdog.watchdog.core.fleet import LEDGER_ANNOTATION
from tests.fleet import cluster as k8s
from tests.fleet.clients import NS
from tests.integration.kmock_api import serve_events

LEASE = "gpu-watchdog-llm"


def cluster_of(kmock: Any, replicas: int) -> tuple[client.ApiClient, list[str]]:
    serve_events(kmock)
    deploy = kmock.add(k8s.deployment("llm", NS, replicas))
    rs = kmock.add(k8s.replica_set(deploy, "5c9d7b6f4x"))
    names = [f"llm-5c9d7b6f4x-{c * 5}" for c in "bcdfghjk"[:replicas]]
    for i, name in enumerate(names):
        kmock.add(k8s.pod_of(rs, name, f"node-{i}", ready=True))
    cfg = client.Configuration()
    cfg.host = str(kmock.url).rstrip("/")
    cfg.retries = 0
    return client.ApiClient(cfg), names


async def after_creation() -> None:
    """Past the clock skew a replacement may have: a slot taken now is not one these pods replace."""
    await asyncio.sleep(fleet.CLOCK_SKEW_S + 0.5)


def stored_ledger(kmock: Any) -> fleet.Ledger:
    lease = kmock.lease(NS, LEASE)
    return fleet.parse(None if lease is None else (lease["metadata"].get("annotations") or {}).get(LEDGER_ANNOTATION))
