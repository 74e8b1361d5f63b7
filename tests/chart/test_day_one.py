"""What stops a first install or upgrade on a real GPU cluster, checked on the rendered manifests.

Each test states the rule a cluster applies (the kubelet, PodSecurity admission, the Deployment
controller, the eviction API, Prometheus Operator) and checks the chart's output against it.
"""

from __future__ import annotations

import json
import math
import re
from pathlib import Path
from typing import Any

import helm_python as helm
import jsonschema
import kubernetes_validate
import pytest
import yaml

from gpu_watchdog.units import parse_duration
from gpu_watchdog.watchdog.core import config_schema
from gpu_watchdog.watchdog.edge.config import ConfigError, from_mapping
from tests.chart import pod_security
from tests.chart.rendering import (
    CHART,
    K8S_VERSION,
    by_kind,
    containers,
    pod_template,
    render,
    render_error,
    watchdog_config,
    with_images,
)
from tests.chart.value_sets import ADMITTED, ALL_ON, EXTERNAL, HF_VLLM, PRIVILEGED_PR, VLLM


def quantity(q: str) -> float:
    units = {"Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40, "k": 1e3, "M": 1e6, "G": 1e9, "T": 1e12}
    m = re.fullmatch(r"([0-9.]+)([A-Za-z]*)", q)
    assert m, q
    return float(m.group(1)) * units.get(m.group(2), 1)


def mount_of(container: dict[str, Any], path: str) -> dict[str, Any] | None:
    """The volume mount a path lies under (the deepest one), as the container sees its files."""
    best = None
    for m in container.get("volumeMounts", []):
        if path == m["mountPath"] or path.startswith(m["mountPath"].rstrip("/") + "/"):
            if best is None or len(m["mountPath"]) > len(best["mountPath"]):
                best = m
    return best


NEW_VALUES = [
    HF_VLLM, PRIVILEGED_PR, {"strategy": {"type": "Recreate"}},
    {**HF_VLLM, "inference": {"engine": "vllm", "cache": {"pvc": {"claimName": "cache"}}}},
    {**EXTERNAL, "external": {**EXTERNAL["external"], "apiKeySecret": {"name": "k"}, "metricsPath": "/prom"},
     "prometheusRelease": "kps", "serviceMonitor": {"enabled": True}, "prometheusRule": {"enabled": True}},
    {"imagePullSecrets": [{"name": "r"}], "runtimeClassName": "nvidia", "priorityClassName": "p",
     "podDisruptionBudget": {"unhealthyPodEvictionPolicy": "IfHealthyBudget"}, "inference": {"gpus": 2}},
]


@pytest.mark.parametrize("values", NEW_VALUES)
def test_new_values_lint_clean_and_validate_against_kubernetes(values: dict[str, Any]) -> None:
    report = helm.lint(str(CHART), with_images(values), strict=True, kube_version=f"v{K8S_VERSION}")
    assert report["errors"] == [] and [m for m in report["messages"] if m["severity"] >= 2] == [], report
    for doc in render(values):
        if not doc["apiVersion"].startswith("monitoring.coreos.com/"):
            kubernetes_validate.validate(doc, K8S_VERSION, strict=True)


# --- 2. model downloads and compile caches ------------------------------------------------------

CACHE_ENV = ("HOME", "XDG_CACHE_HOME", "HF_HOME", "VLLM_CACHE_ROOT", "TORCHINDUCTOR_CACHE_DIR", "TRITON_CACHE_DIR")
MODEL_SIZED = 20 * 2**30  # an 8B model in bf16 is ~16 GB before any compile cache


@pytest.mark.parametrize("values", [HF_VLLM, EXTERNAL, {**HF_VLLM, "inference": {
    "engine": "vllm", "cache": {"pvc": {"claimName": "model-cache"}}}}])
def test_downloads_and_compile_caches_live_on_a_volume_sized_for_a_model(values: dict[str, Any]) -> None:
    """The kubelet evicts a pod whose emptyDir outgrows its sizeLimit: /tmp (1Gi) holds no model."""
    docs = render(values)
    inf = containers(docs)["inference"]
    volumes = {v["name"]: v for v in pod_template(docs)["volumes"]}
    env = {e["name"]: e.get("value") for e in inf["env"]}
    for name in CACHE_ENV:
        path = env[name]
        assert not path.startswith("/tmp"), (name, path)
        mount = mount_of(inf, path)
        assert mount is not None and not mount.get("readOnly"), f"{name}={path} is on the read-only root filesystem"
        volume = volumes[mount["name"]]
        if "emptyDir" in volume:
            assert quantity(volume["emptyDir"]["sizeLimit"]) >= MODEL_SIZED, (name, volume)
        else:
            assert volume["persistentVolumeClaim"]["claimName"] == "model-cache", volume


# --- 3. vLLM's image under the pod's uid --------------------------------------------------------

@pytest.mark.parametrize("values", [HF_VLLM, EXTERNAL])
def test_a_uid_without_passwd_entry_still_has_a_user_name(values: dict[str, Any]) -> None:
    """vllm/vllm-openai has no USER and no passwd entry for 10001; torch's inductor calls
    getpass.getuser() at import, which reads USER/LOGNAME before falling back to getpwuid()."""
    docs = render(values)
    inf = containers(docs)["inference"]
    uid = (inf.get("securityContext") or {}).get("runAsUser") or pod_template(docs)["securityContext"]["runAsUser"]
    assert uid != 0
    env = {e["name"]: e.get("value") for e in inf["env"]}
    assert env.get("USER") and env.get("LOGNAME"), env
    assert env.get("TORCHINDUCTOR_CACHE_DIR"), env


# --- 4. rollouts on GPUs ---------------------------------------------------------------------------

@pytest.mark.parametrize("replicas", [1, 2, 4])
def test_a_rollout_never_needs_more_gpus_than_the_release_holds(replicas: int) -> None:
    """The Deployment controller runs up to replicas + maxSurge pods; a surge pod on a full GPU
    node stays Pending for ever and the rollout with it."""
    [deploy] = by_kind(render({"replicaCount": replicas}), "Deployment")
    strategy = deploy["spec"]["strategy"]
    assert strategy["type"] == "RollingUpdate"
    assert strategy["rollingUpdate"]["maxSurge"] == 0 and strategy["rollingUpdate"]["maxUnavailable"] >= 1


def test_the_strategy_is_the_operators_to_choose() -> None:
    [recreate] = by_kind(render({"strategy": {"type": "Recreate"}}), "Deployment")
    assert recreate["spec"]["strategy"] == {"type": "Recreate"}
    kubernetes_validate.validate(recreate, K8S_VERSION, strict=True)
    surge = {"strategy": {"rollingUpdate": {"maxSurge": 1, "maxUnavailable": 0}}}
    [deploy] = by_kind(render(surge), "Deployment")
    assert deploy["spec"]["strategy"]["rollingUpdate"] == {"maxSurge": 1, "maxUnavailable": 0}
    assert "strategy" in render_error({"strategy": {"type": "BlueGreen"}})


# --- 5. the startup probe against the watchdog's startup_timeout ------------------------------------

@pytest.mark.parametrize(("values", "timeout"), [
    ({}, "30m"), (VLLM, "30m"),
    ({"watchdog": {"config": {"policy": {"startup_timeout": "2h"}}}}, "2h"),
    ({**VLLM, "watchdog": {"config": {"policy": {"startup_timeout": 5400}}},
      "inference": {**VLLM["inference"], "startupProbe": {"periodSeconds": 10}}}, 5400),
])
def test_the_kubelet_never_kills_a_model_the_watchdog_still_lets_load(values: dict[str, Any], timeout: Any) -> None:
    probe = containers(render(values))["inference"]["startupProbe"]
    window = probe["periodSeconds"] * probe["failureThreshold"]
    assert window >= parse_duration(timeout), (window, timeout)
    assert window <= parse_duration(timeout) + 120, "the watchdog's own limit should decide, not a far later one"


def test_a_startup_probe_shorter_than_the_startup_timeout_is_refused() -> None:
    text = render_error({"inference": {"startupProbe": {"periodSeconds": 5, "failureThreshold": 120}}})
    assert "startup_timeout" in text and "failureThreshold" in text, text
    ok = containers(render({"inference": {"startupProbe": {"periodSeconds": 10, "failureThreshold": 200}}}))
    assert ok["inference"]["startupProbe"]["failureThreshold"] == 200


# --- 6. PodSecurity and the PodResources hostPath --------------------------------------------------

@pytest.mark.parametrize(("level", "values"), ADMITTED)
def test_every_rendered_pod_passes_the_namespaces_pod_security_level(level: str, values: dict[str, Any]) -> None:
    docs = render({**values, "podSecurityLevel": level})
    pods = [pod_template(docs)] + [d["spec"] for d in by_kind(docs, "Pod")]
    for pod in pods:
        assert pod_security.violations(pod, level) == [], level


@pytest.mark.parametrize("engine_values", [VLLM, EXTERNAL])
def test_pod_resources_is_off_unless_the_namespace_admits_it(engine_values: dict[str, Any]) -> None:
    for level in ("restricted", "baseline"):
        pod = pod_template(render({**engine_values, "podSecurityLevel": level,
                               "watchdog": {"podResources": {"runAsRoot": True}}}))
        assert not any("hostPath" in v for v in pod["volumes"]), level
    # privileged but non-root: the socket would refuse the connection, so it stays off too.
    pod = pod_template(render({**engine_values, "podSecurityLevel": "privileged"}))
    assert not any("hostPath" in v for v in pod["volumes"])


@pytest.mark.parametrize(("values", "words"), [
    ({**VLLM, "watchdog": {"podResources": {"enabled": True, "runAsRoot": True}}}, ["hostPath", "restricted"]),
    ({**VLLM, "podSecurityLevel": "baseline", "watchdog": {"podResources": {"enabled": True, "runAsRoot": True}}},
     ["hostPath", "baseline", "podSecurityLevel=privileged"]),
    ({**VLLM, "podSecurityLevel": "privileged", "watchdog": {"podResources": {"enabled": True}}},
     ["root", "runAsRoot=true"]),
    ({"inference": {"model": {"source": "hostPath", "hostPath": {"path": "/models"}}}},
     ["inference.model.source=hostPath", "restricted"]),
    ({"securityContext": {"allowPrivilegeEscalation": True}}, ["restricted", "allowPrivilegeEscalation: false"]),
    ({"podSecurityContext": {"seccompProfile": None}}, ["restricted", "seccompProfile.type: RuntimeDefault"]),
    ({"securityContext": {"capabilities": {"drop": ["NET_RAW"]}}}, ["capabilities.drop: [ALL]"]),
    ({"podSecurityLevel": "baseline", "securityContext": {"privileged": True}}, ["privileged", "baseline"]),
])
def test_a_pod_the_cluster_would_refuse_fails_the_install_saying_why(values: dict[str, Any],
                                                                     words: list[str]) -> None:
    text = render_error(values)
    for word in words:
        assert word in text, (word, text)


# --- 7. values operators need; the sidecar's config checked at render time --------------------------

def test_pull_secrets_runtime_class_priority_and_placement_reach_the_pod() -> None:
    values = {"imagePullSecrets": [{"name": "registry-credentials"}], "runtimeClassName": "nvidia",
              "priorityClassName": "inference-critical",
              "tolerations": [{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}],
              "affinity": {"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {"nodeSelectorTerms": [
                  {"matchExpressions": [{"key": "gpu", "operator": "In", "values": ["h100"]}]}]}}},
              "topologySpreadConstraints": [{"maxSkew": 1, "topologyKey": "kubernetes.io/hostname",
                                             "whenUnsatisfiable": "ScheduleAnyway"}]}
    docs = render(values)
    pod = pod_template(docs)
    assert pod["imagePullSecrets"] == [{"name": "registry-credentials"}]
    assert pod["runtimeClassName"] == "nvidia" and pod["priorityClassName"] == "inference-critical"
    assert pod["tolerations"] == values["tolerations"] and pod["affinity"] == values["affinity"]
    assert pod["topologySpreadConstraints"] == values["topologySpreadConstraints"]
    [test_pod] = by_kind(docs, "Pod")
    assert test_pod["spec"]["imagePullSecrets"] == [{"name": "registry-credentials"}]
    for doc in docs:
        kubernetes_validate.validate(doc, K8S_VERSION, strict=True)


def test_a_pod_that_requested_a_gpu_never_quietly_serves_on_the_cpu() -> None:
    """Without the GPU runtime class the container sees no GPU; `auto` would fall back to the CPU."""
    assert "--device=cuda" in containers(render())["inference"]["args"]
    assert "--device=auto" in containers(render({"inference": {"gpus": 0}}))["inference"]["args"]
    assert "gpus" in render_error({"inference": {"device": "cpu"}})


@pytest.mark.parametrize(("config", "where"), [
    ({"policy": {"hang": {"consecutive_timeout": 3}}}, "consecutive_timeout"),
    ({"policy": {"restart_budgets": {"max_restarts": 3}}}, "restart_budgets"),
    ({"policy": {"max_age": "one day"}}, "max_age"),
    ({"policy": {"memory_pressure": {"reserved_ratio": 1.5}}}, "reserved_ratio"),
    ({"policy": {"admission": {"enabled": "yes"}}}, "enabled"),
    ({"restart": {"strategy": "local"}}, "strategy"),
    ({"server": {"port": 9999}}, "server"),
    ({"kubernetes": {"pod_name": "x"}}, "pod_name"),
])
def test_a_sidecar_config_the_sidecar_would_refuse_fails_the_install(config: dict[str, Any], where: str) -> None:
    """A misspelt key under watchdog.config crash-looped the sidecar at start; now `helm install` says so."""
    text = render_error({"watchdog": {"config": config}})
    assert where in text, text


def test_the_users_own_target_and_kubernetes_keys_survive_next_to_the_charts(monkeypatch: pytest.MonkeyPatch) -> None:
    values = {**VLLM, "watchdog": {"config": {"kubernetes": {"request_timeout": "20s"}}}}
    settings = watchdog_config(values, monkeypatch)
    assert settings.kubernetes.request_timeout == 20.0
    assert settings.target.openai_url == "http://127.0.0.1:8000/v1" and settings.target.openai_model == "llama"


def test_the_charts_config_schema_is_the_one_generated_from_the_settings() -> None:
    doc = json.loads((CHART / "values.schema.json").read_text())
    held, definitions = config_schema.embedded(doc)
    assert (held, definitions) == (config_schema.chart_schema(), config_schema.DEFINITIONS), (
        "helm/gpu-watchdog/values.schema.json's watchdog.config schema is stale against watchdog/core/settings.py"
        f" ({', '.join(config_schema.stale_keys(doc)) or 'definitions'}): run {config_schema.REGENERATE}"
        " and commit helm/gpu-watchdog/values.schema.json")


def test_the_check_command_says_stale_and_how_to_regenerate(tmp_path: Path,
                                                            capsys: pytest.CaptureFixture[str]) -> None:
    stale = json.loads((CHART / "values.schema.json").read_text())
    stale["properties"]["watchdog"]["properties"]["config"]["properties"].pop("policy")
    path = tmp_path / "values.schema.json"
    path.write_text(json.dumps(stale))
    assert config_schema.main(["--check", "--chart-schema", str(path)]) == 1
    assert "python -m gpu_watchdog.watchdog.core.config_schema" in capsys.readouterr().err
    assert config_schema.main(["--chart-schema", str(path)]) == 0
    assert config_schema.main(["--check", "--chart-schema", str(path)]) == 0


# The schema and the loader must agree: what one refuses the other refuses.
AGREE = [
    ({}, True), ({"policy": {"hang": {"consecutive_timeouts": 5}}}, True),
    ({"canary": {"interval": "10m", "timeout": 30}}, True), ({"sampling": {"nvml_interval": " 250ms "}}, True),
    ({"policy": {"memory_pressure": {"reserved_ratio": "85%"}}}, True),
    ({"policy": {"max_age": 0}}, True), ({"restart": {"grace_period": None}}, True),
    ({"restart": {"strategy": "delete"}}, True), ({"target": {"openai_model": None}}, True),
    ({"policy": {"hangs": {}}}, False), ({"canary": {"interval": "soon"}}, False),
    ({"canary": {"interval": 0}}, False), ({"policy": {"memory_pressure": {"reserved_ratio": 2}}}, False),
    ({"policy": {"hang": {"consecutive_timeouts": 1.5}}}, False), ({"policy": {"hang": {"consecutive_timeouts": -1}}},
                                                                   False),
    ({"restart": {"strategy": "reboot"}}, False), ({"policy": {"admission": {"enabled": 1}}}, False),
    ({"policy": "strict"}, False),
]


@pytest.mark.parametrize(("config", "valid"), AGREE)
def test_the_generated_schema_accepts_what_the_sidecar_accepts(config: dict[str, Any], valid: bool,
                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("POD_NAME", "demo-0")
    monkeypatch.setenv("POD_NAMESPACE", "serving")
    schema_ok = jsonschema.Draft7Validator(config_schema.settings_schema()).is_valid(config)
    try:
        from_mapping(config)
        loader_ok = True
    except ConfigError:
        loader_ok = False
    assert (schema_ok, loader_ok) == (valid, valid)


# --- 8. least privilege ---------------------------------------------------------------------------

SA_PATH = "/var/run/secrets/kubernetes.io/serviceaccount"


@pytest.mark.parametrize("values", [{}, VLLM, EXTERNAL])
def test_only_the_watchdog_holds_an_api_token(values: dict[str, Any]) -> None:
    docs = render(values)
    pod = pod_template(docs)
    assert pod["automountServiceAccountToken"] is False
    volumes = {v["name"]: v for v in pod["volumes"]}
    token_volumes = {name for name, v in volumes.items()
                     if any("serviceAccountToken" in s for s in v.get("projected", {}).get("sources", []))}
    holders = {c["name"] for c in [*pod.get("initContainers", []), *pod["containers"]]
               for m in c.get("volumeMounts", []) if m["name"] in token_volumes}
    assert holders == {"watchdog"}
    wd = containers(docs)["watchdog"]
    mount = next(m for m in wd["volumeMounts"] if m["name"] in token_volumes)
    assert mount["mountPath"] == SA_PATH and mount["readOnly"] is True
    # What the Kubernetes client reads in a pod: token, ca.crt and namespace, at the usual path.
    sources = volumes[mount["name"]]["projected"]["sources"]
    paths = {s["serviceAccountToken"]["path"] for s in sources if "serviceAccountToken" in s}
    paths |= {i["path"] for s in sources if "configMap" in s for i in s["configMap"]["items"]}
    paths |= {i["path"] for s in sources if "downwardAPI" in s for i in s["downwardAPI"]["items"]}
    assert paths == {"token", "ca.crt", "namespace"}
    [test_pod] = by_kind(docs, "Pod")
    assert test_pod["spec"]["automountServiceAccountToken"] is False


def test_node_event_rbac_does_not_clash_between_namespaces() -> None:
    chart = helm.Chart.load(str(CHART))

    def default_ns_names(namespace: str) -> set[tuple[str, str]]:
        out = chart.render(with_images({}), name="demo", namespace=namespace, is_install=True)
        docs = [d for path, text in out.items() if not path.endswith("NOTES.txt")
                for d in yaml.safe_load_all(text) if isinstance(d, dict)]
        return {(d["kind"], d["metadata"]["name"]) for d in docs
                if d.get("metadata", {}).get("namespace") == "default"}

    a, b = default_ns_names("team-a"), default_ns_names("team-b")
    assert len(a) == 2 and len(b) == 2 and not a & b, (a, b)


def test_the_budget_is_keyed_on_the_deployment_the_api_names() -> None:
    """No name handed down: the sidecar reads its pod's controller (so a renamed or foreign
    Deployment keys its budget right), which the Role lets it do for its pod alone."""
    docs = render()
    env = {e["name"]: e.get("value") for e in containers(docs)["watchdog"]["env"]}
    assert "GPU_WATCHDOG_WORKLOAD" not in env
    config = yaml.safe_load(next(d for d in docs if d["kind"] == "ConfigMap"
                                 and "config.yaml" in d.get("data", {}))["data"]["config.yaml"])
    assert not (config.get("kubernetes") or {}).get("workload")
    role = next(d for d in docs if d["kind"] == "Role" and d["metadata"]["name"].endswith("-watchdog"))
    assert any(r["resources"] == ["pods"] and r["verbs"] == ["get"] for r in role["rules"])


# --- 9. the PDB when every replica is unready ------------------------------------------------------

def test_a_drain_is_not_blocked_by_unready_pods() -> None:
    """IfHealthyBudget (the API default) refuses to evict an unready pod while the budget is short,
    which is always when every replica is unready: node drains hang."""
    [pdb] = by_kind(render(), "PodDisruptionBudget")
    assert pdb["spec"]["unhealthyPodEvictionPolicy"] == "AlwaysAllow"
    kubernetes_validate.validate(pdb, K8S_VERSION, strict=True)


# --- 10. monitoring -------------------------------------------------------------------------------

def test_prometheus_objects_carry_the_release_label_kube_prometheus_stack_selects() -> None:
    docs = render(ALL_ON)
    for kind in ("ServiceMonitor", "PrometheusRule"):
        [obj] = by_kind(docs, kind)
        assert obj["metadata"]["labels"]["release"] == "kube-prometheus-stack", kind
    own = render({"serviceMonitor": {"enabled": True, "labels": {"prometheus": "main"}}})
    assert by_kind(own, "ServiceMonitor")[0]["metadata"]["labels"]["prometheus"] == "main"
    for key in ("serviceMonitor", "prometheusRule"):
        assert "prometheusRelease" in render_error({key: {"enabled": True}})


def test_the_service_monitor_scrapes_the_servers_own_metrics_path() -> None:
    on = {"prometheusRelease": "kps", "serviceMonitor": {"enabled": True}}
    ext = {**EXTERNAL, **on, "external": {**EXTERNAL["external"], "metricsPath": "/prom"}}
    [monitor] = by_kind(render(ext), "ServiceMonitor")
    endpoints = {(e["port"], e["path"]) for e in monitor["spec"]["endpoints"]}
    assert endpoints == {("http", "/prom"), ("metrics", "/metrics")}
    none = {**EXTERNAL, **on, "external": {**EXTERNAL["external"], "metricsPath": ""}}
    [monitor] = by_kind(render(none), "ServiceMonitor")
    assert [e["port"] for e in monitor["spec"]["endpoints"]] == ["metrics"]


@pytest.mark.parametrize("values", [
    {**VLLM, "vllm": {**VLLM["vllm"], "apiKeySecret": {"name": "vllm-key", "key": "token"}}},
    {**EXTERNAL, "external": {**EXTERNAL["external"], "apiKeySecret": {"name": "tgi-key"}}},
])
def test_helm_test_sends_the_api_key_the_server_requires(values: dict[str, Any]) -> None:
    [test_pod] = by_kind(render(values), "Pod")
    spec = test_pod["spec"]
    [check] = spec["containers"]
    [volume] = spec["volumes"]
    secret = values.get("vllm", values.get("external"))["apiKeySecret"]  # type: ignore[index]
    assert volume["secret"]["secretName"] == secret["name"]
    assert volume["secret"]["items"] == [{"key": secret.get("key") or "key", "path": "key"}]
    [mount] = check["volumeMounts"]
    script = check["command"][-1]
    assert f'open("{mount["mountPath"]}/key")' in script and '"Authorization"' in script and "Bearer" in script
    kubernetes_validate.validate(test_pod, K8S_VERSION, strict=True)


# --- 11. shutdown and NVML -----------------------------------------------------------------------

@pytest.mark.parametrize("values", [{}, VLLM, EXTERNAL])
def test_the_server_keeps_serving_while_endpoints_drop_the_pod(values: dict[str, Any]) -> None:
    docs = render(values)
    pod = pod_template(docs)
    stop = containers(docs)["inference"]["lifecycle"]["preStop"]
    seconds = stop["sleep"]["seconds"] if "sleep" in stop else int(stop["exec"]["command"][-1])
    assert seconds >= 5
    drain = parse_duration(watchdog_config_raw(docs)["restart"]["drain_timeout"])
    assert pod["terminationGracePeriodSeconds"] >= seconds + drain + 15
    assert "terminationGracePeriodSeconds" in render_error({"terminationGracePeriodSeconds": 30})


def watchdog_config_raw(docs: list[dict[str, Any]]) -> dict[str, Any]:
    cm = next(d for d in by_kind(docs, "ConfigMap") if d["metadata"]["name"].endswith("-watchdog"))
    return yaml.safe_load(cm["data"]["config.yaml"])  # type: ignore[no-any-return]


def test_nvml_in_the_sidecar_takes_no_gpu_and_the_readme_says_where_it_works() -> None:
    wd = containers(render())["watchdog"]
    assert "nvidia.com/gpu" not in json.dumps(wd["resources"])
    assert {"name": "NVIDIA_VISIBLE_DEVICES", "value": "all"} in wd["env"]
    assert not any(e["name"] == "NVIDIA_VISIBLE_DEVICES" for e in containers(render(
        {"watchdog": {"nvidiaVisibleDevices": ""}}))["watchdog"]["env"])
    readme = (CHART / "README.md").read_text()
    section = readme[readme.index("### NVML in the sidecar"):]
    for word in ("NVIDIA_VISIBLE_DEVICES", "CDI", "accept-nvidia-visible-devices-envvar-when-unprivileged",
                 "runtimeClassName", "gpus_unknown"):
        assert word in section, word


def test_ceil_matches_the_templates_rounding() -> None:
    """The derived failureThreshold is ceil((startup_timeout + 60 s) / period), as the template computes it."""
    probe = containers(render({"watchdog": {"config": {"policy": {"startup_timeout": "17m"}}},
                               "inference": {"startupProbe": {"periodSeconds": 7}}}))["inference"]["startupProbe"]
    assert probe["failureThreshold"] == math.ceil((17 * 60 + 60) / 7)


@pytest.mark.parametrize("node_events", [True, False])
def test_node_events_off_reaches_the_sidecar(node_events: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    """Without the Role in `default` the sidecar must not try to write its Node Event (a 403 each time)."""
    settings = watchdog_config({"watchdog": {"nodeEvents": node_events}}, monkeypatch)
    assert settings.policy.escalation.node_event is node_events
    rendered = {(d["kind"], d["metadata"].get("namespace")) for d in render({"watchdog": {"nodeEvents": node_events}})}
    assert (("Role", "default") in rendered) is node_events


VERDICT_PROBE = Path(__file__).resolve().parents[2] / "helm" / "gpu-watchdog" / "files" / "verdict-probe.sh"
ENGINES: list[dict[str, Any]] = [{}, VLLM, EXTERNAL]


@pytest.mark.parametrize("engine_values", ENGINES, ids=["bundled", "vllm", "external"])
@pytest.mark.parametrize("strategy", ["container", "evict"])
def test_the_container_rung_is_rendered_for_every_engine(engine_values: dict[str, Any], strategy: str,
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    """The inference container's liveness reads the watchdog's verdict from a shared emptyDir, and
    only the watchdog can write it; the pod rung keeps its eviction right."""
    values = {**engine_values, "watchdog": {**engine_values.get("watchdog", {}),
                                            "config": {"restart": {"strategy": strategy}}}}
    docs = render(values)
    c = containers(docs)
    inf, wd = c["inference"], c["watchdog"]
    role = next(d for d in docs if d["kind"] == "Role" and d["metadata"]["name"].endswith("-watchdog"))
    verbs = {(r["resources"][0], v) for r in role["rules"] for v in r["verbs"]}
    assert ("pods/eviction", "create") in verbs
    kubernetes_validate.validate(next(d for d in docs if d["kind"] == "Deployment"), "1.30", strict=True)
    if strategy == "evict":
        assert "exec" not in inf["livenessProbe"] and mount_of(inf, "/var/run/gpu-watchdog-verdict") is None
        return
    settings = watchdog_config(values, monkeypatch)
    assert settings.restart.strategy == "container"
    probe = inf["livenessProbe"]
    assert probe["exec"]["command"] == ["sh", "-c", VERDICT_PROBE.read_text()]
    assert probe["failureThreshold"] >= 2 and probe["timeoutSeconds"] >= 5  # one slow probe never kills
    verdict_dir = str(Path(settings.restart.verdict_file).parent)
    assert mount_of(inf, verdict_dir) == {"name": "verdict", "mountPath": verdict_dir, "readOnly": True}
    assert mount_of(wd, verdict_dir) == {"name": "verdict", "mountPath": verdict_dir}
    volumes = {v["name"]: v for v in pod_template(docs)["volumes"]}
    assert volumes["verdict"]["emptyDir"]["medium"] == "Memory"
