"""Reading back the pod's restart Events, and reporting a suspect GPU on its Node.

Never taints, cordons or drains: node-level remediation (NVSentinel, node-problem-detector
consumers, autoscalers) acts on what is reported here.
"""

from __future__ import annotations

import datetime as dt
from typing import Any

from gpu_watchdog import logs
from gpu_watchdog.watchdog.core.escalation import (
    GPUS_ANNOTATION,
    NODE_ANNOTATION,
    REASON_ANNOTATION,
    WORKLOAD_ANNOTATION,
    XID_ANNOTATION,
    RestartRecord,
    Suspect,
)
from gpu_watchdog.watchdog.edge.kube.kube import CONTROLLER, event_body, event_name, events_path
from gpu_watchdog.watchdog.edge.kube.kube_api import STRATEGIC_MERGE_PATCH, KubeApi, api_of, parse_time, path

log = logs.get("watchdog.node")

NODE_EVENTS_NAMESPACE = "default"  # Events about cluster-scoped objects live there (kubelet's do too)
CONDITION = "GPUSuspect"
PAGE = 500  # Events per list call; a namespace's list is read to its end or not at all


def restart_record(event: dict[str, Any]) -> RestartRecord | None:
    """One of our restart Events (the API's JSON) as a record; None for anything else."""
    meta = event.get("metadata") or {}
    annotations = meta.get("annotations") or {}
    if event.get("reportingController") != CONTROLLER or not (
            GPUS_ANNOTATION in annotations or WORKLOAD_ANNOTATION in annotations):
        return None
    regarding = event.get("regarding") or {}
    if regarding.get("kind") not in (None, "Pod"):
        return None  # a Node report, not a restart
    at = parse_time(event.get("eventTime")) if event.get("eventTime") else parse_time(meta.get("creationTimestamp"))
    if at is None:
        return None
    gpus = tuple(g for g in annotations.get(GPUS_ANNOTATION, "").split(",") if g)
    xid = annotations.get(XID_ANNOTATION)
    return RestartRecord(at=at, reason=annotations.get(REASON_ANNOTATION, ""), gpus=gpus,
                         pod=regarding.get("name") or "",
                         xid=int(xid) if xid and xid.isdigit() else None,
                         workload=annotations.get(WORKLOAD_ANNOTATION) or None,
                         node=annotations.get(NODE_ANNOTATION) or None)


class NodeReporter:
    def __init__(self, api_client: KubeApi, namespace: str, node_name: str, request_timeout: float,
                 node_condition: bool, node_event: bool = True) -> None:
        self.namespace = namespace
        self.node_event = node_event
        self.node_name = node_name
        self.timeout = request_timeout
        self.node_condition = node_condition
        self.api = api_of(api_client)

    def restart_records(self) -> list[RestartRecord]:
        """Blocking: the namespace's restart Events (every pod's, not only ours), read to the last
        page; any page that fails fails the whole read, so that a partial list never passes for all."""
        items: list[Any] = []
        token: str | None = None
        while True:
            page = self.api.get(events_path(self.namespace), query={"limit": PAGE, "continue": token or None},
                                timeout=self.timeout)
            items.extend(page.get("items") or [])
            token = (page.get("metadata") or {}).get("continue")
            if not token:
                break
        return [r for r in (restart_record(e) for e in items if isinstance(e, dict)) if r is not None]

    def report(self, suspect: Suspect, pod: str) -> None:
        """Blocking: a Warning Event on the Node, and the Node condition when that is switched on."""
        if not self.node_event and not self.node_condition:
            return  # reported in our own log, status and metrics only
        if not self.node_name:
            raise ValueError("the node's name is unknown (set NODE_NAME from the downward API spec.nodeName)")
        if suspect.answers:
            reason = "WrongAnswers"
            message = (f"GPU {suspect.uuid} on node {self.node_name}: {suspect.answers}. The card computes wrong;"
                       f" a new process on it did not cure it (reported by pod {pod}).")
        elif suspect.driver_says:
            # The driver's own word: said at once, before any restart could fail to cure it.
            reason = "DriverRecoveryAction"
            message = (f"GPU {suspect.uuid} on node {self.node_name}: the driver says {suspect.driver_says}"
                       + (f" (Xid {suspect.xid})" if suspect.xid else "")
                       + f"; the node needs {suspect.node_action}: a new process on this GPU cannot cure it"
                       f" (reported by pod {pod}).")
        else:
            reason = "RepeatedGPURestarts"
            message = (f"GPU {suspect.uuid} on node {self.node_name}: {len(suspect.restarts)} restarts in the window"
                       f" did not cure it (reasons {', '.join(suspect.reasons)}"
                       + (f"; Xid {', '.join(map(str, suspect.xids))}" if suspect.xids else "")
                       + f"; pods {', '.join(sorted({r.pod for r in suspect.restarts}))}). A pod restart cannot"
                       " fix a failing GPU; the node needs attention.")
        now = dt.datetime.now(dt.UTC)
        body = event_body(event_name(self.node_name), NODE_EVENTS_NAMESPACE,
                          {"kind": "Node", "apiVersion": "v1", "name": self.node_name}, CONDITION, message, "Report",
                          "Warning", pod, {GPUS_ANNOTATION: suspect.uuid})
        if self.node_event:
            self.api.post(events_path(NODE_EVENTS_NAMESPACE), body, timeout=self.timeout)
        if self.node_condition:
            stamp = now.isoformat().replace("+00:00", "Z")
            patch = {"status": {"conditions": [{
                "type": CONDITION, "status": "True", "reason": reason, "message": message[:1024],
                "lastTransitionTime": stamp, "lastHeartbeatTime": stamp}]}}
            # A strategic merge keeps the kubelet's own conditions: the list merges by `type`.
            self.api.patch(path("/api/v1/nodes", self.node_name, "status"), patch, STRATEGIC_MERGE_PATCH,
                           timeout=self.timeout)
