"""The Kubernetes side: evict or delete *our own* pod, and record Events on it.

The client is synchronous; callers run it through `asyncio.to_thread`.
"""

from __future__ import annotations

import os
import secrets
import time
from collections.abc import Callable
from typing import Any

from gpu_watchdog import logs
from gpu_watchdog.watchdog.edge.kube.kube_api import (
    KubeApi,
    api_of,
    default_kubeconfig,
    from_kubeconfig,
    in_cluster,
    micro_time,
    path,
)

log = logs.get("watchdog.kube")

CONTROLLER = "gpu-watchdog.io/watchdog"


class RefusedError(RuntimeError):
    """An action aimed at a pod that is not the watchdog's own."""


def load_api_client(kubeconfig: str | None, request_timeout: float) -> KubeApi:
    """The API client of the sidecar and its commands: in a cluster (no kubeconfig named) the pod's
    service account, else the kubeconfig (named, else $KUBECONFIG or ~/.kube/config)."""
    if kubeconfig is None and os.environ.get("KUBERNETES_SERVICE_HOST"):
        return in_cluster(request_timeout)
    return from_kubeconfig(kubeconfig if kubeconfig is not None else default_kubeconfig(), request_timeout)


def pod_path(namespace: str, name: str | None = None, sub: str | None = None) -> str:
    return path("/api/v1/namespaces", namespace, "pods", name, sub)


def events_path(namespace: str) -> str:
    return path("/apis/events.k8s.io/v1/namespaces", namespace, "events")


def event_body(name: str, namespace: str, regarding: dict[str, str], reason: str, note: str, action: str,
               event_type: str, reporting_instance: str, annotations: dict[str, str] | None,
               at: float | None = None) -> dict[str, Any]:
    """An `events.k8s.io/v1` Event, as the typed models wrote it (fields that are None left out);
    `at`: its `eventTime`, the writer's wall clock (now where None)."""
    metadata: dict[str, Any] = {"name": name, "namespace": namespace}
    if annotations:
        metadata["annotations"] = annotations
    return {"apiVersion": "events.k8s.io/v1", "kind": "Event", "metadata": metadata, "eventTime": micro_time(at),
            "reportingController": CONTROLLER, "reportingInstance": reporting_instance, "action": action,
            "reason": reason, "note": note[:1024], "type": event_type, "regarding": regarding}


def event_name(regarding: str) -> str:
    """Unique without the server's help (as the kubelet names its Events): object name + time + a nonce."""
    return f"{regarding}.{time.time_ns():x}{secrets.token_hex(2)}"


def event_reason(rule: str) -> str:
    return "".join(part.capitalize() for part in rule.split("_"))


def workload_from_pod(pod_name: str, labels: dict[str, str], owners: list[tuple[str, str]]) -> str:
    """The restart budget's key, from the pod's controller: a Deployment's name (its ReplicaSet is
    named `<deployment>-<pod-template-hash>`, the hash also being the pod's label, so no read of the
    ReplicaSet and no right to it is needed), a StatefulSet's, a Job's, a lone ReplicaSet's, or the
    pod's own name when nothing controls it."""
    if not owners:
        return pod_name
    kind, name = owners[0]
    template_hash = labels.get("pod-template-hash")
    if kind == "ReplicaSet" and template_hash and name.endswith(f"-{template_hash}"):
        return name[: -len(template_hash) - 1]
    return name


class PodActions:
    """Every call names the pod it acts on and is refused unless that pod is ours."""

    def __init__(self, api_client: KubeApi, pod_name: str, namespace: str, request_timeout: float,
                 wall_clock: Callable[[], float] = time.time) -> None:
        if not pod_name or not namespace:
            raise RefusedError("the watchdog's own pod name and namespace are unknown; refusing to act")
        downward = os.environ.get("POD_NAME")
        if downward and downward != pod_name:
            raise RefusedError(f"configured pod {pod_name!r} is not this pod ({downward!r}); refusing to act")
        self.pod_name = pod_name
        self.namespace = namespace
        self.api = api_of(api_client)
        self.timeout = request_timeout
        self.wall_clock = wall_clock  # an Event's time is its writer's

    def _guard(self, name: str, namespace: str) -> None:
        if (name, namespace) != (self.pod_name, self.namespace):
            log.error("refused_foreign_pod", pod=name, namespace=namespace, own_pod=self.pod_name,
                      own_namespace=self.namespace)
            raise RefusedError(f"refusing to act on pod {namespace}/{name}: the watchdog only acts on its own pod"
                               f" {self.namespace}/{self.pod_name}")

    def evict(self, name: str, namespace: str, grace_period: int | None, dry_run: bool = False) -> None:
        """`dry_run`: ask whether the disruption budget allows the eviction, evicting nothing (the API
        server runs the same PodDisruptionBudget check and answers 429 where it would refuse)."""
        self._guard(name, namespace)
        body: dict[str, Any] = {"apiVersion": "policy/v1", "kind": "Eviction",
                                "metadata": {"name": name, "namespace": namespace}}
        if grace_period is not None:
            body["deleteOptions"] = {"gracePeriodSeconds": grace_period}
        # The answer is its status alone: the echoed object is neither needed nor trusted to parse.
        self.api.post(pod_path(namespace, name, "eviction"), body, query={"dryRun": "All" if dry_run else None},
                      timeout=self.timeout)

    def owner_workload(self) -> str:
        """Blocking: the workload our pod belongs to, from its `ownerReferences` (see `workload_from_pod`)."""
        found = self.api.get(pod_path(self.namespace, self.pod_name), timeout=self.timeout)
        meta = found.get("metadata") or {}
        owners = [(str(o.get("kind")), str(o.get("name"))) for o in meta.get("ownerReferences") or []
                  if o.get("controller")]
        return workload_from_pod(self.pod_name, meta.get("labels") or {}, owners)

    def delete(self, name: str, namespace: str, grace_period: int | None, dry_run: bool = False) -> None:
        """`dry_run`: ask whether the API would delete it (RBAC, admission), deleting nothing."""
        self._guard(name, namespace)
        self.api.delete(pod_path(namespace, name), timeout=self.timeout,
                        query={"gracePeriodSeconds": grace_period, "dryRun": "All" if dry_run else None})

    def record_event(self, name: str, namespace: str, reason: str, note: str, action: str,
                     event_type: str = "Warning", annotations: dict[str, str] | None = None) -> None:
        self._guard(name, namespace)
        body = event_body(event_name(name), namespace, {"kind": "Pod", "apiVersion": "v1", "name": name,
                                                        "namespace": namespace},
                          reason, note, action, event_type, name, annotations, self.wall_clock())
        self.api.post(events_path(namespace), body, timeout=self.timeout)
