"""What the watchdog shows: states, readiness, `/status` and the metrics snapshot, built from the fold
alone (the history, its edges' facts among it) and the settings."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from gpu_watchdog.watchdog.core import correctness, edges, names, policy
from gpu_watchdog.watchdog.core.fleet import FleetView
from gpu_watchdog.watchdog.core.history import History
from gpu_watchdog.watchdog.core.idle_memory import IdleMemory
from gpu_watchdog.watchdog.core.samples import CanarySample, GpuSample, ServerSample, TorchSample
from gpu_watchdog.watchdog.core.settings import Settings

# One worker of the service: its index, its last allocator read and its last canary (None: none yet).
WorkerRow = tuple[int, TorchSample | None, CanarySample | None]


@dataclass
class Snapshot:
    gpus: tuple[GpuSample, ...] = ()
    torch: TorchSample | None = None
    canary: CanarySample | None = None
    server: ServerSample | None = None
    budget_remaining: int = 0
    states: frozenset[str] = frozenset()
    idle_memory: IdleMemory | None = None
    admission_limit: int | None = None
    suspects: tuple[str, ...] = ()
    fleet: FleetView | None = None  # only where the workload's ledger is read
    workload: str | None = None
    # `target.workers` > 1: every worker as last read (0: the watched one), and its latest canary.
    workers: tuple[WorkerRow, ...] = ()
    # Shadow decisions (policy.enforce) by (action, reason), counted since the sidecar started.
    would: tuple[tuple[str, str, int], ...] = ()


def fleet_of(h: History) -> FleetView | None:
    """The workload's ledger as last seen, where restarts go through one."""
    return h.edge.fleet if h.edge.fleet.lease else None


def states(settings: Settings, h: History, now: float) -> frozenset[str]:
    out: set[str] = set()
    e = h.edge
    target = policy.target_state(h, settings.policy, now)
    if target is not None and not h.restart_acting:
        out.add(target)
    last_canary = h.canaries[-1] if h.canaries else None
    last_torch = h.torch[-1] if h.torch else None
    if h.restart_in_progress:
        out.add(names.RESTART_WAITING if h.restart_waiting else names.RESTARTING)
    if edges.not_recorded_now(e, now) is not None:
        out.add(names.RESTART_NOT_RECORDED)
    if last_canary is not None and not last_canary.ok and target not in (names.SATURATED, names.PROGRESS_UNKNOWN):
        out.add(names.CANARY_FAILING)
    if (last_canary is not None and last_canary.error_class == "unreachable") or (
            last_torch is not None and not last_torch.reachable):
        out.add(names.TARGET_UNREACHABLE)
    if policy.budget_remaining(settings.policy, h, now, h.budget_from_events) <= 0:
        out.add(names.BUDGET_EXHAUSTED)
    if not e.nvml_available:
        out.add(names.NVML_UNAVAILABLE)
    elif policy.gpus_unknown(h):
        out.add(names.GPUS_UNKNOWN)
    if e.suspects:
        out.add(names.GPU_SUSPECT)
    f = fleet_of(h)
    if f is not None:
        if f.held is not None:
            out.add(f.held)
        if f.breaker is not None:
            out.add(names.FLEET_BREAKER_OPEN)
        if f.error is not None:
            out.add(names.FLEET_LEDGER_UNKNOWN)
    if h.server_metrics_url is not None and (not h.server or not h.server[-1].reachable):
        out.add(names.SERVER_METRICS_UNAVAILABLE)
    return frozenset(out)


def ready(settings: Settings, h: History, now: float) -> tuple[bool, dict[str, Any]]:
    ok = policy.serviceable(h, settings.policy, now)
    if ok:
        return True, {"ready": True, "reason": None, "state": policy.target_state(h, settings.policy, now)}
    last = h.canaries[-1] if h.canaries else None
    if h.restart_acting:
        reason = "restarting"
    elif last is not None and last.ok and last.draining:
        reason = "draining: the server admits nothing"
    elif h.served_at is None:
        reason = "no successful canary yet" if last is None or last.ok else f"starting: canary {last.error_class}"
    else:
        reason = f"canary failed: {last.error_class}" if last is not None else "no canary yet"
    return False, {"ready": False, "reason": reason}


def snapshot(settings: Settings, h: History, now: float) -> Snapshot:
    return Snapshot(
        gpus=h.gpus,
        torch=next((t for t in reversed(h.torch) if t.reachable), None),
        canary=h.canaries[-1] if h.canaries else None,
        server=next((s for s in reversed(h.server) if s.reachable), None),
        budget_remaining=policy.budget_remaining(settings.policy, h, now, h.budget_from_events),
        states=states(settings, h, now),
        idle_memory=h.idle_memory,
        suspects=tuple(sp.uuid for sp in h.edge.suspects),
        admission_limit=h.ladder.limit if h.ladder is not None else None,
        fleet=fleet_of(h),
        workload=h.workload,
        workers=_workers_snapshot(settings, h),
        would=tuple(would_counts(h)),
    )


def _workers_snapshot(settings: Settings, h: History) -> tuple[WorkerRow, ...]:
    if settings.target.workers < 2:
        return ()
    first = (0, next((t for t in reversed(h.torch) if t.at >= h.epoch), None), h.canaries[-1] if h.canaries else None)
    others = [] if h.workers is None else [
        (w.worker, w.memory, (h.worker_canaries.get(w.worker) or [None])[-1]) for w in h.workers.workers]
    return (first, *others)


def status(settings: Settings, h: History, now: float, wall_now: float) -> dict[str, Any]:
    def asdict(obj: Any) -> Any:
        return None if obj is None else dataclasses.asdict(obj)

    sat, sat_figures = policy.saturated(h)
    unknown, unknown_figures = policy.progress_unknown(settings.policy, h, now)
    ours = policy.our_gpus(h)
    unavailable = next((g.reason for g in h.gpus if not g.available), None)
    e, fleet, idle = h.edge, fleet_of(h), h.idle_memory
    return {
        "states": sorted(states(settings, h, now)),
        "ready": policy.serviceable(h, settings.policy, now),
        "strategy": h.strategy,
        "target": {"state": policy.target_state(h, settings.policy, now), "served_at_s": None
                   if h.served_at is None else round(h.served_at - h.started_at, 3), "canary": h.edge.canary,
                   "saturation": sat_figures if sat else None,
                   # The server said so in its last canary answer: drained (by us, an operator or its
                   # own shutdown), admitting nothing; a control drain ends at its deadline.
                   "draining": bool(h.canaries and h.canaries[-1].draining),
                   "progress_unknown": unknown_figures if unknown else None},
        "nvml": {"available": e.nvml_available, "reason": unavailable},
        "gpus": {"ours": list(ours) if ours else None, "source": "kubelet" if h.pod_gpus else
                 "inference process" if ours else None, "visible": h.gpus_visible,
                 "pod_resources_error": e.pod_gpus_error,
                 "note": f"{h.gpus_visible} GPUs visible and the pod's are unknown: not sampled, and no Xid"
                         " restarts" if policy.gpus_unknown(h) else None},
        "server_metrics": {"url": h.server_metrics_url,
                           "last": asdict(h.server[-1] if h.server else None)},
        "uptime_s": round(now - h.started_at, 3),
        "restart_budget_remaining": policy.budget_remaining(settings.policy, h, now, h.budget_from_events),
        "restart_budget": {"scope": "workload" if h.budget_from_events else "pod",
                           "workload": h.workload, "read_error": e.budget_read_error,
                           "replicas": h.replicas,
                           "allowance": policy.workload_allowance(settings.policy, h.replicas)
                           if h.budget_from_events else None,
                           "lineage_bound": settings.policy.restart_budget.max_restarts,
                           "read_s_ago": None if h.workload_read_at is None else round(now - h.workload_read_at, 1),
                           "ignored_future_records": len(e.ignored_records)},
        "event_loop_lag_s": e.loop_lag,
        "workers": workers_status(settings, h, now),
        "restart_in_progress": h.restart_in_progress,
        "restart_waiting": h.restart_waiting,
        "restart_failed": e.restart_failed,
        "restart_not_recorded": edges.not_recorded_now(e, now),
        "fleet": None if fleet is None else fleet_status(fleet),
        "quarantine": edges.quarantine_status(e, settings.policy.quarantine.enabled, fleet is not None, wall_now),
        "placement": edges.placement_status(e, settings.policy.placement) if h.keeps_out else None,
        "correctness": correctness_status(settings, h),
        "last_samples": {"gpus": [dataclasses.asdict(g) for g in h.gpus], "torch": asdict(h.torch[-1] if h.torch
                                                                                          else None),
                         "canary": asdict(h.canaries[-1] if h.canaries else None)},
        "idle_memory": None if idle is None else {
            **dataclasses.asdict(idle), "growth_bytes": idle.growth_bytes,
            "growth_ratio": round(idle.growth_ratio, 6), "growing": idle.growing},
        "admission": None if h.ladder is None else {
            **dataclasses.asdict(h.ladder), "enabled": settings.policy.admission.enabled,
            # Seconds of the limit in full use (only those count) before the next probe.
            "next_probe_in_s": None if h.ladder.limit >= h.ladder.ceiling
            else round(max(0.0, h.ladder.wait - h.ladder.used), 1)},
        "gpu_suspect": [{"uuid": sp.uuid, "restarts": len(sp.restarts), "reasons": sp.reasons, "xids": sp.xids,
                         "driver_says": sp.driver_says, "node_action": sp.node_action,
                         "answers": sp.answers} for sp in e.suspects],
        "shadow": shadow_status(settings, h),
        "last_decisions": [d.to_json() for d in list(h.decisions)[-20:]],
        "restarts": [dataclasses.asdict(a) for a in h.actions if a.action == "restart"][-20:],
    }


def correctness_status(settings: Settings, h: History) -> dict[str, Any] | None:
    """Answers checked: the fleet's agreement, and this process's latest comparisons."""
    c = settings.policy.correctness
    if not c.enabled:
        return None
    probes = h.probes_since_epoch()
    run = 0
    for p in reversed([p for p in probes if p.result in (correctness.MATCH, *correctness.DEVIATIONS)]):
        if p.result == correctness.MATCH:
            break
        run += 1
    return {"reference": h.edge.correctness or None, "every_canaries": c.every, "margin": c.margin,
            "tolerance": c.tolerance, "consecutive": c.consecutive, "deviations_in_a_row": run,
            "last": [dataclasses.asdict(p) for p in probes[-5:]]}


def workers_status(settings: Settings, h: History, now: float) -> dict[str, Any] | None:
    """The service's workers: the first is the target (its canary, allocator and decisions above),
    the others as their control APIs last answered."""
    if settings.target.workers < 2:
        return None
    def canary(k: int) -> dict[str, Any] | None:
        run = h.worker_canaries.get(k)
        if not run:
            return None
        c = run[-1]
        return {"ok": c.ok, "error_class": c.error_class, "latency_s": round(c.latency_s, 3),
                "s_ago": round(now - c.at, 1)}

    seen = [] if h.workers is None else [
        {"worker": w.worker, "url": w.url, "reachable": w.memory.reachable, "error": w.memory.error,
         "instance_id": w.memory.instance_id, "device": w.memory.device, "uuid": w.memory.uuid,
         "poisoned": w.memory.poisoned, "inflight": w.memory.inflight, "queued": w.memory.queued,
         "admission_limit": w.memory.admission_limit, "canary": canary(w.worker)} for w in h.workers.workers]
    # Every worker is decided for: the first by every rule above, the others for a hang of their own
    # canaries (a poisoned one exits by itself and its server replaces it).
    return {"count": settings.target.workers, "decided_for": list(range(settings.target.workers)),
            "read_s_ago": None if h.workers is None else round(now - h.workers.at, 1), "others": seen}


def fleet_status(f: FleetView) -> dict[str, Any]:
    b = f.breaker
    return {
        "lease": f.lease, "replicas": f.replicas, "max_unavailable": f.max_unavailable,
        "unavailable": len(f.restarting), "restarting": list(f.restarting), "slot_held": f.slot_held,
        "held": f.held, "held_detail": f.held_detail, "ledger_error": f.error,
        "breaker": None if b is None else {"open": True, "reason": b.reason, "opened_at": b.opened_at,
                                           "restarted": list(b.restarted), "replicas": b.replicas,
                                           "opened_by": b.opened_by, "last_held_at": b.held_at},
        names.FLEET_UNAVAILABLE_LIMIT: f.held == names.FLEET_UNAVAILABLE_LIMIT,
    }


def shadow_status(settings: Settings, h: History) -> dict[str, Any]:
    """What is enforced, and what was decided and not performed (`policy.enforce`): the counts since
    the sidecar started, and the latest of those decisions."""
    enforce = settings.policy.enforce
    return {
        "enforce": list(enforce),
        "enforced": {a: policy.enforced(settings.policy, a, "") or any(r in enforce for r in _reasons(a))
                     for a in names.ENFORCEABLE_ACTIONS},
        "would": [{"action": a, "reason": r, "count": n} for a, r, n in would_counts(h)],
        "recent": [d.to_json() for d in h.decisions if d.outcome == names.WOULD][-20:],
        # Served by our servers, and refused had the quarantine been enforced.
        "would_refuse": h.edge.would_refuse,
    }


def _reasons(action: str) -> tuple[str, ...]:
    """The reasons that enforce `action` for some of its decisions (quarantine and placement: none)."""
    return {names.RESTART: names.RESTART_REASONS, names.EMPTY_CACHE: names.EMPTY_CACHE_REASONS,
            names.ADMISSION: (names.OOM, names.RECOVERED)}.get(action, ())


def would_counts(h: History) -> list[tuple[str, str, int]]:
    """(action, reason, count) of every shadow decision since the sidecar started."""
    out = []
    for key, n in sorted(h.would.items()):
        action, _, reason = key.partition(":")
        out.append((action, reason, n))
    return out
