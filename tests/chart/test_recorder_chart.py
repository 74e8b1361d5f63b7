"""The flight recorder in the chart (watchdog.recorder): an emptyDir only the watchdog container
mounts, the rendered config's `recorder.path` on it, and the way to copy the recording out."""

from __future__ import annotations

from typing import Any

import helm_python as helm
import kubernetes_validate
import pytest
import yaml

from gpu_watchdog.watchdog.edge.config import from_mapping
from tests.chart import pod_security
from tests.chart.rendering import (
    CHART,
    K8S_VERSION,
    by_kind,
    containers,
    merge,
    pod_template,
    render,
    render_error,
    render_manifests,
    with_images,
)
from tests.chart.value_sets import EXTERNAL, PRIVILEGED_PR, VLLM

RECORDER_DIR = "/var/lib/gpu-watchdog"
RECORDING = f"{RECORDER_DIR}/flight.jsonl"
OFF: dict[str, Any] = {"watchdog": {"recorder": {"enabled": False}}}

# (values, Kubernetes version, whether the watchdog is a native sidecar there)
PLACES = [
    ({}, K8S_VERSION, True),  # auto: a native sidecar from 1.29
    ({"watchdog": {"nativeSidecar": True}}, "1.29.0", True),
    ({"watchdog": {"nativeSidecar": True}}, "1.33.0", True),
    ({"watchdog": {"nativeSidecar": False}}, K8S_VERSION, False),
    ({}, "1.28.0", False),  # auto before 1.29: the pod's second container
    (VLLM, K8S_VERSION, True),
    (EXTERNAL, K8S_VERSION, True),
]


def rendered_config(docs: list[dict[str, Any]]) -> dict[str, Any]:
    cm = next(d for d in by_kind(docs, "ConfigMap") if d["metadata"]["name"].endswith("-watchdog"))
    config: dict[str, Any] = yaml.safe_load(cm["data"]["config.yaml"])
    return config


def settings_of(docs: list[dict[str, Any]], monkeypatch: pytest.MonkeyPatch) -> Any:
    monkeypatch.setenv("POD_NAME", "demo-0")
    monkeypatch.setenv("POD_NAMESPACE", "serving")
    return from_mapping(rendered_config(docs))


def recorder_volumes(docs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [v for v in pod_template(docs)["volumes"] if v["name"] == "recorder"]


def recorder_mounts(docs: list[dict[str, Any]]) -> dict[str, list[dict[str, Any]]]:
    """Every container of the pod (init, sidecar or not) with the mounts it has of the recorder's volume."""
    pod = pod_template(docs)
    return {c["name"]: [m for m in c.get("volumeMounts", []) if m["name"] == "recorder"]
            for c in [*pod.get("initContainers", []), *pod["containers"]]}


def notes(values: dict[str, Any]) -> str:
    manifests = render_manifests(values)
    return next(text for path, text in manifests.items() if path.endswith("NOTES.txt"))


@pytest.mark.parametrize(("values", "kube", "is_native"), PLACES)
def test_the_recording_lives_on_an_emptydir_only_the_watchdog_writes(values: dict[str, Any], kube: str,
                                                                    is_native: bool,
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    docs = render(values, kube_version=kube)
    pod = pod_template(docs)
    native = [c for c in pod.get("initContainers", []) if c["name"] == "watchdog"]
    assert bool(native) == is_native and (not native or native[0]["restartPolicy"] == "Always")
    assert recorder_volumes(docs) == [{"name": "recorder", "emptyDir": {"sizeLimit": "128Mi"}}]
    mounts = recorder_mounts(docs)
    assert mounts.pop("watchdog") == [{"name": "recorder", "mountPath": RECORDER_DIR}]  # read-write
    assert all(found == [] for found in mounts.values()), mounts
    # The volume is the one writable place: every root filesystem stays read-only.
    for name, c in containers(docs).items():
        assert c["securityContext"]["readOnlyRootFilesystem"] is True, name
    assert rendered_config(docs)["recorder"] == {"path": RECORDING}
    settings = settings_of(docs, monkeypatch)
    assert settings.recorder.path == RECORDING and settings.recorder.max_bytes == 64 * 2**20
    [deploy] = by_kind(docs, "Deployment")
    kubernetes_validate.validate(deploy, ".".join(kube.split(".")[:2]) + ".0", strict=True)


@pytest.mark.parametrize(("values", "kube", "is_native"), PLACES)
def test_disabled_there_is_no_volume_no_mount_and_nothing_recorded(values: dict[str, Any], kube: str,
                                                                   is_native: bool,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    docs = render(merge(values, OFF), kube_version=kube)
    assert recorder_volumes(docs) == []
    assert all(found == [] for found in recorder_mounts(docs).values())
    assert not any(m["mountPath"] == RECORDER_DIR for c in containers(docs).values() for m in c["volumeMounts"])
    assert rendered_config(docs)["recorder"] == {"path": None}
    assert settings_of(docs, monkeypatch).recorder.path is None


def test_the_size_bound_and_the_volumes_limit_are_the_users(monkeypatch: pytest.MonkeyPatch) -> None:
    docs = render({"watchdog": {"config": {"recorder": {"max_bytes": "32MiB"}}}})
    assert rendered_config(docs)["recorder"] == {"max_bytes": "32MiB", "path": RECORDING}
    assert settings_of(docs, monkeypatch).recorder.max_bytes == 32 * 2**20
    docs = render({"watchdog": {"recorder": {"sizeLimit": "1Gi"}, "config": {"recorder": {"max_bytes": "512MiB"}}}})
    assert recorder_volumes(docs) == [{"name": "recorder", "emptyDir": {"sizeLimit": "1Gi"}}]
    assert settings_of(docs, monkeypatch).recorder.max_bytes == 512 * 2**20
    # Disabled, max_bytes is kept (it bounds nothing) and no limit is checked against it.
    docs = render(merge(OFF, {"watchdog": {"config": {"recorder": {"max_bytes": "1GiB"}}}}))
    assert rendered_config(docs)["recorder"] == {"max_bytes": "1GiB", "path": None}


def test_a_recorder_path_of_the_users_own_is_refused_by_the_install() -> None:
    text = render_error({"watchdog": {"config": {"recorder": {"path": "/tmp/flight.jsonl"}}}})
    assert "/watchdog/config/recorder" in text and "'path'" in text, text
    text = render_error(merge(OFF, {"watchdog": {"config": {"recorder": {"path": "/tmp/flight.jsonl"}}}}))
    assert "/watchdog/config/recorder" in text and "'path'" in text, text


@pytest.mark.parametrize(("values", "words"), [
    ({"watchdog": {"config": {"recorder": {"max_bytes": "128MiB"}}}},
     ["watchdog.recorder.sizeLimit=128Mi", "watchdog.config.recorder.max_bytes=128MiB", "evicts"]),
    ({"watchdog": {"config": {"recorder": {"max_bytes": 134217728}}}},
     ["watchdog.config.recorder.max_bytes=134217728"]),
    ({"watchdog": {"recorder": {"sizeLimit": "64Mi"}}}, ["sizeLimit=64Mi", "max_bytes=64MiB"]),
    ({"watchdog": {"recorder": {"sizeLimit": "1G"}, "config": {"recorder": {"max_bytes": "1GB"}}}},
     ["sizeLimit=1G", "max_bytes=1GB"]),
])
def test_a_volume_the_recording_would_outgrow_is_refused_saying_why(values: dict[str, Any],
                                                                    words: list[str]) -> None:
    text = render_error(values)
    for word in words:
        assert word in text, (word, text)


@pytest.mark.parametrize("values", [{}, OFF, {"watchdog": {"recorder": {"sizeLimit": "1.5Gi"}}}])
def test_recorder_values_lint_clean(values: dict[str, Any]) -> None:
    report = helm.lint(str(CHART), with_images(values), strict=True, kube_version=f"v{K8S_VERSION}")
    assert report["errors"] == [] and [m for m in report["messages"] if m["severity"] >= 2] == [], report


@pytest.mark.parametrize(("level", "values", "kube"), [
    ("restricted", {}, K8S_VERSION), ("restricted", {"watchdog": {"nativeSidecar": True}}, "1.29.0"),
    ("restricted", {"watchdog": {"nativeSidecar": False}}, K8S_VERSION), ("restricted", OFF, K8S_VERSION),
    ("restricted", VLLM, K8S_VERSION), ("baseline", EXTERNAL, K8S_VERSION),
    ("privileged", PRIVILEGED_PR, K8S_VERSION),
])
def test_the_pods_still_pass_the_namespaces_pod_security_level(level: str, values: dict[str, Any],
                                                                kube: str) -> None:
    docs = render({**values, "podSecurityLevel": level}, kube_version=kube)
    pods = [pod_template(docs)] + [d["spec"] for d in by_kind(docs, "Pod")]
    for pod in pods:
        assert pod_security.violations(pod, level) == [], level


def test_the_notes_say_how_to_copy_the_recording_out_and_replay_it() -> None:
    text = notes({})
    assert f"kubectl -n serving exec POD -c watchdog -- cat {RECORDING} > flight.jsonl" in text
    assert "flight.jsonl.1" in text
    assert "gpu-watchdog replay flight.jsonl" in text
    assert "--set policy.hang.consecutive_timeouts=5" in text
    off = notes(OFF)
    assert RECORDER_DIR not in off and "gpu-watchdog replay" not in off
