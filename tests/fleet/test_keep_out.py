"""The placement effects (`KeepOut`, the real `Placer` and `LeaseLedger`) against the emulator, in
process, with the wall clock in the test's hand: a trace over days (the repeat offender, through the
records as the Lease holds them), a GPU suspect, the strategies that taint nothing, an API that
refuses, and a rule by our name that we did not place."""

from __future__ import annotations

import asyncio
import copy
from typing import Any

import pytest
from kubernetes import client

from gpu_watchdog.watchdog.core import placement
from gpu_watchdog.watchdog.core.escalation import RestartRecord, Suspect
from gpu_watchdog.watchdog.core.names import CONTEXT_LOSS, HANG
from gpu_watchdog.watchdog.core.policy import Decision
from gpu_watchdog.watchdog.edge.config import from_mapping
from gpu_watchdog.watchdog.edge.effects.fleet import LeaseLedger
from gpu_watchdog.watchdog.edge.effects.placement import Placer
from gpu_watchdog.watchdog.edge.keep_out import KeepOut
from gpu_watchdog.watchdog.edge.metrics import WatchdogMetrics
from tests.fleet import cluster as k8s
from tests.fleet.cluster import Cluster
from tests.traces import Trace

NS, WORKLOAD, POD, NODE = "serving", "llm", "llm-5c9d7b6f4x-abcde", "node-a"
CARD = "gpu.nvidia.com/node-a/gpu-0"
OWNER = placement.owner_of(NS, WORKLOAD)
DAY = placement.DAY_S
T0 = 1_780_000_000.0 - (1_780_000_000.0 % DAY) + 3600


class Clock:
    def __init__(self, at: float) -> None:
        self.at = at

    def __call__(self) -> float:
        return self.at


def api_client(cluster: Cluster) -> client.ApiClient:
    cfg = client.Configuration()
    cfg.host = str(cluster.url).rstrip("/")
    return client.ApiClient(cfg)


def add_pods(cluster: Cluster, pods: dict[str, tuple[str, str | None]], driver: str = "gpu.nvidia.com",
             workload: str = WORKLOAD) -> None:
    """The workload's pods: name -> (node, DRA device of `driver`, or None for a device-plugin GPU)."""
    deploy = cluster.add(k8s.deployment(workload, NS, len(pods), labels={"app": workload}))
    rs = cluster.add(k8s.replica_set(deploy, "5c9d7b6f4x"))
    for name, (node, device) in pods.items():
        pod = k8s.pod_of(rs, name, node, ready=True)
        if device is not None:
            pod["spec"]["resourceClaims"] = [{"name": "gpu", "resourceClaimTemplateName": "gpu"}]
            pod["status"]["resourceClaimStatuses"] = [{"name": "gpu", "resourceClaimName": f"{name}-gpu"}]
        stored = cluster.add(pod)
        if device is not None:
            cluster.add(k8s.resource_claim(copy.deepcopy(stored), "gpu", driver, node, device))
    for node in {n for n, _ in pods.values()}:
        if cluster.node(node) is None:
            cluster.add(k8s.node_of(node, gpus=None if any(d for n, d in pods.values() if n == node) else 1))


def keep_out(cluster: Cluster, clock: Clock, pod: str = POD, node: str = NODE, workload: str = WORKLOAD,
             **placement_settings: Any) -> tuple[KeepOut, WatchdogMetrics, LeaseLedger]:
    settings = from_mapping({
        "target": {"openai_url": "http://127.0.0.1:9", "metrics_url": None}, "restart": {"strategy": "evict"},
        "kubernetes": {"pod_name": pod, "namespace": NS, "node_name": node},
        "policy": {"placement": {"strategy": "device", **placement_settings}}})
    api = api_client(cluster)
    ledger = LeaseLedger(api, NS, f"gpu-watchdog-{workload}", workload, pod, 5.0, wall_clock=clock)
    metrics = WatchdogMetrics(lambda: None)  # type: ignore[arg-type, return-value]
    placer = Placer(api, NS, pod, node, workload, 5.0)
    trace = Trace(settings)
    return KeepOut(settings=settings, placer=placer, ledger=ledger, metrics=metrics, wall_clock=clock,
                   workload=workload, history=lambda: trace.history, fold=trace.fold), metrics, ledger


def counted(metrics: WatchdogMetrics, action: str) -> float:
    return float(metrics.placement_actions.labels(action=action)._value.get())


def lost_context(evidence: str = "canary", **detail: Any) -> Decision:
    return Decision("restart", CONTEXT_LOSS, {"evidence": evidence, **detail}, drain=False)


async def test_a_card_remediated_on_two_days_is_tainted_at_its_first_fault_of_the_third(kmock: Cluster) -> None:
    """Each fault is a context loss the canary saw: nothing in it is about the card. The records,
    kept in the Lease past any Event's TTL, make the third day's first one a repeat offender's."""
    add_pods(kmock, {POD: (NODE, "gpu-0"), "llm-5c9d7b6f4x-fghij": ("node-b", "gpu-0")})
    clock = Clock(T0)
    effects, metrics, ledger = keep_out(kmock, clock)
    outcomes = []
    for at in (T0, T0 + 60, T0 + 2 * DAY, T0 + 2 * DAY + 600, T0 + 5 * DAY):
        clock.at = at
        outcomes.append(await effects.before_pod_rung(lost_context(), None, ()))
    assert outcomes == [None, None, None, None, "tainted"]
    [rule] = kmock.stored("devicetaintrules")
    assert rule["spec"]["deviceSelector"] == {"driver": "gpu.nvidia.com", "pool": NODE, "device": "gpu-0"}
    assert "2 different days" in rule["metadata"]["annotations"][placement.EVIDENCE_ANNOTATION]
    records = await asyncio.to_thread(ledger.read_placement)
    assert [r.at for r in records.remediations] == [T0, T0 + 2 * DAY, T0 + 5 * DAY]  # one a day
    assert counted(metrics, "tainted") == 1


async def test_a_gpu_suspect_is_tainted_and_a_hang_counts_as_a_remediation(kmock: Cluster) -> None:
    add_pods(kmock, {POD: (NODE, "gpu-0")})
    clock = Clock(T0)
    effects, _, ledger = keep_out(kmock, clock)
    assert await effects.before_pod_rung(Decision("restart", HANG, {}), None, ()) is None
    restarts = tuple(RestartRecord(T0 - i * 600, HANG, ("GPU-abc",), "old-pod") for i in range(2))
    assert await effects.before_pod_rung(Decision("restart", HANG, {}), None, [Suspect("GPU-abc", restarts)]) \
        == "tainted"
    assert [t.evidence for t in (await asyncio.to_thread(ledger.read_placement)).taints] == [
        "2 restarts on this card within the window did not cure it"]
    # Not a curing restart: neither remembered nor tainted.
    assert await effects.before_pod_rung(Decision("restart", "fragmentation", {}), None, ()) is None


@pytest.mark.parametrize(("strategy", "device", "outcome"), [
    ("none", "gpu-0", "would_taint"), ("device", None, "not_possible"), ("none", None, "would_taint")])
async def test_strategies_that_taint_nothing_say_what_they_would(kmock: Cluster, strategy: str, device: str | None,
                                                                 outcome: str) -> None:
    add_pods(kmock, {POD: (NODE, device)})
    effects, metrics, ledger = keep_out(kmock, Clock(T0), strategy=strategy)
    uuid = CARD if device else "GPU-1f2e"
    got = await effects.before_pod_rung(lost_context("device_health", resource_id=uuid, uuid=uuid), None, ())
    assert got == outcome and counted(metrics, outcome) == 1
    assert kmock.stored("devicetaintrules") == [] and kmock.writes_to("nodes") == []
    records = await asyncio.to_thread(ledger.read_placement)
    assert records.taints == () and [r.card for r in records.remediations] == [uuid]


async def test_an_api_that_refuses_the_taint_never_holds_the_restart_and_leaves_no_record(kmock: Cluster) -> None:
    add_pods(kmock, {POD: (NODE, "gpu-0")})
    kmock["post", "/apis/resource.k8s.io/v1/devicetaintrules"] << 403
    kmock.kube_version = "1.37"
    effects, metrics, ledger = keep_out(kmock, Clock(T0))
    assert await effects.before_pod_rung(lost_context("device_health", resource_id=CARD), None, ()) == "failed"
    error = effects.history().edge.placement_error
    assert counted(metrics, "failed") == 1 and error is not None and "403" in error
    # Forgotten: it neither counts against the bound nor waits to be lifted.
    assert (await asyncio.to_thread(ledger.read_placement)).taints == ()


async def test_a_rule_by_our_name_that_we_did_not_place_is_never_lifted(kmock: Cluster) -> None:
    add_pods(kmock, {POD: (NODE, "gpu-0")})
    clock = Clock(T0)
    effects, _, ledger = keep_out(kmock, clock, ttl="1h")
    assert await effects.before_pod_rung(lost_context("device_health", resource_id=CARD), None, ()) == "tainted"
    [rule] = kmock.stored("devicetaintrules")
    name = rule["metadata"]["name"]
    # Someone replaced it with one of their own by that name (no label of ours).
    kmock.remove("devicetaintrules", "", name)
    theirs = {**rule, "metadata": {"name": name, "labels": {"team": "hardware"}}}
    kmock.add(theirs)
    clock.at = T0 + 3601
    await effects.reconcile()
    assert [r["metadata"]["labels"] for r in kmock.stored("devicetaintrules")] == [{"team": "hardware"}]
    records = await asyncio.to_thread(ledger.read_placement)
    assert records.taints == () and [(x.target, x.by) for x in records.lifts] == [(name, POD)]


async def test_what_the_records_hold_is_kept_in_the_cluster(kmock: Cluster) -> None:
    """An operator's `kubectl delete` of our rule (or a lift racing a renewal) is undone while the record
    stands; a rule of ours the records lost is lifted once past its expiry."""
    add_pods(kmock, {POD: (NODE, "gpu-0")})
    clock = Clock(T0)
    effects, _, ledger = keep_out(kmock, clock, ttl="1h")
    assert await effects.before_pod_rung(lost_context("device_health", resource_id=CARD), None, ()) == "tainted"
    [rule] = kmock.stored("devicetaintrules")
    kmock.remove("devicetaintrules", "", rule["metadata"]["name"])
    await effects.reconcile()
    assert [r["metadata"]["name"] for r in kmock.stored("devicetaintrules")] == [rule["metadata"]["name"]]
    # The records lose it (say, a Lease recreated): the rule is ours, and lifted once past its expiry.
    await asyncio.to_thread(ledger.update_placement, lambda rec, at: (placement.Records(), None))
    clock.at = T0 + 1800
    await effects.reconcile()
    assert len(kmock.stored("devicetaintrules")) == 1
    clock.at = T0 + 3601
    await effects.reconcile()
    assert kmock.stored("devicetaintrules") == []


async def test_no_execute_comes_only_once_the_restart_was_accepted(kmock: Cluster) -> None:
    add_pods(kmock, {POD: (NODE, "gpu-0"), "llm-5c9d7b6f4x-fghij": ("node-b", "gpu-0")})
    effects, _, ledger = keep_out(kmock, Clock(T0), effect="NoExecute", max_percent=100)
    decision = lost_context("device_health", resource_id=CARD)
    assert await effects.before_pod_rung(decision, None, ()) == "tainted"
    [rule] = kmock.stored("devicetaintrules")
    assert rule["spec"]["taint"]["effect"] == "NoSchedule"  # nothing evicted before our own Event and PDB
    await effects.after_pod_rung(True)
    [rule] = kmock.stored("devicetaintrules")
    assert rule["spec"]["taint"]["effect"] == "NoExecute"
    assert [t.effect for t in (await asyncio.to_thread(ledger.read_placement)).taints] == ["NoExecute"]
    # A restart that was not accepted leaves it NoSchedule.
    other, _, _ = keep_out(kmock, Clock(T0), pod="llm-5c9d7b6f4x-fghij", node="node-b", effect="NoExecute",
                           max_percent=100)
    assert await other.before_pod_rung(lost_context("device_health", resource_id="gpu.nvidia.com/node-b/gpu-0"),
                                       None, ()) == "tainted"
    await other.after_pod_rung(False)
    assert sorted(r["spec"]["taint"]["effect"] for r in kmock.stored("devicetaintrules")) == ["NoExecute",
                                                                                             "NoSchedule"]


async def test_a_nic_beside_a_device_plugin_gpu_is_never_taken_for_it(kmock: Cluster) -> None:
    add_pods(kmock, {POD: (NODE, "nic-0")}, driver="net.example.com")
    effects, _, ledger = keep_out(kmock, Clock(T0), strategy="node")
    # A time-sliced GPU: the kubelet names it twice, with ::N.
    got = await effects.before_pod_rung(lost_context("recovery_action", recovery_action="GPU_RESET", uuid="GPU-9"),
                                        ("GPU-9::0", "GPU-9::1"), ())
    assert got == "tainted" and kmock.stored("devicetaintrules") == []
    node = kmock.node(NODE)
    assert node is not None and node["spec"]["taints"] == [
        {"key": placement.NODE_TAINT_KEY, "value": f"{OWNER}-{int(T0 + 86400)}", "effect": "NoSchedule"}]
    assert [t.card for t in (await asyncio.to_thread(ledger.read_placement)).taints] == ["GPU-9"]


async def test_a_taint_put_back_after_its_lift_is_swept_and_a_node_gone_frees_its_record(kmock: Cluster) -> None:
    add_pods(kmock, {POD: (NODE, None), "llm-5c9d7b6f4x-fghij": ("node-b", None)})
    clock = Clock(T0)
    effects, _, ledger = keep_out(kmock, clock, strategy="node", ttl="1h", max_percent=100)
    health = lost_context("device_health", resource_id="GPU-a", uuid="GPU-a")
    assert await effects.before_pod_rung(health, None, ()) == "tainted"
    ours = {"key": placement.NODE_TAINT_KEY, "value": f"{OWNER}-{int(T0 + 3600)}", "effect": "NoSchedule"}
    clock.at = T0 + 3601
    await effects.reconcile()
    node = kmock.node(NODE)
    assert node is not None and not node["spec"].get("taints")
    # A sidecar that read the records before the lift puts it back: the next pass takes it away again.
    kmock.set_node_taints(NODE, [ours])
    clock.at = T0 + 3660
    await effects.reconcile()
    node = kmock.node(NODE)
    assert node is not None and not node["spec"].get("taints")
    # A tainted node an autoscaler removed: its record goes at the next pass, and frees the bound.
    other, _, _ = keep_out(kmock, clock, pod="llm-5c9d7b6f4x-fghij", node="node-b", strategy="node", ttl="1h",
                           max_percent=100)
    assert await other.before_pod_rung(lost_context("device_health", resource_id="GPU-b", uuid="GPU-b"), None,
                                       ()) == "tainted"
    kmock.remove("nodes", "", "node-b")
    await other.reconcile()
    assert (await asyncio.to_thread(ledger.read_placement)).taints == ()


# -- I9: every taint we place is lifted by its expiry, whatever happens to the Lease or to an answer ----------

PODS4: dict[str, tuple[str, str | None]] = {f"llm-5c9d7b6f4x-{i}": (f"node-{i}", None) for i in range(4)}


def node_taints(cluster: Cluster, name: str) -> list[dict[str, Any]]:
    node = cluster.node(name)
    assert node is not None
    return list(node["spec"].get("taints") or [])


def health(uuid: str) -> Decision:
    return lost_context("device_health", resource_id=uuid, uuid=uuid)


async def empty_the_records(ledger: LeaseLedger) -> None:
    """An operator's cleanup (or a Lease recreated): the placement annotation emptied."""
    await asyncio.to_thread(ledger.update_placement, lambda rec, at: (placement.Records(), None))


async def test_with_the_records_emptied_the_bound_holds_and_every_node_taint_is_lifted_at_its_expiry(
        kmock: Cluster) -> None:
    """Four replicas on four nodes, cap 2 (max_nodes 2, 50 % of 4). The placement annotation is emptied after
    each taint: the sidecars find the taints again in the cluster (the nodes they saw in the records), so
    the third card is capped; at the expiry the taints are lifted though no record names them."""
    add_pods(kmock, PODS4)
    clock = Clock(T0)
    sidecars = [keep_out(kmock, clock, pod=name, node=node, strategy="node", ttl="1h")
                for name, (node, _) in PODS4.items()]

    async def reconcile_all() -> None:
        for effects, _, _ in sidecars:
            await effects.reconcile()

    ledger = sidecars[0][2]
    for i in range(3):
        clock.at = T0 + 60 * i
        outcome = await sidecars[i][0].before_pod_rung(health(f"GPU-{i}"), None, ())
        assert outcome == ("tainted" if i < 2 else "capped"), (i, outcome)
        await reconcile_all()  # every minute, every sidecar
        await empty_the_records(ledger)
    assert [n for n in ("node-0", "node-1", "node-2", "node-3") if node_taints(kmock, n)] == ["node-0", "node-1"]
    # Still emptied at each pass: the taints in force are recorded again (and counted), not lifted.
    clock.at = T0 + 1800
    await reconcile_all()
    records = await asyncio.to_thread(ledger.read_placement)
    assert sorted(t.target for t in records.taints) == ["node-0", "node-1"]
    await empty_the_records(ledger)
    # Past their expiry (1 h, plus one reconcile): lifted, as the nodes' taints state, with no record.
    clock.at = T0 + 3600 + 120
    await reconcile_all()
    assert [n for n in ("node-0", "node-1", "node-2", "node-3") if node_taints(kmock, n)] == []


async def test_with_the_records_emptied_device_taint_rules_are_found_counted_and_lifted(kmock: Cluster) -> None:
    pods: dict[str, tuple[str, str | None]] = {f"llm-5c9d7b6f4x-{i}": (f"node-{i}", "gpu-0") for i in range(4)}
    add_pods(kmock, pods)
    clock = Clock(T0)
    sidecars = [keep_out(kmock, clock, pod=name, node=node, ttl="1h") for name, (node, _) in pods.items()]
    ledger = sidecars[0][2]
    outcomes = []
    for i in range(3):
        outcomes.append(await sidecars[i][0].before_pod_rung(
            health(f"gpu.nvidia.com/node-{i}/gpu-0"), None, ()))
        await empty_the_records(ledger)
    assert outcomes == ["tainted", "tainted", "capped"] and len(kmock.stored("devicetaintrules")) == 2
    clock.at = T0 + 3601
    await sidecars[3][0].reconcile()
    assert kmock.stored("devicetaintrules") == []


class LostAnswers:
    """The API's answer to a node PATCH lost after the write was applied (a timeout on the way back), and
    optionally the next `gets` reads of a node after it too: the client sees an error, the cluster holds the
    write."""

    def __init__(self, effects: KeepOut, gets: int = 0) -> None:
        api = effects.placer.api  # type: ignore[attr-defined]
        self.patch, self.get, self.gets, self.lost = api.patch, api.get, gets, False
        api.patch, api.get = self._patch, self._get

    def _patch(self, path: str, *args: Any, **kwargs: Any) -> Any:
        answer = self.patch(path, *args, **kwargs)
        if path.startswith("/api/v1/nodes/") and not self.lost:
            self.lost = True
            raise TimeoutError(f"PATCH {path}: no answer within the timeout")
        return answer

    def _get(self, path: str, *args: Any, **kwargs: Any) -> Any:
        if path.startswith("/api/v1/nodes/") and self.lost and self.gets > 0:
            self.gets -= 1
            raise TimeoutError(f"GET {path}: no answer within the timeout")
        return self.get(path, *args, **kwargs)


@pytest.mark.parametrize("gets", [0, 1], ids=["checked", "unchecked"])
async def test_a_node_patch_applied_whose_answer_was_lost_is_lifted_at_its_expiry(kmock: Cluster, gets: int) -> None:
    """checked: the read after it finds our entry (recorded as present). unchecked: that read is lost too;
    the record stays (it may have landed), and even with the records emptied the taint is lifted."""
    add_pods(kmock, {POD: (NODE, None), "llm-5c9d7b6f4x-fghij": ("node-b", None)})
    clock = Clock(T0)
    effects, _, ledger = keep_out(kmock, clock, strategy="node", ttl="1h", max_percent=100)
    other, _, _ = keep_out(kmock, clock, pod="llm-5c9d7b6f4x-fghij", node="node-b", strategy="node", ttl="1h",
                           max_percent=100)
    LostAnswers(effects, gets)
    assert await effects.before_pod_rung(health("GPU-a"), None, ()) == ("tainted" if gets == 0 else "failed")
    assert placement.node_held(node_taints(kmock, NODE), OWNER) == [("NoSchedule", int(T0 + 3600))]
    assert [t.target for t in (await asyncio.to_thread(ledger.read_placement)).taints] == [NODE]
    await other.reconcile()  # the other sidecar reads the records: it knows of node-a now
    await empty_the_records(ledger)
    clock.at = T0 + 3601
    await other.reconcile()
    assert node_taints(kmock, NODE) == []


async def test_a_workloads_expiry_never_lifts_the_node_taint_another_workload_still_holds(kmock: Cluster) -> None:
    add_pods(kmock, {POD: (NODE, None)})
    add_pods(kmock, {"embedder-5c9d7b6f4x-abcde": (NODE, None)}, workload="embedder")
    clock = Clock(T0)
    a, _, a_ledger = keep_out(kmock, clock, strategy="node", ttl="1h", max_percent=100)
    b, _, _ = keep_out(kmock, clock, pod="embedder-5c9d7b6f4x-abcde", workload="embedder", strategy="node",
                       ttl="1h", max_percent=100)
    assert await a.before_pod_rung(health("GPU-a"), None, ()) == "tainted"
    clock.at = T0 + 1800
    assert await b.before_pod_rung(health("GPU-b"), None, ()) == "tainted"
    [shared] = node_taints(kmock, NODE)  # one taint per key and effect: both workloads' entries in it
    b_owner = placement.owner_of(NS, "embedder")
    assert placement.node_entries(shared["value"]) == {OWNER: int(T0 + 3600), b_owner: int(T0 + 5400)}
    # A's expiry: A's record goes, the taint B holds stays.
    clock.at = T0 + 3601
    await a.reconcile()
    await b.reconcile()
    assert node_taints(kmock, NODE) == [shared]
    assert (await asyncio.to_thread(a_ledger.read_placement)).taints == ()
    # B's expiry: lifted (by either: nothing in force is left in it).
    clock.at = T0 + 5401
    await a.reconcile()
    assert node_taints(kmock, NODE) == []
    await b.reconcile()
    assert node_taints(kmock, NODE) == []


async def test_a_node_taint_of_the_previous_format_is_still_lifted_by_its_record(kmock: Cluster) -> None:
    add_pods(kmock, {POD: (NODE, None)})
    clock = Clock(T0)
    effects, _, ledger = keep_out(kmock, clock, strategy="node", ttl="1h", max_percent=100)
    old = placement.Taint(placement.NODE, NODE, "GPU-a", NODE, POD, T0, T0 + 3600, "before the upgrade", "NoSchedule")
    await asyncio.to_thread(ledger.update_placement, lambda rec, at: (placement.Records(taints=(old,)), None))
    operators = {"key": placement.NODE_TAINT_KEY, "value": "GPU-replaced-last-week", "effect": "PreferNoSchedule"}
    kmock.set_node_taints(NODE, [operators, {"key": placement.NODE_TAINT_KEY, "value": "GPU-a",
                                             "effect": "NoSchedule"}])
    clock.at = T0 + 3601
    await effects.reconcile()
    assert node_taints(kmock, NODE) == [operators]
