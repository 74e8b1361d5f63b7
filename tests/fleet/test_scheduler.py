"""The scheduler stand-in: where a GPU pod lands, given the taints and DeviceTaintRules in the cluster,
and the harness's use of it (a pod that fits nowhere stays Pending; a freed, untainted card is given
again). Taints and rules are written through the real `kubernetes` client, as a sidecar writes them."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest
from kubernetes import client

from tests.fleet import cluster as k8s
from tests.fleet.clients import NS, core_api, custom, refusal, taint_rule
from tests.fleet.cluster import Cluster
from tests.fleet.harness import Fleet
from tests.fleet.scheduler import Placement, Scheduler, rule_matches, tolerates

SUSPECT = {"key": "gpu-watchdog.io/gpu-suspect", "value": "GPU-node-a-0", "effect": "NoSchedule"}
MERGE = "application/merge-patch+json"


def taint_node(cluster: Cluster, node: str, taints: list[dict[str, Any]]) -> None:
    """The sidecar's way: read, then a merge patch of the whole list, conditional on the version read."""
    core = core_api(cluster)
    read = core.read_node(node)
    core.patch_node(node, {"metadata": {"resourceVersion": read.metadata.resource_version},
                           "spec": {"taints": taints or None}}, _content_type=MERGE)


def add_pod(cluster: Cluster, name: str, tolerations: list[dict[str, Any]] | None = None) -> None:
    """A pod waiting for the scheduler, as the ReplicaSet controller creates it."""
    rs = {"metadata": {"name": "llm-x", "namespace": NS, "uid": "u"}, "apiVersion": "apps/v1", "kind": "ReplicaSet",
          "spec": {"template": k8s.pod_template({"app": "llm"})}}
    pod = k8s.unscheduled(k8s.pod_of(rs, name, "", ready=False), "waiting for the scheduler")
    if tolerations:
        pod["spec"]["tolerations"] = tolerations
    cluster.add(pod)


def where(placement: Placement | None) -> tuple[str, str] | None:
    return None if placement is None else (placement.node, placement.device)


def test_toleration_rules() -> None:
    taint = {"key": "gpu-watchdog.io/gpu-suspect", "value": "GPU-1", "effect": "NoSchedule"}
    assert tolerates({"key": taint["key"], "operator": "Exists"}, taint)
    assert tolerates({"operator": "Exists"}, taint)  # an empty key with Exists tolerates everything
    assert tolerates({"key": taint["key"], "value": "GPU-1"}, taint)  # Equal is the default operator
    assert not tolerates({"key": taint["key"], "value": "GPU-2"}, taint)
    assert not tolerates({"key": taint["key"], "operator": "Exists", "effect": "NoExecute"}, taint)
    assert not tolerates({"key": "other", "operator": "Exists"}, taint)


def test_device_taint_rule_selectors() -> None:
    rule = taint_rule("r", "v1", pool="node-a", device="gpu-0")
    assert rule_matches(rule, "gpu.nvidia.com", "node-a", "gpu-0")
    assert not rule_matches(rule, "gpu.nvidia.com", "node-a", "gpu-1")
    assert not rule_matches(rule, "other.example.com", "node-a", "gpu-0")
    del rule["spec"]["deviceSelector"]["device"]  # a missing field matches any: the whole pool
    assert rule_matches(rule, "gpu.nvidia.com", "node-a", "gpu-1")
    assert not rule_matches(rule, "gpu.nvidia.com", "node-b", "gpu-1")
    del rule["spec"]["deviceSelector"]
    assert not rule_matches(rule, "gpu.nvidia.com", "node-a", "gpu-0")  # no selector: no device


async def test_the_nodes_are_registered_with_their_gpus(kmock: Cluster) -> None:
    Scheduler(kmock, {"node-a": 2}, mode="device_plugin")
    Scheduler(kmock, {"node-b": 1}, mode="dra")
    core = core_api(kmock)
    nodes = await asyncio.to_thread(core.list_node)
    assert {n.metadata.name: (n.status.allocatable or {}).get("nvidia.com/gpu") for n in nodes.items} == {
        "node-a": "2", "node-b": None}
    slices = await asyncio.to_thread(custom(kmock).list_cluster_custom_object, "resource.k8s.io", "v1",
                                     "resourceslices")
    [piece] = slices["items"]
    assert piece["spec"]["pool"]["name"] == "node-b" and [d["name"] for d in piece["spec"]["devices"]] == ["gpu-0"]


async def test_a_tainted_node_is_skipped_unless_the_pod_tolerates_it(kmock: Cluster) -> None:
    scheduler = Scheduler(kmock, {"node-a": 1, "node-b": 1}, mode="device_plugin")
    await asyncio.to_thread(taint_node, kmock, "node-a", [SUSPECT])
    add_pod(kmock, "p1")
    add_pod(kmock, "p2", tolerations=[{"key": SUSPECT["key"], "operator": "Exists", "effect": "NoSchedule"}])
    first = scheduler.place("p1", NS)
    assert first is not None and (first.node, first.device, first.card) == ("node-b", "GPU-node-b-0", "GPU-node-b-0")
    assert where(scheduler.place("p2", NS)) == ("node-a", "GPU-node-a-0")
    assert scheduler.place("p1", NS) == first  # a pod keeps the card it holds


async def test_a_prefer_no_schedule_node_only_when_nothing_else_fits(kmock: Cluster) -> None:
    scheduler = Scheduler(kmock, {"node-a": 1, "node-b": 1}, mode="device_plugin")
    await asyncio.to_thread(taint_node, kmock, "node-a", [{**SUSPECT, "effect": "PreferNoSchedule"}])
    assert where(scheduler.place("p1")) == ("node-b", "GPU-node-b-0")
    assert where(scheduler.place("p2")) == ("node-a", "GPU-node-a-0")  # the only card left
    assert scheduler.place("p3") is None


async def test_a_cordoned_node_is_skipped(kmock: Cluster) -> None:
    scheduler = Scheduler(kmock, {"node-a": 1, "node-b": 1}, mode="device_plugin")
    kmock.mutate("nodes", "", "node-a", lambda node: node["spec"].update(unschedulable=True))
    assert where(scheduler.place("p1")) == ("node-b", "GPU-node-b-0")


async def test_a_tainted_device_is_skipped_and_its_pools_other_device_used(kmock: Cluster) -> None:
    scheduler = Scheduler(kmock, {"node-a": 2, "node-b": 2}, mode="dra")
    api = custom(kmock)
    version = kmock.device_taint_rule_version
    await asyncio.to_thread(api.create_cluster_custom_object, "resource.k8s.io", version, "devicetaintrules",
                            taint_rule("gpu-watchdog-node-a-gpu-0", version, pool="node-a", device="gpu-0"))
    # An informing taint ("None") and another driver's rule keep nothing out.
    await asyncio.to_thread(api.create_cluster_custom_object, "resource.k8s.io", version, "devicetaintrules",
                            taint_rule("informs", version, pool="node-a", device="gpu-1", effect="None"))
    other = taint_rule("other-driver", version, pool="node-b", device="gpu-0")
    other["spec"]["deviceSelector"]["driver"] = "net.example.com"
    await asyncio.to_thread(api.create_cluster_custom_object, "resource.k8s.io", version, "devicetaintrules", other)
    assert scheduler.tainted_devices() == [("node-a", "gpu-0")]
    p1 = scheduler.place("p1")
    assert p1 is not None and (p1.node, p1.device, p1.pool) == ("node-a", "gpu-1", "node-a")
    assert p1.card == "gpu.nvidia.com/node-a/gpu-1" and p1.uuid == "GPU-node-a-1"
    assert where(scheduler.place("p2")) == ("node-b", "gpu-0")
    # A rule for a whole pool (no device) keeps every device of the node out.
    await asyncio.to_thread(api.create_cluster_custom_object, "resource.k8s.io", version, "devicetaintrules",
                            {**taint_rule("pool-b", version), "spec": {
                                "deviceSelector": {"pool": "node-b"},
                                "taint": {"key": "gpu-watchdog.io/suspect", "effect": "NoExecute"}}})
    assert scheduler.place("p3") is None
    assert scheduler.refusals["p3"] == "0/2 nodes are available: 2 node(s) cannot allocate all claims."


async def test_a_freed_card_is_given_again_unless_tainted(kmock: Cluster) -> None:
    """The control of the feature: without a taint the replacement lands where its predecessor was."""
    scheduler = Scheduler(kmock, {"node-a": 2}, mode="dra")
    assert where(scheduler.place("p1")) == ("node-a", "gpu-0")
    assert where(scheduler.release("p1")) == ("node-a", "gpu-0")
    assert where(scheduler.place("p2")) == ("node-a", "gpu-0")  # the same card again
    scheduler.release("p2")
    kmock.add(taint_rule("gpu-watchdog-node-a-gpu-0", "v1"))  # as if written before
    assert where(scheduler.place("p3")) == ("node-a", "gpu-1")


async def test_a_pod_that_fits_nowhere_waits_until_the_taint_is_lifted(kmock: Cluster) -> None:
    scheduler = Scheduler(kmock, {"node-a": 1}, mode="device_plugin")
    assert where(scheduler.place("p1")) == ("node-a", "GPU-node-a-0")
    assert scheduler.place("p2") is None
    assert scheduler.refusals["p2"] == "0/1 nodes are available: 1 node(s) Insufficient nvidia.com/gpu."
    scheduler.release("p1")
    await asyncio.to_thread(taint_node, kmock, "node-a", [SUSPECT])
    assert scheduler.place("p2") is None
    assert scheduler.refusals["p2"] == ("0/1 nodes are available: 1 node(s) had untolerated taint"
                                        " {gpu-watchdog.io/gpu-suspect: GPU-node-a-0}.")
    await asyncio.to_thread(taint_node, kmock, "node-a", [])
    assert where(scheduler.place("p2")) == ("node-a", "GPU-node-a-0") and "p2" not in scheduler.refusals


# --- through the harness: real processes -------------------------------------------------------------------------

async def test_a_dra_pod_evicted_after_its_device_is_tainted_lands_on_another_card(kmock: Cluster,
                                                                                    tmp_path: Path) -> None:
    scheduler = Scheduler(kmock, {"node-a": 2}, mode="dra")
    async with Fleet(kmock, tmp_path, replicas=1, scheduler=scheduler) as fleet:
        [first] = fleet.pods()
        assert (first.node, first.card) == ("node-a", "gpu.nvidia.com/node-a/gpu-0")
        api, core = custom(kmock), core_api(kmock)
        version = kmock.device_taint_rule_version
        fleet.set_device_health(first, "Healthy", "ok")

        def read_first() -> tuple[Any, Any]:
            pod = core.read_namespaced_pod(first.name, NS)
            [status] = pod.status.resource_claim_statuses
            return pod, api.get_namespaced_custom_object("resource.k8s.io", version, NS, "resourceclaims",
                                                         status.resource_claim_name)

        pod, claim = await asyncio.to_thread(read_first)
        assert pod.spec.node_name == "node-a" and [c.name for c in pod.spec.resource_claims] == ["gpu"]
        [inference] = [c for c in pod.spec.containers if c.name == "inference"]
        assert [c.name for c in inference.resources.claims] == ["gpu"]
        [inference_status] = [c for c in pod.status.container_statuses if c.name == "inference"]
        [allocated] = inference_status.allocated_resources_status
        assert allocated.name == "claim:gpu/gpu"
        assert [(r.resource_id, r.health, r.message) for r in allocated.resources] == [
            ("gpu.nvidia.com/node-a/gpu-0", "Healthy", "ok")]
        assert claim["status"]["allocation"]["devices"]["results"] == [
            {"request": "gpu", "driver": "gpu.nvidia.com", "pool": "node-a", "device": "gpu-0"}]

        def taint_then_evict() -> None:
            api.create_cluster_custom_object("resource.k8s.io", version, "devicetaintrules",
                                             taint_rule("gpu-watchdog-node-a-gpu-0", version))
            core.create_namespaced_pod_eviction(first.name, NS, client.V1Eviction(
                metadata=client.V1ObjectMeta(name=first.name, namespace=NS)))

        await asyncio.to_thread(taint_then_evict)
        [replacement] = fleet.replacements()
        assert (replacement.node, replacement.card) == ("node-a", "gpu.nvidia.com/node-a/gpu-1")
        await fleet.wait_until(lambda: replacement.ready_at is not None, 30, "the replacement's sidecar ready")
        assert kmock.read("resourceclaims", NS, f"{first.name}-gpu") is None  # gone with its pod
        claim = kmock.read("resourceclaims", NS, f"{replacement.name}-gpu")
        assert claim is not None and claim["status"]["allocation"]["devices"]["results"][0]["device"] == "gpu-1"
        scheduled = [(m.pod, m.detail["card"]) for m in fleet.timeline if m.kind == "scheduled"]
        assert scheduled == [(first.name, "gpu.nvidia.com/node-a/gpu-0"),
                             (replacement.name, "gpu.nvidia.com/node-a/gpu-1")]
        writes = [(w.verb, w.resource) for w in kmock.writes if w.resource in ("devicetaintrules", "pods")]
        assert writes == [("create", "devicetaintrules"), ("evict", "pods")]


async def test_a_replacement_no_node_takes_stays_pending_until_the_taint_is_lifted(kmock: Cluster,
                                                                                  tmp_path: Path) -> None:
    scheduler = Scheduler(kmock, {"node-a": 1}, mode="device_plugin")
    async with Fleet(kmock, tmp_path, replicas=1, scheduler=scheduler) as fleet:
        [first] = fleet.pods()
        assert (first.node, first.card) == ("node-a", "GPU-node-a-0")
        pod = kmock.read("pods", NS, first.name)
        assert pod is not None
        [inference] = [c for c in pod["spec"]["containers"] if c["name"] == "inference"]
        assert inference["resources"]["limits"] == {"nvidia.com/gpu": "1"}
        core = core_api(kmock)
        await asyncio.to_thread(taint_node, kmock, "node-a", [SUSPECT])
        await asyncio.to_thread(core.delete_namespaced_pod, first.name, NS)
        [replacement] = fleet.replacements()
        assert fleet.pending() == [replacement] and not replacement.scheduled and replacement.card is None
        await asyncio.sleep(0.6)  # a few of the probe loop's retries
        assert replacement.sidecar is None and replacement.model is None  # no processes while Pending
        waiting = await asyncio.to_thread(core.read_namespaced_pod, replacement.name, NS)
        assert waiting.spec.node_name is None and waiting.status.phase == "Pending"
        [cond] = [c for c in waiting.status.conditions if c.type == "PodScheduled"]
        assert (cond.status, cond.reason) == ("False", "Unschedulable")
        assert "untolerated taint {gpu-watchdog.io/gpu-suspect: GPU-node-a-0}" in cond.message
        with pytest.raises(ValueError, match="holds no GPU card"):
            fleet.set_device_health(replacement, "Unhealthy")

        await asyncio.to_thread(taint_node, kmock, "node-a", [])
        assert (replacement.node, replacement.card) == ("node-a", "GPU-node-a-0") and fleet.pending() == []
        await fleet.wait_until(lambda: replacement.ready_at is not None, 30, "the replacement's sidecar ready")
        placed = await asyncio.to_thread(core.read_namespaced_pod, replacement.name, NS)
        assert placed.spec.node_name == "node-a" and placed.status.phase == "Running"
        kinds = [m.kind for m in fleet.timeline if m.pod == replacement.name]
        assert kinds[:3] == ["created", "unschedulable", "scheduled"]
        fleet.set_device_health(replacement, "Healthy")
        [inference_status] = [c for c in (await asyncio.to_thread(core.read_namespaced_pod, replacement.name, NS)
                                          ).status.container_statuses if c.name == "inference"]
        [allocated] = inference_status.allocated_resources_status
        assert (allocated.name, allocated.resources[0].resource_id) == ("nvidia.com/gpu", "GPU-node-a-0")
        missing = await asyncio.to_thread(refusal, lambda: core.read_namespaced_pod(first.name, NS))
        assert missing.status == 404
