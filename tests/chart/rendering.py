"""The chart rendered by the Helm SDK as `helm install` would render it, and the rendered objects read
back (the pod, its containers, what its Roles grant, the sidecar's settings). Every chart test and the
docs' `helm install` blocks render through here, so all of them render the chart the same way."""

from __future__ import annotations

import json
from typing import Any

import helm_python as helm
import pytest
import yaml
from helm_python import _native

from gpu_watchdog.watchdog.edge.config import from_mapping
from tests.helpers import ROOT

CHART = ROOT / "helm" / "gpu-watchdog"
K8S_VERSION = "1.30.0"

# The chart has no default image repositories: every install names its own registry.
IMAGES: dict[str, Any] = {"inference": {"image": {"repository": "registry.example.com/ml/gpu-watchdog-inference"}},
                          "watchdog": {"image": {"repository": "registry.example.com/ml/gpu-watchdog-watchdog"}}}


def merge(base: Any, over: Any) -> Any:
    """`over` over `base`, dicts merged key by key, anything else replaced."""
    if isinstance(base, dict) and isinstance(over, dict):
        return {**base, **{k: merge(base.get(k), v) for k, v in over.items()}}
    return over


def with_images(values: dict[str, Any] | None) -> dict[str, Any]:
    """`values` over IMAGES, merged key by key."""
    return merge(IMAGES, values or {})  # type: ignore[no-any-return]


def render_manifests(values: dict[str, Any] | None = None, kube_version: str = K8S_VERSION,
                     namespace: str = "serving") -> dict[str, str]:
    """The chart's manifests as `helm install` renders them on a cluster at `kube_version` (what
    `helm template --kube-version` sets: `.Capabilities.KubeVersion`). helm-python 0.2.2's
    Chart.render passes no version to the Helm SDK, whose own default then decides; the C library
    it binds takes the version among its render options, so it is called with them."""
    chart = helm.Chart.load(str(CHART))
    opts = {"name": "demo", "namespace": namespace, "is_install": True, "kube_version": f"v{kube_version}"}
    rendered = _native.call_string("helm_render", chart._raw(), json.dumps(with_images(values)), json.dumps(opts))
    manifests: dict[str, str] = json.loads(rendered)
    return manifests


def render(values: dict[str, Any] | None = None, kube_version: str = K8S_VERSION) -> list[dict[str, Any]]:
    """The rendered objects, at the Kubernetes version they are validated against unless told."""
    manifests = render_manifests(values, kube_version)
    docs: list[dict[str, Any]] = []
    for path, text in sorted(manifests.items()):
        if path.endswith("NOTES.txt"):
            continue
        docs.extend(d for d in yaml.safe_load_all(text) if d)
    return docs


def render_error(values: dict[str, Any], namespace: str = "serving") -> str:
    chart = helm.Chart.load(str(CHART))
    with pytest.raises(helm.HelmError) as err:
        chart.render(with_images(values), name="demo", namespace=namespace, is_install=True)
    return str(err.value)


def render_failure(values: dict[str, Any], kube: str) -> str:
    with pytest.raises(helm.HelmError) as err:
        render_manifests(values, kube)
    return str(err.value)


def schema_version(kube: str) -> str:
    major, minor = kube.split(".")[:2]
    return f"{major}.{minor}.0"


def by_kind(docs: list[dict[str, Any]], kind: str) -> list[dict[str, Any]]:
    return [d for d in docs if d["kind"] == kind]


def pod_template(docs: list[dict[str, Any]]) -> dict[str, Any]:
    [deploy] = by_kind(docs, "Deployment")
    return deploy["spec"]["template"]["spec"]  # type: ignore[no-any-return]


def containers(docs: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """The pod's long-running containers by name: its containers and its native sidecars (init
    containers with restartPolicy Always), so the watchdog is found in either place it runs."""
    pod = pod_template(docs)
    sidecars = [c for c in pod.get("initContainers", []) if c.get("restartPolicy") == "Always"]
    return {c["name"]: c for c in [*sidecars, *pod["containers"]]}


# Each one is a call the sidecar makes (see templates/rbac.yaml), and no more.
ALLOWED = {
    ("", "pods", "get"),
    ("", "pods", "list"),  # the fleet's census of the workload's pods, before a slot is taken
    ("", "pods/eviction", "create"),
    ("events.k8s.io", "events", "create"),
    ("events.k8s.io", "events", "list"),
    ("apps", "deployments", "get"),
    ("coordination.k8s.io", "leases", "get"),
    ("coordination.k8s.io", "leases", "update"),
}


def grants(docs: list[dict[str, Any]], namespace: str = "serving") -> set[tuple[str, str, str]]:
    """What the Roles grant in one namespace (the release's, unless named)."""
    roles = [r for r in by_kind(docs, "Role") if r["metadata"].get("namespace", "serving") == namespace]
    return {(g, r, v) for role in roles for rule in role["rules"] for g in rule["apiGroups"]
            for r in rule["resources"] for v in rule["verbs"]}


def watchdog_config(values: dict[str, Any], monkeypatch: pytest.MonkeyPatch) -> Any:
    monkeypatch.setenv("POD_NAME", "demo-0")
    monkeypatch.setenv("POD_NAMESPACE", "serving")
    cm = next(d for d in by_kind(render(values), "ConfigMap") if d["metadata"]["name"].endswith("-watchdog"))
    return from_mapping(yaml.safe_load(cm["data"]["config.yaml"]))


def comment_above(text: str, line_start: str) -> str:
    """The comment lines right above the line that starts (after its indent) with `line_start`."""
    lines = text.splitlines()
    at = next(i for i, line in enumerate(lines) if line.strip().startswith(line_start))
    comment: list[str] = []
    for line in reversed(lines[:at]):
        if not line.strip().startswith("#"):
            break
        comment.insert(0, line.strip().lstrip("# "))
    return " ".join(comment)
