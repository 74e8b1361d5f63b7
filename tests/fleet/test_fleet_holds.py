"""A sidecar's restarts held by the workload's ledger while its server serves on: one episode said
once, no slot given back while its restart waits, the hold over once no restart is wanted.

In-process sidecars (the real Watchdog, restarter and Lease ledger, with the real `kubernetes`
client) against the emulator; each watches a real HTTP server on loopback that always answers.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

from aiohttp import web
from kubernetes import client

from gpu_watchdog.watchdog.core import fleet
from gpu_watchdog.watchdog.core.names import FLEET_UNAVAILABLE_LIMIT, HANG, MAX_AGE, RUNG_CONTAINER, RUNG_POD
from gpu_watchdog.watchdog.edge.config import from_mapping
from gpu_watchdog.watchdog.edge.effects.fleet import LeaseLedger
from gpu_watchdog.watchdog.edge.effects.node import NodeReporter
from gpu_watchdog.watchdog.edge.effects.restart import KubeRestarter
from gpu_watchdog.watchdog.edge.kube.kube import PodActions
from gpu_watchdog.watchdog.runtime.app import Watchdog
from tests.fleet.clients import NS
from tests.fleet.workload import LEASE, after_creation, cluster_of, stored_ledger
from tests.helpers import until
from tests.integration.loopback import serve_everything
from tests.integration.sidecar_stand_ins import NoNvml


@asynccontextmanager
async def serving() -> AsyncIterator[str]:
    async def handler(request: web.Request) -> web.Response:
        if request.path.endswith("/models"):
            return web.json_response({"data": [{"id": "m"}]})
        return web.json_response({"choices": [{"text": "x"}]})

    async with serve_everything(handler) as url:
        yield url


def sidecar(api: client.ApiClient, pod: str, url: str, **policy: Any) -> Watchdog:
    settings = from_mapping({
        "target": {"openai_url": url, "metrics_url": None},
        "canary": {"interval": "200ms", "timeout": "1s"},
        "policy": {"max_age_jitter": 0, **policy},
        "restart": {"strategy": "evict", "max_attempts": 50, "retry_initial": "200ms", "retry_max": "200ms"},
        "kubernetes": {"pod_name": pod, "namespace": NS, "node_name": "", "request_timeout": 5},
        "server": {"host": "127.0.0.1", "port": 0},
    })
    restarter = KubeRestarter(PodActions(api, pod, NS, 5.0), settings.restart, workload="llm")
    events = NodeReporter(api, NS, "", 5.0, False)
    ledger = LeaseLedger(api, NS, LEASE, "llm", pod, 5.0)
    return Watchdog(settings, restarter, nvml_backend=NoNvml(), restart_events=events,  # type: ignore[arg-type]
                    workload="llm", ledger=ledger)


async def test_a_restart_held_while_its_server_serves_is_one_episode_and_takes_the_slot_that_frees(
        kmock: Any) -> None:
    """A planned restart (max_age) of a serving replica while another holds the only slot: held,
    said once (however many canaries the server answers meanwhile), waiting in the ledger once, and
    carried out when the slot frees."""
    api, pods = cluster_of(kmock, 2)
    await after_creation()
    other = fleet.Slot(pods[1], HANG, RUNG_POD, 0.0)
    seed = LeaseLedger(api, NS, LEASE, "llm", pods[1], 5.0)
    await asyncio.to_thread(seed.update, lambda _l, now: (fleet.Ledger(slots=(fleet.Slot(
        other.pod, other.reason, other.rung, now),)), None))
    evictions = kmock[f"post /api/v1/namespaces/{NS}/pods/{pods[0]}/eviction"]
    async with serving() as url:
        wd = sidecar(api, pods[0], url, max_age="2s", fleet={"max_unavailable": 1})
        await wd.start(serve_http=False)
        try:
            await until(lambda: wd.executor.fleet.held == FLEET_UNAVAILABLE_LIMIT, 20, "the restart held")
            await asyncio.sleep(3.0)  # many canaries served, many asks
            assert wd.metrics.registry.get_sample_value(
                "gpu_watchdog_fleet_held_total", {"why": FLEET_UNAVAILABLE_LIMIT}) == 1.0
            held = [d for d in wd.history.decisions if d.outcome == FLEET_UNAVAILABLE_LIMIT]
            assert len(held) == 1 and held[0].reason == MAX_AGE
            # Decided once, held once: the asks every 2 s since are not decisions of their own.
            assert len([d for d in wd.history.decisions if d.outcome == "started"]) == 1
            waits = [w for w in kmock.writes_to("leases") if w.ok]
            assert len(waits) == 2  # the seed, and joining the waiting list once
            assert [w.pod for w in stored_ledger(kmock).waiting] == [pods[0]]
            assert not [r for r in evictions if "dryRun" not in r.params]
            assert FLEET_UNAVAILABLE_LIMIT in wd.states() and wd.ready()[0]  # it serves: in the Service
            status = wd.status()["fleet"]
            assert status["held"] == FLEET_UNAVAILABLE_LIMIT and status["restarting"] == [pods[1]]
            # The other replica's replacement serves: its slot is given back, ours is taken.
            await asyncio.to_thread(seed.update, lambda led, now: (fleet.give_back(led, pods[1], True), None))
            await until(lambda: wd.executor.fleet.slot_held, 20, "the freed slot taken")
            assert [s.pod for s in stored_ledger(kmock).slots] == [pods[0]]
            assert stored_ledger(kmock).waiting == ()
        finally:
            await wd.stop()


async def test_no_slot_is_given_back_while_its_restart_waits_for_the_disruption_budget(kmock: Any) -> None:
    """The slot is taken, then the PodDisruptionBudget refuses the eviction: the server serves on
    (undrained, ready) and answers every canary, and the slot stays ours until the restart is done."""
    api, pods = cluster_of(kmock, 2)
    kmock.set_disruption_budget(NS, "llm", {"app": "llm"}, 2)  # every eviction refused while both serve
    async with serving() as url:
        wd = sidecar(api, pods[0], url, max_age="1s")
        await wd.start(serve_http=False)
        try:
            await until(lambda: wd.executor.fleet.slot_held, 20, "the slot taken")
            await until(lambda: len(kmock.writes_to("pods", verb="evict")) >= 3, 20, "evictions refused")
            assert wd.history.restart_waiting and wd.ready()[0]
            served = sum(1 for c in wd.history.canaries if c.served)
            await asyncio.sleep(1.5)
            assert sum(1 for c in wd.history.canaries if c.served) > served  # canaries served meanwhile
            assert [s.pod for s in stored_ledger(kmock).slots] == [pods[0]]
            assert wd.executor.fleet.slot_held
            kmock.set_disruption_budget(NS, "llm", {"app": "llm"}, None)  # the budget allows it now
            await until(lambda: any(w.ok and not w.dry_run for w in kmock.writes_to("pods", verb="evict")), 20,
                        "the eviction")
            # The pod is going away: the slot stays until its replacement serves.
            assert [s.pod for s in stored_ledger(kmock).slots] == [pods[0]]
        finally:
            await wd.stop()
    print(json.dumps({"evictions_refused": len([w for w in kmock.writes_to("pods", verb="evict") if w.code == 429])}))


async def test_a_slot_left_behind_by_an_earlier_sidecar_is_given_back_once_the_target_serves(kmock: Any) -> None:
    """The sidecar took a slot for an in-place restart, then was restarted itself before it gave the
    slot back: the new sidecar, seeing its pod's name in the ledger and its target serving, gives it
    back (before, the fleet waited `slot_timeout`, 30 min, for it). Another pod's slot stays."""
    api, pods = cluster_of(kmock, 3)
    await after_creation()
    seed = LeaseLedger(api, NS, LEASE, "llm", pods[1], 5.0)
    await asyncio.to_thread(seed.update, lambda _l, now: (fleet.Ledger(slots=(
        fleet.Slot(pods[0], HANG, RUNG_CONTAINER, now), fleet.Slot(pods[2], HANG, RUNG_POD, now))), None))
    async with serving() as url:
        wd = sidecar(api, pods[0], url, fleet={"max_unavailable": 1})
        await wd.start(serve_http=False)
        try:
            await until(lambda: [s.pod for s in stored_ledger(kmock).slots] == [pods[2]], 30,
                        "the slot left behind given back")
            assert not wd.executor.fleet.slot_held and wd.executor.fleet.restarting == (pods[2],)
            assert not kmock.writes_to("pods", verb="evict")
        finally:
            await wd.stop()
