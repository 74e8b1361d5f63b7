"""A stand-in for kube-scheduler's GPU placement, against the fleet emulator's store.

    scheduler = Scheduler(cluster, {"node-a": 2, "node-b": 2}, mode="dra")
    placement = scheduler.place("llm-5c9d7b6f4x-bcdfg", "serving")  # Placement(node="node-a", device="gpu-0", ...)
    scheduler.release("llm-5c9d7b6f4x-bcdfg")

What it emulates, of the scheduler's filters and scores that decide where a GPU pod lands:

- TaintToleration: a node's `NoSchedule` and `NoExecute` taints repel a pod unless one of the pod's
  tolerations tolerates them (the toleration rules of k8s.io/api core/v1 `Toleration.ToleratesTaint`);
  `PreferNoSchedule` taints the pod does not tolerate are avoided where another node fits (the score:
  fewer such taints wins); a cordoned node (`spec.unschedulable`) repels as its
  `node.kubernetes.io/unschedulable:NoSchedule` taint would.
- Device plugin (`mode="device_plugin"`): a node's `nvidia.com/gpu` cards, each a UUID `GPU-<node>-<i>`,
  each held by at most one pod (NodeResourcesFit over the extended resource, with the kubelet's
  device manager picking the card).
- DRA (`mode="dra"`): each node's pool (named after the node, as the NVIDIA DRA driver names it) of
  devices `gpu-0..gpu-<n-1>`, each allocated to at most one claim; a device matched by a DeviceTaintRule
  with effect `NoSchedule` or `NoExecute` is not allocated (the claims here tolerate no device taint).
  A rule's `spec.deviceSelector` is matched on `driver`, `pool` and `device`, a missing one matching
  any; a rule without a selector matches nothing.

The taints and the rules are read from the cluster's store at the moment of placing, so whatever a
sidecar wrote through the API (or a test through `Cluster.set_node_taints`) decides the next placement.
The order is deterministic: the nodes in the order given, then the cards by index, the first free and
untainted card wins; so a card freed by a removed pod is the next one given unless it is tainted.
Not emulated: CPU, memory and pod-count fit, affinity, topology spread, preemption, device taint
tolerations in claims, the taint-eviction controllers (a `NoExecute` node or device taint evicts no
running pod here: only placements avoid it), and the binding (the harness writes `spec.nodeName` and
the claim: it is the controllers and the kubelet too).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

from tests.fleet import cluster as k8s
from tests.fleet.cluster import Cluster

JSON = dict[str, Any]
Mode = Literal["dra", "device_plugin"]
GPU_RESOURCE = "nvidia.com/gpu"
REPELLING = ("NoSchedule", "NoExecute")
# The taint a cordoned node is treated as having (the NodeUnschedulable filter).
UNSCHEDULABLE_TAINT: JSON = {"key": "node.kubernetes.io/unschedulable", "effect": "NoSchedule"}


@dataclass(frozen=True)
class Placement:
    """Where a pod landed. `device`: the DRA device name (`gpu-<i>`, in the pool named after the node) or
    the device plugin's card UUID; `card`: the card's identity as the pod's allocatedResourcesStatus names
    it (`resourceID`): DRA `<driver>/<pool>/<device>`, device plugin the UUID."""

    node: str
    index: int
    device: str
    card: str
    driver: str | None = None  # DRA only
    uuid: str = ""  # the card's UUID (DRA: its ResourceSlice `uuid` attribute)

    @property
    def pool(self) -> str:
        return self.node


def card_uuid(node: str, index: int) -> str:
    return f"GPU-{node}-{index}"


def tolerates(toleration: JSON, taint: JSON) -> bool:
    """k8s.io/api core/v1 Toleration.ToleratesTaint: an empty effect tolerates every effect; `Exists`
    with an empty key tolerates every taint; `Equal` (the default operator) needs the same value."""
    if toleration.get("effect") and toleration["effect"] != taint.get("effect"):
        return False
    if toleration.get("key") and toleration["key"] != taint.get("key"):
        return False
    operator = toleration.get("operator") or "Equal"
    if operator == "Exists":
        return True
    if operator == "Equal":
        return bool(toleration.get("key")) and (toleration.get("value") or "") == (taint.get("value") or "")
    return False


def tolerated(taint: JSON, tolerations: list[JSON]) -> bool:
    return any(tolerates(t, taint) for t in tolerations)


def rule_matches(rule: JSON, driver: str, pool: str, device: str) -> bool:
    """Whether a DeviceTaintRule's selector picks this device."""
    selector = (rule.get("spec") or {}).get("deviceSelector")
    if selector is None:
        return False
    if selector.get("selectors") or selector.get("deviceClassName"):
        # CEL and classes were dropped from the API in 1.35; a rule using them would match here wrongly.
        raise ValueError(f"DeviceTaintRule {rule['metadata']['name']}: only driver, pool and device are emulated,"
                         f" not {sorted(k for k in selector if k not in ('driver', 'pool', 'device'))}")
    wanted = {"driver": driver, "pool": pool, "device": device}
    return all(selector.get(field) in (None, value) for field, value in wanted.items())


class Scheduler:
    """Places GPU pods on `nodes` (node name -> its GPU cards), one card each. The Node objects (and in
    `dra` mode a ResourceSlice per node) are added to `cluster` unless already there."""

    def __init__(self, cluster: Cluster, nodes: dict[str, int], mode: Mode, driver: str = "gpu.nvidia.com") -> None:
        if mode not in ("dra", "device_plugin"):
            raise ValueError(f"mode: 'dra' or 'device_plugin', not {mode!r}")
        if not nodes or any(n < 0 for n in nodes.values()):
            raise ValueError(f"nodes: at least one, each with zero or more cards, not {nodes!r}")
        self.cluster = cluster
        self.nodes = dict(nodes)
        self.mode: Mode = mode
        self.driver = driver
        self._held: dict[str, Placement] = {}  # pod -> its card
        self.refusals: dict[str, str] = {}  # pod -> why it fit nowhere, the last time it was tried
        for node, cards in self.nodes.items():
            if cluster.node(node) is None:
                cluster.add(k8s.node_of(node, cards if mode == "device_plugin" else None, wall=cluster.wall))
            if mode == "dra" and cluster.read("resourceslices", "", f"{node}-{driver}") is None:
                cluster.add(k8s.resource_slice(node, driver, {f"gpu-{i}": card_uuid(node, i) for i in range(cards)}))

    # --- what the harness uses ------------------------------------------------------------------------------

    def place(self, pod: str, namespace: str | None = None) -> Placement | None:
        """A free, allowed card for `pod` (its own if it holds one already), now held by it; None when none
        fits (`refusals[pod]` says why, in the scheduler's words). The pod's tolerations are read from the
        stored pod (`namespace`, or the one pod of that name in any namespace); no stored pod: none."""
        if pod in self._held:
            return self._held[pod]
        tolerations = self._tolerations(pod, namespace)
        fits: list[tuple[int, int, Placement]] = []  # (PreferNoSchedule taints not tolerated, order, card)
        why: dict[str, int] = {}
        for order, (node, cards) in enumerate(self.nodes.items()):
            obj = self.cluster.node(node)
            if obj is None:
                why["not found"] = why.get("not found", 0) + 1
                continue
            repelling = self._repelling(obj, tolerations)
            if repelling is not None:
                key = f"had untolerated taint {{{repelling}}}"
                why[key] = why.get(key, 0) + 1
                continue
            card = self._free_card(node, cards)
            if card is None:
                key = ("cannot allocate all claims" if self.mode == "dra" else f"Insufficient {GPU_RESOURCE}")
                why[key] = why.get(key, 0) + 1
                continue
            prefer_not = sum(1 for t in self._taints(obj)
                             if t.get("effect") == "PreferNoSchedule" and not tolerated(t, tolerations))
            fits.append((prefer_not, order, card))
        if not fits:
            self.refusals[pod] = (f"0/{len(self.nodes)} nodes are available: "
                                  + ", ".join(f"{n} node(s) {reason}" for reason, n in sorted(why.items())) + ".")
            return None
        _, _, card = min(fits, key=lambda f: (f[0], f[1]))
        self._held[pod] = card
        self.refusals.pop(pod, None)
        return card

    def release(self, pod: str) -> Placement | None:
        """The pod is gone: its card is free again. What it held, None when it held nothing."""
        self.refusals.pop(pod, None)
        return self._held.pop(pod, None)

    def placement(self, pod: str) -> Placement | None:
        return self._held.get(pod)

    def held(self) -> dict[str, Placement]:
        """pod -> its card, for every pod holding one."""
        return dict(self._held)

    def tainted_devices(self) -> list[tuple[str, str]]:
        """(pool, device) of every device a NoSchedule / NoExecute DeviceTaintRule keeps out now."""
        rules = self._device_rules()
        return [(node, f"gpu-{i}") for node, cards in self.nodes.items() for i in range(cards)
                if any(rule_matches(r, self.driver, node, f"gpu-{i}") for r in rules)]

    # --- the filters -------------------------------------------------------------------------------------------

    def _tolerations(self, pod: str, namespace: str | None) -> list[JSON]:
        if namespace is not None:
            found = self.cluster.read("pods", namespace, pod)
        else:
            found = next((p for p in self.cluster.stored("pods") if p["metadata"]["name"] == pod), None)
        return list(((found or {}).get("spec") or {}).get("tolerations") or [])

    @staticmethod
    def _taints(node: JSON) -> list[JSON]:
        taints = list((node.get("spec") or {}).get("taints") or [])
        if (node.get("spec") or {}).get("unschedulable"):
            taints.append(UNSCHEDULABLE_TAINT)
        return taints

    def _repelling(self, node: JSON, tolerations: list[JSON]) -> str | None:
        """The first taint of the node that keeps the pod out, as `key: value` (None: none does)."""
        for taint in self._taints(node):
            if taint.get("effect") in REPELLING and not tolerated(taint, tolerations):
                return f"{taint.get('key')}: {taint['value']}" if taint.get("value") else str(taint.get("key"))
        return None

    def _device_rules(self) -> list[JSON]:
        if self.mode != "dra":
            return []
        return [r for r in self.cluster.stored("devicetaintrules")
                if ((r.get("spec") or {}).get("taint") or {}).get("effect") in REPELLING]

    def _free_card(self, node: str, cards: int) -> Placement | None:
        taken = {p.index for p in self._held.values() if p.node == node}
        rules = self._device_rules()
        for i in range(cards):
            if i in taken:
                continue
            if self.mode == "device_plugin":
                uuid = card_uuid(node, i)
                return Placement(node=node, index=i, device=uuid, card=uuid, uuid=uuid)
            device = f"gpu-{i}"
            if any(rule_matches(r, self.driver, node, device) for r in rules):
                continue
            return Placement(node=node, index=i, device=device, card=f"{self.driver}/{node}/{device}",
                             driver=self.driver, uuid=card_uuid(node, i))
        return None
