"""The simulated cluster's Kubernetes API server, in-process: what the sidecars' real clients
(`LeaseLedger`, `PodActions` and `KubeRestarter`, `NodeReporter`) send their requests to.

Each client gets its own `SimApi`, a `KubeApi` whose one transport method (`request`) is answered
here instead of over HTTP; everything above it is the production client. It answers as the API
server does where the rules depend on it: every write stamps a new `resourceVersion` and a stale one
is refused (409); `creationTimestamp` is the server's clock (whole seconds), never the writer's; an
object that is not there is a 404; an eviction is refused (429) where a PodDisruptionBudget would be
broken, and a dry run asks the same without acting; Events expire after `EVENT_TTL_S`; a write can
be refused (500) or applied with its answer lost (a timeout after the server acted).

The pods and the Deployment are the world's own (its controller's); this only renders them as the
API lists them, from the world's ground truth.
"""

from __future__ import annotations

import copy
import datetime as dt
import email.utils
import json
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any
from urllib.parse import unquote

from gpu_watchdog.watchdog.edge.kube.kube_api import JSON_TYPE, ApiError, KubeApi

if TYPE_CHECKING:
    from tests.sim.world import World

NODE_TAINT_KEY = "gpu-watchdog.io/gpu-suspect"  # as the chart's and the docs' name it: the invariants' spelling

NS = "sim"
WORKLOAD = "sim-model"
EVENT_TTL_S = 3600.0  # the API server's default `--event-ttl`
PAGE = 500  # the most items one LIST answers (then a continue token)


def stamp(at: float) -> str:
    """A `creationTimestamp`: RFC 3339, whole seconds, as the API server writes it."""
    return dt.datetime.fromtimestamp(int(at), dt.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


@dataclass
class Logged:
    """One request the server acted on (the ground truth the invariants read)."""

    at: float  # the server's time
    caller: str
    method: str
    path: str
    status: int


@dataclass(frozen=True)
class NodeWrite:
    """One write of a node's taints the server applied."""

    at: float
    caller: str
    node: str
    before: tuple[dict[str, Any], ...]
    after: tuple[dict[str, Any], ...]
    owner: str | None  # the writer's workload's `<owner>` (None: an operator's)
    held: int  # the nodes holding an entry of that owner in force, once it was written
    scope: int  # the nodes the writer's workload ran on then


@dataclass
class Cluster:
    """The API server's store and its log. `faults(caller, method, path)` says what happens to a
    request: None (answered), "refused" (500, nothing done), "lost" (done, its answer lost) or
    "raced" (another writer's write to the same object lands first: a stale write is a 409)."""

    world: World
    version: int = 1
    leases: dict[str, dict[str, Any]] = field(default_factory=dict)
    events: list[dict[str, Any]] = field(default_factory=list)
    posted: list[dict[str, Any]] = field(default_factory=list)  # every Event ever written, expired ones too
    log: list[Logged] = field(default_factory=list)
    faults: Callable[[str, str, str], str | None] = lambda caller, method, path: None
    # A PodDisruptionBudget on the workload's pods: at most this many of the desired may be unready
    # for an eviction to be allowed (None: there is none, every eviction is allowed).
    pdb_max_unavailable: int | None = None
    evicted: Callable[[str, str], None] = lambda pod, caller: None  # the world removes it
    # The nodes, each with its taints, and every write of a node's taints the server applied (the ground
    # truth I9 reads: who changed which taints, from what to what, at which server time).
    nodes: dict[str, dict[str, Any]] = field(default_factory=dict)
    node_writes: list[NodeWrite] = field(default_factory=list)
    # Other workloads' pods and Deployments (their placement's scope): name -> (node, app label).
    others: dict[str, tuple[str, str]] = field(default_factory=dict)

    def next_version(self) -> str:
        self.version += 1
        return str(self.version)

    def expire_events(self) -> None:
        now = self.world.now
        self.events = [e for e in self.events if now - e["_at"] < EVENT_TTL_S]

    # -- answers ---------------------------------------------------------------------------------

    def answer(self, caller: str, method: str, path: str, body: Any, query: Mapping[str, Any]) -> dict[str, Any]:
        parts = [unquote(p) for p in path.strip("/").split("/")]
        write = method != "GET"
        fault = self.faults(caller, method, path) if query.get("dryRun") is None else None
        if fault == "refused":
            raise api_error(500, "Internal Server Error", "etcdserver: request timed out")
        if fault == "raced" and parts[-1] in self.leases:
            self.leases[parts[-1]]["metadata"]["resourceVersion"] = self.next_version()
        answer = self._route(caller, method, parts, body, query)
        if write:
            self.log.append(Logged(self.world.now, caller, method, path, 200))
        if fault == "lost":
            raise TimeoutError(f"{method} {path}: no answer within the deadline")
        return answer

    def _route(self, caller: str, method: str, parts: list[str], body: Any, query: Mapping[str, Any]
               ) -> dict[str, Any]:
        if parts[:4] == ["apis", "coordination.k8s.io", "v1", "namespaces"] and parts[5:6] == ["leases"]:
            return self._lease(method, parts[6] if len(parts) > 6 else None, body)
        if parts[:4] == ["apis", "events.k8s.io", "v1", "namespaces"] and parts[5:6] == ["events"]:
            return self._events(method, parts[4], body, query)
        if parts[:4] == ["apis", "apps", "v1", "namespaces"] and len(parts) == 7:
            if parts[5] == "deployments" and method == "GET" and (
                    parts[6] == WORKLOAD or parts[6] in {app for _, app in self.others.values()}):
                return self._deployment(parts[6])
            raise api_error(404, "Not Found", f'{parts[5]}.apps "{parts[6]}" not found')
        if parts[:3] == ["api", "v1", "nodes"] and len(parts) == 4:
            return self._node(caller, method, parts[3], body)
        if parts[:2] == ["apis", "resource.k8s.io"] and len(parts) == 3:
            # Discovery: this cluster serves no DeviceTaintRule (device-plugin GPUs: node taints).
            raise api_error(404, "Not Found", "the server could not find the requested resource")
        if parts[:3] == ["api", "v1", "namespaces"] and parts[4:5] == ["pods"]:
            return self._pods(caller, method, parts[5] if len(parts) > 5 else None,
                              parts[6] if len(parts) > 6 else None, query)
        raise api_error(404, "Not Found", f"the server could not find the requested resource ({'/'.join(parts)})")

    def _lease(self, method: str, name: str | None, body: Any) -> dict[str, Any]:
        if method == "GET" and name is not None:
            found = self.leases.get(name)
            if found is None:
                raise api_error(404, "Not Found", f'leases.coordination.k8s.io "{name}" not found')
            return copy.deepcopy(found)
        if method == "POST" and name is None:
            meta = dict(body.get("metadata") or {})
            created = str(meta.get("name"))
            if created in self.leases:
                raise api_error(409, "Conflict", f'leases.coordination.k8s.io "{created}" already exists')
            meta.update(resourceVersion=self.next_version(), creationTimestamp=stamp(self.world.now))
            self.leases[created] = {**body, "metadata": meta}
            return copy.deepcopy(self.leases[created])
        if method == "PUT" and name is not None:
            found = self.leases.get(name)
            if found is None:
                raise api_error(404, "Not Found", f'leases.coordination.k8s.io "{name}" not found')
            meta = dict(body.get("metadata") or {})
            if meta.get("resourceVersion") != found["metadata"]["resourceVersion"]:
                raise api_error(409, "Conflict", "Operation cannot be fulfilled on leases.coordination.k8s.io"
                                f' "{name}": the object has been modified; please apply your changes to the latest'
                                " version and try again")
            meta.update(resourceVersion=self.next_version(),
                        creationTimestamp=found["metadata"]["creationTimestamp"])
            self.leases[name] = {**body, "metadata": meta}
            return copy.deepcopy(self.leases[name])
        if method == "DELETE" and name is not None:
            if self.leases.pop(name, None) is None:
                raise api_error(404, "Not Found", f'leases.coordination.k8s.io "{name}" not found')
            return {"kind": "Status", "status": "Success"}
        raise api_error(405, "Method Not Allowed", f"{method} leases")

    def _events(self, method: str, namespace: str, body: Any, query: Mapping[str, Any]) -> dict[str, Any]:
        self.expire_events()
        if method == "POST":
            meta = dict(body.get("metadata") or {})
            meta.update(namespace=namespace, resourceVersion=self.next_version(),
                        creationTimestamp=stamp(self.world.now))
            self.events.append({**body, "metadata": meta, "_at": self.world.now})
            self.posted.append(self.events[-1])
            return {k: v for k, v in self.events[-1].items() if k != "_at"}
        if method == "GET":
            mine = [e for e in self.events if e["metadata"]["namespace"] == namespace]
            start = int(query.get("continue") or 0)
            limit = int(query.get("limit") or PAGE)
            page = [{k: v for k, v in e.items() if k != "_at"} for e in mine[start:start + limit]]
            more = start + limit < len(mine)
            return {"kind": "EventList", "items": page,
                    "metadata": {"continue": str(start + limit)} if more else {}}
        raise api_error(405, "Method Not Allowed", f"{method} events")

    def _deployment(self, name: str = WORKLOAD) -> dict[str, Any]:
        w = self.world
        replicas = w.desired if name == WORKLOAD else sum(1 for _, app in self.others.values() if app == name)
        return {"kind": "Deployment", "metadata": {"name": name, "namespace": NS},
                "spec": {"replicas": replicas, "selector": {"matchLabels": {"app": name}}}}

    def add_node(self, name: str, taints: list[dict[str, Any]]) -> None:
        if name not in self.nodes:
            self.nodes[name] = {"kind": "Node", "metadata": {"name": name, "resourceVersion": self.next_version()},
                                "spec": {"taints": taints}}

    def _node(self, caller: str, method: str, name: str, body: Any) -> dict[str, Any]:
        found = self.nodes.get(name)
        if found is None:
            raise api_error(404, "Not Found", f'nodes "{name}" not found')
        if method == "GET":
            return copy.deepcopy(found)
        if method == "PATCH":
            meta = (body or {}).get("metadata") or {}
            # A merge patch that names a resourceVersion is a compare-and-swap (409 on a stale one).
            stale = meta.get("resourceVersion") not in (None, found["metadata"]["resourceVersion"])
            if stale:
                raise api_error(409, "Conflict", f'Operation cannot be fulfilled on nodes "{name}": the object has'
                                " been modified; please apply your changes to the latest version and try again")
            spec = (body or {}).get("spec") or {}
            if "taints" in spec:
                before = tuple(copy.deepcopy(found["spec"].get("taints") or []))
                found["spec"]["taints"] = list(spec["taints"] or [])
                owner = self.world.owner(caller)
                held = sum(1 for node in self.nodes.values() if any(
                    owner is not None and taint_entries(t).get(owner, 0) > self.world.now
                    for t in node["spec"].get("taints") or [] if t.get("key") == NODE_TAINT_KEY))
                self.node_writes.append(NodeWrite(self.world.now, caller, name, before,
                                                  tuple(copy.deepcopy(found["spec"]["taints"])), owner, held,
                                                  self.world.scope(caller)))
            found["metadata"]["resourceVersion"] = self.next_version()
            return copy.deepcopy(found)
        raise api_error(405, "Method Not Allowed", f"{method} nodes")

    def _pods(self, caller: str, method: str, name: str | None, sub: str | None,
              query: Mapping[str, Any]) -> dict[str, Any]:
        w = self.world
        if name is None and method == "GET":
            wanted = dict(t.split("=", 1) for t in str(query.get("labelSelector") or "").split(",") if "=" in t)
            items = [self.pod_json(p.name) for p in w.alive()] + [self.other_json(n) for n in self.others]
            return {"kind": "PodList",
                    "items": [i for i in items if all(i["metadata"]["labels"].get(k) == v for k, v in wanted.items())]}
        if name in self.others and method == "GET" and sub is None:
            return self.other_json(name)
        pod = w.pods.get(name or "")
        if pod is None or not pod.alive or name is None:
            raise api_error(404, "Not Found", f'pods "{name}" not found')
        if method == "GET" and sub is None:
            return self.pod_json(name)
        dry = query.get("dryRun") is not None
        if method == "POST" and sub == "eviction":
            if not self.disruption_allowed(name):
                raise api_error(429, "Too Many Requests", "Cannot evict pod as it would violate the pod's disruption"
                             " budget.")
            if not dry:
                self.evicted(name, caller)
            return {"kind": "Status", "status": "Success"}
        if method == "DELETE" and sub is None:
            if not dry:
                self.evicted(name, caller)
            return {"kind": "Status", "status": "Success"}
        raise api_error(405, "Method Not Allowed", f"{method} pods/{sub}")

    def disruption_allowed(self, name: str) -> bool:
        """As the disruption controller counts: the pods Ready now, less this one if it is, against the
        desired replicas less the budget's `maxUnavailable`."""
        if self.pdb_max_unavailable is None:
            return True
        w = self.world
        healthy = sum(1 for p in w.alive() if w.ready(p))
        return healthy - (w.desired - self.pdb_max_unavailable) > 0 or not w.ready(w.pods[name])

    def pod_json(self, name: str) -> dict[str, Any]:
        w = self.world
        p = w.pods[name]
        return {"kind": "Pod",
                "metadata": {"name": p.name, "namespace": NS, "creationTimestamp": stamp(p.created_at),
                             "labels": {"app": WORKLOAD, "pod-template-hash": p.template},
                             "ownerReferences": [{"kind": "ReplicaSet", "name": f"{WORKLOAD}-{p.template}",
                                                  "controller": True}]},
                "spec": {"nodeName": p.node},
                "status": {"conditions": [{"type": "Ready", "status": "True" if w.ready(p) else "False"}]}}


    def other_json(self, name: str) -> dict[str, Any]:
        node, app = self.others[name]
        return {"kind": "Pod", "metadata": {"name": name, "namespace": NS, "labels": {"app": app}},
                "spec": {"nodeName": node}, "status": {"conditions": [{"type": "Ready", "status": "True"}]}}


def taint_entries(taint: Mapping[str, Any]) -> dict[str, int]:
    """A gpu-watchdog node taint's entries as its value spells them (`<owner>-<expiry>`, dot-separated),
    read here on their own: the checker does not trust the parser it checks."""
    out: dict[str, int] = {}
    for part in str(taint.get("value") or "").split("."):
        owner, _, until = part.partition("-")
        if until.isdigit():
            out[owner] = max(out.get(owner, 0), int(until))
    return out


def api_error(status: int, reason: str, message: str) -> ApiError:
    return ApiError(status, reason, json.dumps({"kind": "Status", "status": "Failure", "message": message,
                                                "code": status}))


class SimApi(KubeApi):
    """One client's connection to the simulated API server: `caller` is its identity (its pod's
    service account, or an operator), `wall_clock` its node's clock. Each answer carries the server's
    `Date`, as a real one does, which the client learns the server's clock from (`KubeApi.now`)."""

    def __init__(self, cluster: Cluster, caller: str, wall_clock: Callable[[], float]) -> None:
        # No pool, no TLS: nothing leaves the process.
        self.server = "https://sim.invalid"
        self.timeout = 5.0
        self._token = None
        self._token_file = None
        self.wall_clock = wall_clock
        self.clock_offset = 0.0
        self.cluster = cluster
        self.caller = caller

    def request(self, method: str, path: str, body: Any = None, query: Mapping[str, Any] | None = None,
                content_type: str = JSON_TYPE, timeout: float | None = None,
                parse: bool = True) -> dict[str, Any] | None:
        # Through JSON both ways, as on the wire: nothing a client holds is shared with the store.
        sent = None if body is None else json.loads(json.dumps(body))
        try:
            answer = self.cluster.answer(self.caller, method, path.split("?", 1)[0], sent,
                                         {k: v for k, v in (query or {}).items() if v is not None})
        except ApiError:
            self.learn_time(email.utils.formatdate(self.cluster.world.now, usegmt=True))
            raise
        self.learn_time(email.utils.formatdate(self.cluster.world.now, usegmt=True))
        return json.loads(json.dumps(answer)) if parse else None
