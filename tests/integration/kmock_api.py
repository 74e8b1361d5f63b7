"""Our pod, its namespace and its node as kmock's Kubernetes API emulator serves them, and what the
sidecar wrote there read back. Shared by every test against kmock (the integration conftest's `api`
fixture seeds this pod), so a pod, a namespace or a GPU means the same thing in each of them."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

NS, POD = "serving", "model-0"
# Our pod's GPU, another pod's GPU on the same node, and that node.
OURS, OTHER, NODE = "GPU-11111111-aaaa", "GPU-22222222-bbbb", "gpu-node-7"


def pod(name: str = POD, ns: str = NS) -> dict[str, Any]:
    return {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": name, "namespace": ns},
            "spec": {"containers": [{"name": "inference", "image": "gpu-watchdog-inference"}]}}


def serve_events(kmock: Any) -> None:
    """Declare the Events resource, so an empty namespace lists as 200 with no items, as a real API server answers."""
    kmock.resources["events.k8s.io/v1/events"] = kmock.ResourceInfo(
        namespaced=True, kind="Event", verbs={"create", "list", "get"})


def objects(kmock: Any, plural: str) -> list[dict[str, Any]]:
    out = []
    for key in list(kmock.objects):
        if getattr(key[0], "plural", None) == plural:
            obj = kmock.objects[key]
            out.append(dict(getattr(obj, "raw", None) or obj))
    return out


def events(kmock: Any) -> list[dict[str, Any]]:
    return objects(kmock, "events")


def kubeconfig(path: Path, url: str) -> None:
    """A kubeconfig file pointing a client at the emulator, in our namespace (for a sidecar started as a process)."""
    path.write_text(yaml.safe_dump({
        "apiVersion": "v1", "kind": "Config", "current-context": "kmock",
        "clusters": [{"name": "kmock", "cluster": {"server": url}}],
        "users": [{"name": "kmock", "user": {"token": "not-a-real-token"}}],
        "contexts": [{"name": "kmock", "context": {"cluster": "kmock", "user": "kmock", "namespace": NS}}],
    }))
