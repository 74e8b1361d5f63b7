"""Where the watchdog runs in the pod (watchdog.nativeSidecar), checked on the manifests Helm renders
for clusters at 1.28, 1.29 and 1.33.

From the Kubernetes documentation (Sidecar Containers; Container.restartPolicy in the API reference):
an init container with `restartPolicy: Always` is a sidecar. It starts in the init sequence, but the
kubelet goes on to the next init container, and after the last to the app containers, as soon as it
has started or, when it has a startupProbe, once that probe has succeeded. It keeps running and is
restarted on its own when it exits; its readinessProbe counts for the pod's readiness. When the pod
terminates, the sidecars are stopped only after every app container has exited (in reverse order).
Beta and on by default since 1.29 (the SidecarContainers feature gate), GA in 1.33. Plain containers
of a pod start together, with no order kept between them, and all get SIGTERM at the same time
(each after its own preStop hook).
"""

from __future__ import annotations

import json
from typing import Any

import helm_python as helm
import kubernetes_validate
import pytest

from gpu_watchdog.units import parse_duration
from tests.chart import pod_security
from tests.chart.rendering import (
    CHART,
    by_kind,
    containers,
    merge,
    pod_template,
    render,
    render_failure,
    render_manifests,
    schema_version,
    with_images,
)
from tests.chart.value_sets import ADMITTED, EXTERNAL, PRIVILEGED_PR, VLLM

NATIVE_FROM = [("1.28.0", False), ("1.29.0", True), ("1.33.0", True),
               # Providers' versions carry a suffix semver reads as a pre-release.
               ("1.29.3-eks-adc7111", True), ("1.30.1-gke.1261000", True)]


def native(values: dict[str, Any], mode: Any) -> dict[str, Any]:
    return merge(values, {"watchdog": {"nativeSidecar": mode}})  # type: ignore[no-any-return]


@pytest.mark.parametrize(("kube", "is_native"), NATIVE_FROM)
def test_auto_makes_the_watchdog_a_native_sidecar_from_1_29(kube: str, is_native: bool) -> None:
    docs = render({}, kube)
    pod = pod_template(docs)
    if is_native:
        [sidecar] = pod["initContainers"]
        assert sidecar["name"] == "watchdog" and sidecar["restartPolicy"] == "Always"
        assert [c["name"] for c in pod["containers"]] == ["inference"]
    else:
        assert "initContainers" not in pod
        assert [c["name"] for c in pod["containers"]] == ["inference", "watchdog"]
        assert "restartPolicy" not in containers(docs)["watchdog"]
    for doc in docs:
        if not doc["apiVersion"].startswith("monitoring.coreos.com/"):
            kubernetes_validate.validate(doc, schema_version(kube), strict=True)


@pytest.mark.parametrize("kube", ["1.28.0", "1.33.0"])
def test_lint_is_clean_at_either_shape(kube: str) -> None:
    report = helm.lint(str(CHART), with_images({}), strict=True, kube_version=f"v{kube}")
    assert report["errors"] == [] and [m for m in report["messages"] if m["severity"] >= 2] == [], report


VARIANTS: list[dict[str, Any]] = [
    {}, VLLM, EXTERNAL, PRIVILEGED_PR, {"watchdog": {"config": {"restart": {"strategy": "evict"}}}},
    {"watchdog": {"nvidiaVisibleDevices": "", "resources": {"limits": {"memory": "512Mi"}}}},
]


@pytest.mark.parametrize("values", VARIANTS)
def test_the_watchdog_is_the_same_container_in_both_places(values: dict[str, Any]) -> None:
    """Only restartPolicy differs: probes, mounts, env, ports, resources and securityContext are one text."""
    sidecar = containers(render(native(values, True), "1.33.0"))["watchdog"]
    plain_new = containers(render(native(values, False), "1.33.0"))["watchdog"]
    plain_old = containers(render(values, "1.28.0"))["watchdog"]
    assert sidecar.pop("restartPolicy") == "Always"
    assert sidecar == plain_new == plain_old


@pytest.mark.parametrize("kube", ["1.29.0", "1.33.0"])
def test_the_model_server_starts_after_the_watchdog_answers(kube: str) -> None:
    docs = render({}, kube)
    pod = pod_template(docs)
    [sidecar] = pod["initContainers"]
    probe = sidecar["startupProbe"]
    # /healthz (the loop ticks), not /readyz: readiness needs a canary answered by the model server,
    # which waits for this very probe; it would never pass.
    assert probe["httpGet"]["path"] == "/healthz"
    ports = {p["name"]: p["containerPort"] for p in sidecar["ports"]}
    assert probe["httpGet"]["port"] in ports and ports[probe["httpGet"]["port"]] == 9402
    assert probe["periodSeconds"] <= 2, "the model server's start waits one period at least"
    assert probe["periodSeconds"] * probe["failureThreshold"] >= 30, "a slow start must not kill the watchdog"
    assert sidecar["readinessProbe"]["httpGet"]["path"] == "/readyz"  # still gates the pod's readiness
    # The model server's own load is bounded by its startup probe, not by the watchdog's.
    inf = containers(docs)["inference"]
    assert inf["startupProbe"]["periodSeconds"] * inf["startupProbe"]["failureThreshold"] >= parse_duration("30m")


def test_plain_containers_start_together() -> None:
    """No order between plain containers: the probe only holds off the watchdog's own probes."""
    pod = pod_template(render({}, "1.28.0"))
    assert [c["name"] for c in pod["containers"]] == ["inference", "watchdog"]
    assert containers(render({}, "1.28.0"))["watchdog"]["startupProbe"]["httpGet"]["path"] == "/healthz"


@pytest.mark.parametrize("kube", ["1.29.0", "1.33.0"])
def test_the_native_sidecar_outlives_the_model_server(kube: str) -> None:
    """Stopped only after the model server has exited: the watchdog reports through the whole
    preStop wait and drain, all within the pod's grace period."""
    docs = render({}, kube)
    pod = pod_template(docs)
    [sidecar] = pod["initContainers"]
    assert sidecar["restartPolicy"] == "Always" and "lifecycle" not in sidecar
    inf = containers(docs)["inference"]
    stop = inf["lifecycle"]["preStop"]
    wait = stop["sleep"]["seconds"] if "sleep" in stop else int(stop["exec"]["command"][-1])
    assert pod["terminationGracePeriodSeconds"] >= wait + 30 + 15  # preStop + drain_timeout + shutdown


def test_a_plain_watchdog_stops_before_the_model_server_has_drained() -> None:
    """Plain: SIGTERM reaches both containers at once, each after its own preStop. The model server
    sleeps out its preStop first (endpoints drop the pod) and then drains; the watchdog has no
    preStop, so it exits at once and the drain goes unwatched (the pod is going anyway: nothing is
    restarted). A native sidecar is what keeps it to the end."""
    docs = render({}, "1.28.0")
    c = containers(docs)
    assert "lifecycle" not in c["watchdog"]
    stop = c["inference"]["lifecycle"]["preStop"]
    assert stop == {"exec": {"command": ["sleep", "5"]}}  # below 1.30 there is no sleep action


@pytest.mark.parametrize("kube", ["1.28.0", "1.29.0", "1.33.0"])
@pytest.mark.parametrize("engine_values", [{}, VLLM, EXTERNAL], ids=["bundled", "vllm", "external"])
def test_the_in_place_rung_restarts_the_model_server_alone(kube: str, engine_values: dict[str, Any]) -> None:
    """restart.strategy container: the inference container's liveness probe reads the watchdog's
    verdict, so the kubelet restarts that container; nothing of the kind is on the watchdog, and a
    native sidecar is not one of the pod's containers at all."""
    docs = render(merge(engine_values, {"watchdog": {"config": {"restart": {"strategy": "container"}}}}), kube)
    pod = pod_template(docs)
    c = containers(docs)
    inf, wd = c["inference"], c["watchdog"]
    assert inf["livenessProbe"]["exec"]["command"][:2] == ["sh", "-c"]
    assert "gpu-watchdog-verdict" in inf["livenessProbe"]["exec"]["command"][2]
    assert wd["livenessProbe"] == {"httpGet": {"path": "/healthz", "port": "metrics"}, "periodSeconds": 10,
                                   "timeoutSeconds": 2, "failureThreshold": 3}
    assert not any("exec" in wd.get(p, {}) for p in ("livenessProbe", "readinessProbe", "startupProbe"))
    in_containers = "watchdog" in [x["name"] for x in pod["containers"]]
    assert in_containers is (kube == "1.28.0")


def test_the_explicit_values() -> None:
    assert "initContainers" in pod_template(render(native({}, True), "1.28.0"))  # the alpha gate, turned on
    assert "initContainers" not in pod_template(render(native({}, False), "1.33.0"))
    assert pod_template(render(native({}, "auto"), "1.33.0")) == pod_template(render({}, "1.33.0"))
    text = render_failure(native({}, True), "1.27.0")
    assert "watchdog.nativeSidecar" in text and "1.27" in text and "auto or false" in text, text
    assert "nativeSidecar" in render_failure(native({}, "yes"), "1.33.0")


@pytest.mark.parametrize(("kube", "mode"), [("1.28.0", "auto"), ("1.29.0", "auto"), ("1.33.0", False)])
def test_the_service_reaches_the_watchdog_by_port_number(kube: str, mode: Any) -> None:
    """A native sidecar's named ports reach EndpointSlices only from 1.33 (kubernetes#128850): a
    Service naming `metrics` had no endpoint for the watchdog before, and `helm test` with it."""
    docs = render(native({}, mode), kube)
    [service] = by_kind(docs, "Service")
    port = next(p for p in service["spec"]["ports"] if p["name"] == "metrics")
    wd = containers(docs)["watchdog"]
    assert port["targetPort"] == next(p["containerPort"] for p in wd["ports"] if p["name"] == "metrics")
    assert isinstance(port["targetPort"], int)


@pytest.mark.parametrize(("level", "values"), ADMITTED)
@pytest.mark.parametrize("kube", ["1.28.0", "1.33.0"])
def test_both_shapes_pass_the_namespaces_pod_security_level(level: str, values: dict[str, Any], kube: str) -> None:
    pod = pod_template(render({**values, "podSecurityLevel": level}, kube))
    assert pod_security.violations(pod, level) == [], (level, kube)
    assert {c["name"] for c in pod_security._containers(pod)} == {"inference", "watchdog"}


def test_the_notes_say_where_the_watchdog_runs() -> None:
    new = render_manifests({}, "1.33.0")["gpu-watchdog/templates/NOTES.txt"]
    old = render_manifests({}, "1.28.0")["gpu-watchdog/templates/NOTES.txt"]
    assert "native sidecar" in new and "native sidecar" not in old
    for notes in (new, old):
        assert "logs deploy/demo-gpu-watchdog -c watchdog" in notes


def test_the_values_schema_documents_the_three_modes() -> None:
    schema = json.loads((CHART / "values.schema.json").read_text())
    assert schema["properties"]["watchdog"]["properties"]["nativeSidecar"]["enum"] == ["auto", True, False]
