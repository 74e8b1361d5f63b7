"""The fleet emulator's semantics, through the real `kubernetes` client: what the sidecars will rely on."""

from __future__ import annotations

import asyncio
import json
import re
import threading
from pathlib import Path
from typing import Any

import pytest
from kubernetes import client

from tests.fleet import cluster as k8s
from tests.fleet.clients import DRA, NS, api_of, apps_api, coordination, core_api, custom, refusal, taint_rule
from tests.fleet.cluster import Cluster, PodRemoval
from tests.fleet.harness import Fleet


def lease(name: str, holder: str) -> client.V1Lease:
    return client.V1Lease(metadata=client.V1ObjectMeta(name=name, namespace=NS),
                          spec=client.V1LeaseSpec(holder_identity=holder, lease_duration_seconds=15))


def status_of(exc: client.ApiException) -> dict[str, Any]:
    """The refusal's body: a `Status` as the API server shapes it."""
    body: dict[str, Any] = json.loads(exc.body or "")
    assert body["kind"] == "Status" and body["status"] == "Failure" and body["code"] == exc.status, body
    return body


def reason_of(exc: client.ApiException) -> str:
    return str(status_of(exc)["reason"])


async def test_create_get_replace_with_the_read_version(kmock: Cluster) -> None:
    leases = coordination(kmock)

    def run() -> tuple[Any, Any, Any]:
        created = leases.create_namespaced_lease(NS, lease("ledger", "a"))
        read = leases.read_namespaced_lease("ledger", NS)
        read.spec.holder_identity = "b"
        return created, read, leases.replace_namespaced_lease("ledger", NS, read)

    created, read, replaced = await asyncio.to_thread(run)
    meta = created.metadata
    assert meta.uid and meta.creation_timestamp is not None and meta.resource_version.isdigit()
    assert read.metadata.resource_version == meta.resource_version
    # A new version, higher than the one read; what the server owns survives the replace.
    assert int(replaced.metadata.resource_version) > int(meta.resource_version)
    assert replaced.metadata.uid == meta.uid and replaced.spec.holder_identity == "b"
    stored = kmock.lease(NS, "ledger")
    assert stored is not None and stored["spec"]["holderIdentity"] == "b"
    assert stored["metadata"]["resourceVersion"] == replaced.metadata.resource_version == kmock.resource_version
    assert [(w.verb, w.code, w.sent_version) for w in kmock.writes_to("leases")] == [
        ("create", 201, None), ("replace", 200, meta.resource_version)]


async def test_a_replace_with_a_stale_or_no_version_is_a_conflict(kmock: Cluster) -> None:
    leases = coordination(kmock)

    def run() -> tuple[client.ApiException, client.ApiException]:
        leases.create_namespaced_lease(NS, lease("ledger", "a"))
        first = leases.read_namespaced_lease("ledger", NS)
        first.spec.holder_identity = "b"
        leases.replace_namespaced_lease("ledger", NS, first)
        first.spec.holder_identity = "stale"  # still carries the version read before the replace
        stale = refusal(lambda: leases.replace_namespaced_lease("ledger", NS, first))
        first.metadata.resource_version = None  # Leases allow no unconditional update
        blind = refusal(lambda: leases.replace_namespaced_lease("ledger", NS, first))
        return stale, blind

    stale, blind = await asyncio.to_thread(run)
    for exc in (stale, blind):
        assert exc.status == 409 and reason_of(exc) == "Conflict"
        assert status_of(exc)["message"].startswith('Operation cannot be fulfilled on leases.coordination.k8s.io'
                                                    ' "ledger": the object has been modified')
    stored = kmock.lease(NS, "ledger")
    assert stored is not None and stored["spec"]["holderIdentity"] == "b"
    assert [w.code for w in kmock.writes_to("leases", verb="replace")] == [200, 409, 409]


async def test_concurrent_replaces_with_one_version_exactly_one_wins(kmock: Cluster) -> None:
    leases = coordination(kmock)
    await asyncio.to_thread(leases.create_namespaced_lease, NS, lease("ledger", "nobody"))
    read = await asyncio.to_thread(leases.read_namespaced_lease, "ledger", NS)
    writers = 4
    barrier = threading.Barrier(writers)

    def write(holder: str) -> int:
        body = client.V1Lease(metadata=client.V1ObjectMeta(name="ledger", namespace=NS,
                                                           resource_version=read.metadata.resource_version),
                              spec=client.V1LeaseSpec(holder_identity=holder))
        barrier.wait()  # all at once, each with the same version read
        try:
            leases.replace_namespaced_lease("ledger", NS, body)
            return 200
        except client.ApiException as exc:
            return int(exc.status)

    codes = await asyncio.gather(*(asyncio.to_thread(write, f"w{i}") for i in range(writers)))
    assert sorted(codes) == [200] + [409] * (writers - 1)
    winner = f"w{codes.index(200)}"
    stored = kmock.lease(NS, "ledger")
    assert stored is not None and stored["spec"]["holderIdentity"] == winner
    replaces = kmock.writes_to("leases", verb="replace")
    assert {w.sent_version for w in replaces} == {read.metadata.resource_version}
    assert [w.body["spec"]["holderIdentity"] for w in replaces if w.ok and w.body] == [winner]


async def test_creating_an_existing_lease_is_already_exists(kmock: Cluster) -> None:
    leases = coordination(kmock)

    def run() -> client.ApiException:
        leases.create_namespaced_lease(NS, lease("ledger", "a"))
        return refusal(lambda: leases.create_namespaced_lease(NS, lease("ledger", "b")))

    exc = await asyncio.to_thread(run)
    assert exc.status == 409 and reason_of(exc) == "AlreadyExists"
    stored = kmock.lease(NS, "ledger")
    assert stored is not None and stored["spec"]["holderIdentity"] == "a"  # the first one stays


async def test_a_missing_lease_is_not_found_to_read_and_to_replace(kmock: Cluster) -> None:
    leases = coordination(kmock)

    def run() -> tuple[client.ApiException, client.ApiException]:
        missing = refusal(lambda: leases.read_namespaced_lease("ledger", NS))
        body = client.V1Lease(metadata=client.V1ObjectMeta(name="ledger", namespace=NS, resource_version="1"))
        return missing, refusal(lambda: leases.replace_namespaced_lease("ledger", NS, body))

    read, replace = await asyncio.to_thread(run)
    assert read.status == 404 and reason_of(read) == "NotFound"
    assert status_of(read)["message"] == 'leases.coordination.k8s.io "ledger" not found'
    assert replace.status == 404 and reason_of(replace) == "NotFound"
    assert kmock.lease(NS, "ledger") is None


def workload(cluster: Cluster, replicas: int) -> list[str]:
    deploy = cluster.add(k8s.deployment("llm", NS, replicas))
    rs = cluster.add(k8s.replica_set(deploy, "5c9d7b6f4x"))
    return [cluster.add(k8s.pod_of(rs, f"llm-5c9d7b6f4x-p{i}", f"node-{i}", ready=True))["metadata"]["name"]
            for i in range(replicas)]


async def test_a_dry_run_delete_keeps_the_pod_and_a_real_one_removes_it(kmock: Cluster) -> None:
    [name] = workload(kmock, 1)
    removed: list[PodRemoval] = []
    kmock.on_pod_removed(removed.append)
    core = core_api(kmock)
    before = kmock.resource_version

    await asyncio.to_thread(core.delete_namespaced_pod, name, NS, dry_run="All", grace_period_seconds=5)
    assert kmock.read("pods", NS, name) is not None and removed == [] and kmock.resource_version == before
    # The pod deserializes with the real client: schema-complete, owned by its ReplicaSet.
    pod = await asyncio.to_thread(core.read_namespaced_pod, name, NS)
    assert pod.metadata.owner_references[0].kind == "ReplicaSet" and pod.metadata.owner_references[0].controller

    await asyncio.to_thread(core.delete_namespaced_pod, name, NS, grace_period_seconds=5)
    assert kmock.read("pods", NS, name) is None
    assert [(r.name, r.how, r.grace_period) for r in removed] == [(name, "delete", 5)]
    assert [(w.code, w.dry_run) for w in kmock.writes_to("pods", name, verb="delete")] == [(200, True), (200, False)]
    gone = await asyncio.to_thread(refusal, lambda: core.read_namespaced_pod(name, NS))
    assert gone.status == 404 and reason_of(gone) == "NotFound"


async def test_evictions_honour_dry_run_and_the_disruption_budget(kmock: Cluster) -> None:
    p0, p1, p2, p3 = workload(kmock, 4)
    kmock.set_disruption_budget(NS, "llm", {"app": "llm"}, min_available=2)
    core = core_api(kmock)

    def evict(name: str, dry: bool = False) -> int:
        body = client.V1Eviction(metadata=client.V1ObjectMeta(name=name, namespace=NS))
        try:
            core.create_namespaced_pod_eviction(name, NS, body, **({"dry_run": "All"} if dry else {}))
            return 201
        except client.ApiException as exc:
            assert exc.status != 429 or "disruption budget" in (exc.body or "")
            return int(exc.status)

    assert await asyncio.to_thread(evict, p0, True) == 201
    assert len(kmock.pods(NS)) == 4  # asked, nothing evicted
    assert await asyncio.to_thread(evict, p0) == 201
    kmock.set_pod_ready(NS, p3, False)
    # Two Ready pods left, two needed: a Ready one may not go, not even as a question...
    assert await asyncio.to_thread(evict, p1, True) == 429
    assert await asyncio.to_thread(evict, p1) == 429
    # ...while an unready one takes nothing from a budget that holds: it may.
    assert await asyncio.to_thread(evict, p3) == 201
    # Below the budget, an unready pod may not go either (IfHealthyBudget).
    kmock.set_pod_ready(NS, p2, False)
    assert await asyncio.to_thread(evict, p2) == 429
    assert k8s.names_of(kmock.pods(NS)) == [p1, p2]
    assert [(w.name, w.code, w.dry_run) for w in kmock.writes_to("pods", verb="evict")] == [
        (p0, 201, True), (p0, 201, False), (p1, 429, True), (p1, 429, False), (p3, 201, False), (p2, 429, False)]
    assert {w.reason for w in kmock.writes_to("pods", verb="evict") if not w.ok} == {"TooManyRequests"}


async def test_the_deployment_reads_with_its_replicas_and_live_status(kmock: Cluster) -> None:
    names = workload(kmock, 3)
    kmock.set_pod_ready(NS, names[0], False)
    apps = apps_api(kmock)
    deploy = await asyncio.to_thread(apps.read_namespaced_deployment, "llm", NS)
    assert deploy.spec.replicas == 3 and deploy.spec.selector.match_labels == {"app": "llm"}
    assert deploy.status.replicas == 3 and deploy.status.ready_replicas == 2
    kmock.scale(NS, "llm", 5)
    deploy = await asyncio.to_thread(apps.read_namespaced_deployment, "llm", NS)
    assert deploy.spec.replicas == 5 and deploy.metadata.generation == 2
    pods = await asyncio.to_thread(core_api(kmock).list_namespaced_pod, NS,
                                   label_selector="app=llm,pod-template-hash=5c9d7b6f4x")
    assert sorted(p.metadata.name for p in pods.items) == sorted(names)
    kmock.add(k8s.statefulset("db", NS, 2))
    sts = await asyncio.to_thread(apps.read_namespaced_stateful_set, "db", NS)
    assert sts.spec.replicas == 2 and sts.status.replicas == 0  # no pods of its own


async def test_a_tests_own_reaction_answers_before_the_emulated_route(kmock: Cluster) -> None:
    """Faults are injected as with plain kmock: the test's reaction first, the emulator after it."""
    leases = coordination(kmock)
    await asyncio.to_thread(leases.create_namespaced_lease, NS, lease("ledger", "a"))
    read = await asyncio.to_thread(leases.read_namespaced_lease, "ledger", NS)
    failing = kmock[f"put /apis/coordination.k8s.io/v1/namespaces/{NS}/leases/ledger"][:1] << 500 << {
        "kind": "Status", "apiVersion": "v1", "status": "Failure", "code": 500, "reason": "InternalError"}
    read.spec.holder_identity = "b"
    exc = await asyncio.to_thread(refusal, lambda: leases.replace_namespaced_lease("ledger", NS, read))
    assert exc.status == 500 and len(failing) == 1
    replaced = await asyncio.to_thread(leases.replace_namespaced_lease, "ledger", NS, read)
    assert replaced.spec.holder_identity == "b"
    # The intercepted write never reached the emulator: one replace recorded, and it is the one stored.
    assert [w.code for w in kmock.writes_to("leases", verb="replace")] == [200]


async def test_a_real_delete_brings_a_replacement_whose_sidecar_serves(kmock: Cluster, tmp_path: Path) -> None:
    async with Fleet(kmock, tmp_path, replicas=2) as fleet:
        first = [p.name for p in fleet.pods()]
        assert len({p.node for p in fleet.pods()}) == 2
        for name in first:
            assert re.fullmatch(rf"llm-{fleet.template_hash}-[{'bcdfghjklmnpqrstvwxz2456789'}]{{5}}", name)
        core = core_api(kmock)
        victim, other = fleet.pods()

        await asyncio.to_thread(core.delete_namespaced_pod, victim.name, NS, dry_run="All")
        await asyncio.sleep(0.5)  # time for a controller that would wrongly react
        assert [p.name for p in fleet.pods()] == first and fleet.replacements() == []
        assert victim.sidecar is not None and victim.sidecar.proc.poll() is None
        assert [m.kind for m in fleet.deletions(dry_run=True)] == ["dry_delete"]

        await asyncio.to_thread(core.delete_namespaced_pod, victim.name, NS)
        [replacement] = fleet.replacements()
        assert replacement.replaces == victim.name and replacement.name not in first
        assert replacement.name.startswith(f"llm-{fleet.template_hash}-") and replacement.node not in ("node-0",
                                                                                                      "node-1")
        assert fleet.restarting() == 1
        await fleet.wait_until(lambda: replacement.ready_at is not None, 20, "the replacement's sidecar ready")
        assert fleet.restarting() == 0 and fleet.max_restarting() == 1
        assert victim.sidecar.proc.poll() is not None  # the kubelet stopped the deleted pod's processes
        assert sorted(p.name for p in fleet.pods()) == sorted([other.name, replacement.name])
        assert sorted(k8s.names_of(kmock.pods(NS))) == sorted([other.name, replacement.name])
        pod = kmock.read("pods", NS, replacement.name)
        assert pod is not None and k8s.pod_ready(pod)  # the probe made it Ready
        status = await fleet.status(replacement)
        assert isinstance(status, dict) and status
        kinds = [m.kind for m in fleet.timeline if m.pod in (victim.name, replacement.name)]
        assert kinds.index("deleted") < kinds.index("created", kinds.index("deleted")) < len(kinds)


# --- Nodes ------------------------------------------------------------------------------------------------------

SUSPECT = {"key": "gpu-watchdog.io/gpu-suspect", "value": "GPU-node-a-0", "effect": "NoSchedule"}
MERGE = "application/merge-patch+json"


async def test_a_node_taint_patch_is_conditional_on_the_version_it_carries(kmock: Cluster) -> None:
    kmock.add(k8s.node_of("node-a", gpus=2))
    kmock.set_node_taints("node-a", [{"key": "admin", "value": "x", "effect": "PreferNoSchedule"}])
    core = core_api(kmock)

    def run() -> tuple[Any, Any, client.ApiException, Any]:
        read = core.read_node("node-a")
        mine = [t.to_dict() for t in read.spec.taints] + [SUSPECT]
        body = {"metadata": {"resourceVersion": read.metadata.resource_version}, "spec": {"taints": mine}}
        patched = core.patch_node("node-a", body, _content_type=MERGE)
        # Another sidecar that read the same version and patches after: refused, to read and decide again.
        stale = refusal(lambda: core.patch_node("node-a", body, _content_type=MERGE))
        return read, patched, stale, core.read_node("node-a")

    read, patched, stale, now = await asyncio.to_thread(run)
    assert int(patched.metadata.resource_version) > int(read.metadata.resource_version)
    # A merge patch replaces the list whole: what was sent is what there is.
    assert [(t.key, t.value, t.effect) for t in now.spec.taints] == [
        ("admin", "x", "PreferNoSchedule"), (SUSPECT["key"], SUSPECT["value"], "NoSchedule")]
    assert stale.status == 409 and reason_of(stale) == "Conflict"
    assert status_of(stale)["message"] == ('Operation cannot be fulfilled on nodes "node-a": the object has been'
                                           ' modified; please apply your changes to the latest version and try again')
    assert now.metadata.resource_version == patched.metadata.resource_version
    assert now.status.allocatable["nvidia.com/gpu"] == "2"
    assert [(w.verb, w.code, w.sent_version) for w in kmock.writes_to("nodes")] == [
        ("patch", 200, read.metadata.resource_version), ("patch", 409, read.metadata.resource_version)]


async def test_a_node_patch_is_validated_and_keeps_what_it_does_not_own(kmock: Cluster) -> None:
    kmock.add(k8s.node_of("node-a", gpus=1))
    core = core_api(kmock)

    def run() -> dict[str, Any]:
        out: dict[str, Any] = {}
        long_value = {**SUSPECT, "value": "GPU-" + "f" * 60}
        out["long"] = refusal(lambda: core.patch_node("node-a", {"spec": {"taints": [long_value]}},
                                                      _content_type=MERGE))
        out["effect"] = refusal(lambda: core.patch_node("node-a", {"spec": {"taints": [{**SUSPECT, "effect": "Bad"}]}},
                                                        _content_type=MERGE))
        out["twice"] = refusal(lambda: core.patch_node("node-a", {"spec": {"taints": [SUSPECT, SUSPECT]}},
                                                       _content_type=MERGE))
        out["json_patch"] = refusal(lambda: core.patch_node("node-a", [{"op": "add", "path": "/spec/taints",
                                                                        "value": [SUSPECT]}]))
        # The main resource ignores status, and a patch without a resourceVersion applies to what is there.
        out["tainted"] = core.patch_node("node-a", {"spec": {"taints": [SUSPECT]}, "status": {"allocatable": {}}},
                                         _content_type=MERGE)
        out["same"] = core.patch_node("node-a", {"spec": {"taints": [SUSPECT]}}, _content_type=MERGE)
        # The kubelet's and the sidecar's strategic status patch merges conditions by type, spec untouched.
        out["status"] = core.patch_node_status("node-a", {"status": {"conditions": [
            {"type": "GPUSuspect", "status": "True", "reason": "RepeatedGPURestarts"}]}, "spec": {"taints": None}},
            _content_type="application/strategic-merge-patch+json")
        out["untainted"] = core.patch_node("node-a", {"spec": {"taints": None}}, _content_type=MERGE)
        return out

    out = await asyncio.to_thread(run)
    for key in ("long", "effect", "twice"):
        assert out[key].status == 422 and reason_of(out[key]) == "Invalid", key
    assert 'spec.taints[0].value: Invalid value: "GPU-ffff' in status_of(out["long"])["message"]
    assert "must be no more than 63 characters" in status_of(out["long"])["message"]
    assert 'Unsupported value: "Bad"' in status_of(out["effect"])["message"]
    assert "unique by key and effect" in status_of(out["twice"])["message"]
    assert out["json_patch"].status == 415  # not emulated, and said so
    tainted, same, status, untainted = out["tainted"], out["same"], out["status"], out["untainted"]
    assert tainted.status.allocatable["nvidia.com/gpu"] == "1"
    # Nothing changed: no write, the same resourceVersion (as the API server skips an unchanged update).
    assert same.metadata.resource_version == tainted.metadata.resource_version
    assert [c.type for c in status.status.conditions] == ["Ready", "GPUSuspect"]
    assert [t.key for t in status.spec.taints] == [SUSPECT["key"]]
    assert untainted.spec.taints is None
    assert [w.code for w in kmock.writes_to("nodes")] == [422, 422, 422, 415, 200, 200, 200, 200]
    missing = await asyncio.to_thread(refusal, lambda: core.patch_node("node-z", {"spec": {}}, _content_type=MERGE))
    assert missing.status == 404 and status_of(missing)["message"] == 'nodes "node-z" not found'


# --- resource.k8s.io ----------------------------------------------------------------------------------------------


def discover(api: Any) -> str | None:
    """The sidecar's discovery: the first of v1, v1beta2, v1alpha3 whose resources name devicetaintrules."""
    for version in ("v1", "v1beta2", "v1alpha3"):
        try:
            found = api.get_api_resources(DRA, version)
        except client.ApiException as exc:
            assert exc.status == 404, exc
            continue
        if any(r.name == "devicetaintrules" for r in found.resources):
            return version
    return None


@pytest.mark.parametrize(("kube", "expected", "unserved", "preferred"), [
    ("1.33", "v1alpha3", "v1", "v1beta2"),
    ("1.36", "v1beta2", "v1beta1", "v1"),
    ("1.37", "v1", "v1alpha3", "v1"),
])
async def test_device_taint_rules_are_found_and_served_at_the_version_the_kubernetes_release_has(
        kmock: Cluster, kube: str, expected: str, unserved: str, preferred: str) -> None:
    kmock.kube_version = kube
    api = custom(kmock)

    def run() -> dict[str, Any]:
        out: dict[str, Any] = {"version": discover(api)}
        v = out["version"]
        out["unserved"] = refusal(lambda: api.get_api_resources(DRA, unserved))
        out["unserved_list"] = refusal(lambda: api.list_cluster_custom_object(DRA, unserved, "devicetaintrules"))
        out["group"] = client.ApisApi(api_of(kmock)).get_api_versions()
        out["version_info"] = client.VersionApi(api_of(kmock)).get_code()
        out["created"] = api.create_cluster_custom_object(DRA, v, "devicetaintrules", taint_rule("gpu-watchdog-a-0", v))
        api.create_cluster_custom_object(DRA, v, "devicetaintrules", taint_rule("gpu-watchdog-a-1", v, device="gpu-1"))
        api.create_cluster_custom_object(DRA, v, "devicetaintrules", taint_rule("admins", v, labels={"team": "ops"}))
        # Two sidecars creating the same rule: the second is told it exists.
        out["again"] = refusal(lambda: api.create_cluster_custom_object(DRA, v, "devicetaintrules",
                                                                        taint_rule("gpu-watchdog-a-0", v)))
        out["ours"] = api.list_cluster_custom_object(DRA, v, "devicetaintrules",
                                                     label_selector="app.kubernetes.io/managed-by=gpu-watchdog")
        out["read"] = api.get_cluster_custom_object(DRA, v, "devicetaintrules", "gpu-watchdog-a-0")
        out["deleted"] = api.delete_cluster_custom_object(DRA, v, "devicetaintrules", "gpu-watchdog-a-0")
        out["gone"] = refusal(lambda: api.get_cluster_custom_object(DRA, v, "devicetaintrules", "gpu-watchdog-a-0"))
        out["gone_delete"] = refusal(lambda: api.delete_cluster_custom_object(DRA, v, "devicetaintrules",
                                                                              "gpu-watchdog-a-0"))
        return out

    out = await asyncio.to_thread(run)
    assert out["version"] == expected == kmock.device_taint_rule_version
    for key in ("unserved", "unserved_list"):
        assert out[key].status == 404 and reason_of(out[key]) == "NotFound"
    [group] = [g for g in out["group"].groups if g.name == DRA]
    assert group.preferred_version.version == preferred
    assert [v.version for v in group.versions] == list(k8s.DRA_SERVED[kube])
    assert out["version_info"].git_version == f"v{kube}.0"
    created = out["created"]
    assert created["apiVersion"] == f"{DRA}/{expected}" and created["metadata"]["resourceVersion"].isdigit()
    assert created["spec"]["taint"]["timeAdded"].endswith("Z") and "namespace" not in created["metadata"]
    assert out["again"].status == 409 and reason_of(out["again"]) == "AlreadyExists"
    assert status_of(out["again"])["message"] == 'devicetaintrules.resource.k8s.io "gpu-watchdog-a-0" already exists'
    assert out["ours"]["kind"] == "DeviceTaintRuleList"
    assert sorted(k8s.names_of(out["ours"]["items"])) == ["gpu-watchdog-a-0", "gpu-watchdog-a-1"]
    assert out["read"]["spec"]["deviceSelector"] == {"driver": "gpu.nvidia.com", "pool": "node-a", "device": "gpu-0"}
    assert out["deleted"]["status"] == "Success" and out["deleted"]["details"]["name"] == "gpu-watchdog-a-0"
    for key in ("gone", "gone_delete"):
        assert out[key].status == 404 and reason_of(out[key]) == "NotFound"
    assert sorted(k8s.names_of(kmock.stored("devicetaintrules"))) == ["admins", "gpu-watchdog-a-1"]
    assert [(w.verb, w.code) for w in kmock.writes_to("devicetaintrules", "gpu-watchdog-a-0")] == [
        ("create", 201), ("create", 409), ("delete", 200), ("delete", 404)]


async def test_a_device_taint_rule_is_one_object_at_every_version_and_is_validated(kmock: Cluster) -> None:
    kmock.kube_version = "1.36"  # v1beta2 and v1alpha3 both serve DeviceTaintRules
    api = custom(kmock)

    def run() -> dict[str, Any]:
        out: dict[str, Any] = {}
        api.create_cluster_custom_object(DRA, "v1alpha3", "devicetaintrules",
                                         taint_rule("gpu-watchdog-a-0", "v1alpha3"))
        out["other_version"] = refusal(lambda: api.create_cluster_custom_object(
            DRA, "v1beta2", "devicetaintrules", taint_rule("gpu-watchdog-a-0", "v1beta2")))
        out["beta"] = api.get_cluster_custom_object(DRA, "v1beta2", "devicetaintrules", "gpu-watchdog-a-0")
        out["typed"] = client.ResourceV1beta2Api(api_of(kmock)).read_device_taint_rule("gpu-watchdog-a-0")
        out["prefer"] = refusal(lambda: api.create_cluster_custom_object(
            DRA, "v1beta2", "devicetaintrules", taint_rule("node-like", "v1beta2", effect="PreferNoSchedule")))
        out["name"] = refusal(lambda: api.create_cluster_custom_object(
            DRA, "v1beta2", "devicetaintrules", taint_rule("GPU_Watchdog", "v1beta2")))
        out["none"] = api.create_cluster_custom_object(DRA, "v1beta2", "devicetaintrules",
                                                       taint_rule("informs", "v1beta2", effect="None"))
        return out

    out = await asyncio.to_thread(run)
    assert out["other_version"].status == 409 and reason_of(out["other_version"]) == "AlreadyExists"
    assert out["beta"]["apiVersion"] == f"{DRA}/v1beta2"
    typed = out["typed"]  # the typed client reads it too: the body is schema-valid
    assert typed.spec.taint.key == "gpu-watchdog.io/suspect" and typed.spec.device_selector.pool == "node-a"
    assert out["prefer"].status == 422 and 'spec.taint.effect: Unsupported value: "PreferNoSchedule"' in status_of(
        out["prefer"])["message"]
    assert out["name"].status == 422 and "metadata.name: Invalid value" in status_of(out["name"])["message"]
    assert out["none"]["spec"]["taint"]["effect"] == "None"  # 1.35 and later know the informing effect
    [stored] = [r for r in kmock.stored("devicetaintrules") if r["metadata"]["name"] == "gpu-watchdog-a-0"]
    assert stored["apiVersion"] == f"{DRA}/v1alpha3"  # stored once, as written


async def test_resource_claims_and_the_pods_device_status(kmock: Cluster) -> None:
    [name] = workload(kmock, 1)
    pod = kmock.read("pods", NS, name)
    assert pod is not None
    kmock.add(k8s.resource_claim(pod, "gpu", "gpu.nvidia.com", "node-0", "gpu-1"))
    kmock.kube_version = "1.33"
    api, core = custom(kmock), core_api(kmock)
    before = pod["metadata"]["resourceVersion"]
    kmock.set_pod_status(NS, name, {"resourceClaimStatuses": [{"name": "gpu", "resourceClaimName": f"{name}-gpu"}]},
                         containers={"inference": {"allocatedResourcesStatus": [{"name": "claim:gpu/gpu", "resources": [
                             {"resourceID": "gpu.nvidia.com/node-0/gpu-1", "health": "Unhealthy"}]}]}})

    def run() -> dict[str, Any]:
        out: dict[str, Any] = {}
        out["claim"] = api.get_namespaced_custom_object(DRA, "v1beta2", NS, "resourceclaims", f"{name}-gpu")
        # At 1.33 v1alpha3 serves DeviceTaintRules only: no claims there.
        out["alpha"] = refusal(lambda: api.get_namespaced_custom_object(DRA, "v1alpha3", NS, "resourceclaims",
                                                                       f"{name}-gpu"))
        out["list"] = api.list_namespaced_custom_object(DRA, "v1beta1", NS, "resourceclaims")
        claim = {"apiVersion": f"{DRA}/v1beta2", "kind": "ResourceClaim", "metadata": {"name": "extra"},
                 "spec": {"devices": {"requests": []}}}
        out["created"] = api.create_namespaced_custom_object(DRA, "v1beta2", NS, "resourceclaims", claim)
        out["again"] = refusal(lambda: api.create_namespaced_custom_object(DRA, "v1beta2", NS, "resourceclaims", claim))
        out["deleted"] = api.delete_namespaced_custom_object(DRA, "v1beta2", NS, "resourceclaims", "extra")
        out["gone"] = refusal(lambda: api.delete_namespaced_custom_object(DRA, "v1beta2", NS, "resourceclaims",
                                                                          "extra"))
        out["pod"] = core.read_namespaced_pod(name, NS)
        return out

    out = await asyncio.to_thread(run)
    [result] = out["claim"]["status"]["allocation"]["devices"]["results"]
    assert result == {"request": "gpu", "driver": "gpu.nvidia.com", "pool": "node-0", "device": "gpu-1"}
    assert out["claim"]["apiVersion"] == f"{DRA}/v1beta2"
    assert out["alpha"].status == 404
    assert k8s.names_of(out["list"]["items"]) == [f"{name}-gpu"]
    assert out["created"]["metadata"]["namespace"] == NS
    assert out["again"].status == 409 and reason_of(out["again"]) == "AlreadyExists"
    assert out["deleted"]["status"] == "Success" and out["gone"].status == 404
    read = out["pod"]
    assert int(read.metadata.resource_version) > int(before)
    assert [(s.name, s.resource_claim_name) for s in read.status.resource_claim_statuses] == [("gpu", f"{name}-gpu")]
    [inference] = [c for c in read.status.container_statuses if c.name == "inference"]
    [allocated] = inference.allocated_resources_status
    assert allocated.name == "claim:gpu/gpu"
    assert [(r.resource_id, r.health) for r in allocated.resources] == [("gpu.nvidia.com/node-0/gpu-1", "Unhealthy")]
    assert inference.ready  # the rest of the container's status kept
