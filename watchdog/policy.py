"""The decision rules: a pure function of (settings, history, now) -> decisions with a reason.

No I/O and no clock of its own: everything it knows comes in through its arguments, so every
rule is tested on recorded traces.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from statistics import median
from typing import Any

from watchdog.config import PolicySettings
from watchdog.samples import History, TorchSample

# Xid classes (NVIDIA Xid catalog). App faults kill the process's context; hardware ones need
# the GPU reset, which a pod restart also triggers on most setups; warnings never restart.
XID_APP_FAULT = frozenset({13, 31, 43, 45, 68})
XID_ECC = frozenset({48, 94})
XID_HARDWARE = frozenset({46, 62, 64, 74, 79, 95, 109, 119, 120})
XID_CRITICAL = XID_APP_FAULT | XID_ECC | XID_HARDWARE
XID_WARN_ONLY = frozenset({63, 92})

RESTART_REASONS = ("context_loss", "hang", "fragmentation_drift", "max_age")
EMPTY_CACHE_REASONS = ("memory_pressure", "oom", "fragmentation_drift")


@dataclass(frozen=True)
class Decision:
    action: str  # restart | empty_cache
    reason: str
    detail: dict[str, Any] = field(default_factory=dict)
    drain: bool = True
    allowed: bool = True
    blocked_by: str | None = None
    instance_id: str | None = None


def budget_remaining(settings: PolicySettings, history: History, now: float) -> int:
    used = len(history.restarts_within(now, settings.restart_budget.window))
    return max(0, settings.restart_budget.max_restarts - used)


def decide(settings: PolicySettings, history: History, now: float) -> list[Decision]:
    if history.restart_in_progress:
        return []
    restart = _restart_rule(settings, history, now)
    if restart is not None:
        if budget_remaining(settings, history, now) <= 0:
            restart = Decision(restart.action, restart.reason, restart.detail, restart.drain, allowed=False,
                               blocked_by="restart_budget", instance_id=restart.instance_id)
            # A blocked restart must not hide a cache flush that may still help.
            return [restart, *_cache_rules(settings, history, now)]
        return [restart]
    return _cache_rules(settings, history, now)


def _latest_instance(history: History) -> str | None:
    samples = history.torch_since_epoch()
    if samples:
        return samples[-1].instance_id
    canaries = history.canaries_since_epoch()
    return canaries[-1].instance_id if canaries else None


def _restart_rule(settings: PolicySettings, h: History, now: float) -> Decision | None:
    return (
        _context_loss(h)
        or _hang(settings, h)
        or _fragmentation_restart(settings, h, now)
        or _max_age(settings, h, now)
    )


def _context_loss(h: History) -> Decision | None:
    canaries = h.canaries_since_epoch()
    if canaries and canaries[-1].error_class == "fatal_cuda":
        c = canaries[-1]
        return Decision("restart", "context_loss", {"evidence": "canary", "error": c.error}, drain=False,
                        instance_id=c.instance_id)
    torch = h.torch_since_epoch()
    if torch and torch[-1].poisoned:
        t = torch[-1]
        return Decision("restart", "context_loss", {"evidence": "poisoned_flag", "error": t.poison_reason},
                        drain=False, instance_id=t.instance_id)
    gpu = h.gpu
    if gpu is not None and gpu.lost and gpu.at >= h.epoch:
        return Decision("restart", "context_loss", {"evidence": "gpu_lost", "uuid": gpu.uuid}, drain=False,
                        instance_id=_latest_instance(h))
    our_uuid = _our_uuid(h)
    for ev in h.xids:
        if ev.at < h.epoch or ev.xid not in XID_CRITICAL:
            continue
        if our_uuid is not None and ev.uuid is not None and ev.uuid != our_uuid:
            continue  # another GPU on the node: not our process's context
        kind = "app_fault" if ev.xid in XID_APP_FAULT else "ecc" if ev.xid in XID_ECC else "hardware"
        return Decision("restart", "context_loss", {"evidence": "xid", "xid": ev.xid, "class": kind, "uuid": ev.uuid},
                        drain=False, instance_id=_latest_instance(h))
    return None


def _our_uuid(h: History) -> str | None:
    return h.torch_uuid() or (h.gpu.uuid if h.gpu is not None else None)


def _hang(settings: PolicySettings, h: History) -> Decision | None:
    n = settings.hang.consecutive_timeouts
    canaries = h.canaries_since_epoch()
    recent = canaries[-n:]
    if len(recent) < n or not all(c.error_class == "timeout" for c in recent):
        return None
    # A hung kernel never finishes, so there is nothing to drain.
    return Decision("restart", "hang", {"consecutive_timeouts": n, "last_latency_s": recent[-1].latency_s},
                    drain=False, instance_id=recent[-1].instance_id or _latest_instance(h))


def _sample_signals(settings: PolicySettings, prev: TorchSample | None, cur: TorchSample) -> dict[str, Any]:
    """Fragmentation evidence in one allocator sample (against the one before it); empty when none."""
    signals: dict[str, Any] = {}
    if cur.reserved_bytes <= 0:
        return signals
    if cur.fragmentation_ratio >= settings.fragmentation.ratio:
        signals["fragmentation_ratio"] = round(cur.fragmentation_ratio, 4)
        signals["reserved_bytes"] = cur.reserved_bytes
        signals["allocated_bytes"] = cur.allocated_bytes
    if prev is not None and cur.alloc_retries > prev.alloc_retries:
        signals["alloc_retries_delta"] = cur.alloc_retries - prev.alloc_retries
    if cur.injected and signals:
        signals["injected"] = True
    return signals


def _drift_signals(settings: PolicySettings, h: History) -> dict[str, Any]:
    """Evidence of fragmentation in the latest figures; empty when there is none."""
    f = settings.fragmentation
    signals: dict[str, Any] = {}
    torch = h.torch_since_epoch()
    if torch:
        signals = _sample_signals(settings, torch[-2] if len(torch) >= 2 else None, torch[-1])
    if f.latency_factor > 0:
        oks = [c.latency_s for c in h.canaries_since_epoch() if c.ok]
        if len(oks) >= 8:
            baseline = median(oks[:5])
            current = median(oks[-3:])
            if baseline > 0 and current >= f.latency_factor * baseline:
                signals["canary_latency_s"] = round(current, 4)
                signals["canary_baseline_s"] = round(baseline, 4)
    return signals


def _episode_start(settings: PolicySettings, h: History) -> float:
    """When the current drift began: just after the last allocator sample that showed none.

    A flush that cured an earlier episode must not count against this one, or a pod whose
    fragmentation empty_cache keeps fixing would eventually be restarted for it.
    """
    samples = h.torch_since_epoch()
    for i in range(len(samples) - 1, -1, -1):
        prev = samples[i - 1] if i > 0 else None
        if not _sample_signals(settings, prev, samples[i]):
            return samples[i].at
    return h.epoch


def _fragmentation_attempts(settings: PolicySettings, h: History, now: float) -> list[float]:
    window = settings.fragmentation.window
    start = max(h.epoch, _episode_start(settings, h))
    return [a.at for a in h.actions
            if a.action == "empty_cache" and a.reason == "fragmentation_drift" and a.at >= start
            and now - a.at < window]


def _fresh_after(h: History, at: float) -> TorchSample | None:
    """The first reachable allocator sample taken after `at`: the effect of an action."""
    for t in h.torch:
        if t.reachable and t.at > at:
            return t
    return None


def _fragmentation_restart(settings: PolicySettings, h: History, now: float) -> Decision | None:
    signals = _drift_signals(settings, h)
    if not signals:
        return None
    attempts = _fragmentation_attempts(settings, h, now)
    if len(attempts) < settings.fragmentation.empty_cache_attempts:
        return None
    if _fresh_after(h, attempts[-1]) is None:
        return None  # the last flush's effect is not observed yet
    return Decision("restart", "fragmentation_drift",
                    {**signals, "empty_cache_attempts": len(attempts)}, drain=True, instance_id=_latest_instance(h))


def _max_age(settings: PolicySettings, h: History, now: float) -> Decision | None:
    if settings.max_age <= 0:
        return None
    torch = h.torch_since_epoch()
    age = torch[-1].uptime_s + (now - torch[-1].at) if torch else now - max(h.started_at, h.epoch)
    limit = settings.max_age * (1.0 + h.jitter)
    if age < limit:
        return None
    return Decision("restart", "max_age", {"age_s": round(age, 1), "max_age_s": round(limit, 1)}, drain=True,
                    instance_id=_latest_instance(h))


def _cache_rules(settings: PolicySettings, h: History, now: float) -> list[Decision]:
    torch = h.torch_since_epoch()
    if not torch:
        return []
    last = torch[-1]
    flushes = [a.at for a in h.actions if a.action == "empty_cache"]
    last_flush = flushes[-1] if flushes else None
    if last_flush is not None and last.at <= last_flush:
        return []  # wait for figures taken after the last flush
    signals = _drift_signals(settings, h)
    if signals and len(_fragmentation_attempts(settings, h, now)) < settings.fragmentation.empty_cache_attempts:
        return [Decision("empty_cache", "fragmentation_drift", signals, instance_id=last.instance_id)]
    cooled = last_flush is None or now - last_flush >= settings.memory_pressure.cooldown
    if not cooled:
        return []
    if len(torch) >= 2 and last.ooms > torch[-2].ooms:
        return [Decision("empty_cache", "oom", {"ooms": last.ooms, "new_ooms": last.ooms - torch[-2].ooms},
                         instance_id=last.instance_id)]
    if last.total_bytes > 0 and last.reserved_bytes / last.total_bytes >= settings.memory_pressure.reserved_ratio:
        return [Decision("empty_cache", "memory_pressure",
                         {"reserved_bytes": last.reserved_bytes, "total_bytes": last.total_bytes,
                          "reserved_ratio": round(last.reserved_bytes / last.total_bytes, 4)},
                         instance_id=last.instance_id)]
    return []
