"""The Kubernetes side: evict or delete *our own* pod, and record Events on it.

The client is synchronous; callers run it through `asyncio.to_thread`.
"""

from __future__ import annotations

import contextlib
import datetime as dt
import os
import secrets
import time
from typing import Any

from gpu_watchdog import logs
from gpu_watchdog.watchdog.actions.k8s import client, config

log = logs.get("watchdog.kube")

CONTROLLER = "gpu-watchdog.io/watchdog"


class RefusedError(RuntimeError):
    """An action aimed at a pod that is not the watchdog's own."""


def load_api_client(kubeconfig: str | None, request_timeout: float) -> client.ApiClient:
    if kubeconfig is None and os.environ.get("KUBERNETES_SERVICE_HOST"):
        config.load_incluster_config()
        return client.ApiClient()
    configuration = client.Configuration()
    config.load_kube_config(config_file=kubeconfig, client_configuration=configuration)
    configuration.retries = 0
    return client.ApiClient(configuration)


def event_name(regarding: str) -> str:
    """Unique without the server's help (as the kubelet names its Events): object name + time + a nonce."""
    return f"{regarding}.{time.time_ns():x}{secrets.token_hex(2)}"


def event_reason(rule: str) -> str:
    return "".join(part.capitalize() for part in rule.split("_"))


def _options(timeout: float, dry_run: bool = False) -> dict[str, Any]:
    """For calls whose answer is their status alone: the echoed object is neither needed nor
    trusted to parse (a proxy's garbage after a 2xx must not turn a stored Event into a failure)."""
    out: dict[str, Any] = {"_request_timeout": timeout, "_preload_content": False}
    if dry_run:
        out["dry_run"] = "All"
    return out


def _discard(response: Any) -> None:
    """Read and hand back the connection of an answer we do not parse."""
    with contextlib.suppress(Exception):
        response.read()
        response.release_conn()


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

    def __init__(self, api_client: client.ApiClient, pod_name: str, namespace: str, request_timeout: float) -> None:
        if not pod_name or not namespace:
            raise RefusedError("the watchdog's own pod name and namespace are unknown; refusing to act")
        downward = os.environ.get("POD_NAME")
        if downward and downward != pod_name:
            raise RefusedError(f"configured pod {pod_name!r} is not this pod ({downward!r}); refusing to act")
        self.pod_name = pod_name
        self.namespace = namespace
        self.core = client.CoreV1Api(api_client)
        self.events = client.EventsV1Api(api_client)
        self.timeout = request_timeout

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
        body = client.V1Eviction(
            metadata=client.V1ObjectMeta(name=name, namespace=namespace),
            delete_options=client.V1DeleteOptions(grace_period_seconds=grace_period) if grace_period is not None
            else None,
        )
        _discard(self.core.create_namespaced_pod_eviction(name, namespace, body, **_options(self.timeout, dry_run)))

    def owner_workload(self) -> str:
        """Blocking: the workload our pod belongs to, from its `ownerReferences` (see `workload_from_pod`)."""
        found = self.core.read_namespaced_pod(self.pod_name, self.namespace, _request_timeout=self.timeout)
        meta = found.metadata or client.V1ObjectMeta()
        owners = [(o.kind, o.name) for o in (meta.owner_references or []) if o.controller]
        return workload_from_pod(self.pod_name, meta.labels or {}, owners)

    def delete(self, name: str, namespace: str, grace_period: int | None, dry_run: bool = False) -> None:
        """`dry_run`: ask whether the API would delete it (RBAC, admission), deleting nothing."""
        self._guard(name, namespace)
        kwargs = _options(self.timeout, dry_run)
        if grace_period is not None:
            kwargs["grace_period_seconds"] = grace_period
        _discard(self.core.delete_namespaced_pod(name, namespace, **kwargs))

    def record_event(self, name: str, namespace: str, reason: str, note: str, action: str,
                     event_type: str = "Warning", annotations: dict[str, str] | None = None) -> None:
        self._guard(name, namespace)
        body = client.EventsV1Event(
            metadata=client.V1ObjectMeta(name=event_name(name), namespace=namespace,
                                         annotations=annotations or None),
            event_time=dt.datetime.now(dt.UTC),
            reporting_controller=CONTROLLER,
            reporting_instance=name,
            action=action,
            reason=reason,
            note=note[:1024],
            type=event_type,
            regarding=client.V1ObjectReference(kind="Pod", api_version="v1", name=name, namespace=namespace),
        )
        _discard(self.events.create_namespaced_event(namespace, body, **_options(self.timeout)))
