"""kmock's Kubernetes emulator, extended where the fleet tests need what a real API server does.

kmock 0.8 keeps objects, but without `resourceVersion`, `uid` or `creationTimestamp`, has no PUT,
and records a write before any reaction sees it (a `DELETE ?dryRun=All` deletes; a second POST of an
object answers its own "Object Already Exists"). The sidecars coordinate through optimistic
concurrency, so this emulator serves Pods, Leases and the workload controllers itself:

- one cluster-wide resourceVersion, an increasing integer as a string (etcd's revision), bumped
  by every write and stamped on the written object;
- Leases: GET, LIST, POST (409 AlreadyExists), PUT (404 when missing; 409 Conflict unless the body
  carries the current resourceVersion: Leases allow no unconditional update), DELETE;
- Deployments, ReplicaSets, StatefulSets: GET and LIST, with a live `status` counted from the pods;
- Pods: GET, LIST (label selectors), POST, DELETE and POST `.../eviction`, both honouring `dryRun=All`
  (answered as if done, nothing changed) and evictions honouring PodDisruptionBudgets
  (`min_available` over the Ready pods its selector picks: 429 where an eviction would go below);
- errors as the API server shapes them: `kind: Status`, `status: Failure`, `reason`, `code`, `details`;
- a record of every write (`writes`) and hooks the harness's controller and kubelet hang on
  (`on_pod_removed`).

It is kmock underneath: everything else (Events, discovery) is kmock's, and a test's own reactions
(`kmock[...] << 500`) still answer before these routes, so faults can be injected as usual.
Use it through the `kmock` fixture under `tests/fleet/` (its conftest selects this class), or
standalone: `async with Cluster() as api, kmock.Server(api): ...`.
"""

from __future__ import annotations

import copy
import datetime as dt
import re
import time
import uuid
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import aiohttp.web
import attrs
import kmock

JSON = dict[str, Any]

# plural -> (group, version, kind); the group and version are those the routes are served at.
KINDS: dict[str, tuple[str, str, str]] = {
    "pods": ("", "v1", "Pod"),
    "leases": ("coordination.k8s.io", "v1", "Lease"),
    "deployments": ("apps", "v1", "Deployment"),
    "replicasets": ("apps", "v1", "ReplicaSet"),
    "statefulsets": ("apps", "v1", "StatefulSet"),
}
PLURALS = {kind: plural for plural, (_, _, kind) in KINDS.items()}
WORKLOADS = ("deployments", "replicasets", "statefulsets")

# The API server's own words (k8s.io/apiserver registry/generic/registry/store.go).
OPTIMISTIC_LOCK = "the object has been modified; please apply your changes to the latest version and try again"
PDB_REFUSAL = "Cannot evict pod as it would violate the pod's disruption budget."


def qualified(plural: str) -> str:
    """`pods`, `leases.coordination.k8s.io`: how the API server names a resource in its errors."""
    group = KINDS[plural][0] if plural in KINDS else ""
    return f"{plural}.{group}" if group else plural


def failure(code: int, reason: str, message: str, details: JSON | None = None) -> JSON:
    """A `Status` as the API server answers an error with."""
    out: JSON = {"kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Failure", "message": message,
                 "reason": reason, "code": code}
    if details is not None:
        out["details"] = details
    return out


def _details(plural: str, name: str) -> JSON:
    group = KINDS[plural][0] if plural in KINDS else ""
    return {"name": name, **({"group": group} if group else {}), "kind": plural}


def not_found(plural: str, name: str) -> JSON:
    return failure(404, "NotFound", f'{qualified(plural)} "{name}" not found', _details(plural, name))


def already_exists(plural: str, name: str) -> JSON:
    return failure(409, "AlreadyExists", f'{qualified(plural)} "{name}" already exists', _details(plural, name))


def conflict(plural: str, name: str, why: str = OPTIMISTIC_LOCK) -> JSON:
    return failure(409, "Conflict", f'Operation cannot be fulfilled on {qualified(plural)} "{name}": {why}',
                   _details(plural, name))


def bad_request(message: str) -> JSON:
    return failure(400, "BadRequest", message)


def invalid(plural: str, name: str, message: str) -> JSON:
    return failure(422, "Invalid", f'{KINDS[plural][2]} "{name}" is invalid: {message}', _details(plural, name))


def method_not_allowed(method: str, path: str) -> JSON:
    return failure(405, "MethodNotAllowed", f"the server does not allow this method on the requested resource"
                                            f" ({method} {path}; this emulator serves only what the fleet tests use)")


def is_dry_run(params: dict[str, str], body: Any) -> bool:
    """`?dryRun=All`, or `dryRun: [All]` in DeleteOptions (top level or an Eviction's `deleteOptions`)."""
    if params.get("dryRun") == "All":
        return True
    if isinstance(body, dict):
        for options in (body, body.get("deleteOptions") or {}):
            if isinstance(options, dict) and "All" in (options.get("dryRun") or []):
                return True
    return False


def pod_ready(pod: JSON) -> bool:
    """Counted as healthy by a disruption budget: Running, not terminating, its Ready condition True."""
    status = pod.get("status") or {}
    if status.get("phase") != "Running" or (pod.get("metadata") or {}).get("deletionTimestamp"):
        return False
    return any(c.get("type") == "Ready" and c.get("status") == "True" for c in status.get("conditions") or [])


# --- label selectors (the equality- and set-based grammar of `?labelSelector=`) ---------------------------

_SET_TERM = re.compile(r"^\s*([^\s!=]+)\s+(in|notin)\s+\(([^)]*)\)\s*$")


def _split_terms(selector: str) -> list[str]:
    terms, depth, current = [], 0, ""
    for ch in selector:
        depth += ch == "("
        depth -= ch == ")"
        if ch == "," and depth == 0:
            terms.append(current)
            current = ""
        else:
            current += ch
    terms.append(current)
    return [t.strip() for t in terms if t.strip()]


@dataclass(frozen=True)
class _Term:
    key: str
    op: str  # in | notin | exists | missing
    values: frozenset[str] = frozenset()

    def __call__(self, labels: dict[str, str]) -> bool:
        if self.op == "exists":
            return self.key in labels
        if self.op == "missing":
            return self.key not in labels
        return (labels.get(self.key) in self.values) == (self.op == "in")


def parse_selector(selector: str) -> Callable[[dict[str, str]], bool]:
    """A predicate over labels for `k=v`, `k==v`, `k!=v`, `k`, `!k`, `k in (a,b)`, `k notin (a,b)`."""
    terms: list[_Term] = []
    for term in _split_terms(selector):
        if m := _SET_TERM.match(term):
            values = frozenset(v.strip() for v in m.group(3).split(",") if v.strip())
            terms.append(_Term(m.group(1), m.group(2), values))
        elif "!=" in term:
            key, value = (p.strip() for p in term.split("!=", 1))
            terms.append(_Term(key, "notin", frozenset({value})))
        elif "=" in term:
            key, value = (p.strip() for p in term.replace("==", "=").split("=", 1))
            terms.append(_Term(key, "in", frozenset({value})))
        elif term.startswith("!"):
            terms.append(_Term(term[1:].strip(), "missing"))
        else:
            terms.append(_Term(term, "exists"))
    return lambda labels: all(t(labels) for t in terms)


def matches(selector: dict[str, Any], labels: dict[str, str]) -> bool:
    """A LabelSelector object (`matchLabels` and `matchExpressions`) over labels."""
    for key, value in (selector.get("matchLabels") or {}).items():
        if labels.get(key) != value:
            return False
    for expr in selector.get("matchExpressions") or []:
        key, op, values = expr["key"], expr["operator"], set(expr.get("values") or [])
        ok = {"In": labels.get(key) in values, "NotIn": labels.get(key) not in values,
              "Exists": key in labels, "DoesNotExist": key not in labels}.get(op)
        if not ok:
            return False
    return True


# --- what happened ------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Write:
    """One write the API answered. `sent_version`: the body's `metadata.resourceVersion` (a replace's
    precondition); `version`: the object's resourceVersion after it (None unless it was stored)."""

    at: float
    verb: str  # create | replace | delete | evict
    resource: str  # plural: leases, pods, ...
    namespace: str
    name: str
    code: int
    dry_run: bool = False
    sent_version: str | None = None
    version: str | None = None
    body: JSON | None = None  # the stored object after a stored write; what was sent otherwise
    reason: str | None = None  # the Status reason of a refusal

    @property
    def ok(self) -> bool:
        return 200 <= self.code < 300


@dataclass(frozen=True)
class PodRemoval:
    """A pod really gone (a real delete or eviction): what the ReplicaSet controller and kubelet act on."""

    at: float
    namespace: str
    name: str
    how: str  # delete | evict
    pod: JSON
    grace_period: int | None = None


@dataclass
class DisruptionBudget:
    name: str
    namespace: str
    selector: JSON  # a LabelSelector: {"matchLabels": {...}}
    min_available: int


# --- the emulator -----------------------------------------------------------------------------------------------

def _now_rfc3339(wall: Callable[[], dt.datetime]) -> str:
    return wall().astimezone(dt.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def _wall() -> dt.datetime:
    return dt.datetime.now(dt.UTC)


@attrs.define(kw_only=True)
class Cluster(kmock.KubernetesEmulator):
    """The API server of the fleet tests (see the module's doc). `clock` stamps `writes`; `wall` the
    objects' timestamps."""

    clock: Callable[[], float] = time.monotonic
    wall: Callable[[], dt.datetime] = _wall
    _store: dict[tuple[str, str, str], JSON] = attrs.field(factory=dict, init=False)
    _revision: int = attrs.field(default=1000, init=False)
    writes: list[Write] = attrs.field(factory=list, init=False)
    budgets: dict[tuple[str, str], DisruptionBudget] = attrs.field(factory=dict, init=False)
    _removal_hooks: list[Callable[[PodRemoval], None]] = attrs.field(factory=list, init=False)
    _write_hooks: list[Callable[[Write], None]] = attrs.field(factory=list, init=False)

    def __attrs_post_init__(self) -> None:
        super().__attrs_post_init__()
        # Below a test's own reactions (priority 0), above kmock's fallbacks (-inf).
        (self ** -1)[self._owns] << self._serve
        for plural, (group, version, kind) in KINDS.items():
            self.resources[f"{group}/{version}/{plural}" if group else f"{version}/{plural}"] = kmock.ResourceInfo(
                namespaced=True, kind=kind, verbs={"get", "list", "create", "update", "delete"},
                subresources={"eviction"} if plural == "pods" else set())
        # Events as kmock keeps them: an empty namespace lists as 200 with no items.
        self.resources["events.k8s.io/v1/events"] = kmock.ResourceInfo(
            namespaced=True, kind="Event", verbs={"create", "list", "get"})

    # --- routing -----------------------------------------------------------------------------------------------

    def _plural_of(self, request: kmock.Request) -> str | None:
        res = request.resource
        if res is None or res.plural not in KINDS:
            return None
        group, version, _ = KINDS[res.plural]
        return res.plural if (res.group, res.version) == (group, version) else None

    def _owns(self, request: kmock.Request) -> bool:
        return self._plural_of(request) is not None

    async def _handle(self, request: kmock.Request) -> aiohttp.web.StreamResponse:
        if self._owns(request):
            # Past kmock's own object bookkeeping, which would store or delete before any reaction
            # (dry runs included): these routes keep their own state with the real semantics.
            return await super(kmock.KubernetesEmulator, self)._handle(request)
        return await super()._handle(request)

    def _serve(self, request: kmock.Request) -> kmock.Response:
        # Synchronous from request to answer: one write is atomic against every other request.
        plural = self._plural_of(request)
        assert plural is not None
        method = str(request.method.value).upper()
        ns, name, sub = request.namespace or "", request.name, request.subresource
        params = dict(request.params)
        body = request.data
        if sub is not None:
            if plural == "pods" and sub == "eviction" and method == "POST" and name:
                return self._answer(self._evict(ns, name, params, body))
            return self._answer(method_not_allowed(method, request.url.path))
        if params.get("watch") in ("true", "1"):
            # Not emulated: better a clear refusal than a list where a stream of events was asked for.
            return self._answer(method_not_allowed(f"{method} ?watch", request.url.path))
        if name is None:
            if method == "GET":
                return self._answer(self._list(plural, ns, params))
            if method == "POST":
                return self._answer(self._create(plural, ns, params, body))
        elif method == "GET":
            found = self.read(plural, ns, name)
            return self._answer(found if found is not None else not_found(plural, name))
        elif method == "PUT" and plural == "leases":
            return self._answer(self._replace(plural, ns, name, params, body))
        elif method == "DELETE" and plural in ("pods", "leases"):
            return self._answer(self._delete(plural, ns, name, params, body))
        return self._answer(method_not_allowed(method, request.url.path))

    @staticmethod
    def _answer(answer: JSON | tuple[int, JSON]) -> kmock.Response:
        """An object (200), `(code, object)`, or a failure `Status` (its own code)."""
        if isinstance(answer, tuple):
            code, body = answer
        else:
            body = answer
            code = int(body["code"]) if body.get("kind") == "Status" and "code" in body else 200
        return kmock.Response(status=code, payload=body)

    # --- the verbs ---------------------------------------------------------------------------------------------

    def _bump(self) -> str:
        self._revision += 1
        return str(self._revision)

    def _record(self, **fields: Any) -> None:
        write = Write(at=self.clock(), **fields)
        self.writes.append(write)
        for hook in list(self._write_hooks):
            hook(write)

    def _list(self, plural: str, ns: str, params: dict[str, str]) -> JSON:
        select = parse_selector(params.get("labelSelector", ""))
        fields = parse_selector(params.get("fieldSelector", ""))
        items = [copy.deepcopy(self._with_status(plural, obj)) for (p, n, _), obj in self._store.items()
                 if p == plural and (not ns or n == ns) and select(obj["metadata"].get("labels") or {})
                 and fields(_field_values(obj))]
        group, version, kind = KINDS[plural]
        return {"apiVersion": f"{group}/{version}" if group else version, "kind": f"{kind}List",
                "metadata": {"resourceVersion": str(self._revision)}, "items": items}

    def _create(self, plural: str, ns: str, params: dict[str, str], body: Any) -> JSON | tuple[int, JSON]:
        if not isinstance(body, dict):
            return bad_request(f"the body of a {KINDS[plural][2]} create must be a JSON object")
        meta = body.get("metadata") or {}
        name = meta.get("name") or ""
        if not name and meta.get("generateName"):
            name = meta["generateName"] + uuid.uuid4().hex[:5]
        if not name:
            return invalid(plural, "", "metadata.name: Required value: name or generateName is required")
        if meta.get("namespace") not in (None, "", ns):
            return bad_request("the namespace of the provided object does not match the namespace sent on the request")
        dry = is_dry_run(params, body)
        if (plural, ns, name) in self._store:
            refusal = already_exists(plural, name)
            self._record(verb="create", resource=plural, namespace=ns, name=name, code=409, dry_run=dry,
                         sent_version=meta.get("resourceVersion"), body=copy.deepcopy(body), reason="AlreadyExists")
            return refusal
        obj = self._stamp(plural, ns, name, body, dry)
        if not dry:
            self._store[(plural, ns, name)] = obj
        self._record(verb="create", resource=plural, namespace=ns, name=name, code=201, dry_run=dry,
                     sent_version=meta.get("resourceVersion"), version=obj["metadata"]["resourceVersion"],
                     body=copy.deepcopy(obj))
        return 201, copy.deepcopy(obj)

    def _stamp(self, plural: str, ns: str, name: str, body: JSON, dry: bool) -> JSON:
        group, version, kind = KINDS[plural]
        obj = copy.deepcopy(body)
        obj["apiVersion"] = f"{group}/{version}" if group else version
        obj["kind"] = kind
        meta = obj.setdefault("metadata", {})
        meta.update(name=name, namespace=ns, uid=str(uuid.uuid4()),
                    creationTimestamp=_now_rfc3339(self.wall),
                    resourceVersion=str(self._revision + 1) if dry else self._bump())
        if plural in WORKLOADS:
            meta.setdefault("generation", 1)
        return obj

    def _replace(self, plural: str, ns: str, name: str, params: dict[str, str], body: Any) -> JSON:
        if not isinstance(body, dict):
            return bad_request(f"the body of a {KINDS[plural][2]} replace must be a JSON object")
        meta = body.get("metadata") or {}
        sent = meta.get("resourceVersion")
        dry = is_dry_run(params, body)

        def refused(status: JSON) -> JSON:
            self._record(verb="replace", resource=plural, namespace=ns, name=name, code=int(status["code"]),
                         dry_run=dry, sent_version=sent, body=copy.deepcopy(body), reason=status["reason"])
            return status

        if meta.get("name") not in (None, name):
            return refused(bad_request(f"the name of the object ({meta.get('name')}) does not match the name on"
                                       f" the URL ({name})"))
        if meta.get("namespace") not in (None, "", ns):
            return refused(bad_request("the namespace of the provided object does not match the namespace sent"
                                       " on the request"))
        current = self._store.get((plural, ns, name))
        if current is None:
            return refused(not_found(plural, name))
        # Leases allow no unconditional update: no resourceVersion is as stale as a wrong one.
        if sent != current["metadata"]["resourceVersion"]:
            return refused(conflict(plural, name))
        if meta.get("uid") not in (None, current["metadata"]["uid"]):
            return refused(conflict(plural, name, f"Precondition failed: UID in precondition: {meta.get('uid')},"
                                                  f" UID in object meta: {current['metadata']['uid']}"))
        obj = copy.deepcopy(body)
        group, version, kind = KINDS[plural]
        obj["apiVersion"], obj["kind"] = f"{group}/{version}" if group else version, kind
        new_meta = obj.setdefault("metadata", {})
        # What the server owns survives whatever the client sent.
        for key in ("name", "namespace", "uid", "creationTimestamp"):
            new_meta[key] = current["metadata"][key]
        new_meta["resourceVersion"] = str(self._revision + 1) if dry else self._bump()
        if not dry:
            self._store[(plural, ns, name)] = obj
        self._record(verb="replace", resource=plural, namespace=ns, name=name, code=200, dry_run=dry,
                     sent_version=sent, version=new_meta["resourceVersion"], body=copy.deepcopy(obj))
        return copy.deepcopy(obj)

    def _preconditions_fail(self, plural: str, name: str, obj: JSON, body: Any) -> JSON | None:
        pre = (body or {}).get("preconditions") if isinstance(body, dict) else None
        if not pre:
            return None
        meta = obj["metadata"]
        if pre.get("uid") not in (None, meta["uid"]):
            return conflict(plural, name, f"Precondition failed: UID in precondition: {pre['uid']},"
                                          f" UID in object meta: {meta['uid']}")
        if pre.get("resourceVersion") not in (None, meta["resourceVersion"]):
            return conflict(plural, name, f"Precondition failed: ResourceVersion in precondition:"
                                          f" {pre['resourceVersion']}, ResourceVersion in object meta:"
                                          f" {meta['resourceVersion']}")
        return None

    @staticmethod
    def _grace(params: dict[str, str], body: Any, pod: JSON) -> int | None:
        options = body if isinstance(body, dict) else {}
        options = options.get("deleteOptions") or options
        raw = params.get("gracePeriodSeconds", options.get("gracePeriodSeconds"))
        if raw is not None:
            return int(raw)
        spec_grace = (pod.get("spec") or {}).get("terminationGracePeriodSeconds")
        return int(spec_grace) if spec_grace is not None else (30 if "spec" in pod else None)

    def _delete(self, plural: str, ns: str, name: str, params: dict[str, str], body: Any) -> JSON:
        dry = is_dry_run(params, body)
        current = self._store.get((plural, ns, name))
        refusal = not_found(plural, name) if current is None else self._preconditions_fail(plural, name, current,
                                                                                            body)
        if refusal is not None:
            self._record(verb="delete", resource=plural, namespace=ns, name=name, code=int(refusal["code"]),
                         dry_run=dry, reason=refusal["reason"])
            return refusal
        assert current is not None
        grace = self._grace(params, body, current) if plural == "pods" else None
        gone = self._remove(plural, ns, name, dry, grace)
        self._record(verb="delete", resource=plural, namespace=ns, name=name, code=200, dry_run=dry,
                     version=None if dry else gone["metadata"]["resourceVersion"], body=copy.deepcopy(gone))
        if plural == "pods" and not dry:
            self._removed(gone, how="delete", grace=grace)
        return gone

    def _remove(self, plural: str, ns: str, name: str, dry: bool, grace: int | None = None) -> JSON:
        """The object as a delete answers it (marked for deletion); gone from the store unless `dry`.
        Gone at once: the kubelet here confirms a pod's end as soon as it is asked to stop it."""
        obj = copy.deepcopy(self._store[(plural, ns, name)])
        if plural == "pods":
            obj["metadata"]["deletionTimestamp"] = _now_rfc3339(self.wall)
            obj["metadata"]["deletionGracePeriodSeconds"] = grace if grace is not None else 30
        if dry:
            return obj
        obj["metadata"]["resourceVersion"] = self._bump()
        del self._store[(plural, ns, name)]
        return obj

    def _removed(self, pod: JSON, how: str, grace: int | None) -> None:
        meta = pod["metadata"]
        removal = PodRemoval(at=self.clock(), namespace=meta["namespace"], name=meta["name"], how=how,
                             pod=copy.deepcopy(pod), grace_period=grace)
        for hook in list(self._removal_hooks):
            hook(removal)

    def _evict(self, ns: str, name: str, params: dict[str, str], body: Any) -> JSON | tuple[int, JSON]:
        dry = is_dry_run(params, body)
        pod = self._store.get(("pods", ns, name))
        refusal = not_found("pods", name) if pod is None else self._budget_refusal(pod)
        if refusal is None and pod is not None:
            refusal = self._preconditions_fail("pods", name, pod, (body or {}).get("deleteOptions")
                                               if isinstance(body, dict) else None)
        if refusal is not None:
            self._record(verb="evict", resource="pods", namespace=ns, name=name, code=int(refusal["code"]),
                         dry_run=dry, reason=refusal["reason"])
            return refusal
        assert pod is not None
        grace = self._grace(params, body, pod)
        gone = self._remove("pods", ns, name, dry, grace)
        self._record(verb="evict", resource="pods", namespace=ns, name=name, code=201, dry_run=dry,
                     version=None if dry else gone["metadata"]["resourceVersion"], body=copy.deepcopy(gone))
        if not dry:
            self._removed(gone, how="evict", grace=grace)
        return 201, {"kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Success", "code": 201}

    def _budget_refusal(self, pod: JSON) -> JSON | None:
        """The eviction subresource's disruption-budget check (pkg/registry/core/pod/storage/eviction.go),
        with the default `unhealthyPodEvictionPolicy: IfHealthyBudget`."""
        meta, status = pod["metadata"], pod.get("status") or {}
        if status.get("phase") in ("Succeeded", "Failed", "Pending") or meta.get("deletionTimestamp"):
            return None  # nothing a budget protects
        labels = meta.get("labels") or {}
        budgets = [b for b in self.budgets.values() if b.namespace == meta["namespace"] and matches(b.selector, labels)]
        if not budgets:
            return None
        if len(budgets) > 1:
            return failure(500, "InternalError", "This pod has more than one PodDisruptionBudget, which the"
                                                 " eviction subresource does not support.")
        budget = budgets[0]
        healthy = sum(1 for (p, n, _), other in self._store.items()
                      if p == "pods" and n == budget.namespace and matches(budget.selector,
                                                                           other["metadata"].get("labels") or {})
                      and pod_ready(other))
        if pod_ready(pod):
            allowed = healthy - budget.min_available >= 1
        else:
            allowed = healthy >= budget.min_available  # an unready pod takes nothing from a healthy budget
        if allowed:
            return None
        return failure(429, "TooManyRequests", PDB_REFUSAL, {"causes": [{
            "reason": "DisruptionBudget",
            "message": f"The disruption budget {budget.name} needs {budget.min_available} healthy pods and has"
                       f" {healthy} currently"}]})

    def _with_status(self, plural: str, obj: JSON) -> JSON:
        """A workload's status, counted from its pods now (what its controller would have written)."""
        if plural not in WORKLOADS:
            return obj
        selector = (obj.get("spec") or {}).get("selector") or {}
        ns = obj["metadata"]["namespace"]
        pods = [p for (k, n, _), p in self._store.items()
                if k == "pods" and n == ns and selector and matches(selector, p["metadata"].get("labels") or {})]
        ready = sum(1 for p in pods if pod_ready(p))
        out = dict(obj)
        out["status"] = {**(obj.get("status") or {}), "observedGeneration": obj["metadata"].get("generation", 1),
                         "replicas": len(pods), "readyReplicas": ready, "availableReplicas": ready,
                         **({"updatedReplicas": len(pods)} if plural != "replicasets" else {}),
                         **({"unavailableReplicas": max(0, int(obj["spec"].get("replicas", 1)) - ready)}
                            if plural == "deployments" else {})}
        return out

    # --- the test's side ------------------------------------------------------------------------------------------

    @property
    def resource_version(self) -> str:
        """The cluster's current resourceVersion."""
        return str(self._revision)

    def add(self, obj: JSON) -> JSON:
        """Store an object as a POST would (uid, creationTimestamp, resourceVersion), unrecorded in
        `writes`: the cluster as it was before the test. Its kind says where it goes."""
        kind = obj.get("kind", "")
        if kind not in PLURALS:
            raise ValueError(f"cannot store a {kind!r}: this emulator keeps {', '.join(sorted(PLURALS))}")
        plural = PLURALS[kind]
        meta = obj.get("metadata") or {}
        ns, name = meta.get("namespace") or "", meta.get("name") or ""
        if not ns or not name:
            raise ValueError(f"a {kind} needs metadata.name and metadata.namespace, got {meta!r}")
        if (plural, ns, name) in self._store:
            raise ValueError(f"{qualified(plural)} {ns}/{name} already exists")
        stored = self._stamp(plural, ns, name, obj, dry=False)
        self._store[(plural, ns, name)] = stored
        return copy.deepcopy(stored)

    def read(self, plural: str, namespace: str, name: str) -> JSON | None:
        """A copy of the stored object (with a workload's live status), None when there is none."""
        found = self._store.get((plural, namespace, name))
        return copy.deepcopy(self._with_status(plural, found)) if found is not None else None

    def stored(self, plural: str, namespace: str | None = None) -> list[JSON]:
        """Copies of the stored objects of a resource (`kmock.objects` is kmock's own store: Events)."""
        return [copy.deepcopy(self._with_status(plural, o)) for (p, n, _), o in self._store.items()
                if p == plural and namespace in (None, n)]

    def lease(self, namespace: str, name: str) -> JSON | None:
        return self.read("leases", namespace, name)

    def pods(self, namespace: str, selector: str = "") -> list[JSON]:
        """The pods alive now, `selector` as `?labelSelector=` takes it."""
        select = parse_selector(selector)
        return [p for p in self.stored("pods", namespace) if select(p["metadata"].get("labels") or {})]

    def set_pod_ready(self, namespace: str, name: str, ready: bool) -> bool:
        """The kubelet's report of the pod's readiness probe; False when the pod is gone. A write (a new
        resourceVersion) only when the condition changes."""
        pod = self._store.get(("pods", namespace, name))
        if pod is None:
            return False
        status = pod.setdefault("status", {})
        conditions = status.setdefault("conditions", [])
        wanted = "True" if ready else "False"
        for c in conditions:
            if c.get("type") == "Ready":
                if c.get("status") == wanted:
                    return True
                c.update(status=wanted, lastTransitionTime=_now_rfc3339(self.wall))
                break
        else:
            conditions.append({"type": "Ready", "status": wanted, "lastTransitionTime": _now_rfc3339(self.wall)})
        for c in conditions:
            if c.get("type") == "ContainersReady":
                c.update(status=wanted)
        for cs in status.get("containerStatuses") or []:
            cs["ready"] = ready
        pod["metadata"]["resourceVersion"] = self._bump()
        return True

    def scale(self, namespace: str, name: str, replicas: int, plural: str = "deployments") -> None:
        """A new `spec.replicas` (as `kubectl scale` writes it; the controller's reaction is the harness's)."""
        obj = self._store.get((plural, namespace, name))
        if obj is None:
            raise KeyError(f"no {qualified(plural)} {namespace}/{name}")
        obj["spec"]["replicas"] = replicas
        obj["metadata"]["generation"] = int(obj["metadata"].get("generation", 1)) + 1
        obj["metadata"]["resourceVersion"] = self._bump()

    def set_disruption_budget(self, namespace: str, name: str, selector: dict[str, str],
                              min_available: int | None) -> None:
        """A PodDisruptionBudget `minAvailable` over the pods whose labels match `selector`; None removes it."""
        if min_available is None:
            self.budgets.pop((namespace, name), None)
        else:
            self.budgets[(namespace, name)] = DisruptionBudget(name, namespace, {"matchLabels": dict(selector)},
                                                               min_available)

    def on_pod_removed(self, hook: Callable[[PodRemoval], None]) -> Callable[[], None]:
        """Call `hook` (on the event loop, inside the request) for every pod really deleted or evicted;
        returns the function that unhooks it."""
        self._removal_hooks.append(hook)
        return lambda: self._removal_hooks.remove(hook) if hook in self._removal_hooks else None

    def on_write(self, hook: Callable[[Write], None]) -> Callable[[], None]:
        """Call `hook` for every write answered (refusals and dry runs too); returns the unhooking function."""
        self._write_hooks.append(hook)
        return lambda: self._write_hooks.remove(hook) if hook in self._write_hooks else None

    def writes_to(self, resource: str | None = None, name: str | None = None, verb: str | None = None,
                  dry_run: bool | None = None) -> list[Write]:
        """The recorded writes, filtered by what is given."""
        return [w for w in self.writes if resource in (None, w.resource) and name in (None, w.name)
                and verb in (None, w.verb) and dry_run in (None, w.dry_run)]


def _field_values(obj: JSON) -> dict[str, str]:
    """The fields a `?fieldSelector=` may name."""
    meta, spec, status = obj.get("metadata") or {}, obj.get("spec") or {}, obj.get("status") or {}
    out = {"metadata.name": meta.get("name", ""), "metadata.namespace": meta.get("namespace", "")}
    if obj.get("kind") == "Pod":
        out.update({"spec.nodeName": spec.get("nodeName", ""), "status.phase": status.get("phase", "")})
    return out


# --- objects as their controllers write them -------------------------------------------------------------------

def _container(name: str, image: str, port: int | None = None) -> JSON:
    out: JSON = {"name": name, "image": image, "imagePullPolicy": "IfNotPresent",
                 "terminationMessagePath": "/dev/termination-log", "terminationMessagePolicy": "File"}
    if port is not None:
        out["ports"] = [{"name": "http", "containerPort": port, "protocol": "TCP"}]
    return out


def pod_template(labels: dict[str, str]) -> JSON:
    return {"metadata": {"labels": dict(labels)},
            "spec": {"containers": [_container("inference", "gpu-watchdog-inference", 8000),
                                    _container("watchdog", "gpu-watchdog", 9402)],
                     "restartPolicy": "Always", "terminationGracePeriodSeconds": 30, "dnsPolicy": "ClusterFirst"}}


def deployment(name: str, namespace: str, replicas: int, labels: dict[str, str] | None = None) -> JSON:
    labels = labels or {"app": name}
    return {"apiVersion": "apps/v1", "kind": "Deployment",
            "metadata": {"name": name, "namespace": namespace, "labels": dict(labels)},
            "spec": {"replicas": replicas, "selector": {"matchLabels": dict(labels)}, "template": pod_template(labels),
                     "strategy": {"type": "RollingUpdate", "rollingUpdate": {"maxUnavailable": "25%",
                                                                             "maxSurge": "25%"}},
                     "revisionHistoryLimit": 10, "progressDeadlineSeconds": 600}}


def owner(obj: JSON) -> JSON:
    """An ownerReference to `obj` as its controller."""
    return {"apiVersion": obj["apiVersion"], "kind": obj["kind"], "name": obj["metadata"]["name"],
            "uid": obj["metadata"]["uid"], "controller": True, "blockOwnerDeletion": True}


def replica_set(deploy: JSON, template_hash: str) -> JSON:
    labels = {**deploy["spec"]["template"]["metadata"]["labels"], "pod-template-hash": template_hash}
    template = copy.deepcopy(deploy["spec"]["template"])
    template["metadata"]["labels"] = labels
    return {"apiVersion": "apps/v1", "kind": "ReplicaSet",
            "metadata": {"name": f"{deploy['metadata']['name']}-{template_hash}",
                         "namespace": deploy["metadata"]["namespace"], "labels": dict(labels),
                         "annotations": {"deployment.kubernetes.io/revision": "1"},
                         "ownerReferences": [owner(deploy)]},
            "spec": {"replicas": deploy["spec"]["replicas"],
                     "selector": {"matchLabels": {**deploy["spec"]["selector"]["matchLabels"],
                                                  "pod-template-hash": template_hash}},
                     "template": template}}


def statefulset(name: str, namespace: str, replicas: int, labels: dict[str, str] | None = None) -> JSON:
    labels = labels or {"app": name}
    return {"apiVersion": "apps/v1", "kind": "StatefulSet",
            "metadata": {"name": name, "namespace": namespace, "labels": dict(labels)},
            "spec": {"replicas": replicas, "serviceName": name, "selector": {"matchLabels": dict(labels)},
                     "template": pod_template(labels), "podManagementPolicy": "OrderedReady",
                     "updateStrategy": {"type": "RollingUpdate"}}}


def pod_of(rs: JSON, name: str, node: str, ready: bool, wall: Callable[[], dt.datetime] = _wall) -> JSON:
    """A pod as the ReplicaSet controller creates it and the kubelet reports it: scheduled on `node`,
    Running, its Ready condition `ready`."""
    template = copy.deepcopy(rs["spec"]["template"])
    stamp = _now_rfc3339(wall)
    flag = "True" if ready else "False"
    return {"apiVersion": "v1", "kind": "Pod",
            "metadata": {"name": name, "namespace": rs["metadata"]["namespace"],
                         "generateName": f"{rs['metadata']['name']}-", "labels": template["metadata"]["labels"],
                         "ownerReferences": [owner(rs)]},
            "spec": {**template["spec"], "nodeName": node, "serviceAccountName": "default"},
            "status": {"phase": "Running", "hostIP": "10.0.0.1", "podIP": "10.1.0.1", "startTime": stamp,
                       "qosClass": "BestEffort",
                       "conditions": [{"type": t, "status": "True" if t in ("PodScheduled", "Initialized") else flag,
                                       "lastTransitionTime": stamp}
                                      for t in ("PodScheduled", "Initialized", "ContainersReady", "Ready")],
                       "containerStatuses": [{"name": c["name"], "image": c["image"], "imageID": "",
                                              "ready": ready, "restartCount": 0, "started": True,
                                              "state": {"running": {"startedAt": stamp}}}
                                             for c in template["spec"]["containers"]]}}


def names_of(objs: Iterable[JSON]) -> list[str]:
    return [o["metadata"]["name"] for o in objs]
