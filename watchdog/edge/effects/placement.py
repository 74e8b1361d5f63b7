"""Tainting a card in the cluster: a DRA device's DeviceTaintRule, or (opt-in) its node's taint.

Blocking (callers run it through `asyncio.to_thread`); what to taint and whether the bound allows it
is decided by `watchdog.core.placement`. The DeviceTaintRule's API version is found by discovery:
v1alpha3 in Kubernetes 1.33-1.35 (feature gate DRADeviceTaints), v1beta2 in 1.36, v1 from 1.37.
Only what we placed is ever lifted: a rule without our label and our workload's annotations, or a node
taint without our workload's entry (nor, in the previous format, a card our records name), is left as
it is. What the cluster holds of ours says until when (`held`): the records lost, it is still lifted.
"""

from __future__ import annotations

import datetime as dt
import time
from collections.abc import Iterable
from typing import Any

from gpu_watchdog import logs
from gpu_watchdog.watchdog.core import placement
from gpu_watchdog.watchdog.core.names import GPU_DRIVERS
from gpu_watchdog.watchdog.core.placement import Card, Taint
from gpu_watchdog.watchdog.edge.effects.fleet import read_workload, selector_text
from gpu_watchdog.watchdog.edge.kube.kube import pod_path
from gpu_watchdog.watchdog.edge.kube.kube_api import (
    MERGE_PATCH,
    ApiError,
    KubeApi,
    api_of,
    parse_time,
    path,
    second_time,
)

log = logs.get("watchdog.placement")

GROUP = "resource.k8s.io"
VERSIONS = ("v1", "v1beta2", "v1alpha3")  # newest first: the first that serves DeviceTaintRules is used
# ResourceClaims are served elsewhere: v1 from 1.34, v1beta2 from 1.33, v1beta1 from 1.32 (v1alpha3 has none).
CLAIM_VERSIONS = ("v1", "v1beta2", "v1beta1")
RULES = "devicetaintrules"
CLAIMS = "resourceclaims"
CONFLICT_TRIES = 5  # a node's taints written over another writer's: read and decide again


class Placer:
    def __init__(self, api_client: KubeApi, namespace: str, pod_name: str, node_name: str,
                 workload: str, request_timeout: float) -> None:
        self.namespace = namespace
        self.pod_name = pod_name
        self.node_name = node_name
        self.workload = workload
        self.owner = placement.owner_of(namespace, workload)
        self.timeout = request_timeout
        self.api = api_of(api_client)
        self._served: dict[str, str | None] = {}

    # -- what the cluster says ---------------------------------------------------------------------------

    def version(self) -> str | None:
        """The resource.k8s.io version that serves DeviceTaintRules (None: this cluster has none)."""
        return self._served_at(RULES, VERSIONS)

    def _served_at(self, plural: str, versions: tuple[str, ...]) -> str | None:
        """The first of `versions` whose discovery lists `plural`; kept once found (a cluster upgrade
        restarts the pods that would have to see it change)."""
        if self._served.get(plural) is not None:
            return self._served[plural]
        for v in versions:
            try:
                found = self.api.get(path("/apis", GROUP, v), timeout=self.timeout)
            except ApiError as exc:
                if exc.status == 404:
                    continue
                raise
            if any(isinstance(r, dict) and r.get("name") == plural for r in found.get("resources") or []):
                self._served[plural] = v
                return v
        return None

    def cards(self, pod_gpus: tuple[str, ...] | None, named: str | None = None) -> list[Card]:
        """Our pod's GPUs: the DRA devices its ResourceClaims were allocated; where it has none, the device
        plugin's on our node: the kubelet's UUIDs (`pod_gpus`), else the one our own evidence names
        (`named`: the UUID in our pod's status or our NVML, where the kubelet's socket is not mounted)."""
        pod = self.api.get(pod_path(self.namespace, self.pod_name), timeout=self.timeout)
        spec, status = pod.get("spec") or {}, pod.get("status") or {}
        node = spec.get("nodeName") or self.node_name
        # Claims made from a template are named in the status; a shared claim by its name in the spec.
        names = [str(st["resourceClaimName"]) for st in status.get("resourceClaimStatuses") or []
                 if st.get("resourceClaimName")]
        names += [str(c["resourceClaimName"]) for c in spec.get("resourceClaims") or [] if c.get("resourceClaimName")]
        version = self._served_at(CLAIMS, CLAIM_VERSIONS) if names else None
        cards: list[Card] = []
        for name in dict.fromkeys(names) if version is not None else ():
            claim = self.api.get(path("/apis", GROUP, version, "namespaces", self.namespace, CLAIMS, name),
                                 timeout=self.timeout)
            results = (((claim.get("status") or {}).get("allocation") or {}).get("devices") or {}).get("results") or []
            for r in results:
                driver, pool, device = r.get("driver"), r.get("pool"), r.get("device")
                # A GPU driver's devices only: a NIC allocated beside the GPU is never taken for it.
                if driver in GPU_DRIVERS and isinstance(pool, str) and isinstance(device, str):
                    cards.append(Card(f"{driver}/{pool}/{device}", node, driver, pool, device))
        if not cards:
            # A time-sliced GPU's ID carries ::N: the card is the UUID before it, once.
            uuids = dict.fromkeys(u.split("::")[0] for u in (pod_gpus or ((named,) if named else ())))
            cards = [Card(uuid, node) for uuid in uuids]
        return cards

    def scope(self, kind: str, cards_per_pod: int) -> tuple[int, frozenset[str]]:
        """What the bound is a share of: the workload's nodes (its pods' distinct nodes) for node taints,
        its cards (pods x our pod's cards) for device taints; and those nodes, whose taints a decision
        reads (one of ours there, its record lost, still counts). Unreadable: 1, the smallest bound."""
        selector = self._selector()
        if selector is None:
            return 1, frozenset()
        pods = self.api.get(pod_path(self.namespace), query={"labelSelector": selector},
                            timeout=self.timeout).get("items") or []
        alive = [p for p in pods if isinstance(p, dict) and not (p.get("metadata") or {}).get("deletionTimestamp")]
        nodes = frozenset(str(p["spec"]["nodeName"]) for p in alive if (p.get("spec") or {}).get("nodeName"))
        if kind == placement.NODE:
            return max(1, len(nodes)), nodes
        return max(1, len(alive) * max(1, cards_per_pod)), nodes

    def _selector(self) -> str | None:
        return selector_text(read_workload(self.api, self.workload, self.namespace, self.timeout))

    # -- taints --------------------------------------------------------------------------------------------

    def place(self, taint: Taint, card: Card, now: float | None = None) -> str:
        """`placed`, or `present` (ours already there, as late: another sidecar raced us, or a retry).
        A node's taint of our key and effect that is no workload's of ours raises `placement.NotOurs`."""
        if taint.kind == placement.DEVICE:
            return self._create_rule(taint, card)
        at = time.time() if now is None else now
        return self._patch_node(taint.node, lambda taints: placement.with_node_taint(taints, taint, self.owner, at),
                                done="placed", unchanged="present")

    def ensure(self, taint: Taint, now: float | None = None) -> str:
        """A taint our records hold, in the cluster as recorded: `present`, `placed` (it was missing: a
        race with a lift, an operator's delete), `escalated` (its effect set to the record's), or
        `not_ours` (a rule by that name, or a node taint of our key and effect, we did not place: left)."""
        card = placement.card_of(taint)
        if taint.kind == placement.NODE:
            try:
                return self.place(taint, card, now)
            except placement.NotOurs:
                return "not_ours"
        version = self.version()
        if version is None:
            raise RuntimeError(f"this cluster serves no DeviceTaintRule ({GROUP} {', '.join(VERSIONS)})")
        try:
            rule = self.api.get(self._rules(version, taint.target), timeout=self.timeout)
        except ApiError as exc:
            if exc.status == 404:
                return self._create_rule(taint, card)
            raise
        if not ours(rule, taint.card):
            return "not_ours"
        effect = ((rule.get("spec") or {}).get("taint") or {}).get("effect")
        # Only ever raised (NoSchedule to NoExecute): a sidecar that read the records before an
        # escalation must not take it back.
        if placement.EFFECT_RANK.get(str(effect), -1) >= placement.EFFECT_RANK.get(taint.effect, 0):
            return "present"
        self.api.patch(self._rules(version, taint.target), {"spec": {"taint": {"effect": taint.effect}}},
                       MERGE_PATCH, timeout=self.timeout)
        return "escalated"

    def present(self, taint: Taint) -> bool:
        """Whether our taint for that card is in the cluster (a create that timed out may have landed)."""
        if taint.kind == placement.NODE:
            node, taints = self._node_taints(taint.node)
            until = placement.node_expiry(taint.until)
            if node is None:
                return False
            held = any(u >= until for effect, u in placement.node_held(taints, self.owner) if effect == taint.effect)
            # The previous format (the card as its value), ours where a record names the card.
            return held or (bool(taint.card) and any(
                t.get("key") == placement.NODE_TAINT_KEY and t.get("value") == placement.label_value(taint.card)
                for t in taints))
        version = self.version()
        if version is None:
            return False
        try:
            rule = self.api.get(self._rules(version, taint.target), timeout=self.timeout)
        except ApiError as exc:
            if exc.status == 404:
                return False
            raise
        return ours(rule, taint.card)

    def lift(self, taint: Taint, now: float | None = None, force: bool = True) -> str:
        """`lifted`, `absent` (gone already, or, on a node, still held: by our own later entry where not
        `force`, or by another workload's entry in force), or `not_ours` (a rule by that name we did not
        place: left). `force` (an operator's clear): our node entry goes even before its expiry."""
        if taint.kind == placement.NODE:
            at = time.time() if now is None else now
            return self._patch_node(
                taint.node, lambda taints: placement.without_node_taint(taints, self.owner, at, taint.card, force),
                done="lifted", unchanged="absent")
        version = self.version()
        if version is None:
            return "absent"
        try:
            rule = self.api.get(self._rules(version, taint.target), timeout=self.timeout)
        except ApiError as exc:
            if exc.status == 404:
                return "absent"
            raise
        if not ours(rule, taint.card):
            return "not_ours"
        try:
            self.api.delete(self._rules(version, taint.target), timeout=self.timeout)
        except ApiError as exc:
            if exc.status == 404:
                return "absent"
            raise
        return "lifted"

    def held(self, nodes: Iterable[str], now: float, strict: bool = False) -> tuple[list[Taint], set[str]]:
        """What the cluster holds of this workload's, whatever the records say: its DeviceTaintRules (the
        workload and namespace in their annotations) and its entries in the taints of `nodes` (a node
        cannot be listed: those the caller knows of), each with the expiry the cluster states; and the
        nodes of `nodes` that hold nothing of ours (or are gone). A node that cannot be read is neither, or
        raises where `strict` (a count for a decision must be whole)."""
        found: list[Taint] = []
        clear: set[str] = set()
        for rule in self.rules():
            t = rule_record(rule, self.workload, self.namespace)
            if t is not None:
                found.append(t)
        for name in sorted(set(nodes)):
            try:
                node, taints = self._node_taints(name)
            except Exception as exc:  # one node unreadable: the others still are; it is read again next time
                if strict:
                    raise
                log.debug("placement_node_unreadable", node=name, error=str(exc)[:200])
                continue
            held = placement.node_held(taints, self.owner) if node is not None else []
            if not held:
                clear.add(name)
            for effect, until in held:
                found.append(Taint(placement.NODE, name, "", name, "", now, float(until),
                                   "found in the node's taint", effect))
        return found, clear

    def sweep_node(self, name: str, now: float) -> str:
        """Our node taints past their expiry lifted, whatever the records say (none in force of ours nor of
        another workload in the same taint): `lifted` or `absent`."""
        return self._patch_node(name, lambda taints: placement.without_node_taint(taints, self.owner, now),
                                done="lifted", unchanged="absent")

    def rules(self) -> list[dict[str, Any]]:
        """The DeviceTaintRules labelled ours, cluster-wide (an operator's list)."""
        version = self.version()
        if version is None:
            return []
        found = self.api.get(self._rules(version), query={"labelSelector": "=".join(placement.MANAGED_BY)},
                             timeout=self.timeout)
        return [r for r in found.get("items") or [] if isinstance(r, dict)]

    @staticmethod
    def _rules(version: str, name: str | None = None) -> str:
        return path("/apis", GROUP, version, RULES, name)

    def _create_rule(self, taint: Taint, card: Card) -> str:
        version = self.version()
        if version is None:
            raise RuntimeError(f"this cluster serves no DeviceTaintRule ({GROUP} {', '.join(VERSIONS)})")
        until = second_time(taint.until)
        spec = rule_spec(taint, card)
        body: dict[str, Any] = {
            "apiVersion": f"{GROUP}/{version}", "kind": "DeviceTaintRule",
            "metadata": {"name": taint.target, "labels": dict([placement.MANAGED_BY]),
                         "annotations": {placement.EVIDENCE_ANNOTATION: taint.evidence[:1024],
                                         placement.UNTIL_ANNOTATION: until, placement.POD_ANNOTATION: taint.pod,
                                         placement.WORKLOAD_ANNOTATION: self.workload,
                                         placement.NAMESPACE_ANNOTATION: self.namespace,
                                         placement.CARD_ANNOTATION: taint.card,
                                         placement.NODE_ANNOTATION: taint.node}},
            "spec": spec,
        }
        try:
            self.api.post(self._rules(version), body, timeout=self.timeout)
        except ApiError as exc:
            if exc.status != 409:
                raise
            # Another sidecar placed it first, or someone else owns the name: only ours, for this very
            # device, stands for the taint.
            found = self.api.get(self._rules(version, taint.target), timeout=self.timeout)
            selector = (found.get("spec") or {}).get("deviceSelector") or {}
            if ours(found, taint.card) and selector == spec["deviceSelector"]:
                return "present"
            raise placement.NotOurs(f"DeviceTaintRule {taint.target} exists and is not ours for {taint.card}") from None
        return "placed"

    def _node_taints(self, name: str) -> tuple[dict[str, Any] | None, list[dict[str, Any]]]:
        """The node (None: it is gone) and its taints as the API spells them."""
        try:
            node = self.api.get(path("/api/v1/nodes", name), timeout=self.timeout)
        except ApiError as exc:
            if exc.status == 404:
                return None, []
            raise
        return node, [t for t in (node.get("spec") or {}).get("taints") or [] if isinstance(t, dict)]

    def _patch_node(self, name: str, change: Any, done: str, unchanged: str) -> str:
        """`done` once written, `unchanged` where nothing was to change, `absent` where the node is gone."""
        for _ in range(CONFLICT_TRIES):
            node, current = self._node_taints(name)
            if node is None:
                return "absent"  # the node is gone (an autoscaler removed it): nothing to taint or lift
            new = change(current)
            if new is None:
                return unchanged
            # The resourceVersion read makes the merge conditional: a kubelet's or an operator's write in
            # between is never overwritten (409, then decided again on what they wrote).
            body = {"metadata": {"resourceVersion": (node.get("metadata") or {}).get("resourceVersion")},
                    "spec": {"taints": new}}
            try:
                self.api.patch(path("/api/v1/nodes", name), body, MERGE_PATCH, timeout=self.timeout)
            except ApiError as exc:
                if exc.status == 409:
                    continue
                raise
            return done
        raise RuntimeError(f"node {name}: {CONFLICT_TRIES} conflicting writes of its taints in a row")


def rule_spec(taint: Taint, card: Card) -> dict[str, Any]:
    """The DeviceTaintRule's spec: that one device, our key, the card's short name as the value
    (the same in the v1alpha3, v1beta2 and v1 schemas)."""
    return {"deviceSelector": {"driver": card.driver, "pool": card.pool, "device": card.device},
            "taint": {"key": placement.DEVICE_TAINT_KEY, "value": placement.label_value(card.device or card.id),
                      "effect": taint.effect}}


def ours(rule: dict[str, Any], card: str | None = None) -> bool:
    """A DeviceTaintRule we placed (labelled ours, and for `card` where one is named)."""
    meta = rule.get("metadata") or {}
    key, value = placement.MANAGED_BY
    if (meta.get("labels") or {}).get(key) != value:
        return False
    return card is None or (meta.get("annotations") or {}).get(placement.CARD_ANNOTATION) == card


def rule_record(rule: dict[str, Any], workload: str, namespace: str) -> Taint | None:
    """A DeviceTaintRule of this workload's (labelled ours, its annotations naming the workload and its
    namespace, with an expiry) as a record: the expiry, card, pod and evidence its annotations state."""
    if not ours(rule):
        return None
    meta = rule.get("metadata") or {}
    annotations = meta.get("annotations") or {}
    name = meta.get("name")
    if not isinstance(name, str) or annotations.get(placement.WORKLOAD_ANNOTATION) != workload \
            or annotations.get(placement.NAMESPACE_ANNOTATION) != namespace:
        return None
    try:
        until = dt.datetime.strptime(str(annotations.get(placement.UNTIL_ANNOTATION)), "%Y-%m-%dT%H:%M:%SZ")
    except ValueError:
        return None
    until_s = until.replace(tzinfo=dt.UTC).timestamp()
    at = min(parse_time(meta.get("creationTimestamp")) or until_s, until_s)
    spec = rule.get("spec") or {}
    pool = (spec.get("deviceSelector") or {}).get("pool")
    node = annotations.get(placement.NODE_ANNOTATION) or (pool if isinstance(pool, str) else "")
    effect = (spec.get("taint") or {}).get("effect")
    return Taint(placement.DEVICE, name, str(annotations.get(placement.CARD_ANNOTATION, "")), str(node),
                 str(annotations.get(placement.POD_ANNOTATION, "")), at, until_s,
                 str(annotations.get(placement.EVIDENCE_ANNOTATION, ""))[:placement.EVIDENCE_KEPT],
                 str(effect) if effect in placement.EFFECT_RANK else "NoSchedule")
