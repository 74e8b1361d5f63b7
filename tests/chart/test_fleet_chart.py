"""The fleet's ledger as the chart installs it: the Lease, the sidecar's rights to it and its Deployment,
and the name handed to the sidecar, checked on the rendered manifests."""

from __future__ import annotations

import dataclasses
from typing import Any

import kubernetes_validate
import pytest
import yaml

from gpu_watchdog.watchdog.edge.config import FleetSettings, QuarantineSettings, RestartBudgetSettings, from_mapping
from gpu_watchdog.watchdog.edge.effects.fleet import lease_name
from gpu_watchdog.watchdog.edge.kube.kube import workload_from_pod
from tests.chart.rendering import (
    CHART,
    K8S_VERSION,
    by_kind,
    comment_above,
    containers,
    render,
    render_error,
    render_manifests,
    watchdog_config,
)
from tests.chart.value_sets import ALL_ON, EXTERNAL, VLLM
from tests.sim.world import PROBE_FAILURES, PROBE_PERIOD_S


def lease(docs: list[dict[str, Any]]) -> dict[str, Any] | None:
    leases = by_kind(docs, "Lease")
    assert len(leases) <= 1, leases
    return leases[0] if leases else None


def role_rules(docs: list[dict[str, Any]], group: str, resource: str) -> list[dict[str, Any]]:
    roles = [r for r in by_kind(docs, "Role") if r["metadata"].get("namespace", "serving") == "serving"]
    return [rule for role in roles for rule in role["rules"]
            if group in rule["apiGroups"] and resource in rule["resources"]]


def strategy(name: str, **fleet: Any) -> dict[str, Any]:
    config: dict[str, Any] = {"restart": {"strategy": name}}
    if fleet:
        config["policy"] = {"fleet": fleet}
    return {"watchdog": {"config": config}}


@pytest.mark.parametrize("values", [{}, strategy("evict"), strategy("delete"), VLLM, EXTERNAL, ALL_ON])
def test_the_chart_creates_the_lease_and_hands_its_name_to_the_sidecar(values: dict[str, Any],
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    docs = render(values)
    found = lease(docs)
    assert found is not None
    kubernetes_validate.validate(found, K8S_VERSION, strict=True)
    [deploy] = by_kind(docs, "Deployment")
    assert found["metadata"]["name"] == f"{deploy['metadata']['name']}-fleet"
    assert "namespace" not in found["metadata"]  # the release's, beside the pods that write it
    settings = watchdog_config(values, monkeypatch)
    assert settings.policy.fleet.enabled is True
    # The name the sidecar's ledger opens is the one the chart created.
    assert lease_name("anything", settings.policy.fleet.lease_name) == found["metadata"]["name"]


@pytest.mark.parametrize("values", [{}, ALL_ON, {"podAnnotations": {"team": "ml"}}])
def test_the_lease_leaves_the_sidecars_ledger_to_them(values: dict[str, Any]) -> None:
    """The sidecars keep the ledger in the Lease's annotations and write spec.holderIdentity and
    renewTime; whatever the chart templates there a `helm upgrade` patches back, with no
    resourceVersion check, over slots taken and an open breaker."""
    found = lease(render(values))
    assert found is not None
    assert "annotations" not in found["metadata"]
    assert found["spec"] == {}


def quarantine_off(values: dict[str, Any]) -> dict[str, Any]:
    config = values["watchdog"]["config"]
    config.setdefault("policy", {})["quarantine"] = {"enabled": False}
    return values


@pytest.mark.parametrize("values", [strategy("none"), quarantine_off(strategy("container", enabled=False)),
                                    quarantine_off(strategy("evict", enabled=False))])
def test_no_lease_and_no_right_to_one_where_the_fleet_and_the_quarantine_are_off(
        values: dict[str, Any], monkeypatch: pytest.MonkeyPatch) -> None:
    docs = render(values)
    assert lease(docs) is None
    assert role_rules(docs, "coordination.k8s.io", "leases") == []
    assert watchdog_config(values, monkeypatch).policy.fleet.lease_name == ""


def test_the_quarantine_alone_keeps_the_lease_for_its_records(monkeypatch: pytest.MonkeyPatch) -> None:
    values = strategy("evict", enabled=False)
    docs = render(values)
    found = lease(docs)
    assert found is not None
    [rule] = role_rules(docs, "coordination.k8s.io", "leases")
    assert rule["resourceNames"] == [found["metadata"]["name"]] and sorted(rule["verbs"]) == ["get", "update"]
    settings = watchdog_config(values, monkeypatch)
    assert settings.policy.fleet.enabled is False and settings.policy.quarantine.enabled is True
    assert lease_name("anything", settings.policy.fleet.lease_name) == found["metadata"]["name"]


def test_the_user_keeps_the_other_fleet_settings(monkeypatch: pytest.MonkeyPatch) -> None:
    values = strategy("container", max_unavailable=2, breaker="60%", window="2h", slot_timeout="10m")
    fleet = watchdog_config(values, monkeypatch).policy.fleet
    assert (fleet.max_unavailable, fleet.breaker, fleet.window, fleet.slot_timeout) == ("2", 0.6, 7200.0, 600.0)
    assert fleet.lease_name == "demo-gpu-watchdog-fleet"


def test_a_lease_name_the_role_does_not_grant_is_refused() -> None:
    text = render_error(strategy("container", lease_name="shared-ledger"))
    assert "lease_name" in text and "shared-ledger" in text and "demo-gpu-watchdog-fleet" in text, text
    # Naming the chart's own Lease changes nothing.
    same = render(strategy("container", lease_name="demo-gpu-watchdog-fleet"))
    assert lease(same) is not None


def test_the_lease_rule_is_get_and_update_of_that_lease_alone() -> None:
    docs = render()
    found = lease(docs)
    assert found is not None
    [rule] = role_rules(docs, "coordination.k8s.io", "leases")
    assert rule["resourceNames"] == [found["metadata"]["name"]]
    assert sorted(rule["verbs"]) == ["get", "update"]  # no create (the chart's), no list, watch, delete


@pytest.mark.parametrize("values", [{}, strategy("evict", enabled=False), strategy("delete")])
def test_the_deployment_rule_is_get_of_the_charts_deployment_alone(values: dict[str, Any]) -> None:
    docs = render(values)
    [deploy] = by_kind(docs, "Deployment")
    [rule] = role_rules(docs, "apps", "deployments")
    assert sorted(rule["verbs"]) == ["get"]
    assert rule["resourceNames"] == [deploy["metadata"]["name"]]
    # The name the sidecar reads spec.replicas under: its pod's ReplicaSet, <deployment>-<pod-template-hash>.
    assert workload_from_pod(f"{deploy['metadata']['name']}-7d9f8c6b5-x2x4q", {"pod-template-hash": "7d9f8c6b5"},
                             [("ReplicaSet", f"{deploy['metadata']['name']}-7d9f8c6b5")]) == rule["resourceNames"][0]
    assert role_rules(docs, "apps", "statefulsets") == [] and role_rules(docs, "apps", "replicasets") == []


def test_the_notes_say_how_to_close_the_breaker() -> None:
    notes = render_manifests({})["gpu-watchdog/templates/NOTES.txt"]
    assert "demo-gpu-watchdog-fleet" in notes
    assert "-c watchdog -- gpu-watchdog fleet reset-breaker" in notes
    off = render_manifests(strategy("container", enabled=False))["gpu-watchdog/templates/NOTES.txt"]
    assert "reset-breaker" not in off


def test_the_values_give_the_sidecars_defaults_and_comment_every_fleet_setting() -> None:
    """values.yaml spells the fleet's settings out; they must be the sidecar's own defaults, each one
    explained in the comment above them."""
    text = (CHART / "values.yaml").read_text()
    policy = yaml.safe_load(text)["watchdog"]["config"]["policy"]
    settings = from_mapping({"policy": {"fleet": policy["fleet"], "restart_budget": policy["restart_budget"]},
                             "kubernetes": {"pod_name": "p", "namespace": "n"}})
    assert settings.policy.fleet == FleetSettings()
    assert settings.policy.restart_budget == RestartBudgetSettings()
    fleet_comment = comment_above(text, "fleet: {")
    for f in dataclasses.fields(FleetSettings):
        assert f.name in fleet_comment, f"values.yaml says nothing of policy.fleet.{f.name}"
    assert "per_replica" in comment_above(text, "restart_budget: {")


def test_the_quarantine_settings_are_the_sidecars_defaults_and_each_is_explained() -> None:
    text = (CHART / "values.yaml").read_text()
    policy = yaml.safe_load(text)["watchdog"]["config"]["policy"]
    settings = from_mapping({"policy": {"quarantine": policy["quarantine"]},
                             "kubernetes": {"pod_name": "p", "namespace": "n"}})
    assert settings.policy.quarantine == QuarantineSettings()
    said = comment_above(text, "quarantine: {")
    for f in dataclasses.fields(QuarantineSettings):
        assert f.name in said, f"values.yaml says nothing of policy.quarantine.{f.name}"
    notes = render_manifests({})["gpu-watchdog/templates/NOTES.txt"]
    assert "-c watchdog -- gpu-watchdog quarantine lift FINGERPRINT" in notes
    off = render_manifests(quarantine_off(strategy("container")))["gpu-watchdog/templates/NOTES.txt"]
    assert "quarantine lift" not in off


@pytest.mark.parametrize("values", [{}, VLLM, EXTERNAL, ALL_ON])
def test_every_replica_gets_the_releases_fingerprint_key(values: dict[str, Any]) -> None:
    docs = render(values)
    [secret] = [s for s in by_kind(docs, "Secret") if s["metadata"]["name"].endswith("-fingerprint")]
    kubernetes_validate.validate(secret, K8S_VERSION, strict=True)
    assert len(secret["data"]["key"]) >= 48
    [deploy] = by_kind(docs, "Deployment")
    spec = deploy["spec"]["template"]["spec"]
    model = [c for c in spec["containers"] if c["name"] != "watchdog"]
    for container in model:
        [env] = [e for e in container.get("env", []) if e["name"] == "GPU_WATCHDOG_FINGERPRINT_KEY"]
        assert env["valueFrom"]["secretKeyRef"] == {"name": secret["metadata"]["name"], "key": "key"}
    own = render({**values, "inference": {**values.get("inference", {}), "fingerprintKeySecret": "my-key"}})
    assert not [s for s in by_kind(own, "Secret") if s["metadata"]["name"].endswith("-fingerprint")]
    assert '"name": "my-key"' in str(by_kind(own, "Deployment")).replace("'", '"')
    # The sidecar never needs it: it reads fingerprints, it does not compute them.
    watchdog = [c for c in spec.get("initContainers", []) + spec["containers"] if c["name"] == "watchdog"]
    assert watchdog and all("GPU_WATCHDOG_FINGERPRINT_KEY" not in str(c.get("env")) for c in watchdog)


QUARANTINE_OFF = {"watchdog": {"config": {"policy": {"quarantine": {"enabled": False}}}}}


@pytest.mark.parametrize(("values", "waits"), [({}, True), (strategy("none"), True), (QUARANTINE_OFF, False)])
def test_the_server_waits_for_the_quarantine_wherever_the_sidecar_keeps_one(values: dict[str, Any],
                                                                            waits: bool) -> None:
    """The bundled server's flags as the real `serve` parser reads them: a new process serves only once
    its sidecar's list is in force, wherever the sidecar pushes one."""
    from gpu_watchdog.cli import build_parser
    from gpu_watchdog.inference.settings import from_args

    args = containers(render(values))["inference"]["args"]
    settings = from_args(build_parser().parse_args(args))
    assert settings.quarantine_wait == (60.0 if waits else 0.0)


def test_the_simulation_probes_readiness_as_the_chart_does() -> None:
    """The fleet's rules are proven in a simulation whose kubelet sets each pod's Ready condition from
    probes every PROBE_PERIOD_S, a container unready after its PROBE_FAILURES: the lag the census allows for is the
    chart's, for both containers and every engine."""
    for values in (None, VLLM, EXTERNAL):
        for name, c in containers(render(values)).items():
            probe = c.get("readinessProbe")
            assert probe is not None, name
            assert (probe["periodSeconds"], probe["failureThreshold"]) == (PROBE_PERIOD_S, PROBE_FAILURES[name]), name
            assert probe.get("successThreshold", 1) == 1, name
