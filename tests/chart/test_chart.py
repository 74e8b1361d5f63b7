"""The Helm chart, linted and rendered by the Helm SDK and validated against Kubernetes schemas."""

from __future__ import annotations

import filecmp
import json
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
    containers,
    grants,
    render,
    watchdog_config,
    with_images,
)
from tests.chart.value_sets import ALL_ON, EXTERNAL, VLLM
from tests.helpers import ROOT


@pytest.mark.parametrize("values", [{}, ALL_ON, {"watchdog": {"config": {"restart": {"strategy": "delete"}}}},
                                    {"inference": {"model": {"source": "pvc", "pvc": {"claimName": "models"}}}},
                                    VLLM, EXTERNAL])
def test_lint_is_clean(values: dict[str, Any]) -> None:
    report = helm.lint(str(CHART), with_images(values), strict=True, kube_version=f"v{K8S_VERSION}")
    errors = [m for m in report["messages"] if m["severity"] >= 2]
    assert report["errors"] == [] and errors == [], report


@pytest.mark.parametrize("values", [{}, ALL_ON, VLLM, EXTERNAL])
def test_rendered_objects_validate_against_kubernetes_schemas(values: dict[str, Any]) -> None:
    docs = render(values)
    kinds = {d["kind"] for d in docs}
    assert {"Deployment", "Service", "ServiceAccount", "Role", "RoleBinding", "PodDisruptionBudget",
            "ConfigMap"} <= kinds
    for doc in docs:
        if doc["apiVersion"].startswith("monitoring.coreos.com/"):
            continue  # Prometheus Operator CRDs: checked structurally below
        kubernetes_validate.validate(doc, K8S_VERSION, strict=True)
    if values == ALL_ON:
        [rule] = by_kind(docs, "PrometheusRule")
        assert rule["spec"] == yaml.safe_load((ROOT / "dashboards" / "alerts.yaml").read_text())
        [monitor] = by_kind(docs, "ServiceMonitor")
        assert {e["port"] for e in monitor["spec"]["endpoints"]} == {"http", "metrics"}
        dashboards = [d for d in by_kind(docs, "ConfigMap") if d["metadata"]["name"].endswith("-dashboard")]
        assert dashboards[0]["metadata"]["labels"]["grafana_dashboard"] == "1"
        assert json.loads(dashboards[0]["data"]["gpu-watchdog.json"]) == json.loads(
            (ROOT / "dashboards" / "gpu-watchdog.json").read_text())


def test_probes_gpu_and_downward_api() -> None:
    c = containers(render())
    inf, wd = c["inference"], c["watchdog"]
    assert inf["resources"]["limits"]["nvidia.com/gpu"] == 1
    assert inf["startupProbe"]["httpGet"]["path"] == "/readyz"
    assert inf["livenessProbe"]["exec"]["command"][:2] == ["sh", "-c"]  # the verdict (restart.strategy container)
    assert inf["readinessProbe"]["httpGet"]["path"] == "/readyz"
    assert wd["readinessProbe"]["httpGet"] == {"path": "/readyz", "port": "metrics"}
    assert wd["livenessProbe"]["httpGet"] == {"path": "/healthz", "port": "metrics"}
    env = {e["name"]: e for e in wd["env"]}
    assert env["POD_NAME"]["valueFrom"]["fieldRef"]["fieldPath"] == "metadata.name"
    assert env["POD_NAMESPACE"]["valueFrom"]["fieldRef"]["fieldPath"] == "metadata.namespace"
    assert env["NODE_NAME"]["valueFrom"]["fieldRef"]["fieldPath"] == "spec.nodeName"
    assert "--token-file=/var/run/gpu-watchdog/token" in inf["args"]
    assert not any("token" in e["name"].lower() and "value" in e for e in inf.get("env", []) + wd["env"])


def test_security_context_non_root_read_only() -> None:
    docs = render()
    [deploy] = by_kind(docs, "Deployment")
    pod = deploy["spec"]["template"]["spec"]
    assert pod["securityContext"]["runAsNonRoot"] is True
    for c in containers(docs).values():
        sc = c["securityContext"]
        assert sc["readOnlyRootFilesystem"] is True
        assert sc["allowPrivilegeEscalation"] is False
        assert sc["capabilities"]["drop"] == ["ALL"]
        assert sc["runAsNonRoot"] is True
    # Drain must fit in the grace period.
    assert pod["terminationGracePeriodSeconds"] >= 30 + 15
    volumes = {v["name"]: v for v in pod["volumes"]}
    assert "emptyDir" in volumes["control-token"]


def test_rbac_is_least_privilege() -> None:
    docs = render()
    assert grants(docs) == ALLOWED
    assert not by_kind(docs, "ClusterRole") and not by_kind(docs, "ClusterRoleBinding")
    delete = grants(render({"watchdog": {"config": {"restart": {"strategy": "delete"}}}}))
    assert ("", "pods", "delete") in delete and ("", "pods/eviction", "create") not in delete
    # Strategy none calls no API: nothing to grant.
    none = render({"watchdog": {"config": {"restart": {"strategy": "none"}}}})
    assert grants(none) == set() and grants(none, "default") == set() and not by_kind(none, "RoleBinding")
    sa = by_kind(docs, "ServiceAccount")[0]["metadata"]["name"]
    assert {b["subjects"][0]["name"] for b in by_kind(docs, "RoleBinding")} == {sa}
    # Suspect GPUs are reported as Events on their Node, which live in "default": create only.
    assert grants(docs, "default") == {("events.k8s.io", "events", "create")}
    assert grants(render({"watchdog": {"nodeEvents": False}}), "default") == set()


def test_every_granted_verb_is_one_the_code_calls() -> None:
    """The Role's rules against the calls the sidecar's Kubernetes edge makes (the client's method
    names), so that a verb no code uses cannot stay granted."""
    import importlib
    import inspect
    import pkgutil

    from gpu_watchdog.watchdog.edge import effects, kube

    source = "".join(inspect.getsource(importlib.import_module(f"{package.__name__}.{m.name}"))
                     for package in (effects, kube) for m in pkgutil.iter_modules(package.__path__))
    # Each grant, and the REST call of the sidecar's edge (`watchdog/edge/effects/`, `kube/`) that needs it.
    calls = {("", "pods", "get"): r"api\.get\(pod_path\(self\.namespace, self\.pod_name\)",
             ("", "pods", "list"): r"api\.get\(pod_path\(self\.namespace\), query=\{\"labelSelector\"",
             ("", "pods/eviction", "create"): r"api\.post\(pod_path\(namespace, name, \"eviction\"\)",
             ("", "pods", "delete"): r"api\.delete\(pod_path\(namespace, name\)",
             ("events.k8s.io", "events", "create"): r"api\.post\(events_path\(",
             ("events.k8s.io", "events", "list"): r"api\.get\(events_path\(",
             ("apps", "deployments", "get"): r"api\.get\(path\(\"/apis/apps/v1/namespaces\"",
             ("coordination.k8s.io", "leases", "get"): r"api\.get\(self\._leases\(self\.name\)",
             ("coordination.k8s.io", "leases", "update"): r"api\.put\(self\._leases\(self\.name\)"}
    granted = grants(render()) | grants(render({"watchdog": {"config": {"restart": {"strategy": "delete"}}}}))
    for grant in granted:
        assert grant in calls and re.search(calls[grant], source), f"{grant} is granted but nothing calls it"


def test_the_own_pod_only_policy_is_opt_in_and_names_our_service_account() -> None:
    assert not by_kind(render(), "ValidatingAdmissionPolicy")
    docs = render({"watchdog": {"ownPodOnlyPolicy": True}})
    [policy] = by_kind(docs, "ValidatingAdmissionPolicy")
    [binding] = by_kind(docs, "ValidatingAdmissionPolicyBinding")
    sa = by_kind(docs, "ServiceAccount")[0]["metadata"]["name"]
    assert f"system:serviceaccount:serving:{sa}" in policy["spec"]["matchConditions"][0]["expression"]
    assert {r["resources"][0] for r in policy["spec"]["matchConstraints"]["resourceRules"]} == {
        "pods/eviction", "pods"}
    assert "authentication.kubernetes.io/pod-name" in policy["spec"]["validations"][0]["expression"]
    assert binding["spec"]["policyName"] == policy["metadata"]["name"]
    assert binding["spec"]["validationActions"] == ["Deny"]
    assert binding["spec"]["matchResources"]["namespaceSelector"]["matchLabels"] == {
        "kubernetes.io/metadata.name": "serving"}
    for doc in (policy, binding):
        kubernetes_validate.validate(doc, K8S_VERSION, strict=True)


def test_the_node_condition_is_opt_in_and_patches_nodes_status_only() -> None:
    on = render({"watchdog": {"config": {"policy": {"escalation": {"node_condition": True}}}}})
    [cluster_role] = by_kind(on, "ClusterRole")
    assert [(rule["apiGroups"], rule["resources"], rule["verbs"]) for rule in cluster_role["rules"]] == [
        ([""], ["nodes/status"], ["patch"])]
    [binding] = by_kind(on, "ClusterRoleBinding")
    assert binding["roleRef"]["name"] == cluster_role["metadata"]["name"]
    assert binding["subjects"][0]["name"] == by_kind(on, "ServiceAccount")[0]["metadata"]["name"]
    assert not by_kind(render(), "ClusterRole") and not by_kind(render(), "ClusterRoleBinding")
    for doc in on:
        if not doc["apiVersion"].startswith("monitoring.coreos.com/"):
            kubernetes_validate.validate(doc, K8S_VERSION, strict=True)


def test_pdb_serialises_evictions() -> None:
    [pdb] = by_kind(render(), "PodDisruptionBudget")
    assert pdb["spec"]["maxUnavailable"] == 1
    [deploy] = by_kind(render(), "Deployment")
    assert pdb["spec"]["selector"]["matchLabels"] == deploy["spec"]["selector"]["matchLabels"]


def test_watchdog_config_from_values_is_valid(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("POD_NAME", "demo-0")
    monkeypatch.setenv("POD_NAMESPACE", "serving")
    cm = next(d for d in by_kind(render(), "ConfigMap") if d["metadata"]["name"].endswith("-watchdog"))
    settings = from_mapping(yaml.safe_load(cm["data"]["config.yaml"]))
    assert settings.restart.strategy == "container"
    assert settings.target.control_url == "http://127.0.0.1:8001"
    assert settings.kubernetes.pod_name == "demo-0"


@pytest.mark.parametrize(
    ("values", "where"),
    [
        ({"replicaCount": "two"}, "replicaCount"),
        ({"inference": {"admission": {"maxConcurrency": 0}}}, "maxConcurrency"),
        ({"inference": {"admission": {"maxConcurrency": "lots"}}}, "maxConcurrency"),
        ({"watchdog": {"config": {"restart": {"strategy": "reboot"}}}}, "strategy"),
        ({"watchdog": {"config": {"canary": {"interval": "thirty"}}}}, "interval"),
        ({"service": {"port": "http"}}, "port"),
        ({"inference": {"gpus": "one"}}, "gpus"),
        ({"unknownTopLevel": True}, "unknownTopLevel"),
    ],
)
def test_schema_rejects_wrong_values(values: dict[str, Any], where: str) -> None:
    chart = helm.Chart.load(str(CHART))
    with pytest.raises(helm.HelmError) as err:
        chart.render(with_images(values), name="demo", namespace="serving", is_install=True)
    assert where in str(err.value)


def test_vllm_mode_puts_the_sidecar_next_to_vllm(monkeypatch: pytest.MonkeyPatch) -> None:
    docs = render(VLLM)
    c = containers(docs)
    inf, wd = c["inference"], c["watchdog"]
    assert inf["image"].startswith("vllm/vllm-openai:")
    assert inf["args"][:3] == ["--model=/models/model", "--host=0.0.0.0", "--port=8000"]
    assert "--served-model-name=llama" in inf["args"] and inf["args"][-2:] == ["--max-num-seqs", "64"]
    for probe in ("startupProbe", "readinessProbe"):
        assert inf[probe]["httpGet"] == {"path": "/health", "port": "http"}
    assert "verdict-probe" not in str(inf["livenessProbe"]) and "exec" in inf["livenessProbe"]
    assert inf["resources"]["limits"]["nvidia.com/gpu"] == 1
    assert {"name": "model", "mountPath": "/models/model", "readOnly": True} in inf["volumeMounts"]
    # No control API, so no token anywhere; no hostPath under the default PodSecurity level.
    pod = by_kind(docs, "Deployment")[0]["spec"]["template"]["spec"]
    volumes = {v["name"]: v for v in pod["volumes"]}
    assert "control-token" not in volumes and "pod-resources" not in volumes
    assert wd["securityContext"]["runAsNonRoot"] is True and "runAsUser" not in wd["securityContext"]
    settings = watchdog_config(VLLM, monkeypatch)
    assert settings.target.openai_url == "http://127.0.0.1:8000/v1"
    assert settings.target.metrics_url == "http://127.0.0.1:8000/metrics"
    assert settings.target.openai_model == "llama" and settings.target.api_key_file is None
    assert settings.kubernetes.pod_resources_socket is None


def test_vllm_api_key_reaches_both_containers_from_one_secret(monkeypatch: pytest.MonkeyPatch) -> None:
    values = {**VLLM, "vllm": {"apiKeySecret": {"name": "vllm-key", "key": "token"}}}
    c = containers(render(values))
    env = {e["name"]: e for e in c["inference"]["env"]}
    assert env["VLLM_API_KEY"]["valueFrom"]["secretKeyRef"] == {"name": "vllm-key", "key": "token"}
    pod = by_kind(render(values), "Deployment")[0]["spec"]["template"]["spec"]
    [secret] = [v for v in pod["volumes"] if v["name"] == "api-key"]
    assert secret["secret"] == {"secretName": "vllm-key", "items": [{"key": "token", "path": "key"}]}
    assert watchdog_config(values, monkeypatch).target.api_key_file == "/var/run/gpu-watchdog-api-key/key"


def test_external_mode_and_a_server_without_metrics(monkeypatch: pytest.MonkeyPatch) -> None:
    c = containers(render(EXTERNAL))
    assert c["inference"]["ports"] == [{"name": "http", "containerPort": 8080, "protocol": "TCP"}]
    assert c["inference"]["args"] == ["--model-id", "/models/m", "--port", "8080"]
    assert watchdog_config(EXTERNAL, monkeypatch).target.openai_url == "http://127.0.0.1:8080/v1"
    none = {**EXTERNAL, "external": {**EXTERNAL["external"], "metricsPath": ""}}
    assert watchdog_config(none, monkeypatch).target.metrics_url is None


def test_pod_resources_root_only_by_opt_in_and_off_for_bundled(monkeypatch: pytest.MonkeyPatch) -> None:
    privileged = {**VLLM, "podSecurityLevel": "privileged", "watchdog": {"podResources": {"runAsRoot": True}}}
    docs = render(privileged)
    wd = containers(docs)["watchdog"]
    volumes = {v["name"]: v for v in by_kind(docs, "Deployment")[0]["spec"]["template"]["spec"]["volumes"]}
    assert volumes["pod-resources"]["hostPath"] == {"path": "/var/lib/kubelet/pod-resources", "type": "Directory"}
    assert {"name": "pod-resources", "mountPath": "/var/lib/kubelet/pod-resources", "readOnly": True} in wd[
        "volumeMounts"]
    assert watchdog_config(privileged, monkeypatch).kubernetes.pod_resources_socket == (
        "/var/lib/kubelet/pod-resources/kubelet.sock")
    assert wd["securityContext"]["runAsUser"] == 0 and wd["securityContext"]["runAsNonRoot"] is False
    assert wd["securityContext"]["readOnlyRootFilesystem"] is True and wd["securityContext"]["capabilities"] == {
        "drop": ["ALL"]}
    assert watchdog_config({}, monkeypatch).kubernetes.pod_resources_socket is None
    off = {**VLLM, "watchdog": {"podResources": {"enabled": False}}}
    assert "pod-resources" not in {v["name"] for v in by_kind(render(off), "Deployment")[0]["spec"]["template"][
        "spec"]["volumes"]}


@pytest.mark.parametrize(("values", "message"), [
    ({"inference": {"engine": "vllm"}}, "vllm.model is required"),
    ({"inference": {"engine": "external"}}, "external.image.repository is required for inference.engine=external"),
    ({"inference": {"engine": "tgi"}}, "engine"),
])
def test_peer_modes_say_what_is_missing(values: dict[str, Any], message: str) -> None:
    chart = helm.Chart.load(str(CHART))
    with pytest.raises(helm.HelmError, match=message):
        chart.render(with_images(values), name="demo", namespace="serving", is_install=True)


def test_pvc_model_requires_a_claim() -> None:
    chart = helm.Chart.load(str(CHART))
    with pytest.raises(helm.HelmError, match="claimName is required"):
        chart.render(with_images({"inference": {"model": {"source": "pvc"}}}), name="demo", namespace="serving")


def test_chart_ships_the_same_dashboard_and_rules() -> None:
    for name in ("alerts.yaml", "gpu-watchdog.json"):
        assert filecmp.cmp(ROOT / "dashboards" / name, CHART / "files" / name, shallow=False), (
            f"helm/gpu-watchdog/files/{name} differs from dashboards/{name}: run `make chart-files`")


def test_notes_tell_how_to_reach_everything() -> None:
    chart = helm.Chart.load(str(CHART))
    notes = chart.render(with_images(ALL_ON), name="demo", namespace="serving")["gpu-watchdog/templates/NOTES.txt"]
    assert "port-forward svc/demo-gpu-watchdog 8000:8000" in notes
    assert "/status" in notes and "/metrics" in notes and "dashboard" in notes.lower()


def test_dockerfiles_run_non_root_and_the_sidecar_has_no_torch() -> None:
    inference = (ROOT / "docker" / "inference.Dockerfile").read_text()
    watchdog = (ROOT / "docker" / "watchdog.Dockerfile").read_text()
    assert "USER 10001" in inference and "USER 10001" in watchdog
    assert "torch" not in watchdog.lower().replace("(no torch)", "")
    assert "'.[inference]'" in inference



@pytest.mark.parametrize(("values", "missing"), [
    ({"watchdog": {"image": {"repository": "r/w"}}}, "inference.image.repository"),
    ({"inference": {"image": {"repository": "r/i"}}}, "watchdog.image.repository"),
    ({"inference": {"engine": "vllm", "model": {"source": "pvc", "pvc": {"claimName": "m"}}}},
     "watchdog.image.repository"),
])
def test_install_without_image_repositories_says_where_to_look(values: dict[str, Any], missing: str) -> None:
    chart = helm.Chart.load(str(CHART))
    with pytest.raises(helm.HelmError) as err:
        chart.render(values, name="demo", namespace="serving", is_install=True)
    text = str(err.value)
    assert f"{missing} is not set" in text and "make images" in text and "README" in text, text


def test_vllm_mode_needs_no_inference_image() -> None:
    values = {**VLLM, "watchdog": {"image": {"repository": "r/w"}}}
    chart = helm.Chart.load(str(CHART))
    assert chart.render(values, name="demo", namespace="serving", is_install=True)


def test_helm_test_checks_a_completion_through_the_service_and_the_watchdog() -> None:
    docs = render()
    [test_pod] = [d for d in docs if d["kind"] == "Pod"]
    assert test_pod["metadata"]["annotations"]["helm.sh/hook"] == "test"
    [c] = test_pod["spec"]["containers"]
    assert c["image"] == "registry.example.com/ml/gpu-watchdog-watchdog:0.1.0"
    script = " ".join(c["command"] + c.get("args", []))
    assert "http://demo-gpu-watchdog:8000/v1/completions" in script
    assert "http://demo-gpu-watchdog:9402/readyz" in script
    assert test_pod["spec"]["restartPolicy"] == "Never"
    assert c["securityContext"]["runAsNonRoot"] is True and c["securityContext"]["readOnlyRootFilesystem"] is True
    kubernetes_validate.validate(test_pod, K8S_VERSION, strict=True)
    # Next to vLLM the completion names the served model.
    [vllm] = [d for d in render(VLLM) if d["kind"] == "Pod"]
    assert '"model": "llama"' in " ".join(vllm["spec"]["containers"][0]["command"] +
                                          vllm["spec"]["containers"][0].get("args", []))


# Values documented as one entry: Kubernetes structures passed through, and the watchdog's config.
OPAQUE = {"watchdog.config", "inference.resources", "watchdog.resources", "podSecurityContext", "securityContext",
          "dashboard.labels"}


def test_the_chart_readme_lists_every_value() -> None:
    """helm/gpu-watchdog/README.md's table and values.yaml name the same keys."""
    import re

    values = yaml.safe_load((CHART / "values.yaml").read_text())

    def leaves(d: Any, prefix: str = "") -> set[str]:
        out: set[str] = set()
        for k, v in d.items():
            key = f"{prefix}{k}"
            if isinstance(v, dict) and v and key not in OPAQUE:
                out |= leaves(v, key + ".")
            else:
                out.add(key)
        return out

    documented = set(re.findall(r"^\| `([^`]+)` \|", (CHART / "README.md").read_text(), re.MULTILINE))
    assert documented == leaves(values), (sorted(leaves(values) - documented), sorted(documented - leaves(values)))


def test_the_handler_value_reaches_the_servers_flags() -> None:
    default = containers(render())["inference"]["args"]
    assert not any(a.startswith("--handler") for a in default)  # causal-lm, the server's own default
    values = {"inference": {"handler": "embeddings", "model": {"source": "pvc", "pvc": {"claimName": "models"}}}}
    args = containers(render(values))["inference"]["args"]
    assert "--handler=embeddings" in args and "--model=/models/model" in args
    chart = helm.Chart.load(str(CHART))
    with pytest.raises(helm.HelmError, match="handler"):
        chart.render(with_images({"inference": {"handler": "no such thing"}}), name="demo", namespace="serving",
                     is_install=True)


@pytest.mark.parametrize(("gpus", "workers", "expected"), [(1, "auto", 1), (2, "auto", 2), (4, "auto", 4),
                                                           (0, "auto", 1), (0, 3, 3), (2, 2, 2), (4, 1, 1),
                                                           (4, None, 4), (1, None, 1)])
def test_one_worker_per_gpu_in_the_server_and_the_sidecar_alike(gpus: int, workers: Any, expected: int,
                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    values = {"inference": {"gpus": gpus, "workers": workers}} if workers is not None else {"inference": {"gpus": gpus}}
    args = containers(render(values))["inference"]["args"]
    flags = [a for a in args if a.startswith("--workers")]
    assert flags == ([] if expected == 1 else [f"--workers={expected}"])
    assert watchdog_config(values, monkeypatch).target.workers == expected


@pytest.mark.parametrize(("values", "message"), [
    ({"inference": {"gpus": 2, "workers": 3}}, "inference.workers=3 is more than inference.gpus=2"),
    ({"inference": {"gpus": 4, "workers": 2}}, "would leave 2 GPU(s) without a worker"),
    ({**VLLM, "inference": {**VLLM.get("inference", {}), "workers": 2}}, "the bundled server's"),
    ({"inference": {"workers": 0}}, "workers"),
    ({"inference": {"workers": "many"}}, "workers"),
])
def test_workers_that_do_not_match_the_gpus_are_refused_saying_why(values: dict[str, Any], message: str) -> None:
    chart = helm.Chart.load(str(CHART))
    with pytest.raises(helm.HelmError) as err:
        chart.render(with_images(values), name="demo", namespace="serving", is_install=True)
    assert message in str(err.value)
