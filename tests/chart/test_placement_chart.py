"""policy.placement as the chart installs it: the config handed to the sidecar, the RBAC each strategy
gets and no more, and the opt-in ValidatingAdmissionPolicy (watchdog.placementPolicy), checked on the
manifests the Helm SDK renders.

From the Kubernetes documentation (RBAC; ValidatingAdmissionPolicy; Dynamic Resource Allocation,
device taints): DeviceTaintRules and Nodes are cluster-scoped, so only a ClusterRole can grant them;
RBAC cannot narrow create or list to a name, nor "the node my pod runs on". A pod-bound ServiceAccount
token carries the pod's node in the request's userInfo.extra (authentication.kubernetes.io/node-name,
GA in 1.32), which a ValidatingAdmissionPolicy can compare with what is written. A PATCH of a Node is
admitted as an UPDATE, with the whole old and new objects. An expression that errs fails the request
under failurePolicy Fail. A namespaceSelector does not narrow cluster-scoped objects.

No API server runs here: the policy's expressions are checked for what they must name, and, where a
CEL interpreter is installed (cel-python, `import celpy`), evaluated against admission requests.
"""

from __future__ import annotations

import dataclasses
import re
from typing import Any

import helm_python as helm
import kubernetes_validate
import pytest
import yaml

from gpu_watchdog.watchdog.edge.config import from_mapping
from tests.chart.rendering import (
    ALLOWED,
    CHART,
    K8S_VERSION,
    by_kind,
    comment_above,
    grants,
    render,
    render_failure,
    render_manifests,
    schema_version,
    with_images,
)

NODE_KEY = "gpu-watchdog.io/gpu-suspect"
DEVICE_KEY = "gpu-watchdog.io/suspect"
NODE_NAME = "authentication.kubernetes.io/node-name"
MANAGED_BY = "app.kubernetes.io/managed-by"
SA = "system:serviceaccount:serving:demo-gpu-watchdog"
POLICY_NAME = "serving-demo-gpu-watchdog-placement"
KUBE = ["1.33.0", "1.36.0", "1.37.0"]  # DeviceTaintRules: v1alpha3 (1.33-1.35), v1beta2 (1.36), v1 (1.37)
RULES = ("resource.k8s.io", "devicetaintrules")
CLAIMS = ("resource.k8s.io", "resourceclaims", "get")


def placement(strategy: str | None, restart: str | None = None, **watchdog: Any) -> dict[str, Any]:
    config: dict[str, Any] = {"policy": {"placement": {"strategy": strategy}}}
    if restart is not None:
        config["restart"] = {"strategy": restart}
    return {"watchdog": {"config": config, **watchdog}}


def ours(docs: list[dict[str, Any]], kind: str) -> list[dict[str, Any]]:
    return [d for d in by_kind(docs, kind) if d["metadata"]["name"].endswith("-placement")]


def cluster_rules(docs: list[dict[str, Any]]) -> list[tuple[list[str], list[str], list[str]]]:
    [role] = ours(docs, "ClusterRole")
    return [(r["apiGroups"], r["resources"], r["verbs"]) for r in role["rules"]]


def config_of(docs: list[dict[str, Any]]) -> dict[str, Any]:
    cm = next(d for d in by_kind(docs, "ConfigMap") if d["metadata"]["name"].endswith("-watchdog"))
    return yaml.safe_load(cm["data"]["config.yaml"])  # type: ignore[no-any-return]


def policy_of(docs: list[dict[str, Any]]) -> dict[str, Any]:
    [policy] = [p for p in by_kind(docs, "ValidatingAdmissionPolicy") if p["metadata"]["name"] == POLICY_NAME]
    return policy


# --- off by default ---------------------------------------------------------------------------------------------

DROPPED: dict[str, Any] = {"watchdog": {"config": {"policy": {"placement": None}}}}


@pytest.mark.parametrize(("values", "said"), [({}, "off"), (placement("off"), "off"), (placement(None), None),
                                              (DROPPED, None)])
def test_placement_is_off_by_default_and_grants_nothing(values: dict[str, Any], said: str | None) -> None:
    """The chart's default is the sidecar's (`off`), spelled out and quoted (a bare off is YAML's false);
    null drops the key (or the section), leaving the sidecar's own default."""
    docs = render(values)
    assert not ours(docs, "ClusterRole") and not ours(docs, "ClusterRoleBinding")
    assert not by_kind(docs, "ValidatingAdmissionPolicy") and not by_kind(docs, "ValidatingAdmissionPolicyBinding")
    assert grants(docs) == ALLOWED
    section = config_of(docs)["policy"].get("placement")
    assert (section or {}).get("strategy") == said
    assert (section is None) is (values == DROPPED)


def test_the_values_give_the_sidecars_placement_defaults_and_comment_each() -> None:
    text = (CHART / "values.yaml").read_text()
    given = yaml.safe_load(text)["watchdog"]["config"]["policy"]["placement"]
    assert given["strategy"] == "off"
    base = {"kubernetes": {"pod_name": "p", "namespace": "n"}}
    listed = from_mapping({**base, "policy": {"placement": given}}).policy.placement
    assert listed == from_mapping(base).policy.placement
    said = comment_above(text, "placement: {")
    for f in dataclasses.fields(type(listed)):
        assert f.name in said, f"values.yaml says nothing of policy.placement.{f.name}"
    policy_said = comment_above(text, "placementPolicy:")
    assert NODE_KEY in policy_said and DEVICE_KEY in policy_said and MANAGED_BY in policy_said


# --- the RBAC each strategy gets -------------------------------------------------------------------------------

def test_strategy_device_gets_devicetaintrules_and_no_nodes(monkeypatch: pytest.MonkeyPatch) -> None:
    docs = render(placement("device"))
    assert cluster_rules(docs) == [(["resource.k8s.io"], ["devicetaintrules"], ["get", "list", "create", "delete"])]
    [binding] = ours(docs, "ClusterRoleBinding")
    assert binding["roleRef"] == {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole",
                                  "name": "demo-gpu-watchdog-placement"}
    sa = by_kind(docs, "ServiceAccount")[0]["metadata"]["name"]
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": sa, "namespace": "serving"}]
    # Namespaced: the pod's claims (which device), and the workload's pods (max_percent's share, as the
    # fleet's census counts them too).
    assert grants(docs) == ALLOWED | {CLAIMS, ("", "pods", "list")}
    assert not by_kind(docs, "ValidatingAdmissionPolicy")
    monkeypatch.setenv("POD_NAME", "demo-0")
    monkeypatch.setenv("POD_NAMESPACE", "serving")
    assert from_mapping(config_of(docs)).policy.placement.strategy == "device"


def test_strategy_node_also_gets_nodes_get_and_patch() -> None:
    docs = render(placement("node"))
    assert cluster_rules(docs) == [(["resource.k8s.io"], ["devicetaintrules"], ["get", "list", "create", "delete"]),
                                   ([""], ["nodes"], ["get", "patch"])]
    assert grants(docs) == ALLOWED | {CLAIMS, ("", "pods", "list")}


def test_effect_no_execute_also_gets_the_rules_patch() -> None:
    values = placement("device")
    values["watchdog"]["config"]["policy"]["placement"]["effect"] = "NoExecute"
    assert cluster_rules(render(values)) == [
        (["resource.k8s.io"], ["devicetaintrules"], ["get", "list", "create", "delete", "patch"])]


def test_strategy_none_gets_the_claims_get_alone() -> None:
    docs = render(placement("none"))
    assert not by_kind(docs, "ClusterRole") and not by_kind(docs, "ClusterRoleBinding")
    assert grants(docs) == ALLOWED | {CLAIMS}
    # Beside the other opt-in ClusterRole, which stays as it was.
    both = render({"watchdog": {"config": {"policy": {"placement": {"strategy": "node"},
                                                      "escalation": {"node_condition": True}}}}})
    assert {r["metadata"]["name"] for r in by_kind(both, "ClusterRole")} == {
        "demo-gpu-watchdog-node-condition", "demo-gpu-watchdog-placement"}


def test_every_placement_verb_is_one_the_code_calls() -> None:
    """As test_chart's check of the Role: each verb granted for placement against the client method the
    sidecar's Kubernetes edge calls for it."""
    import importlib
    import inspect
    import pkgutil

    from gpu_watchdog.watchdog.edge import effects as actions

    source = "".join(inspect.getsource(importlib.import_module(f"gpu_watchdog.watchdog.edge.effects.{m.name}"))
                     for m in pkgutil.iter_modules(actions.__path__))
    # Each grant, and the REST call of the sidecar's edge (`watchdog/edge/effects/`) that needs it.
    calls = {(*RULES, "get"): r"api\.get\(self\._rules\(version, taint\.target\)",
             (*RULES, "list"): r"api\.get\(self\._rules\(version\), query=\{\"labelSelector\"",
             (*RULES, "create"): r"api\.post\(self\._rules\(version\)",
             (*RULES, "delete"): r"api\.delete\(self\._rules\(version, taint\.target\)",
             ("", "nodes", "get"): r"api\.get\(path\(\"/api/v1/nodes\", name\)",
             ("", "nodes", "patch"): r"api\.patch\(path\(\"/api/v1/nodes\", name\)",
             CLAIMS: r"api\.get\(path\(\"/apis\", GROUP, version, \"namespaces\", self\.namespace, CLAIMS",
             (*RULES, "patch"): r"api\.patch\(self\._rules\(version, taint\.target\)"}
    values = placement("node")
    docs = render(values)
    values["watchdog"]["config"]["policy"]["placement"].update(strategy="device", effect="NoExecute")
    docs += [d for d in render(values) if d["kind"] == "ClusterRole"]
    cluster = {(g, r, v) for role in ours(docs, "ClusterRole") for rule in role["rules"]
               for g in rule["apiGroups"] for r in rule["resources"] for v in rule["verbs"]}
    granted = cluster | (grants(docs) - ALLOWED)
    assert granted == set(calls)
    for grant in granted:
        assert re.search(calls[grant], source), f"{grant} is granted but nothing calls {calls[grant]}"


def test_a_tainting_strategy_without_the_kubernetes_api_is_refused() -> None:
    for strategy in ("device", "node"):
        text = render_failure(placement(strategy, restart="none"), K8S_VERSION)
        assert f"placement.strategy={strategy}" in text and "restart.strategy none" in text, text
    # Reporting only, with no API at all: nothing granted anywhere.
    docs = render(placement("none", restart="none"))
    assert not by_kind(docs, "Role") and not by_kind(docs, "ClusterRole")


@pytest.mark.parametrize(("strategy", "effect"), [("device", "PreferNoSchedule"), ("node", "NoExecute")])
def test_an_effect_the_sidecar_would_refuse_is_refused_at_install(strategy: str, effect: str) -> None:
    values = placement(strategy)
    values["watchdog"]["config"]["policy"]["placement"]["effect"] = effect
    text = render_failure(values, K8S_VERSION)
    assert f"placement.effect={effect}" in text, text
    ok = placement(strategy)
    other = "NoExecute" if strategy == "device" else "PreferNoSchedule"
    ok["watchdog"]["config"]["policy"]["placement"]["effect"] = other
    assert ours(render(ok), "ClusterRole")


def test_placement_keeps_the_workloads_lease_when_fleet_and_quarantine_are_off() -> None:
    values = placement("device")
    values["watchdog"]["config"]["policy"].update({"fleet": {"enabled": False}, "quarantine": {"enabled": False}})
    leases = [d for d in render(values) if d["kind"] == "Lease"]
    assert [d["metadata"]["name"] for d in leases] == ["demo-gpu-watchdog-fleet"], leases
    off = placement("off")
    off["watchdog"]["config"]["policy"].update({"fleet": {"enabled": False}, "quarantine": {"enabled": False}})
    assert not [d for d in render(off) if d["kind"] == "Lease"]


@pytest.mark.parametrize("strategy", ["sometimes", False])
def test_the_schema_knows_the_strategies(strategy: Any) -> None:
    chart = helm.Chart.load(str(CHART))
    with pytest.raises(helm.HelmError) as err:
        chart.render(with_images(placement(strategy)), name="demo", namespace="serving", is_install=True)
    assert "strategy" in str(err.value)


# --- the admission policy --------------------------------------------------------------------------------------

@pytest.mark.parametrize("strategy", ["node", "device"])
def test_the_placement_policy_is_opt_in_and_names_our_service_account(strategy: str) -> None:
    assert not by_kind(render(placement(strategy), "1.33.0"), "ValidatingAdmissionPolicy")
    docs = render(placement(strategy, placementPolicy=True), "1.33.0")
    policy = policy_of(docs)
    [binding] = by_kind(docs, "ValidatingAdmissionPolicyBinding")
    sa = by_kind(docs, "ServiceAccount")[0]["metadata"]["name"]
    assert policy["spec"]["failurePolicy"] == "Fail"
    assert policy["spec"]["matchConditions"] == [
        {"name": "the-watchdogs-service-account", "expression": f"request.userInfo.username == "
                                                                f"'system:serviceaccount:serving:{sa}'"}]
    rules = {(tuple(r["apiGroups"]), tuple(r["resources"])): r
             for r in policy["spec"]["matchConstraints"]["resourceRules"]}
    assert set(rules) == {(("",), ("nodes",)), (("resource.k8s.io",), ("devicetaintrules",))}
    assert rules[("",), ("nodes",)]["operations"] == ["UPDATE"]  # what a PATCH is admitted as
    assert rules[("resource.k8s.io",), ("devicetaintrules",)]["operations"] == ["CREATE", "UPDATE", "DELETE"]
    assert rules[("resource.k8s.io",), ("devicetaintrules",)]["apiVersions"] == ["*"]  # v1alpha3, v1beta2, v1
    assert binding["metadata"]["name"] == policy["metadata"]["name"] == POLICY_NAME
    assert binding["spec"] == {"policyName": POLICY_NAME, "validationActions": ["Deny"]}


def test_the_policys_expressions_name_the_tokens_node_and_our_keys() -> None:
    policy = policy_of(render(placement("node", placementPolicy=True), "1.33.0"))
    variables = {v["name"]: v["expression"] for v in policy["spec"]["variables"]}
    validations = policy["spec"]["validations"]
    assert NODE_NAME in variables["tokenNode"] and "has(request.userInfo.extra)" in variables["tokenNode"]
    assert f"'{NODE_NAME}' in request.userInfo.extra" in variables["tokenNode"]
    assert "has(object.spec.taints)" in variables["newTaints"]
    assert "has(oldObject.spec.taints)" in variables["oldTaints"]
    on_nodes = [v["expression"] for v in validations if v["expression"].startswith("!variables.isNode")]
    on_rules = [v["expression"] for v in validations if v["expression"].startswith("!variables.isRule")]
    assert len(on_nodes) + len(on_rules) == len(validations) and on_nodes and on_rules
    assert all(NODE_KEY in e for e in on_nodes if "Taints" in e)
    assert any("request.name == variables.tokenNode" in e for e in on_nodes)
    assert any("object.spec.deviceSelector.pool == variables.tokenNode" in e for e in on_rules)
    assert any(DEVICE_KEY in e for e in on_rules)
    assert any("request.operation != 'DELETE'" in e and "wasOurs" in e for e in on_rules)
    assert MANAGED_BY in variables["wasOurs"] and "oldObject.metadata.labels" in variables["wasOurs"]
    for v in validations:
        assert v["message"] and v["reason"] == "Forbidden"
    # Each variable is defined before it is used, and only defined ones are used.
    defined: list[str] = []
    for v in policy["spec"]["variables"]:
        assert set(re.findall(r"variables\.(\w+)", v["expression"])) <= set(defined), v["name"]
        defined.append(v["name"])
    for v in validations:
        assert set(re.findall(r"variables\.(\w+)", v["expression"])) <= set(defined), v["expression"]


@pytest.mark.parametrize("strategy", ["off", "none"])
def test_the_placement_policy_without_placement_on_is_refused(strategy: str) -> None:
    text = render_failure(placement(strategy, placementPolicy=True), "1.33.0")
    assert "watchdog.placementPolicy=true" in text and f'strategy is "{strategy}"' in text, text
    assert "device or node" in text, text
    # A tainting strategy the restart strategy cannot carry out is refused before the policy is.
    text = render_failure(placement("device", restart="none", placementPolicy=True), "1.33.0")
    assert "restart.strategy none" in text, text


def test_the_placement_policy_needs_the_tokens_node_name() -> None:
    text = render_failure(placement("node", placementPolicy=True), "1.31.0")
    assert "1.32" in text and NODE_NAME in text, text
    assert policy_of(render(placement("node", placementPolicy=True), "1.32.0"))


@pytest.mark.parametrize("kube", KUBE)
@pytest.mark.parametrize("values", [placement("none"), placement("device"), placement("node"),
                                    placement("device", placementPolicy=True), placement("node", placementPolicy=True),
                                    placement("node", restart="evict", placementPolicy=True)])
def test_every_placement_variant_validates_against_kubernetes(values: dict[str, Any], kube: str) -> None:
    docs = render(values, kube)
    for doc in docs:
        if doc["apiVersion"].startswith("monitoring.coreos.com/"):
            continue
        kubernetes_validate.validate(doc, schema_version(kube), strict=True)


def test_lint_is_clean_with_placement() -> None:
    report = helm.lint(str(CHART), with_images(placement("node", placementPolicy=True)), strict=True,
                       kube_version="v1.33.0")
    errors = [m for m in report["messages"] if m["severity"] >= 2]
    assert report["errors"] == [] and errors == [], report


def test_the_notes_say_what_is_tainted() -> None:
    def notes(values: dict[str, Any]) -> str:
        return render_manifests(values, "1.33.0")["gpu-watchdog/templates/NOTES.txt"]

    assert "Placement" not in notes({})
    assert "reporting only" in notes(placement("none"))
    node = notes(placement("node", placementPolicy=True))
    assert "kubectl get devicetaintrules -l app.kubernetes.io/managed-by=gpu-watchdog" in node
    assert NODE_KEY in node and POLICY_NAME in node
    assert NODE_KEY not in notes(placement("device"))


# --- the policy evaluated ---------------------------------------------------------------------------------------

def admit(policy: dict[str, Any], request: dict[str, Any], obj: Any, old: Any) -> list[str] | None:
    """The messages of the validations that deny the request (an expression that errs denies, as under
    failurePolicy Fail); [] where it is admitted, None where the policy does not match it."""
    celpy = pytest.importorskip("celpy", reason="no CEL interpreter (pip install cel-python) to evaluate with")
    env = celpy.Environment()
    base = {"request": celpy.json_to_cel(request), "object": celpy.json_to_cel(obj),
            "oldObject": celpy.json_to_cel(old)}

    def run(expression: str, variables: dict[Any, Any]) -> Any:
        try:
            return env.program(env.compile(expression)).evaluate(
                {**base, "variables": celpy.celtypes.MapType(variables)})
        except Exception as exc:  # an error: K8s evaluates variables lazily, so only a used one counts
            return exc

    spec = policy["spec"]
    for condition in spec["matchConditions"]:
        if run(condition["expression"], {}) != True:  # noqa: E712 (a CEL BoolType, or an error)
            return None
    variables: dict[Any, Any] = {}
    for v in spec["variables"]:
        value = run(v["expression"], variables)
        if not isinstance(value, Exception) and not isinstance(value, celpy.CELEvalError):
            variables[celpy.celtypes.StringType(v["name"])] = value
    denied = []
    for v in spec["validations"]:
        ok = run(v["expression"], variables)
        if isinstance(ok, Exception) or isinstance(ok, celpy.CELEvalError) or ok != True:  # noqa: E712
            denied.append(v["message"])
    return denied


def request(resource: str, operation: str, name: str, node: str | None = "node-a", user: str = SA) -> dict[str, Any]:
    group = "" if resource == "nodes" else "resource.k8s.io"
    extra: dict[str, list[str]] = {"authentication.kubernetes.io/pod-name": ["demo-gpu-watchdog-abc12"]}
    if node is not None:
        extra[NODE_NAME] = [node]
    return {"operation": operation, "name": name, "namespace": "",
            "resource": {"group": group, "version": "v1", "resource": resource},
            "userInfo": {"username": user, "uid": "u-1", "groups": ["system:serviceaccounts"], "extra": extra}}


FOREIGN = {"key": "nvidia.com/gpu", "value": "present", "effect": "NoSchedule"}


def node(name: str, *taints: dict[str, Any], labels: dict[str, str] | None = None, **spec: Any) -> dict[str, Any]:
    body: dict[str, Any] = {"podCIDR": "10.0.1.0/24", "providerID": f"aws:///eu-west-1a/{name}", **spec}
    if taints:
        body["taints"] = list(taints)
    return {"apiVersion": "v1", "kind": "Node",
            "metadata": {"name": name, "labels": labels or {"kubernetes.io/hostname": name},
                         "annotations": {"node.alpha.kubernetes.io/ttl": "0"}},
            "spec": body}


def ours_on(card: str) -> dict[str, Any]:
    return {"key": NODE_KEY, "value": card, "effect": "NoSchedule"}


def rule(pool: str, key: str = DEVICE_KEY, labelled: bool = True) -> dict[str, Any]:
    meta: dict[str, Any] = {"name": f"gpu-watchdog-{pool}-gpu-0"}
    if labelled:
        meta["labels"] = {MANAGED_BY: "gpu-watchdog"}
    return {"apiVersion": "resource.k8s.io/v1", "kind": "DeviceTaintRule", "metadata": meta,
            "spec": {"deviceSelector": {"driver": "gpu.nvidia.com", "pool": pool, "device": "gpu-0"},
                     "taint": {"key": key, "value": "gpu-0", "effect": "NoSchedule"}}}


@pytest.fixture(scope="module")
def policy() -> dict[str, Any]:
    return policy_of(render(placement("node", placementPolicy=True), "1.33.0"))


NODE_CASES = [
    # (what, request's node name, token's node, old object, new object, admitted)
    ("own node: our taint added", "node-a", "node-a", node("node-a", FOREIGN),
     node("node-a", FOREIGN, ours_on("GPU-1")), True),
    ("own node without taints: ours added", "node-a", "node-a", node("node-a"), node("node-a", ours_on("GPU-1")), True),
    ("another node: our taint added", "node-b", "node-a", node("node-b", FOREIGN),
     node("node-b", FOREIGN, ours_on("GPU-1")), False),
    ("another node: our taint lifted", "node-b", "node-a", node("node-b", FOREIGN, ours_on("GPU-1")),
     node("node-b", FOREIGN), True),
    ("another node: its last taint lifted", "node-b", "node-a", node("node-b", ours_on("GPU-1")), node("node-b"), True),
    ("another node: our taint's value changed", "node-b", "node-a", node("node-b", ours_on("GPU-1")),
     node("node-b", ours_on("GPU-2")), False),
    ("own node: a foreign taint changed", "node-a", "node-a", node("node-a", FOREIGN),
     node("node-a", {**FOREIGN, "value": "absent"}, ours_on("GPU-1")), False),
    ("own node: a foreign taint removed", "node-a", "node-a", node("node-a", FOREIGN, ours_on("GPU-1")),
     node("node-a", ours_on("GPU-1")), False),
    ("own node: a foreign taint added", "node-a", "node-a", node("node-a"), node("node-a", FOREIGN), False),
    ("own node: the taints reordered", "node-a", "node-a", node("node-a", FOREIGN, ours_on("GPU-1")),
     node("node-a", ours_on("GPU-1"), FOREIGN), True),
    ("own node: cordoned", "node-a", "node-a", node("node-a"), node("node-a", unschedulable=True), False),
    ("own node: a label changed", "node-a", "node-a", node("node-a"),
     node("node-a", ours_on("GPU-1"), labels={"kubernetes.io/hostname": "node-a", "gpu": "bad"}), False),
    ("a token naming no node: our taint added", "node-a", None, node("node-a"), node("node-a", ours_on("GPU-1")),
     False),
    ("a token naming no node: our taint lifted", "node-a", None, node("node-a", ours_on("GPU-1")), node("node-a"),
     True),
    ("another node: a finalizer added", "node-b", "node-a", node("node-b"),
     {**node("node-b"), "metadata": {**node("node-b")["metadata"], "finalizers": ["example.com/hold"]}}, False),
    ("another node: an owner added", "node-b", "node-a", node("node-b"),
     {**node("node-b"), "metadata": {**node("node-b")["metadata"], "ownerReferences": [
         {"apiVersion": "v1", "kind": "ConfigMap", "name": "x", "uid": "u"}]}}, False),
]


@pytest.mark.parametrize(("what", "name", "token_node", "old", "new", "admitted"), NODE_CASES,
                         ids=[c[0] for c in NODE_CASES])
def test_the_policy_on_node_updates(policy: dict[str, Any], what: str, name: str, token_node: str | None,
                                    old: dict[str, Any], new: dict[str, Any], admitted: bool) -> None:
    denied = admit(policy, request("nodes", "UPDATE", name, token_node), new, old)
    assert denied is not None
    assert (denied == []) is admitted, (what, denied)


RULE_CASES = [
    # (what, operation, token's node, old object, new object, admitted, a word of the message)
    ("a rule for our node's pool", "CREATE", "node-a", None, rule("node-a"), True, ""),
    ("a rule for another node's pool", "CREATE", "node-a", None, rule("node-b"), False, "pool"),
    ("a rule with another taint key", "CREATE", "node-a", None, rule("node-a", key="example.com/bad"), False,
     DEVICE_KEY),
    ("a rule without our label", "CREATE", "node-a", None, rule("node-a", labelled=False), False, MANAGED_BY),
    ("a rule selecting no pool", "CREATE", "node-a", None,
     {**rule("node-a"), "spec": {"deviceSelector": {"driver": "gpu.nvidia.com"},
                                 "taint": {"key": DEVICE_KEY, "value": "x", "effect": "NoSchedule"}}}, False, "pool"),
    ("a token naming no node", "CREATE", None, None, rule("node-a"), False, "pool"),
    ("a rule for the whole pool", "CREATE", "node-a", None,
     {**rule("node-a"), "spec": {"deviceSelector": {"driver": "gpu.nvidia.com", "pool": "node-a"},
                                 "taint": {"key": DEVICE_KEY, "value": "x", "effect": "NoExecute"}}},
     False, "one device"),
    # Shadow's (policy.enforce): it keeps nothing out, and the API counts what it would evict.
    ("a rule with the effect None", "CREATE", "node-a", None,
     {**rule("node-a"), "spec": {**rule("node-a")["spec"], "taint": {"key": DEVICE_KEY, "effect": "None"}}}, True,
     ""),
    ("a rule with an effect of no taint's", "CREATE", "node-a", None,
     {**rule("node-a"), "spec": {**rule("node-a")["spec"], "taint": {"key": DEVICE_KEY, "effect": "Evict"}}},
     False, "effect"),
    ("a rule moved to another pool", "UPDATE", "node-a", rule("node-a"), rule("node-b"), False, "pool"),
    ("our rule's effect raised", "UPDATE", "node-a", rule("node-a"),
     {**rule("node-a"), "spec": {**rule("node-a")["spec"], "taint": {"key": DEVICE_KEY, "effect": "NoExecute"}}},
     True, ""),
    ("someone's rule labelled ours", "UPDATE", "node-a", rule("node-a", labelled=False), rule("node-a"), False,
     "its own"),
    ("our rule moved to another device", "UPDATE", "node-a", rule("node-a"),
     {**rule("node-a"), "spec": {**rule("node-a")["spec"], "deviceSelector": {
         "driver": "gpu.nvidia.com", "pool": "node-a", "device": "gpu-1"}}}, False, "never the device"),
    ("our rule deleted from another node", "DELETE", "node-a", rule("node-b"), None, True, ""),
    ("an unlabelled rule deleted", "DELETE", "node-a", rule("node-a", labelled=False), None, False, "delete only"),
]


@pytest.mark.parametrize(("what", "operation", "token_node", "old", "new", "admitted", "word"), RULE_CASES,
                         ids=[c[0] for c in RULE_CASES])
def test_the_policy_on_device_taint_rules(policy: dict[str, Any], what: str, operation: str, token_node: str | None,
                                          old: Any, new: Any, admitted: bool, word: str) -> None:
    name = (new or old)["metadata"]["name"]
    denied = admit(policy, request("devicetaintrules", operation, name, token_node), new, old)
    assert denied is not None
    assert (denied == []) is admitted, (what, denied)
    assert all(word in m for m in denied[:1]), denied


def test_the_policy_leaves_other_users_alone(policy: dict[str, Any]) -> None:
    other = request("nodes", "UPDATE", "node-b", None, user="system:serviceaccount:kube-system:node-controller")
    assert admit(policy, other, node("node-b", FOREIGN), node("node-b")) is None
