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
- Nodes (cluster-scoped): GET, LIST, PATCH, and GET / PATCH of `nodes/status`. Merge patches
  (RFC 7386: a list is replaced whole) and strategic merge patches (`status.conditions` and
  `status.addresses` merged by `type`, other lists replaced); a patch carrying a
  `metadata.resourceVersion` other than the current one is a 409 Conflict (the optimistic lock the
  sidecar's read-modify-patch of `spec.taints` relies on); the main resource keeps `status`, the
  status subresource keeps `spec`; taints validated as the API server does (422 Invalid); a patch
  that changes nothing is no write (no new resourceVersion), as in the API server;
- `resource.k8s.io` (Dynamic Resource Allocation) as the Kubernetes version `kube_version` serves it
  (`DRA_SERVED`): the group's discovery (`/apis/resource.k8s.io`, `/apis/resource.k8s.io/{v}`, 404 for
  a version not served, and the group's entry in `/apis`), and DeviceTaintRules (also PATCH, merge or
  strategic, validated as a create) and ResourceSlices
  (cluster-scoped) and ResourceClaims (namespaced): GET, LIST (label selectors), POST (409
  AlreadyExists), DELETE (404 when missing), at every version that serves the resource. An object is
  stored once and read at any version serving it with `apiVersion` rewritten (the schemas are not
  converted: the fields the tests use are alike at v1alpha3, v1beta1, v1beta2 and v1); a
  DeviceTaintRule is validated (name, taint key, value, effect) and gets `spec.taint.timeAdded`;
- errors as the API server shapes them: `kind: Status`, `status: Failure`, `reason`, `code`, `details`;
- a record of every write (`writes`) and hooks the harness's controller and kubelet hang on
  (`on_pod_removed`, `on_write`); the test's side writes without a record (`add`, `mutate`, `remove`,
  `set_pod_ready`, `set_pod_status`, `set_node_taints`): the kubelet's and the controllers' writes.

It is kmock underneath: everything else (Events, discovery of the other groups) is kmock's, and a
test's own reactions (`kmock[...] << 500`) still answer before these routes, so faults can be injected
as usual. Use it through the `kmock` fixture under `tests/fleet/` (its conftest selects this class;
`@pytest.mark.kmock(kube_version="1.33")` picks a version), or standalone:
`async with Cluster() as api, kmock.Server(api): ...`.
"""

from __future__ import annotations

import copy
import datetime as dt
import json
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

DRA_GROUP = "resource.k8s.io"

# plural -> (group, version, kind); the group and version are those the routes are served at (for
# resource.k8s.io: the version an object added without one is stored at; any served version reads it).
KINDS: dict[str, tuple[str, str, str]] = {
    "pods": ("", "v1", "Pod"),
    "nodes": ("", "v1", "Node"),
    "leases": ("coordination.k8s.io", "v1", "Lease"),
    "deployments": ("apps", "v1", "Deployment"),
    "replicasets": ("apps", "v1", "ReplicaSet"),
    "statefulsets": ("apps", "v1", "StatefulSet"),
    "devicetaintrules": (DRA_GROUP, "v1", "DeviceTaintRule"),
    "resourceclaims": (DRA_GROUP, "v1", "ResourceClaim"),
    "resourceslices": (DRA_GROUP, "v1", "ResourceSlice"),
}
PLURALS = {kind: plural for plural, (_, _, kind) in KINDS.items()}
WORKLOADS = ("deployments", "replicasets", "statefulsets")
CLUSTER_SCOPED = frozenset({"nodes", "devicetaintrules", "resourceslices"})
DRA_PLURALS = frozenset(p for p, (group, _, _) in KINDS.items() if group == DRA_GROUP)
# Created through the API (nodes are the scheduler's and the test's: `add`); deleted through the API.
CREATABLE = frozenset(KINDS) - {"nodes"}
DELETABLE = frozenset({"pods", "leases"}) | DRA_PLURALS

# Which resource.k8s.io versions a Kubernetes release serves, its preferred version first, and which of
# the resources emulated here each serves (DeviceClasses, ResourceClaimTemplates and the rest are not
# emulated, so not listed). DeviceTaintRule: alpha (v1alpha3) from 1.33, beta (v1beta2) in 1.36, GA (v1)
# in 1.37. Since 1.33 v1alpha3 serves DeviceTaintRules only: the claims and slices moved to v1beta1 in
# 1.32, v1beta2 in 1.33 and v1 in 1.34 (the kubernetes client 37.x has no V1alpha3ResourceClaim either).
_ALLOCATION = frozenset({"resourceclaims", "resourceslices"})
_TAINTS = frozenset({"devicetaintrules"})
DRA_SERVED: dict[str, dict[str, frozenset[str]]] = {
    "1.33": {"v1beta2": _ALLOCATION, "v1beta1": _ALLOCATION, "v1alpha3": _TAINTS},
    "1.34": {"v1": _ALLOCATION, "v1beta2": _ALLOCATION, "v1beta1": _ALLOCATION, "v1alpha3": _TAINTS},
    "1.35": {"v1": _ALLOCATION, "v1beta2": _ALLOCATION, "v1beta1": _ALLOCATION, "v1alpha3": _TAINTS},
    "1.36": {"v1": _ALLOCATION, "v1beta2": _ALLOCATION | _TAINTS, "v1alpha3": _TAINTS},
    "1.37": {"v1": _ALLOCATION | _TAINTS, "v1beta2": _ALLOCATION | _TAINTS},
}
KUBE_VERSIONS = tuple(DRA_SERVED)
# The verbs this emulator serves for each resource.k8s.io resource (what its discovery lists).
DRA_VERBS = ("create", "delete", "get", "list")

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


def invalid_fields(plural: str, name: str, errors: list[str]) -> JSON:
    """A 422 for field errors, worded as the API server aggregates them (one, or `[a, b]`)."""
    out = invalid(plural, name, errors[0] if len(errors) == 1 else f"[{', '.join(errors)}]")
    out["details"]["causes"] = [{"reason": "FieldValueInvalid", "message": e} for e in errors]
    return out


def method_not_allowed(method: str, path: str) -> JSON:
    return failure(405, "MethodNotAllowed", f"the server does not allow this method on the requested resource"
                                            f" ({method} {path}; this emulator serves only what the fleet tests use)")


def not_served() -> JSON:
    """A path no served group, version or resource answers (k8s.io/apiserver's notfoundhandler)."""
    return failure(404, "NotFound", "the server could not find the requested resource", {})


def unsupported_media_type(content_type: str) -> JSON:
    return failure(415, "UnsupportedMediaType", f"the body of the request was in an unknown format: {content_type}"
                                                f" (this emulator applies merge and strategic merge patches)")


def success(plural: str, name: str, uid: str) -> JSON:
    """What a DELETE answers for a resource whose store does not return the deleted object."""
    return {"kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Success",
            "details": {**_details(plural, name), "uid": uid}}


# --- validation, in the API server's words (k8s.io/apimachinery/pkg/util/validation) ---------------------------

_DNS_LABEL = r"[a-z0-9]([-a-z0-9]*[a-z0-9])?"
_DNS_SUBDOMAIN = re.compile(rf"^{_DNS_LABEL}(\.{_DNS_LABEL})*$")
_QUALIFIED_NAME = re.compile(r"^([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9]$")
_LABEL_VALUE = re.compile(r"^(([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9])?$")
NODE_TAINT_EFFECTS = ("NoSchedule", "PreferNoSchedule", "NoExecute")


def dns_subdomain_errors(value: str) -> list[str]:
    out = []
    if len(value) > 253:
        out.append("must be no more than 253 characters")
    if not _DNS_SUBDOMAIN.match(value):
        out.append("a lowercase RFC 1123 subdomain must consist of lower case alphanumeric characters, '-' or '.',"
                   " and must start and end with an alphanumeric character (e.g. 'example.com', regex used for"
                   " validation is '[a-z0-9]([-a-z0-9]*[a-z0-9])?(\\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*')")
    return out


def qualified_name_errors(value: str) -> list[str]:
    """A label or taint key: an optional DNS-subdomain prefix and `/`, and a name of at most 63 characters."""
    prefix, _, name = value.rpartition("/")
    out = []
    if "/" in value and not prefix:
        out.append("prefix part must be non-empty")
    elif prefix:
        out += [f"prefix part {e}" for e in dns_subdomain_errors(prefix)]
    if not name:
        out.append("name part must be non-empty")
    elif len(name) > 63:
        out.append("name part must be no more than 63 characters")
    if name and not _QUALIFIED_NAME.match(name):
        out.append("name part must consist of alphanumeric characters, '-', '_' or '.', and must start and end with"
                   " an alphanumeric character (e.g. 'MyName',  or 'my.name',  or '123-abc', regex used for"
                   " validation is '([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9]')")
    return out


def label_value_errors(value: str) -> list[str]:
    out = []
    if len(value) > 63:
        out.append("must be no more than 63 characters")
    if not _LABEL_VALUE.match(value):
        out.append("a valid label must be an empty string or consist of alphanumeric characters, '-', '_' or '.',"
                   " and must start and end with an alphanumeric character (e.g. 'MyValue',  or 'my_value',  or"
                   " '12345', regex used for validation is '(([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9])?')")
    return out


def _field_errors(path: str, value: Any, errors: list[str]) -> list[str]:
    return [f"{path}: Invalid value: {json.dumps(value)}: {e}" for e in errors]


def taint_errors(path: str, taint: Any, effects: tuple[str, ...]) -> list[str]:
    """A node's or a device's taint (pkg/apis/core/validation validateTaints, resource validateDeviceTaint)."""
    if not isinstance(taint, dict):
        return [f"{path}: Invalid value: {json.dumps(taint)}: must be an object"]
    out = []
    key, value, effect = taint.get("key"), taint.get("value", ""), taint.get("effect")
    if not key:
        out.append(f"{path}.key: Required value")
    else:
        out += _field_errors(f"{path}.key", key, qualified_name_errors(str(key)))
    out += _field_errors(f"{path}.value", value, label_value_errors(str(value or "")))
    if not effect:
        out.append(f"{path}.effect: Required value")
    elif effect not in effects:
        supported = ", ".join(json.dumps(e) for e in effects)
        out.append(f"{path}.effect: Unsupported value: {json.dumps(effect)}: supported values: {supported}")
    return out


def node_taints_errors(taints: Any) -> list[str]:
    if taints is None:
        return []
    if not isinstance(taints, list):
        return [f"spec.taints: Invalid value: {json.dumps(taints)}: must be a list"]
    out, seen = [], set()
    for i, taint in enumerate(taints):
        out += taint_errors(f"spec.taints[{i}]", taint, NODE_TAINT_EFFECTS)
        if isinstance(taint, dict):
            pair = (taint.get("key"), taint.get("effect"))
            if pair in seen:
                out.append(f"spec.taints[{i}]: Duplicate value: {json.dumps(f'{pair[0]}:{pair[1]}')}: taints must be"
                           f" unique by key and effect pair")
            seen.add(pair)
    return out


def metadata_errors(meta: JSON) -> list[str]:
    out = _field_errors("metadata.name", meta.get("name", ""), dns_subdomain_errors(str(meta.get("name", ""))))
    for key, value in (meta.get("labels") or {}).items():
        out += _field_errors("metadata.labels", key, qualified_name_errors(str(key)))
        out += _field_errors(f"metadata.labels[{key}]", value, label_value_errors(str(value)))
    for key in meta.get("annotations") or {}:
        out += _field_errors("metadata.annotations", key, [e.lower() for e in qualified_name_errors(str(key))])
    return out


# --- patches -----------------------------------------------------------------------------------------------------

MERGE_PATCH = "application/merge-patch+json"
STRATEGIC_MERGE_PATCH = "application/strategic-merge-patch+json"
# The lists a strategic merge patch merges element by element (`patchMergeKey` in k8s.io/api core/v1
# types.go), by the path of keys down to them; every other list is replaced whole.
MERGE_KEYS: dict[tuple[str, ...], str] = {
    ("status", "conditions"): "type",
    ("status", "addresses"): "type",
    ("metadata", "ownerReferences"): "uid",
}


def merge_patch(target: Any, patch: Any) -> Any:
    """RFC 7386: objects merged key by key, `null` removes a key, anything else (lists too) replaces."""
    if not isinstance(patch, dict):
        return copy.deepcopy(patch)
    out = copy.deepcopy(target) if isinstance(target, dict) else {}
    for key, value in patch.items():
        if value is None:
            out.pop(key, None)
        else:
            out[key] = merge_patch(out.get(key), value)
    return out


def strategic_merge_patch(target: Any, patch: Any, path: tuple[str, ...] = ()) -> Any:
    """A strategic merge patch as the API server applies one to a built-in type: a merge patch, except
    that the lists of `MERGE_KEYS` merge by their key (`$patch: delete` in an element removes it) and
    the `$`-directives are not fields (`$setElementOrder/...` is ignored: order is kept as it was)."""
    if not isinstance(patch, dict):
        return copy.deepcopy(patch)
    if patch.get("$patch") == "replace":
        return {k: copy.deepcopy(v) for k, v in patch.items() if not k.startswith("$")}
    out = copy.deepcopy(target) if isinstance(target, dict) else {}
    for key, value in patch.items():
        if key.startswith("$"):
            continue
        here = (*path, key)
        if value is None:
            out.pop(key, None)
        elif isinstance(value, list) and here in MERGE_KEYS and isinstance(out.get(key), list):
            out[key] = _merge_list(out[key], value, MERGE_KEYS[here], here)
        else:
            out[key] = strategic_merge_patch(out.get(key), value, here)
    return out


def _merge_list(current: list[Any], patch: list[Any], merge_key: str, path: tuple[str, ...]) -> list[Any]:
    out = copy.deepcopy(current)
    for element in patch:
        if not isinstance(element, dict) or merge_key not in element:
            out.append(copy.deepcopy(element))
            continue
        at = next((i for i, e in enumerate(out) if isinstance(e, dict) and e.get(merge_key) == element[merge_key]),
                  None)
        if element.get("$patch") == "delete":
            if at is not None:
                del out[at]
        elif at is None:
            out.append({k: copy.deepcopy(v) for k, v in element.items() if not k.startswith("$")})
        else:
            out[at] = strategic_merge_patch(out[at], element, path)
    return out


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
    verb: str  # create | replace | patch | delete | evict
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
    objects' timestamps; `kube_version` ("1.33" ... "1.37", changeable mid-test) what `resource.k8s.io`
    serves and what `/version` says."""

    clock: Callable[[], float] = time.monotonic
    wall: Callable[[], dt.datetime] = _wall
    kube_version: str = attrs.field(default="1.36", validator=attrs.validators.in_(KUBE_VERSIONS))
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
        # The API server answers these with and without the slash (ApisApi, VersionApi ask with it).
        self.fallback["get /apis/"] << self._serve_apis
        self.fallback["get /version/"] << self._serve_server_version
        for plural, (group, version, kind) in KINDS.items():
            if group == DRA_GROUP:
                continue  # its discovery depends on kube_version: served by _serve_dra_discovery
            subresources = {"pods": {"eviction"}, "nodes": {"status"}}.get(plural, set())
            verbs = {"get", "list", "patch"} if plural == "nodes" else {"get", "list", "create", "update", "delete"}
            self.resources[f"{group}/{version}/{plural}" if group else f"{version}/{plural}"] = kmock.ResourceInfo(
                namespaced=plural not in CLUSTER_SCOPED, kind=kind, verbs=verbs, subresources=subresources)
        # Events as kmock keeps them: an empty namespace lists as 200 with no items.
        self.resources["events.k8s.io/v1/events"] = kmock.ResourceInfo(
            namespaced=True, kind="Event", verbs={"create", "list", "get"})

    # --- routing -----------------------------------------------------------------------------------------------

    def _plural_of(self, request: kmock.Request) -> str | None:
        """The emulated resource a request names, at a version that serves it (None otherwise)."""
        res = request.resource
        if res is None or res.plural not in KINDS:
            return None
        group, version, _ = KINDS[res.plural]
        if group == DRA_GROUP:
            served = self.dra_versions().get(res.version or "", frozenset())
            return res.plural if res.group == DRA_GROUP and res.plural in served else None
        return res.plural if (res.group, res.version) == (group, version) else None

    def _owns(self, request: kmock.Request) -> bool:
        # All of resource.k8s.io: what a version does not serve is a 404 here, not kmock's guess.
        res = request.resource
        return res is not None and (res.group == DRA_GROUP or self._plural_of(request) is not None)

    async def _handle(self, request: kmock.Request) -> aiohttp.web.StreamResponse:
        if self._owns(request):
            # Past kmock's own object bookkeeping, which would store or delete before any reaction
            # (dry runs included): these routes keep their own state with the real semantics.
            return await super(kmock.KubernetesEmulator, self)._handle(request)
        return await super()._handle(request)

    def _serve(self, request: kmock.Request) -> kmock.Response:
        # Synchronous from request to answer: one write is atomic against every other request.
        method = str(request.method.value).upper()
        res = request.resource
        assert res is not None
        if res.group == DRA_GROUP and res.plural is None:
            return self._answer(self._serve_dra_discovery(method, res.version))
        plural = self._plural_of(request)
        if plural is None:
            return self._answer(not_served())  # a resource.k8s.io version or resource not served
        # The API version the answer is written at: where an object is served at several, the one asked.
        api_version = f"{DRA_GROUP}/{res.version}" if plural in DRA_PLURALS else None
        ns, name, sub = request.namespace or "", request.name, request.subresource
        if plural in CLUSTER_SCOPED and request.namespace is not None:
            return self._answer(not_served())  # /namespaces/{ns}/nodes is no path of the API
        params = dict(request.params)
        body = request.data
        content_type = next((v for k, v in request.headers.items() if k.lower() == "content-type"), "")
        if sub is not None:
            if plural == "pods" and sub == "eviction" and method == "POST" and name:
                return self._answer(self._evict(ns, name, params, body))
            if plural == "nodes" and sub == "status" and name:
                if method == "GET":
                    found = self.read(plural, ns, name)
                    return self._answer(found if found is not None else not_found(plural, name))
                if method == "PATCH":
                    return self._answer(self._patch(plural, name, params, body, content_type, status=True))
            return self._answer(method_not_allowed(method, request.url.path))
        if params.get("watch") in ("true", "1"):
            # Not emulated: better a clear refusal than a list where a stream of events was asked for.
            return self._answer(method_not_allowed(f"{method} ?watch", request.url.path))
        if name is None:
            if method == "GET":
                return self._answer(self._list(plural, ns, params, api_version))
            # A namespaced resource.k8s.io object is created in its namespace: the cluster-wide path only lists.
            if method == "POST" and plural in CREATABLE and (ns or plural in CLUSTER_SCOPED
                                                             or plural not in DRA_PLURALS):
                return self._answer(self._create(plural, ns, params, body, api_version))
        elif method == "GET":
            found = self.read(plural, ns, name)
            if found is not None and api_version is not None:
                found["apiVersion"] = api_version
            return self._answer(found if found is not None else not_found(plural, name))
        elif method == "PUT" and plural == "leases":
            return self._answer(self._replace(plural, ns, name, params, body))
        elif method == "PATCH" and plural in ("nodes", "devicetaintrules"):
            patched = self._patch(plural, name, params, body, content_type, status=False)
            if api_version is not None and patched.get("kind") != "Status":
                patched["apiVersion"] = api_version
            return self._answer(patched)
        elif method == "DELETE" and plural in DELETABLE:
            return self._answer(self._delete(plural, ns, name, params, body))
        return self._answer(method_not_allowed(method, request.url.path))

    # --- discovery ---------------------------------------------------------------------------------------------

    def dra_versions(self) -> dict[str, frozenset[str]]:
        """The resource.k8s.io versions `kube_version` serves, preferred first, each with its resources."""
        return DRA_SERVED[self.kube_version]

    @property
    def device_taint_rule_version(self) -> str:
        """The version a client finds DeviceTaintRules at, trying v1, v1beta2, v1alpha3 in turn."""
        served = self.dra_versions()
        return next(v for v in ("v1", "v1beta2", "v1alpha3") if "devicetaintrules" in served.get(v, ()))

    def _dra_group(self) -> JSON:
        versions = [{"groupVersion": f"{DRA_GROUP}/{v}", "version": v} for v in self.dra_versions()]
        return {"kind": "APIGroup", "apiVersion": "v1", "name": DRA_GROUP, "versions": versions,
                "preferredVersion": versions[0]}

    def _serve_dra_discovery(self, method: str, version: str | None) -> JSON:
        if method != "GET":
            return method_not_allowed(method, f"/apis/{DRA_GROUP}" + (f"/{version}" if version else ""))
        if version is None:
            return self._dra_group()
        served = self.dra_versions()
        if version not in served:
            return not_served()
        return {"kind": "APIResourceList", "apiVersion": "v1", "groupVersion": f"{DRA_GROUP}/{version}",
                "resources": [{"name": plural, "singularName": KINDS[plural][2].lower(),
                               "namespaced": plural not in CLUSTER_SCOPED, "kind": KINDS[plural][2],
                               "verbs": list(DRA_VERBS)}
                              for plural in sorted(served[version])]}

    async def _serve_apis(self, request: kmock.Request) -> Any:
        # kmock's list of groups, with resource.k8s.io as kube_version serves it (kmock's guess of a
        # preferred version is any of a set's).
        listed = await super()._serve_apis(request)
        assert isinstance(listed, dict)
        listed["groups"] = [g for g in listed.get("groups", []) if g.get("name") != DRA_GROUP] + [self._dra_group()]
        return listed

    async def _serve_server_version(self, request: kmock.Request) -> Any:
        major, minor = self.kube_version.split(".")
        return {"major": major, "minor": minor, "gitVersion": f"v{self.kube_version}.0",
                "gitCommit": "0000000000000000000000000000000000000000", "gitTreeState": "clean",
                "buildDate": "2026-01-01T00:00:00Z", "goVersion": "go1.25.0", "compiler": "gc",
                "platform": "linux/amd64"}

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

    def _list(self, plural: str, ns: str, params: dict[str, str], api_version: str | None = None) -> JSON:
        select = parse_selector(params.get("labelSelector", ""))
        fields = parse_selector(params.get("fieldSelector", ""))
        items = [copy.deepcopy(self._with_status(plural, obj)) for (p, n, _), obj in self._store.items()
                 if p == plural and (not ns or n == ns) and select(obj["metadata"].get("labels") or {})
                 and fields(_field_values(obj))]
        api_version = api_version or _api_version(plural)
        if plural in DRA_PLURALS:
            for item in items:
                item["apiVersion"] = api_version
        return {"apiVersion": api_version, "kind": f"{KINDS[plural][2]}List",
                "metadata": {"resourceVersion": str(self._revision)}, "items": items}

    def _create(self, plural: str, ns: str, params: dict[str, str], body: Any,
                api_version: str | None = None) -> JSON | tuple[int, JSON]:
        if not isinstance(body, dict):
            return bad_request(f"the body of a {KINDS[plural][2]} create must be a JSON object")
        meta = body.get("metadata") or {}
        name = meta.get("name") or ""
        if not name and meta.get("generateName"):
            name = meta["generateName"] + uuid.uuid4().hex[:5]
        if not name:
            return invalid(plural, "", "metadata.name: Required value: name or generateName is required")
        if meta.get("namespace") not in (None, "", ns) and plural not in CLUSTER_SCOPED:
            return bad_request("the namespace of the provided object does not match the namespace sent on the request")
        dry = is_dry_run(params, body)
        errors = self._create_errors(plural, {**body, "metadata": {**meta, "name": name}})
        if errors:
            refusal = invalid_fields(plural, name, errors)
            self._record(verb="create", resource=plural, namespace=ns, name=name, code=422, dry_run=dry,
                         sent_version=meta.get("resourceVersion"), body=copy.deepcopy(body), reason="Invalid")
            return refusal
        if (plural, ns, name) in self._store:
            refusal = already_exists(plural, name)
            self._record(verb="create", resource=plural, namespace=ns, name=name, code=409, dry_run=dry,
                         sent_version=meta.get("resourceVersion"), body=copy.deepcopy(body), reason="AlreadyExists")
            return refusal
        obj = self._stamp(plural, ns, name, body, dry, api_version)
        if not dry:
            self._store[(plural, ns, name)] = obj
        self._record(verb="create", resource=plural, namespace=ns, name=name, code=201, dry_run=dry,
                     sent_version=meta.get("resourceVersion"), version=obj["metadata"]["resourceVersion"],
                     body=copy.deepcopy(obj))
        return 201, copy.deepcopy(obj)

    def _create_errors(self, plural: str, body: JSON) -> list[str]:
        """What the API server's validation refuses in a create (only DeviceTaintRules are checked: the
        objects a sidecar writes)."""
        if plural != "devicetaintrules":
            return []
        spec = body.get("spec")
        if not isinstance(spec, dict):
            return ["spec: Required value"]
        # "None" (a taint that only informs) came with 1.35 (KEP-5055's beta update).
        effects = ("NoSchedule", "NoExecute", "None") if self.kube_version >= "1.35" else ("NoSchedule", "NoExecute")
        out = metadata_errors(body.get("metadata") or {})
        if "taint" not in spec:
            out.append("spec.taint: Required value")
        else:
            out += taint_errors("spec.taint", spec["taint"], effects)
        selector = spec.get("deviceSelector") or {}
        if not isinstance(selector, dict):
            out.append(f"spec.deviceSelector: Invalid value: {json.dumps(selector)}: must be an object")
        elif selector.get("driver"):
            out += _field_errors("spec.deviceSelector.driver", selector["driver"],
                                 dns_subdomain_errors(str(selector["driver"])))
        return out

    def _stamp(self, plural: str, ns: str, name: str, body: JSON, dry: bool, api_version: str | None = None) -> JSON:
        obj = copy.deepcopy(body)
        obj["apiVersion"] = api_version or _api_version(plural)
        obj["kind"] = KINDS[plural][2]
        meta = obj.setdefault("metadata", {})
        meta.update(name=name, uid=str(uuid.uuid4()), creationTimestamp=_now_rfc3339(self.wall),
                    resourceVersion=str(self._revision + 1) if dry else self._bump())
        if plural in CLUSTER_SCOPED:
            meta.pop("namespace", None)
        else:
            meta["namespace"] = ns
        if plural in WORKLOADS or plural == "devicetaintrules":
            meta.setdefault("generation", 1)
        taint = (obj.get("spec") or {}).get("taint")
        if plural == "devicetaintrules" and isinstance(taint, dict):
            taint.setdefault("timeAdded", _now_rfc3339(self.wall))  # "added automatically during create"
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
        if plural in DRA_PLURALS:
            # These stores do not return the deleted object (no ReturnDeletedObject): a Status says it went.
            return success(plural, name, gone["metadata"]["uid"])
        return gone

    def _patch(self, plural: str, name: str, params: dict[str, str], body: Any, content_type: str,
               status: bool) -> JSON:
        """PATCH of a cluster-scoped object (a Node, a DeviceTaintRule) or of a Node's `status` subresource
        (`status`), validated as a create is."""
        dry = params.get("dryRun") == "All"
        meta = body.get("metadata") if isinstance(body, dict) else None
        sent = meta.get("resourceVersion") if isinstance(meta, dict) else None

        def refused(answer: JSON) -> JSON:
            self._record(verb="patch", resource=plural, namespace="", name=name, code=int(answer["code"]),
                         dry_run=dry, sent_version=sent, body=copy.deepcopy(body), reason=answer["reason"])
            return answer

        kind = content_type.split(";")[0].strip().lower()
        if kind not in (MERGE_PATCH, STRATEGIC_MERGE_PATCH):
            return refused(unsupported_media_type(kind or "(none)"))
        if not isinstance(body, dict):
            return refused(bad_request(f"the body of a {kind} patch must be a JSON object"))
        current = self._store.get((plural, "", name))
        if current is None:
            return refused(not_found(plural, name))
        # The patch's resourceVersion lands on the object, and an update with a resourceVersion is
        # conditional on it (the optimistic lock); a patch without one applies to whatever is there.
        if sent is not None and sent != current["metadata"]["resourceVersion"]:
            return refused(conflict(plural, name))
        patched = merge_patch(current, body) if kind == MERGE_PATCH else strategic_merge_patch(current, body)
        if not isinstance(patched, dict) or patched.get("metadata", {}).get("name") != name:
            return refused(bad_request(f"the name of the object ({(patched.get('metadata') or {}).get('name')}) does"
                                       f" not match the name on the URL ({name})"))
        # What the server owns survives the patch; the main resource ignores status, `status` the spec.
        for key in ("uid", "creationTimestamp", "resourceVersion"):
            patched["metadata"][key] = current["metadata"][key]
        patched["apiVersion"], patched["kind"] = current["apiVersion"], current["kind"]
        for part in ("spec",) if status else ("status",):
            if part in current:
                patched[part] = copy.deepcopy(current[part])
            else:
                patched.pop(part, None)
        errors = node_taints_errors((patched.get("spec") or {}).get("taints")) if plural == "nodes" \
            else self._create_errors(plural, patched)
        if errors:
            return refused(invalid_fields(plural, name, errors))
        if patched != current and not dry:  # an unchanged object is no write: no new resourceVersion
            patched["metadata"]["resourceVersion"] = self._bump()
            self._store[(plural, "", name)] = patched
        elif patched != current:
            patched["metadata"]["resourceVersion"] = str(self._revision + 1)
        self._record(verb="patch", resource=plural, namespace="", name=name, code=200, dry_run=dry, sent_version=sent,
                     version=patched["metadata"]["resourceVersion"], body=copy.deepcopy(patched))
        return copy.deepcopy(patched)

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
        `writes`: the cluster as it was before the test, or a controller's write. Its kind says where it
        goes; a resource.k8s.io object keeps the apiVersion it carries."""
        kind = obj.get("kind", "")
        if kind not in PLURALS:
            raise ValueError(f"cannot store a {kind!r}: this emulator keeps {', '.join(sorted(PLURALS))}")
        plural = PLURALS[kind]
        meta = obj.get("metadata") or {}
        ns, name = "" if plural in CLUSTER_SCOPED else meta.get("namespace") or "", meta.get("name") or ""
        if not name or (not ns and plural not in CLUSTER_SCOPED):
            raise ValueError(f"a {kind} needs metadata.name"
                             f"{'' if plural in CLUSTER_SCOPED else ' and metadata.namespace'}, got {meta!r}")
        if (plural, ns, name) in self._store:
            raise ValueError(f"{qualified(plural)} {ns + '/' if ns else ''}{name} already exists")
        api_version = obj.get("apiVersion") if plural in DRA_PLURALS and str(obj.get("apiVersion", "")).startswith(
            f"{DRA_GROUP}/") else None
        stored = self._stamp(plural, ns, name, obj, dry=False, api_version=api_version)
        self._store[(plural, ns, name)] = stored
        return copy.deepcopy(stored)

    def mutate(self, plural: str, namespace: str, name: str, change: Callable[[JSON], None]) -> JSON | None:
        """A controller's write (the scheduler's binding, the kubelet's status): `change` edits the stored
        object in place, then it gets a new resourceVersion. Unrecorded in `writes`; None when there is
        no such object."""
        obj = self._store.get((plural, "" if plural in CLUSTER_SCOPED else namespace, name))
        if obj is None:
            return None
        change(obj)
        obj["metadata"]["resourceVersion"] = self._bump()
        return copy.deepcopy(obj)

    def remove(self, plural: str, namespace: str, name: str) -> JSON | None:
        """A controller's delete (a pod's generated ResourceClaim once the pod is gone), unrecorded and
        without the hooks; the object as it was, None when there was none."""
        key = (plural, "" if plural in CLUSTER_SCOPED else namespace, name)
        if key not in self._store:
            return None
        return self._remove(plural, key[1], name, dry=False)

    def node(self, name: str) -> JSON | None:
        return self.read("nodes", "", name)

    def set_node_taints(self, name: str, taints: list[JSON]) -> JSON:
        """An administrator's `kubectl taint` (a new resourceVersion, unrecorded): `spec.taints` replaced."""
        def change(node: JSON) -> None:
            spec = node.setdefault("spec", {})
            if taints:
                spec["taints"] = copy.deepcopy(taints)
            else:
                spec.pop("taints", None)

        errors = node_taints_errors(taints)
        if errors:
            raise ValueError("; ".join(errors))
        changed = self.mutate("nodes", "", name, change)
        if changed is None:
            raise KeyError(f"no node {name}")
        return changed

    def set_pod_status(self, namespace: str, name: str, status: JSON | None = None,
                       containers: dict[str, JSON] | None = None) -> JSON | None:
        """The kubelet's (or a controller's) write of a pod's status, with a new resourceVersion:
        `status` merged over it (RFC 7386: a list given replaces the list), `containers` merged into the
        `containerStatuses` entry of each container named (`{"inference": {"allocatedResourcesStatus":
        [...]}}`). The pod after it, None when it is gone."""
        def change(pod: JSON) -> None:
            new = merge_patch(pod.get("status") or {}, status or {})
            entries = new.get("containerStatuses") or []
            for container, fields in (containers or {}).items():
                at = next((i for i, e in enumerate(entries) if e.get("name") == container), None)
                if at is None:  # refused before anything changed: no half-written status
                    raise KeyError(f"pod {namespace}/{name} has no status of a container {container!r}")
                entries[at] = merge_patch(entries[at], fields)
            pod["status"] = new

        return self.mutate("pods", namespace, name, change)

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


def _api_version(plural: str) -> str:
    group, version, _ = KINDS[plural]
    return f"{group}/{version}" if group else version


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


def node_of(name: str, gpus: int | None = None, labels: dict[str, str] | None = None,
            wall: Callable[[], dt.datetime] = _wall) -> JSON:
    """A Node as its kubelet registers it, Ready; `gpus`: the device plugin's `nvidia.com/gpu` count in
    its capacity and allocatable (None: no device plugin, as on a node whose GPUs DRA publishes)."""
    stamp = _now_rfc3339(wall)
    resources = {"cpu": "64", "memory": "512Gi", "pods": "110", **({"nvidia.com/gpu": str(gpus)}
                                                                    if gpus is not None else {})}
    return {"apiVersion": "v1", "kind": "Node",
            "metadata": {"name": name, "labels": {"kubernetes.io/hostname": name, "kubernetes.io/os": "linux",
                                                  **(labels or {})}},
            "spec": {},
            "status": {"capacity": dict(resources), "allocatable": dict(resources),
                       "conditions": [{"type": "Ready", "status": "True", "reason": "KubeletReady",
                                       "message": "kubelet is posting ready status", "lastHeartbeatTime": stamp,
                                       "lastTransitionTime": stamp}],
                       "addresses": [{"type": "Hostname", "address": name}]}}


def resource_slice(node: str, driver: str, devices: dict[str, str]) -> JSON:
    """The ResourceSlice a DRA driver publishes for a node: one pool named after the node (the NVIDIA
    driver's naming), `devices` device name -> uuid attribute (v1's shape: attributes on the device)."""
    return {"apiVersion": f"{DRA_GROUP}/v1", "kind": "ResourceSlice",
            "metadata": {"name": f"{node}-{driver}"},
            "spec": {"driver": driver, "nodeName": node,
                     "pool": {"name": node, "generation": 1, "resourceSliceCount": 1},
                     "devices": [{"name": device, "attributes": {"uuid": {"string": gpu_uuid}}}
                                 for device, gpu_uuid in devices.items()]}}


def resource_claim(pod: JSON, claim: str, driver: str, pool: str, device: str, request: str = "gpu") -> JSON:
    """The claim the resourceclaim controller generates for a pod's `spec.resourceClaims` entry `claim`
    (named `<pod>-<claim>`), allocated by the scheduler to `device` of `pool` and reserved for the pod."""
    meta = pod["metadata"]
    return {"apiVersion": f"{DRA_GROUP}/v1", "kind": "ResourceClaim",
            "metadata": {"name": f"{meta['name']}-{claim}", "namespace": meta["namespace"],
                         "annotations": {"resource.kubernetes.io/pod-claim-name": claim},
                         "ownerReferences": [{"apiVersion": "v1", "kind": "Pod", "name": meta["name"],
                                              "uid": meta["uid"], "controller": True, "blockOwnerDeletion": True}]},
            "spec": {"devices": {"requests": [{"name": request, "exactly": {
                "deviceClassName": driver, "allocationMode": "ExactCount", "count": 1}}]}},
            "status": {"allocation": {
                "devices": {"results": [{"request": request, "driver": driver, "pool": pool, "device": device}]},
                "nodeSelector": {"nodeSelectorTerms": [{"matchFields": [
                    {"key": "metadata.name", "operator": "In", "values": [pool]}]}]}},
                "reservedFor": [{"resource": "pods", "name": meta["name"], "uid": meta["uid"]}]}}


def unscheduled(pod: JSON, message: str, wall: Callable[[], dt.datetime] = _wall) -> JSON:
    """`pod` (as `pod_of` makes it) as it is while no node fits: Pending, no node, PodScheduled False."""
    out = copy.deepcopy(pod)
    out["spec"].pop("nodeName", None)
    out["status"] = {"phase": "Pending", "qosClass": pod.get("status", {}).get("qosClass", "BestEffort"),
                     "conditions": [{"type": "PodScheduled", "status": "False", "reason": "Unschedulable",
                                     "message": message, "lastTransitionTime": _now_rfc3339(wall)}]}
    return out


def names_of(objs: Iterable[JSON]) -> list[str]:
    return [o["metadata"]["name"] for o in objs]
