"""Restart strategies: evict (PDB-respecting), delete, local (restart the child process), none."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any, Protocol

from watchdog import logs
from watchdog.actions.kube import PodActions, RefusedError, event_reason
from watchdog.config import RestartSettings
from watchdog.escalation import GPUS_ANNOTATION, REASON_ANNOTATION, XID_ANNOTATION
from watchdog.policy import Decision

log = logs.get("watchdog.restart")

Sleep = Callable[[float], Awaitable[None]]


@dataclass(frozen=True)
class RestartOutcome:
    done: bool
    detail: str
    attempts: int = 1


class Restarter(Protocol):
    strategy: str

    async def restart(self, decision: Decision) -> RestartOutcome: ...


def annotations_for(decision: Decision) -> dict[str, str]:
    """What a later sidecar reads back: which GPUs a curing restart was for, and why."""
    gpus = decision.detail.get("gpus")
    if not gpus:
        return {}
    out = {GPUS_ANNOTATION: ",".join(gpus), REASON_ANNOTATION: decision.reason}
    if isinstance(decision.detail.get("xid"), int):
        out[XID_ANNOTATION] = str(decision.detail["xid"])
    return out


def note_for(decision: Decision) -> str:
    figures = json.dumps(decision.detail, sort_keys=True, default=str)
    return f"gpu-watchdog restarts this pod: {decision.reason}; {figures}"


class KubeRestarter:
    """Evict (or delete) our pod; a PodDisruptionBudget's 429 means wait and retry, staying unready."""

    def __init__(self, pod: PodActions, settings: RestartSettings, sleep: Sleep = asyncio.sleep) -> None:
        self.pod = pod
        self.settings = settings
        self.strategy = settings.strategy
        self.sleep = sleep

    async def _event(self, decision: Decision, action: str) -> None:
        for attempt in range(3):
            try:
                await asyncio.to_thread(self.pod.record_event, self.pod.pod_name, self.pod.namespace,
                                        event_reason(decision.reason), note_for(decision), action,
                                        annotations=annotations_for(decision))
                return
            except RefusedError:
                raise
            except Exception as exc:
                log.warning("event_failed", attempt=attempt + 1, error=_describe(exc))
                await self.sleep(min(self.settings.retry_initial * 2**attempt, self.settings.retry_max))

    async def restart(self, decision: Decision) -> RestartOutcome:
        s = self.settings
        grace = None if s.grace_period is None else int(s.grace_period)
        action = "Evict" if self.strategy == "evict" else "Delete"
        await self._event(decision, action)
        delay = s.retry_initial
        for attempt in range(1, s.max_attempts + 1):
            try:
                if self.strategy == "evict":
                    await asyncio.to_thread(self.pod.evict, self.pod.pod_name, self.pod.namespace, grace)
                else:
                    await asyncio.to_thread(self.pod.delete, self.pod.pod_name, self.pod.namespace, grace)
                log.warning("pod_restart_requested", strategy=self.strategy, reason=decision.reason,
                            pod=self.pod.pod_name, namespace=self.pod.namespace, attempt=attempt)
                return RestartOutcome(True, f"{self.strategy} accepted", attempt)
            except RefusedError:
                raise
            except Exception as exc:
                status = getattr(exc, "status", None)
                if status == 404:
                    return RestartOutcome(True, "pod already gone", attempt)
                if status == 429:
                    log.warning("eviction_blocked_by_pdb", attempt=attempt, retry_in_s=delay,
                                pod=self.pod.pod_name)
                else:
                    log.error("restart_api_error", strategy=self.strategy, attempt=attempt, status=status,
                              error=_describe(exc), retry_in_s=delay)
                if attempt == s.max_attempts:
                    return RestartOutcome(False, f"gave up after {attempt} attempts: {_describe(exc)}", attempt)
                await self.sleep(delay)
                delay = min(delay * 2, s.retry_max)
        return RestartOutcome(False, "no attempts", 0)  # pragma: no cover - max_attempts >= 1


class Supervisor(Protocol):
    async def restart_child(self, instance_id: str | None, reason: str, graceful: bool) -> bool: ...


class LocalRestarter:
    """Restart the inference child process of `gpu-watchdog up`."""

    strategy = "local"

    def __init__(self, supervisor: Supervisor) -> None:
        self.supervisor = supervisor

    async def restart(self, decision: Decision) -> RestartOutcome:
        # No drain means nothing useful is left to finish (a hung kernel, a dead context): kill at once.
        ok = await self.supervisor.restart_child(decision.instance_id, decision.reason, graceful=decision.drain)
        return RestartOutcome(ok, "child restarted and ready" if ok else "child did not become ready")


class ReportOnlyRestarter:
    strategy = "none"

    async def restart(self, decision: Decision) -> RestartOutcome:
        log.warning("restart_not_performed", reason=decision.reason, strategy="none", detail=decision.detail)
        return RestartOutcome(False, "strategy none: reported only")


def _describe(exc: BaseException) -> str:
    status = getattr(exc, "status", None)
    reason = getattr(exc, "reason", None)
    if status is not None:
        body: Any = getattr(exc, "body", "") or ""
        return f"HTTP {status} {reason or ''}: {str(body)[:200]}".strip()
    return f"{type(exc).__name__}: {str(exc)[:200]}"
