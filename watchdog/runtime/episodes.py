"""Report-only episodes: told once when they begin and once when they end, never acted on.

Busy (canary timeouts while the server's work counter advances), progress unknown (timeouts while
the counter, readable before, cannot be read) and idle memory growth (active memory at idle above
the process's own baseline) each deserve one log line and one metric per episode, not one per
sample, and none of them is a reason to restart.
"""

from __future__ import annotations

from gpu_watchdog import logs
from gpu_watchdog.watchdog.core import idle_memory, policy
from gpu_watchdog.watchdog.core.history import History
from gpu_watchdog.watchdog.core.settings import PolicySettings
from gpu_watchdog.watchdog.edge.metrics import WatchdogMetrics

log = logs.get("watchdog")


class Episodes:
    def __init__(self, metrics: WatchdogMetrics) -> None:
        self.metrics = metrics
        # Which episodes were told as begun: the loop's own log bookkeeping (the figures are the fold's).
        self._saturated = False
        self._progress_unknown = False

    def follow_target(self, settings: PolicySettings, history: History, now: float) -> None:
        now_saturated, figures = policy.saturated(history)
        last = history.canaries[-1] if history.canaries else None
        ended = None if last is None else ("ok" if last.ok else last.error_class)
        if now_saturated and not self._saturated:
            self.metrics.saturation_episodes.inc()
            # Busy is not hung: no restart, readiness held. Logged once per episode.
            log.warning("saturated", action="none", **figures)
        elif self._saturated and not now_saturated:
            log.info("saturation_ended", canary=ended)
        self._saturated = now_saturated
        unknown, figures = policy.progress_unknown(settings, history, now)
        if unknown and not self._progress_unknown:
            self.metrics.progress_unknown_episodes.inc()
            # No evidence either way: not a hang, readiness held, for at most no_evidence_after.
            log.warning("progress_unknown", action="none", **figures)
        elif self._progress_unknown and not unknown:
            log.info("progress_unknown_ended", canary=ended, state=policy.target_state(history, settings, now))
        self._progress_unknown = unknown

    def follow_idle_memory(self, before: idle_memory.IdleMemory | None, after: idle_memory.IdleMemory | None) -> None:
        """The fold's idle-memory figures before and after an allocator sample (`History.idle_memory`)."""
        if after is None:
            return
        # A new process starts from its own baseline: only a change within one process is news.
        was = before is not None and before.instance_id == after.instance_id and before.growing
        if after.growing == was:
            return
        figures = {"baseline_bytes": after.baseline_bytes, "idle_active_bytes": after.current_bytes,
                   "growth_bytes": after.growth_bytes, "growth_ratio": round(after.growth_ratio, 4),
                   "since_s": round(after.at - after.first_at, 1), "instance_id": after.instance_id}
        if after.growing:
            # Report only: a leak is not a failure until it OOMs (handled), and max_age bounds it.
            log.warning("idle_memory_growth", action="none", warn_ratio=idle_memory.WARN_RATIO, **figures)
        else:
            log.info("idle_memory_back_to_baseline", **figures)
