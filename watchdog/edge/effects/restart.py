"""Restart strategies: container (in place, through the kubelet), evict (PDB-respecting), delete,
local (restart the child process), none."""

from __future__ import annotations

import asyncio
import json
import os
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any, Protocol

from gpu_watchdog import logs
from gpu_watchdog.watchdog.core.escalation import (
    GPUS_ANNOTATION,
    INFLIGHT_ANNOTATION,
    NODE_ANNOTATION,
    REASON_ANNOTATION,
    WORKLOAD_ANNOTATION,
    XID_ANNOTATION,
)
from gpu_watchdog.watchdog.core.names import RUNG_CONTAINER, RUNG_POD, RUNG_PROCESS
from gpu_watchdog.watchdog.core.policy import Decision
from gpu_watchdog.watchdog.core.settings import RestartSettings
from gpu_watchdog.watchdog.edge.kube.kube import PodActions, RefusedError, event_reason

log = logs.get("watchdog.restart")

Sleep = Callable[[float], Awaitable[None]]


# Outcome details the loop and the views tell apart.
NOT_RECORDED = "restart_not_recorded"


@dataclass(frozen=True)
class RestartOutcome:
    done: bool
    detail: str
    attempts: int = 1
    rung: str = RUNG_POD
    # The restart Event could not be written, so nothing was done: an unrecorded restart would be
    # invisible to the next pod generation's budget.
    not_recorded: bool = False
    # Its Event was written (whatever became of the restart after it).
    recorded: bool = False
    # The pod was gone already (404): removed by someone else, whenever.
    gone: bool = False


class DrainHandle(Protocol):
    """The server's drain around a restart, owned by the caller.

    `begin` stops the server admitting (bounded, and lifted by the server itself at a deadline);
    `lift` ends it and says the restart is waiting, the server serving as before. Both are
    idempotent and never raise: a drain that cannot be lifted ends at the server's deadline.
    `before_act` is told, just before a pod's eviction or deletion is first asked (and again after the
    API refused it), when (wall clock); it never raises, and the act goes on whatever it could do.
    """

    async def begin(self) -> None: ...
    async def lift(self, why: str) -> None: ...
    async def before_act(self, at: float) -> None: ...


class Restarter(Protocol):
    strategy: str

    async def restart(self, decision: Decision, drain: DrainHandle) -> RestartOutcome: ...

    async def target_served(self, at_wall: float) -> None:
        """The target served a canary (not drained): what this restarter published for the target's
        recovery to make obsolete (the container rung's verdict) is spent. Most publish nothing."""

    async def record_event(self, decision: Decision, action: str, prefix: str = "", shadow: bool = False
                           ) -> str | None:
        """The restart's Event, for a rung this restarter does not carry out itself (a worker's):
        None once written, or where this restarter writes none; else why not."""


def annotations_for(decision: Decision, workload: str | None = None, node: str | None = None) -> dict[str, str]:
    """What a later sidecar reads back: why, for which workload's budget, on which node, and which
    GPUs a curing restart was for."""
    out = {REASON_ANNOTATION: decision.reason}
    if workload:
        out[WORKLOAD_ANNOTATION] = workload
    if node:
        out[NODE_ANNOTATION] = node
    gpus = decision.detail.get("gpus")
    if gpus:
        out[GPUS_ANNOTATION] = ",".join(gpus)
    if isinstance(decision.detail.get("xid"), int):
        out[XID_ANNOTATION] = str(decision.detail["xid"])
    inflight = decision.detail.get("inflight")
    if inflight:
        # The query of death's evidence, where every pod of the workload can read it.
        out[INFLIGHT_ANNOTATION] = ",".join(inflight)
    return out


# The Event of a worker's restart (the worker rung): counted in the budget like any other.
WORKER_ACTION, WORKER_PREFIX = "RestartWorker", "WorkerRestart"


def note_for(decision: Decision, action: str = "Evict") -> str:
    what = {"RestartContainer": "its inference container in place",
            WORKER_ACTION: f"worker {decision.detail.get('worker', 0)} of its server"}.get(action, "this pod")
    return f"gpu-watchdog restarts {what}: {decision.reason}; {_figures(decision)}"


def _figures(decision: Decision) -> str:
    """The decision's figures, where it was stuck and where its stacks are first (a note keeps 1 KiB)."""
    d = decision.detail
    stacks = f"stuck in {d['stuck']}; " if d.get("stuck") else ""
    stacks += f"stacks: {d['stacks']}; " if d.get("stacks") else ""
    rest = {k: v for k, v in d.items() if k not in ("stuck", "stacks")}
    return stacks + json.dumps(rest, sort_keys=True, default=str)


# A shadow restart's Event: Normal, and without the annotations the restart budget counts by.
WOULD_REASON, WOULD_ACTION = "WouldRestart", "Report"
WOULD_ANNOTATION = "gpu-watchdog.io/would-restart"


def would_note(decision: Decision) -> str:
    return (f"gpu-watchdog would restart this pod ({decision.rung}): {decision.reason}; shadow, nothing was done"
            f" (policy.enforce); {_figures(decision)}")


class KubeRestarter:
    """Evict (or delete) our pod; a PodDisruptionBudget's 429 means wait and retry, staying unready."""

    def __init__(self, pod: PodActions, settings: RestartSettings, sleep: Sleep = asyncio.sleep,
                 workload: str | None = None, node: str | None = None,
                 wall_clock: Callable[[], float] = time.time) -> None:
        self.pod = pod
        self.wall_clock = wall_clock
        self.settings = settings
        self.workload = workload
        self.node = node
        self.strategy = settings.strategy
        self.sleep = sleep

    async def record_event(self, decision: Decision, action: str, prefix: str = "", shadow: bool = False
                           ) -> str | None:
        """Write the restart Event: None once written, else why not (after three tries). `shadow`: the
        Normal Event of a restart decided and not performed (`policy.enforce`), which no budget counts."""
        error = "no attempt"
        if shadow:
            reason, note, kind = WOULD_REASON, would_note(decision), "Normal"
            annotations = {WOULD_ANNOTATION: decision.reason}
        else:
            reason, note, kind = prefix + event_reason(decision.reason), note_for(decision, action), "Warning"
            annotations = annotations_for(decision, self.workload, self.node)
        for attempt in range(3):
            try:
                await asyncio.to_thread(self.pod.record_event, self.pod.pod_name, self.pod.namespace, reason, note,
                                        action, event_type=kind, annotations=annotations)
                return None
            except RefusedError:
                raise
            except Exception as exc:
                error = _describe(exc)
                log.warning("event_failed", attempt=attempt + 1, error=error)
                if attempt < 2:
                    await self.sleep(min(self.settings.retry_initial * 2**attempt, self.settings.retry_max))
        return error

    async def restart(self, decision: Decision, drain: DrainHandle) -> RestartOutcome:
        """Ask, record, drain, act, in that order: the server is drained only once the API allows the
        restart (a dry run: the disruption budget for an eviction, RBAC and admission for a delete)
        and its Event is written, and the drain is lifted while it waits."""
        s = self.settings
        grace = None if s.grace_period is None else int(s.grace_period)
        action = "Evict" if self.strategy == "evict" else "Delete"
        recorded = False
        # Whether the last try is known not to have acted: an answer that timed out or failed on the
        # server's side may have evicted the pod, and its replacement is created from then on.
        refused = True
        delay = s.retry_initial
        for attempt in range(1, s.max_attempts + 1):
            acting = False
            try:
                await asyncio.to_thread(self._act, grace, True)
                if not recorded:
                    error = await self.record_event(decision, action)
                    if error is not None:
                        return RestartOutcome(False, f"{NOT_RECORDED}: {error}", attempt, not_recorded=True)
                    recorded = True
                await drain.begin()
                if refused:
                    await drain.before_act(self.wall_clock())
                refused, acting = False, True
                await asyncio.to_thread(self._act, grace, False)
                log.warning("pod_restart_requested", strategy=self.strategy, reason=decision.reason,
                            pod=self.pod.pod_name, namespace=self.pod.namespace, attempt=attempt)
                return RestartOutcome(True, f"{self.strategy} accepted", attempt, recorded=True)
            except RefusedError:
                raise
            except Exception as exc:
                status = getattr(exc, "status", None)
                if status == 404:
                    return RestartOutcome(True, "pod already gone", attempt, recorded=recorded, gone=True)
                if acting:  # the API's answer to the act itself: a 4xx is a refusal, anything else may have acted
                    refused = isinstance(status, int) and 400 <= status < 500 and status != 408
                # Not now: the server serves on while we wait (the disruption budget refuses exactly
                # when the other replicas are short).
                await drain.lift("eviction_refused" if status == 429 else "restart_api_error")
                if status == 429:
                    log.warning("eviction_blocked_by_pdb", attempt=attempt, retry_in_s=delay,
                                pod=self.pod.pod_name)
                else:
                    log.error("restart_api_error", strategy=self.strategy, attempt=attempt, status=status,
                              error=_describe(exc), retry_in_s=delay)
                if attempt == s.max_attempts:
                    return RestartOutcome(False, f"gave up after {attempt} attempts: {_describe(exc)}", attempt,
                                          recorded=recorded)
                await self.sleep(delay)
                delay = min(delay * 2, s.retry_max)
        return RestartOutcome(False, "no attempts", 0)  # pragma: no cover - max_attempts >= 1

    def _act(self, grace: int | None, dry_run: bool) -> None:
        """Blocking: evict or delete our pod, or only ask whether the API would (`dry_run`)."""
        if self.strategy == "evict":
            self.pod.evict(self.pod.pod_name, self.pod.namespace, grace, dry_run)
        else:
            self.pod.delete(self.pod.pod_name, self.pod.namespace, grace, dry_run)

    async def target_served(self, at_wall: float) -> None:
        return None  # nothing published that a recovery makes obsolete


class ChildRestarter(Protocol):
    async def restart_child(self, instance_id: str | None, reason: str, graceful: bool) -> bool: ...


class LocalRestarter:
    """Restart the inference child process of `gpu-watchdog up`."""

    strategy = "local"

    def __init__(self, supervisor: ChildRestarter) -> None:
        self.supervisor = supervisor

    async def restart(self, decision: Decision, drain: DrainHandle) -> RestartOutcome:
        # No drain means nothing useful is left to finish (a hung kernel, a dead context): kill at once.
        await drain.begin()
        ok = await self.supervisor.restart_child(decision.instance_id, decision.reason, graceful=decision.drain)
        return RestartOutcome(ok, "child restarted and ready" if ok else "child did not become ready",
                              rung=RUNG_PROCESS)

    async def target_served(self, at_wall: float) -> None:
        return None  # nothing published that a recovery makes obsolete

    async def record_event(self, decision: Decision, action: str, prefix: str = "", shadow: bool = False
                           ) -> str | None:
        return None  # no cluster to write an Event to


class ContainerRestarter:
    """Restart the inference container in place: publish the verdict its liveness probe reads.

    Fail-open by construction: the probe fails only on a verdict file written after its container
    started and younger than its time-to-live, so a sidecar that is down, crash-looping or slow to
    start can never get the inference container killed. Rung `pod` (a lost GPU, or in-place
    restarts that did not cure) goes to the eviction restarter, where there is one.
    """

    strategy = "container"

    def __init__(self, verdict_file: str, pod: KubeRestarter | None = None,
                 wall_clock: Callable[[], float] = time.time) -> None:
        self.verdict_file = verdict_file
        self.pod = pod
        self.wall_clock = wall_clock
        self.written_at: float | None = None
        self._leftover_checked = False

    async def restart(self, decision: Decision, drain: DrainHandle) -> RestartOutcome:
        if decision.rung == RUNG_POD:
            if self.pod is None:
                return RestartOutcome(False, "the pod rung needs the Kubernetes API, which is not configured",
                                      rung=RUNG_POD)
            return await self.pod.restart(decision, drain)
        if self.pod is not None:
            error = await self.pod.record_event(decision, "RestartContainer", prefix="ContainerRestart")
            if error is not None:
                return RestartOutcome(False, f"{NOT_RECORDED}: {error}", rung=RUNG_CONTAINER, not_recorded=True)
        await drain.begin()
        at = self.wall_clock()
        try:
            await asyncio.to_thread(write_verdict, self.verdict_file, at, decision.reason)
        except OSError as exc:
            return RestartOutcome(False, f"cannot write the verdict {self.verdict_file}: {exc.strerror}",
                                  rung=RUNG_CONTAINER, recorded=self.pod is not None)
        self.written_at = at
        log.warning("container_restart_requested", reason=decision.reason, verdict_file=self.verdict_file)
        return RestartOutcome(True, "verdict written: the kubelet restarts the inference container",
                              rung=RUNG_CONTAINER, recorded=self.pod is not None)

    async def record_event(self, decision: Decision, action: str, prefix: str = "", shadow: bool = False
                           ) -> str | None:
        return None if self.pod is None else await self.pod.record_event(decision, action, prefix, shadow)

    async def target_served(self, at_wall: float) -> None:
        """The target serves again (a new container, or the old one recovered): the verdict is spent.

        A verdict left by an earlier run of this sidecar is cleared at the first success too."""
        if self.written_at is not None and at_wall <= self.written_at:
            return
        if self.written_at is None and self._leftover_checked:
            return
        self._leftover_checked = True
        if await asyncio.to_thread(clear_verdict, self.verdict_file):
            log.info("verdict_cleared", verdict_file=self.verdict_file)
        self.written_at = None


def write_verdict(path: str, at: float, reason: str) -> None:
    """Atomically: the probe never reads half a verdict."""
    tmp = f"{path}.tmp"
    with open(tmp, "w", encoding="ascii") as fh:
        fh.write(f"{int(at)} {reason}\n")
    os.replace(tmp, path)


def clear_verdict(path: str) -> bool:
    try:
        os.unlink(path)
    except FileNotFoundError:
        return False
    return True


class ReportOnlyRestarter:
    strategy = "none"

    async def restart(self, decision: Decision, drain: DrainHandle) -> RestartOutcome:
        log.warning("restart_not_performed", reason=decision.reason, strategy="none", detail=decision.detail)
        return RestartOutcome(False, "strategy none: reported only")

    async def target_served(self, at_wall: float) -> None:
        return None  # nothing published that a recovery makes obsolete

    async def record_event(self, decision: Decision, action: str, prefix: str = "", shadow: bool = False
                           ) -> str | None:
        return None  # no cluster to write an Event to


def _describe(exc: BaseException) -> str:
    status = getattr(exc, "status", None)
    reason = getattr(exc, "reason", None)
    if status is not None:
        body: Any = getattr(exc, "body", "") or ""
        return f"HTTP {status} {reason or ''}: {str(body)[:200]}".strip()
    return f"{type(exc).__name__}: {str(exc)[:200]}"
