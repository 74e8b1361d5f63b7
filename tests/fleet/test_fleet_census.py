"""Availability counted from what the cluster says, with real sidecars on the API emulator: a ledger
that vanishes mid-restart, a pod removed by someone else (a node drain) and a node whose clock runs
30 s fast never put a second replica out with `max_unavailable: 1`, nor hold the fleet for
`slot_timeout`; and the census itself, read through the real edge.

Each scenario prints one line of figures, read with `-s`.
"""

from __future__ import annotations

import asyncio
import time
from pathlib import Path
from typing import Any

from kubernetes import client

from gpu_watchdog.watchdog.core import fleet
from gpu_watchdog.watchdog.core.fleet import LEDGER_ANNOTATION
from gpu_watchdog.watchdog.core.names import FLEET_UNAVAILABLE_LIMIT
from gpu_watchdog.watchdog.edge.effects.fleet import LeaseLedger, LedgerUnavailable
from gpu_watchdog.watchdog.edge.kube.kube_api import parse_time
from tests.fleet import cluster as k8s
from tests.fleet.clients import NS, api_of
from tests.fleet.harness import Fleet, FleetPod
from tests.fleet.readouts import figures, held_lines
from tests.fleet.workload import LEASE, stored_ledger
from tests.integration.kmock_api import events
from tests.tooling import faketime_env

ONE = {"policy": {"fleet": {"max_unavailable": "1"}}}


def by_sidecars(f: Fleet, drained: set[str]) -> list[str]:
    return [m.pod for m in f.deletions() if m.pod not in drained]


async def test_a_ledger_wiped_mid_restart_never_puts_a_second_replica_out(kmock: Any, tmp_path: Path) -> None:
    """A hangs and its replacement takes 10 s to load; meanwhile an operator empties the Lease's
    ledger. B hangs next: the ledger now says nothing is restarting, but the cluster shows A's
    replacement not Ready, so B waits for it (before, a read that found no ledger was a licence)."""
    async with Fleet(kmock, tmp_path, replicas=4, sidecar_config=ONE, replacement_delay=10.0) as f:
        a, b = f.pods()[0], f.pods()[1]
        await f.hang(a)
        await f.wait_until(lambda: len(f.deletions()) == 1, 30, "A restarted")
        kmock.mutate("leases", NS, LEASE, lambda lease: lease["metadata"].setdefault("annotations", {}).pop(
            LEDGER_ANNOTATION, None))
        assert stored_ledger(kmock).slots == ()
        replacement = next(p for p in f.pods() if p.replaces == a.name)
        assert replacement.ready_at is None
        await f.hang(b)
        await f.wait_until(lambda: b.name in held_lines(f, FLEET_UNAVAILABLE_LIMIT), 30, "B held")
        assert len(f.deletions()) == 1
        await f.wait_until(lambda: len(f.deletions()) == 2, 60, "B restarted once A's replacement serves")
        b_out = f.deletions()[1].at
        assert replacement.ready_at is not None and replacement.ready_at <= b_out
        assert f.max_restarting() == 1, f.restarting_series()
        figures("ledger_wiped", restarts=len(f.deletions()), held_s=round(b_out - replacement.ready_at, 1))


async def test_a_pod_drained_by_someone_else_counts_until_its_stand_in_serves(kmock: Any, tmp_path: Path) -> None:
    """A node drain deletes C (no sidecar of ours asked); its stand-in loads for 10 s. B hangs: its
    restart waits for the stand-in, as a PodDisruptionBudget would have it wait."""
    async with Fleet(kmock, tmp_path, replicas=4, sidecar_config=ONE, replacement_delay=10.0) as f:
        b, c = f.pods()[1], f.pods()[2]
        drain = client.CoreV1Api(api_of(kmock))
        await asyncio.to_thread(drain.delete_namespaced_pod, c.name, NS)
        stand_in = next(p for p in f.pods() if p.replaces == c.name)
        await f.hang(b)
        await f.wait_until(lambda: b.name in held_lines(f, FLEET_UNAVAILABLE_LIMIT), 30, "B held")
        assert stand_in.ready_at is None and by_sidecars(f, {c.name}) == []
        await f.wait_until(lambda: by_sidecars(f, {c.name}) == [b.name], 60, "B restarted once the stand-in serves")
        b_out = next(m.at for m in f.deletions() if m.pod == b.name)
        assert stand_in.ready_at is not None and stand_in.ready_at <= b_out
        figures("drained", held_s=round(b_out - stand_in.ready_at, 1))


async def test_the_census_is_the_workloads_pods_by_its_selector_ready_and_terminating(kmock: Any) -> None:
    """Through the real client: the Deployment's spec.replicas, its pods of both templates (a rollout
    under way), each one's Ready condition and deletionTimestamp; another workload's pods left out."""
    deploy = kmock.add(k8s.deployment("llm", NS, 3, {"app": "llm"}))
    old, new = kmock.add(k8s.replica_set(deploy, "aaaa")), kmock.add(k8s.replica_set(deploy, "bbbb"))
    other = kmock.add(k8s.replica_set(kmock.add(k8s.deployment("other", NS, 1, {"app": "other"})), "cccc"))
    for rs, name, ready in ((old, "llm-a", True), (old, "llm-b", False), (new, "llm-c", True), (other, "x", True)):
        kmock.add(k8s.pod_of(rs, name, "n1", ready))
    kmock.mutate("pods", NS, "llm-a", lambda p: p["metadata"].update(deletionTimestamp="2026-01-01T00:00:00Z"))
    api = api_of(kmock)
    # The emulator answers from this test's loop: the blocking client runs beside it.
    seen = await asyncio.to_thread(LeaseLedger(api, NS, LEASE, "llm", "llm-c", 5.0).census)
    assert seen.desired == 3
    assert sorted(seen.pods, key=lambda p: p.name) == [
        fleet.PodSeen("llm-a", True, terminating=True), fleet.PodSeen("llm-b", False), fleet.PodSeen("llm-c", True)]
    # A bare pod's workload has no controller: no fleet to count (the ledger's slots alone bound it).
    assert await asyncio.to_thread(LeaseLedger(api, NS, LEASE, "nothing", "llm-c", 5.0).census) \
        is None
    # One whose pods cannot be listed holds every slot (fail safe).
    kmock["get /api/v1/namespaces/serving/pods"] << 403 << {"kind": "Status", "code": 403, "message": "forbidden"}
    try:
        await asyncio.to_thread(LeaseLedger(api, NS, LEASE, "llm", "llm-c", 5.0).census)
    except LedgerUnavailable as exc:
        assert "403" in str(exc) and "llm" in str(exc)
    else:
        raise AssertionError("a census was counted without the pods")


async def test_a_node_whose_clock_runs_30s_fast_stamps_the_workloads_records_on_the_servers_clock(
        kmock: Any, tmp_path: Path) -> None:
    """A's sidecar runs with its clock 30 s ahead (libfaketime). What it writes for the workload is
    stamped on the API server's clock, learned from its answers' `Date` (`KubeApi.now`), not its own:
    its restart Event says when the restart happened, and its slot is given back by its replacement
    as on any node (stamped 30 s ahead, no pod would ever have been created after it). B hangs once
    that replacement serves: it is restarted at once, not after `slot_timeout` (30 min)."""
    skewed: list[str] = []

    def env(pod: FleetPod) -> dict[str, str]:
        if not skewed:
            skewed.append(pod.name)
        return faketime_env("+30s") if pod.name == skewed[0] else {}

    async with Fleet(kmock, tmp_path, replicas=4, sidecar_config=ONE, replacement_delay=3.0, sidecar_env=env) as f:
        a = f.pod(skewed[0])
        b = next(p for p in f.pods() if p is not a)
        await f.hang(a)
        await f.wait_until(lambda: len(f.deletions()) == 1, 30, "A restarted")
        restart = next(e for e in events(kmock) if (e.get("regarding") or {}).get("name") == a.name
                       and e.get("type") == "Warning")
        stamped = parse_time(restart.get("eventTime"))
        assert stamped is not None and abs(stamped - time.time()) < 10, restart.get("eventTime")
        replacement = next(p for p in f.pods() if p.replaces == a.name)
        await f.wait_until(lambda: replacement.ready_at is not None, 60, "A's replacement serving")
        await f.wait_until(lambda: stored_ledger(kmock).slots == (), 10, "A's slot given back by its replacement")
        await f.hang(b)
        await f.wait_until(lambda: len(f.deletions()) == 2, 30, "B restarted without waiting for slot_timeout")
        assert f.max_restarting() == 1, f.restarting_series()
        figures("clock_fast", restarts=len(f.deletions()))
