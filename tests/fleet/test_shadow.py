"""Shadow, end to end: real sidecars and servers of one Deployment on the API emulator, every rule dark
(`policy.enforce: shadow`), through a query of death (two lost contexts), a hang and a sick card.
Nothing is restarted, refused or tainted (the card's DeviceTaintRule has effect None); every would-have
action is in `/status`, the metrics, a Normal Event and the flight recording, and the summary of the
recordings names each with its count. Then one reason enforced: a hang restarts, a sick card does not.

Prints the summary page (read with `-s`)."""

from __future__ import annotations

import asyncio
import io
import json
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from gpu_watchdog.watchdog.cli.replay import replay_main
from tests.fleet.cluster import Cluster
from tests.fleet.harness import Fleet, FleetPod
from tests.fleet.scheduler import Scheduler
from tests.helpers import json_lines
from tests.integration.kmock_api import events as all_events

pytestmark = pytest.mark.timeout(300)

MARK = "QOD-shadow-51c2"
MARKED = {"prompt": f"compute the {MARK} shape", "max_tokens": 4}
SHADOW = {
    "canary": {"interval": "300ms", "timeout": "1s"},
    "sampling": {"torch_interval": "300ms", "device_health_interval": "300ms"},
    "restart": {"strategy": "evict"},
    "policy": {"enforce": "shadow", "hang": {"consecutive_timeouts": 2, "no_evidence_after": "1s"},
               "quarantine": {"failures": 2, "window": "1h", "ttl": "1h", "confirm": "2s"},
               "placement": {"strategy": "device"}},
}


def would_events(cluster: Cluster, pod: FleetPod) -> list[dict[str, Any]]:
    return [e for e in all_events(cluster) if e.get("reason") == "WouldRestart"
            and (e.get("regarding") or {}).get("name") == pod.name]


def removed_by_us(cluster: Cluster) -> list[tuple[str, str]]:
    return [(w.verb, w.name or "") for w in cluster.writes if w.resource == "pods" and w.verb in ("evict", "delete")
            and w.ok and not w.dry_run]


async def shadow_counts(fleet: Fleet, pod: FleetPod) -> dict[str, int]:
    try:
        status = await fleet.status(pod)
    except Exception:
        return {}
    return {f"{w['action']}:{w['reason']}": w["count"] for w in status["shadow"]["would"]}


async def metrics_text(pod: FleetPod) -> str:
    async with aiohttp.ClientSession() as http, http.get(pod.sidecar_url + "/metrics") as r:
        return await r.text()


def summary(fleet: Fleet, pods: list[FleetPod]) -> tuple[dict[str, Any], str]:
    files = [str(fleet.dir / f"{p.name}.flight.jsonl") for p in pods]
    out, err, page = io.StringIO(), io.StringIO(), io.StringIO()
    assert replay_main(files, None, [], out=out, err=err, summary="json") == 0, err.getvalue()
    assert replay_main(files, None, [], out=page, err=err, summary="text") == 0, err.getvalue()
    return json.loads(out.getvalue()), page.getvalue()


async def test_a_fleet_in_shadow_does_nothing_and_says_everything_it_would_have_done(
        kmock: Cluster, tmp_path: Path) -> None:
    scheduler = Scheduler(kmock, {"node-a": 1, "node-b": 1, "node-c": 1}, mode="dra")
    async with Fleet(kmock, tmp_path, replicas=2, sidecar_config=SHADOW, model="serve", ready_timeout=120,
                     scheduler=scheduler, serve_faults=[{"kind": "context_loss", "when_prompt_contains": MARK}]
                     ) as fleet:
        a, b = fleet.pods()
        await fleet.wait_until(lambda: all((p.name, 1) in fleet.serve_ready for p in (a, b)), 60, "faults armed")

        # A query of death: it kills A's engine, then B's. Two lost contexts, and a quarantine, in shadow.
        for pod, start in ((a, 1), (b, 1)):
            status, body = await fleet.complete(pod, MARKED)
            assert status == 500 and body["error"]["type"] == "fatal_cuda", body
            await fleet.wait_until(lambda pod=pod, start=start: (pod.name, start + 1) in fleet.serve_ready, 90,
                                   f"{pod.name}'s server started again in place")
        await fleet.wait_until(lambda: shadow_counts(fleet, b), 30, "B's would-have actions")
        await fleet.wait_until(
            lambda: asyncio.gather(*(fleet.control(p, "GET", "/control/quarantine") for p in (a, b))), 30, "lists")

        async def shadow_listed() -> bool:
            lists = [(await fleet.control(p, "GET", "/control/quarantine"))["entries"] for p in (a, b)]
            return all(entries and all(e.get("enforce") is False for e in entries) for entries in lists)

        await fleet.wait_until(shadow_listed, 60, "the request quarantined in shadow on both servers")
        # Served, not refused: the marked request (its fault cleared) is answered, and logged as it would have been.
        await fleet.control(a, "POST", "/control/fault", {"kind": "clear"})
        status, body = await fleet.complete(a, MARKED)
        assert status == 200, body
        assert [e for e in json_lines(a.model_log_text()) if e.get("event") == "would_quarantine"]

        # A hang of A's engine.
        await fleet.control(a, "POST", "/control/fault", {"kind": "hang"})
        await fleet.wait_until(lambda: would_events(kmock, a) and any(
            "hang" in e.get("note", "") for e in would_events(kmock, a)), 60, "A's hang said in a Normal Event")
        await fleet.control(a, "POST", "/control/fault", {"kind": "clear"})

        # A sick card under B.
        fleet.set_device_health(b, "Unhealthy", "XID 79: GPU has fallen off the bus")
        await fleet.wait_until(lambda: kmock.stored("devicetaintrules"), 60, "B's card in a DeviceTaintRule")
        await fleet.wait_until(lambda: any("device_health" in e.get("note", "") for e in would_events(kmock, b)), 60,
                               "B's sick card said in a Normal Event")
        await asyncio.sleep(2)  # time enough for anything done in earnest to show

        # Nothing restarted, refused or tainted.
        assert removed_by_us(kmock) == [] and fleet.deletions() == []
        assert [p.name for p in fleet.pods()] == [a.name, b.name]
        [rule] = kmock.stored("devicetaintrules")
        assert rule["spec"]["taint"]["effect"] == "None" and rule["spec"]["deviceSelector"]["device"] == "gpu-0"
        assert not any(e.get("type") == "Warning" and (e.get("regarding") or {}).get("kind") == "Pod"
                       for e in all_events(kmock))
        # Every would-have action said: /status, the metrics, a Normal Event.
        a_counts, b_counts = await shadow_counts(fleet, a), await shadow_counts(fleet, b)
        assert a_counts["restart:hang"] == 1 and a_counts["restart:context_loss"] >= 1, a_counts
        assert b_counts["restart:context_loss"] == 2 and b_counts["placement:context_loss"] == 1, b_counts
        assert a_counts.get("quarantine:context_loss", 0) + b_counts.get("quarantine:context_loss", 0) == 1
        assert 'gpu_watchdog_shadow_actions_total{action="restart",reason="hang"} 1.0' in await metrics_text(a)
        assert all(e["type"] == "Normal" for p in (a, b) for e in would_events(kmock, p))
        hang_event = next(e for e in would_events(kmock, a) if "hang" in e["note"])
        assert "stuck in " in hang_event["note"] and "faults.py" in hang_event["note"], hang_event["note"]

    # ... and the recordings: the summary names each would-have action and its count.
    report, page = summary(fleet, [a, b])
    print(page)
    would = {(w["action"], w["reason"]): w["count"] for w in report["would"]}
    assert would[("restart", "hang")] == 1 and would[("restart", "context_loss")] >= 3, would
    assert would[("quarantine", "context_loss")] == 1 and would[("placement", "context_loss")] == 1, would
    assert report["cost"]["restarts"] == sum(n for (act, _), n in would.items() if act == "restart")
    assert report["cost"]["requests_refused"] >= 1 and report["performed"] == []
    assert "Would have done, and did not (shadow):" in page and "restart      hang" in page


async def test_one_reason_enforced_restarts_for_it_and_only_says_the_others(kmock: Cluster, tmp_path: Path) -> None:
    scheduler = Scheduler(kmock, {"node-a": 1, "node-b": 1, "node-c": 1}, mode="dra")
    config = {**SHADOW, "policy": {**SHADOW["policy"], "enforce": ["hang"]}}
    async with Fleet(kmock, tmp_path, replicas=2, sidecar_config=config, scheduler=scheduler) as fleet:
        a, b = fleet.pods()
        fleet.set_device_health(b, "Unhealthy", "XID 79")
        await fleet.wait_until(lambda: would_events(kmock, b), 60, "B's sick card said in a Normal Event")
        await fleet.hang(a)
        await fleet.wait_until(lambda: removed_by_us(kmock), 60, "A's hang restarted")
        await asyncio.sleep(1)
        assert removed_by_us(kmock) == [("evict", a.name)]
        assert b.alive and [r["spec"]["taint"]["effect"] for r in kmock.stored("devicetaintrules")] == ["None"]
        assert fleet.events_of(a, "restart_finished")[0]["done"] is True
