"""Keeping a sick GPU out of the next placement, end to end: real sidecars, the real client, the
emulator's scheduler stand-in (it honours node taints and DeviceTaintRules when it places a
replacement). A card's fault, as the kubelet reports it in the pod's status, taints its device (or
its node) before the pod is evicted, and the replacement lands on another card; the bound holds when
every card fails at once; an expired taint is lifted; `placement clear` lifts ours and nothing else."""

from __future__ import annotations

import asyncio
import json
import time
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest

from gpu_watchdog.watchdog.core import placement
from tests.fleet.cluster import Cluster, Write
from tests.fleet.harness import Fleet, FleetPod
from tests.fleet.scheduler import Scheduler
from tests.helpers import spawn

pytestmark = pytest.mark.timeout(240)

FAST = {"sampling": {"device_health_interval": "300ms"}, "restart": {"strategy": "evict"}}


def config(**placement_settings: Any) -> dict[str, Any]:
    return {**FAST, "policy": {"hang": {"consecutive_timeouts": 2},
                               "placement": {"strategy": "device", **placement_settings}}}


def first_write(writes: list[Write], resource: str, verb: str, name: str | None = None) -> int:
    return next(i for i, w in enumerate(writes) if w.resource == resource and w.verb == verb and w.ok
                and not w.dry_run and name in (None, w.name))


def rules(cluster: Cluster) -> list[dict[str, Any]]:
    return cluster.stored("devicetaintrules")


@pytest.mark.parametrize("kube", ["1.33", "1.37"])
async def test_a_cards_fault_taints_its_device_before_the_eviction_and_the_replacement_lands_elsewhere(
        kmock: Cluster, tmp_path: Path, kube: str) -> None:
    kmock.kube_version = kube  # v1alpha3 DeviceTaintRules beside v1beta2 claims; v1 for both
    scheduler = Scheduler(kmock, {"node-a": 2, "node-b": 2}, mode="dra")
    async with Fleet(kmock, tmp_path, replicas=2, sidecar_config=config(ttl="8s"), scheduler=scheduler) as fleet:
        sick = fleet.pods()[0]
        assert sick.card == "gpu.nvidia.com/node-a/gpu-0"
        fleet.set_device_health(sick, "Unhealthy", "XID 79: GPU has fallen off the bus")
        await fleet.wait_until(lambda: fleet.replacements() and fleet.replacements()[0].scheduled, 60,
                               "the sick pod's replacement scheduled")
        [replacement] = fleet.replacements()
        writes = kmock.writes
        tainted = first_write(writes, "devicetaintrules", "create")
        assert tainted < first_write(writes, "pods", "evict", sick.name), [(w.verb, w.resource) for w in writes]
        [rule] = rules(kmock)
        assert rule["apiVersion"] == f"resource.k8s.io/{'v1alpha3' if kube == '1.33' else 'v1'}"
        assert rule["spec"]["deviceSelector"] == {"driver": "gpu.nvidia.com", "pool": "node-a", "device": "gpu-0"}
        assert rule["spec"]["taint"]["key"] == placement.DEVICE_TAINT_KEY and rule["spec"]["taint"]["effect"] == \
            "NoSchedule"
        assert rule["metadata"]["annotations"][placement.POD_ANNOTATION] == sick.name
        assert "Unhealthy" in rule["metadata"]["annotations"][placement.EVIDENCE_ANNOTATION]
        # What the sidecar sent is a DeviceTaintRule of that Kubernetes version's schema.
        sent = writes[tainted].body
        assert sent is not None
        kubernetes_validate.validate({k: v for k, v in sent.items() if k != "status"}, f"{kube}.0", strict=True)
        # node-a's other card is the other replica's: the first free untainted card is node-b's.
        assert replacement.card == "gpu.nvidia.com/node-b/gpu-0", replacement.card
        [line] = fleet.events_of(sick, "placement_tainted")
        assert line["card"] == sick.card and line["kind"] == "device"
        # At its expiry (8 s) a sidecar of the workload lifts it; the card may be placed again.
        def lifted() -> list[dict[str, Any]]:
            return [e for p in fleet.all_pods.values() for e in p.log() if e.get("event") == "placement_lifted"]

        def lifted_by_one() -> bool:
            return not rules(kmock) and any(e["outcome"] == "lifted" for e in lifted())

        await fleet.wait_until(lifted_by_one, 40, "the expired DeviceTaintRule lifted")
        # Lifted once, at its expiry; another sidecar's orphan sweep that met it in the moment between
        # its record's removal and its deletion found it gone already, and says so.
        outcomes = [(e["outcome"], e["why"], e["target"]) for e in lifted()]
        assert [o for o in outcomes if o[0] == "lifted"] == [("lifted", "expired", rule["metadata"]["name"])]
        assert all(o == ("absent", "expired and not in the records", rule["metadata"]["name"])
                   for o in outcomes if o[0] != "lifted"), outcomes


async def test_every_card_failing_at_once_taints_no_more_than_the_bound(kmock: Cluster, tmp_path: Path) -> None:
    """Four cards report Unhealthy together and all four pods may restart at once: the sidecars race
    for the bound in the Lease, two cards (50 % of 4, max_nodes 2) are tainted, the rest is reported."""
    scheduler = Scheduler(kmock, {f"node-{i}": 1 for i in range(6)}, mode="dra")
    sidecar = config()
    sidecar["policy"]["fleet"] = {"max_unavailable": 4}
    async with Fleet(kmock, tmp_path, replicas=4, sidecar_config=sidecar, scheduler=scheduler) as fleet:
        first = fleet.pods()
        for pod in first:
            fleet.set_device_health(pod, "Unhealthy")
        await fleet.wait_until(lambda: all(not p.alive for p in first), 60, "all four pods restarted")
        await fleet.wait_until(lambda: len([p for p in fleet.pods() if p.scheduled]) == 4, 60,
                               "four replacements placed")
        tainted = sorted(r["spec"]["deviceSelector"]["pool"] for r in rules(kmock))
        assert len(tainted) == 2, tainted
        capped = [e for p in first for e in p.log() if e.get("event") == "placement_capped"]
        assert len(capped) == 2 and all(e["cap"] == 2 and e["tainted"] == 2 for e in capped), capped
        # No replacement sits on a tainted card; every pod was restarted all the same.
        assert not {p.node for p in fleet.pods()} & set(tainted)
        assert len(fleet.deletions()) == 4


async def cli(fleet: Fleet, pod: FleetPod, tmp_path: Path, *args: str) -> tuple[int, str]:
    """`gpu-watchdog placement ...` as an operator runs it in that pod's watchdog container."""
    env = {"POD_NAME": pod.name, "POD_NAMESPACE": fleet.namespace, "NODE_NAME": pod.node}
    proc = spawn(["placement", *args, "--config", str(pod.config_path)], tmp_path / f"placement-{args[0]}.log",
                 env=env)
    while proc.proc.poll() is None:  # the emulator answers from this loop: keep it turning
        await asyncio.sleep(0.05)
    return proc.proc.returncode, proc.log()


async def test_a_device_plugin_gpus_node_is_tainted_and_cleared_without_touching_anothers_taint(
        kmock: Cluster, tmp_path: Path) -> None:
    scheduler = Scheduler(kmock, {"node-a": 1, "node-b": 1, "node-c": 1}, mode="device_plugin")
    async with Fleet(kmock, tmp_path, replicas=2, sidecar_config=config(strategy="node"),
                     scheduler=scheduler) as fleet:
        sick = next(p for p in fleet.pods() if p.node == "node-a")
        # An operator's taints: one of another key, one of our key for another card. Never ours to touch.
        theirs = [{"key": "example.com/maintenance", "value": "friday", "effect": "PreferNoSchedule"},
                  {"key": placement.NODE_TAINT_KEY, "value": "GPU-replaced-last-week", "effect": "PreferNoSchedule"}]
        kmock.set_node_taints("node-a", theirs)
        fleet.set_device_health(sick, "Unhealthy")
        await fleet.wait_until(lambda: fleet.replacements() and fleet.replacements()[0].scheduled, 60,
                               "the replacement scheduled")
        [replacement] = fleet.replacements()
        assert replacement.node == "node-c"  # node-b is taken, node-a is tainted now
        writes = kmock.writes
        assert first_write(writes, "nodes", "patch", "node-a") < first_write(writes, "pods", "evict", sick.name)
        node = kmock.node("node-a")
        assert node is not None
        # Ours beside theirs: one taint of our key and effect, its value our workload's entry and expiry.
        *kept, ours = node["spec"]["taints"]
        assert kept == theirs and (ours["key"], ours["effect"]) == (placement.NODE_TAINT_KEY, "NoSchedule")
        [(effect, until)] = placement.node_held([ours], placement.owner_of(fleet.namespace, fleet.deployment))
        assert effect == "NoSchedule" and until > time.time() + 23 * 3600

        code, out = await cli(fleet, replacement, tmp_path, "list")
        assert code == 0, out
        shown = json.loads(out[out.index("{\n"):])
        assert [(t["kind"], t["target"], t["card"]) for t in shown["tainted"]] == [("node", "node-a", sick.card)]
        assert [r["card"] for r in shown["remembered"]] == [sick.card]
        assert [(n["node"], n["cards"]) for n in shown["remembered_nodes"]] == [("node-a", [sick.card])]
        code, out = await cli(fleet, replacement, tmp_path, "clear", "node-b")
        assert code == 1 and "no taint of gpu-watchdog on node-b" in out, out
        code, out = await cli(fleet, replacement, tmp_path, "clear", "node-a")
        assert code == 0 and "lifted" in out, out
        node = kmock.node("node-a")
        assert node is not None and node["spec"]["taints"] == theirs
        code, out = await cli(fleet, replacement, tmp_path, "list")
        shown = json.loads(out[out.index("{\n"):])
        assert shown["tainted"] == [] and [x["by"] for x in shown["lifts"]] == ["operator"]
