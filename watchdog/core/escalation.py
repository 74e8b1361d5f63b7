"""Restarts that do not cure: the same GPU restarted for context loss or hangs again and again.

Pure: from the restart records read back from the namespace's Events (each restart's Event names
the pod's GPU UUIDs), which GPUs are suspect. A pod restart cannot fix a failing GPU: the new pod
may land on the same card. Reporting it (an Event on the Node, optionally a Node condition) lets
node-level remediation act; the watchdog itself never taints, cordons or drains a node. Where the
driver itself says the GPU needs a reset or the node a reboot, the GPU is suspect at once
(`driver_says`): no restart has to fail first.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from gpu_watchdog.watchdog.core.names import CONTEXT_LOSS, CORRUPT, HANG, RESTART_REASONS
from gpu_watchdog.watchdog.core.settings import EscalationSettings
from gpu_watchdog.watchdog.core.timing import FUTURE_S

CURING_REASONS = (CONTEXT_LOSS, HANG)  # restarts meant to cure the GPU's state, not the process's age
# Restarts that, when they do not cure, make the card suspect. A corrupt answer is no request's fault,
# so it is not among the curing reasons whose in-flight requests are the query of death's evidence.
SUSPECT_REASONS = (*CURING_REASONS, CORRUPT)
GPUS_ANNOTATION = "gpu-watchdog.io/gpus"
REASON_ANNOTATION = "gpu-watchdog.io/reason"
XID_ANNOTATION = "gpu-watchdog.io/xid"
# The workload (Deployment) whose restart budget a restart Event counts against.
WORKLOAD_ANNOTATION = "gpu-watchdog.io/workload"
# The node the restarted pod ran on: one lineage of a restart loop where the GPUs are not known.
NODE_ANNOTATION = "gpu-watchdog.io/node"
# The request fingerprints in flight at a hang or a lost context (the query of death's evidence).
INFLIGHT_ANNOTATION = "gpu-watchdog.io/inflight"


@dataclass(frozen=True)
class RestartRecord:
    at: float  # seconds since the epoch
    reason: str
    gpus: tuple[str, ...]
    pod: str
    xid: int | None = None
    workload: str | None = None
    node: str | None = None


@dataclass(frozen=True)
class Suspect:
    uuid: str
    restarts: tuple[RestartRecord, ...]
    # Suspect on the driver's word rather than by restarts: NVML's recovery action (GPU_RESET, ...)
    # or the Xid catalog's immediate action (RESET_GPU, RESTART_BM, ...), and what the node needs.
    driver_says: str | None = None
    node_action: str | None = None
    xid: int | None = None  # the Xid the driver's word came with
    # Suspect on its answers: wrong again after a restart on it (what differed).
    answers: str | None = None

    @property
    def reasons(self) -> list[str]:
        return sorted({r.reason for r in self.restarts})

    @property
    def xids(self) -> list[int]:
        return sorted({r.xid for r in self.restarts if r.xid is not None} | ({self.xid} if self.xid else set()))




def believable(records: list[RestartRecord], now: float) -> tuple[list[RestartRecord], list[RestartRecord]]:
    """The records to count, and those dated in the future, which are not: a record dated ahead would
    keep counting until it expired (a forged Event, or a node's clock far off).

    The API does not say who wrote an Event, so a forged one that claims to be ours is counted: it
    can only spend the budget (fewer restarts), never grant one."""
    kept = [r for r in records if r.at <= now + FUTURE_S]
    return kept, [r for r in records if r.at > now + FUTURE_S]


def suspects(settings: EscalationSettings, records: list[RestartRecord], now: float,
             ours: tuple[str, ...] | None) -> list[Suspect]:
    """Our GPUs with at least `restarts` curing restarts within `window`."""
    by_gpu: dict[str, list[RestartRecord]] = defaultdict(list)
    for r in records:
        if r.reason in SUSPECT_REASONS and now - r.at < settings.window:
            for uuid in r.gpus:
                by_gpu[uuid].append(r)
    return [Suspect(uuid, tuple(sorted(rs, key=lambda r: r.at))) for uuid, rs in sorted(by_gpu.items())
            if len(rs) >= settings.restarts and (ours is None or uuid in ours)]


def driver_says(reason: str, detail: Mapping[str, Any]) -> Suspect | None:
    """A restart decided on the driver's word that the GPU needs more than a new process (a `node_action`
    in its detail): the Node is told at once. The GPU is the one the evidence names, else the pod's only
    one, else "unknown" (the Node still hears that one of its GPUs needs it)."""
    node_action = detail.get("node_action")
    if reason != CONTEXT_LOSS or not node_action:
        return None
    word = detail.get("recovery_action") if detail.get("evidence") == "recovery_action" else detail.get("bucket")
    gpus = list(detail.get("gpus") or [])
    uuid = detail.get("uuid") or (gpus[0] if len(gpus) == 1 else "unknown")
    xid = detail.get("xid")
    return Suspect(str(uuid), (), driver_says=str(word or node_action), node_action=str(node_action),
                   xid=xid if isinstance(xid, int) else None)


def answers_wrong(reason: str, detail: Mapping[str, Any]) -> Suspect | None:
    """A process restarted for corrupt answers whose successor on the same card answers wrong again: the
    card is suspect now (the Node is told), whatever the rung can do about it."""
    if reason != CORRUPT or not detail.get("after_restart"):
        return None
    gpus = list(detail.get("gpus") or [])
    differed = detail.get("differed") or {}
    what = ", ".join(f"{k} {differed[k]}" for k in ("probe", "step", "expected", "got") if k in differed)
    return Suspect(str(gpus[0] if len(gpus) == 1 else "unknown"), (),
                   answers=f"its answers deviate from the fleet's reference again after a restart ({what})")


def workload_restarts(records: list[RestartRecord], workload: str | None) -> tuple[RestartRecord, ...]:
    """The workload's pods' restarts (any generation's, any reason), oldest first."""
    if not workload:
        return ()
    return tuple(sorted((r for r in records if r.workload == workload and r.reason in RESTART_REASONS),
                        key=lambda r: r.at))
