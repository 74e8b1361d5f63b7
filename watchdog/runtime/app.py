"""The watchdog's loop: samplers and edges hand their outcomes to `fold` (`state.reduce`, recorded
by the flight recorder), `policy.decide` turns the history into decisions at each evaluation, and
each decision is handed to what performs it (the executor, the restart procedure's edge), whose
outcomes are folded in turn. Views (`/status`, readiness, the metrics) read the fold alone.

Wiring (`watchdog.runtime.wiring`) builds the settings' parts; what exists only while running is built
whole at start (`watchdog.runtime.running`).
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
from collections.abc import Callable
from typing import Any

from gpu_watchdog import logs
from gpu_watchdog.token import read_token
from gpu_watchdog.watchdog.core import ladder, policy, recording, views
from gpu_watchdog.watchdog.core.escalation import CURING_REASONS
from gpu_watchdog.watchdog.core.history import History
from gpu_watchdog.watchdog.core.ladder import Change
from gpu_watchdog.watchdog.core.names import BLOCKED_BY_BUDGET, WOULD
from gpu_watchdog.watchdog.core.policy import Decision, max_age_jitter
from gpu_watchdog.watchdog.core.samples import DecisionRecord
from gpu_watchdog.watchdog.core.settings import Settings, metrics_url
from gpu_watchdog.watchdog.core.state import (
    AdmissionAnswered,
    AdmissionRequested,
    CacheFlushRequested,
    Outcome,
    RestartBegun,
    RestartEnded,
    reduce,
)
from gpu_watchdog.watchdog.core.timing import BUDGET_READ_S, TICK_S
from gpu_watchdog.watchdog.core.views import Snapshot
from gpu_watchdog.watchdog.edge.effects.node import NodeReporter
from gpu_watchdog.watchdog.edge.effects.restart import Restarter
from gpu_watchdog.watchdog.edge.executor import Executor, FleetLedger, RestartEvents
from gpu_watchdog.watchdog.edge.keep_out import CardPlacer
from gpu_watchdog.watchdog.edge.metrics import WatchdogMetrics
from gpu_watchdog.watchdog.edge.recorder import FlightRecorder
from gpu_watchdog.watchdog.edge.samplers.nvml import NvmlBackend, PynvmlBackend
from gpu_watchdog.watchdog.edge.samplers.pod_resources import pod_gpus_reader
from gpu_watchdog.watchdog.runtime import running
from gpu_watchdog.watchdog.runtime.episodes import Episodes
from gpu_watchdog.watchdog.runtime.running import Running

__all__ = ["BUDGET_READ_S", "Watchdog"]

log = logs.get("watchdog")


class Watchdog:
    def __init__(self, settings: Settings, restarter: Restarter, *, nvml_backend: NvmlBackend | None = None,
                 token: str | None = None, pod_gpus: Callable[[], tuple[str, ...] | None] | None = None,
                 node: NodeReporter | None = None, wall_clock: Callable[[], float] = time.time,
                 restart_events: RestartEvents | None = None, workload: str | None = None,
                 ledger: FleetLedger | None = None, placer: CardPlacer | None = None,
                 cluster_clock: Callable[[], float] | None = None, metrics: WatchdogMetrics | None = None) -> None:
        self.settings = settings
        self.restarter = restarter
        self.node = node
        # Where restarts replace the pod, the budget is the workload's: counted from the restart
        # Events every generation of its pods wrote, not from this sidecar's memory.
        self.restart_events = restart_events
        self.workload = workload
        # The workload's ledger (a Lease): its replicas, and at most max_unavailable restarting at once.
        self.ledger = ledger
        # Where the evidence is about the card, it is tainted before the pod rung acts (policy.placement).
        self.placer = placer
        self.wall_clock = wall_clock
        # What the workload's records (its Lease, its Events, placement) are stamped and read by: the
        # API server's clock where there is one (`KubeApi.now`), so that nodes whose clocks disagree
        # agree on them; this node's where there is none.
        self.cluster_clock = cluster_clock or wall_clock
        self.server_metrics_url = metrics_url(settings.target)
        self.nvml_backend = nvml_backend or PynvmlBackend()
        self.given_token = token
        self.pod_gpus = pod_gpus if pod_gpus is not None else pod_gpus_reader(settings)
        self.clock: Callable[[], float] = lambda: 0.0
        self.history = History(started_at=0.0)
        # Its own registry, unless the caller shares one (a simulation of many sidecars in one process).
        self.metrics = metrics or WatchdogMetrics(self.snapshot)
        self.episodes = Episodes(self.metrics)
        self._last_tick = 0.0
        self._actions: set[asyncio.Task[Any]] = set()
        self._eval_lock = asyncio.Lock()
        self._run: Running | None = None
        self.recorder: FlightRecorder | None = None

    @property
    def running(self) -> Running:
        if self._run is None:
            raise RuntimeError("the watchdog is not running: call start() first")
        return self._run

    @property
    def executor(self) -> Executor:
        return self.running.executor

    @property
    def port(self) -> int | None:
        return None if self._run is None else self._run.port

    # -- lifecycle ---------------------------------------------------------------------------

    async def start(self, serve_http: bool = True) -> None:
        self.clock = asyncio.get_running_loop().time
        now = self.clock()
        s, k = self.settings, self.settings.kubernetes
        self.history = History(
            started_at=now, epoch=now, jitter=max_age_jitter(k.pod_name, s.policy.max_age_jitter), pod=k.pod_name,
            node=k.node_name or None, worker_count=s.target.workers, strategy=self.restarter.strategy,
            budget_from_events=self.restart_events is not None, workload=self.workload,
            server_metrics_url=self.server_metrics_url,
            keeps_out=self.placer is not None and self.ledger is not None and s.policy.placement.strategy != "off")
        self._last_tick = now
        if s.recorder.path is not None:
            self.recorder = FlightRecorder(s.recorder.path, s.recorder.max_bytes, self._recording_header,
                                           lambda why: self.metrics.recorder_failures.labels(why=why).inc())
            self.recorder.start()
            log.info("recorder_started", path=s.recorder.path, max_bytes=s.recorder.max_bytes,
                     replay=f"gpu-watchdog replay {s.recorder.path}")
        self._run = run = await running.build(self, serve_http)
        await self.learn_pod_gpus()
        if self.restart_events is not None:
            await self.read_budget()
        running.start_tasks(self, run)
        if self.node is not None:
            self.spawn(self.escalate("start"))
        log.info("watchdog_started", control_url=s.target.control_url if run.samplers.control else None,
                 openai_url=s.target.openai_url, server_metrics_url=self.server_metrics_url,
                 strategy=self.restarter.strategy, nvml=run.samplers.nvml.available, port=run.port,
                 pod_gpus=self.history.pod_gpus, canary_interval_s=s.canary.interval,
                 canary_timeout_s=s.canary.timeout, budget_scope="workload" if self.restart_events else "pod",
                 workers=s.target.workers, workload=self.workload)

    async def stop(self) -> None:
        if self._run is None:
            return
        await running.stop(self._run, self._actions)
        if self.recorder is not None:
            await asyncio.to_thread(self.recorder.stop)
        log.info("watchdog_stopped")

    def read_token(self) -> str | None:
        try:
            return read_token(self.settings.target.token_file)
        except Exception as exc:
            log.warning("token_unreadable", error=str(exc))
            return None

    def fold(self, outcome: Outcome) -> None:
        if self.recorder is not None:
            self.recorder.record(recording.input_line(outcome))
        reduce(self.history, outcome, self.settings.policy.admission)

    def decided(self, now: float, decisions: list[Decision], core: str = recording.POD) -> None:
        if self.recorder is not None:
            self.recorder.record(recording.tick_line(now, decisions, core))

    def _recording_header(self) -> dict[str, Any]:
        return recording.start_line(recording.settings_json(self.settings), self.history,
                                    self.restart_events is not None, self.clock(), self.wall_clock())

    def spawn(self, coro: Any) -> None:
        # Keep a reference: the loop holds tasks weakly, and an action must not vanish mid-way.
        task = asyncio.get_running_loop().create_task(coro)
        self._actions.add(task)
        task.add_done_callback(self._actions.discard)

    async def tick(self) -> None:
        self._last_tick = self.clock()
        await self.evaluate()

    # -- the edges' reads ------------------------------------------------------------------------

    async def learn_pod_gpus(self) -> None:
        self.fold(await self.executor.learn_pod_gpus())

    async def read_budget(self) -> None:
        self.fold(await self.executor.read_budget())

    async def escalate(self, why: str) -> None:
        await self.executor.escalate(why, policy.our_gpus(self.history))

    # -- decisions and their effects ---------------------------------------------------------

    async def evaluate(self) -> None:
        async with self._eval_lock:
            now = self.clock()
            decisions = policy.decide(self.settings.policy, self.history, now, self.restart_events is not None)
            self.decided(now, decisions)
            for decision in decisions:
                self._act(decision, now)
            # Held for the watched target or for another worker: over once neither wants a restart.
            if policy.hold_over(self.settings.policy, self.history, now, self.restart_events is not None):
                self.spawn(self.executor.end_hold())

    def record_decision(self, decision: Decision, outcome: str, now: float) -> None:
        self.fold(DecisionRecord(round(now - self.history.started_at, 3), decision.action, decision.reason, outcome,
                                 decision.detail))
        self.metrics.decisions.labels(action=decision.action, reason=decision.reason, outcome=outcome).inc()

    def _act(self, decision: Decision, now: float) -> None:
        if decision.action == "restart" and not decision.allowed:
            if decision.reason in CURING_REASONS:
                # Nothing restarts, but a request may be what kills or wedges the engine: what was in
                # flight is the query of death's evidence all the same (recorded once per process).
                self.spawn(self.executor.record_failure(decision))
            if self.history.blocked_reported != decision.reason:
                self.record_decision(decision, BLOCKED_BY_BUDGET, now)
                log.error("restart_blocked", reason=decision.reason, blocked_by=decision.blocked_by,
                          budget_window_s=self.settings.policy.restart_budget.window, detail=decision.detail,
                          workload=self.workload, budget_read_error=self.history.edge.budget_read_error)
            return
        if decision.action == "restart":
            if not self.executor.begin(0):
                return  # another worker's restart is under way: decided again once it has ended
            self.fold(RestartBegun(now))
            asked_again = self.history.edge.fleet.held is not None
            if not asked_again and decision.enforced:  # asked again while held: recorded once, as held
                self.record_decision(decision, "started", now)
            self.spawn(self.running.restarts.run(0, decision, asked_again))
        elif decision.action == "empty_cache":
            # Paced as a flush performed would be (its cooldown, the drift's attempts), so that a shadow
            # flush is said once where a real one would have been made once.
            self.fold(CacheFlushRequested(now, decision.reason))
            if not decision.enforced:
                self._would(decision, now)
                return
            self.record_decision(decision, "started", now)
            self.spawn(self.executor.empty_cache(decision))
        elif decision.action in (ladder.SHRINK, ladder.GROW):
            change = Change(decision.action, int(decision.detail["limit"]), decision.detail)
            if not decision.enforced:
                # Taken as answered: the server's own limit, unchanged at its next sample, starts the ladder
                # anew from it, and only new OOMs say the change again.
                self.fold(AdmissionAnswered(now, change, True))
                self._would(decision, now)
                return
            self.fold(AdmissionRequested(change))
            self.record_decision(decision, "started", now)
            self.spawn(self._set_admission(decision, change))

    def _would(self, decision: Decision, now: float) -> None:
        """A shadow decision other than a restart (`watchdog.runtime.restarting` says those): recorded and said."""
        self.record_decision(decision, WOULD, now)
        log.warning("decision", action=decision.action, reason=decision.reason, shadow=True, performed=False,
                    detail=decision.detail)

    async def _set_admission(self, decision: Decision, change: Change) -> None:
        answered = await self.executor.set_admission(change)
        self.fold(answered)
        if answered.ok:
            # Never a restart, and the restart budget is not touched.
            log.warning("decision", action=change.action, reason=decision.reason, limit=change.limit,
                        detail=decision.detail, ladder=dataclasses.asdict(self.history.ladder)
                        if self.history.ladder is not None else None)

    def restarted(self, ended: RestartEnded) -> None:
        """A restart done: the canary's verdict is about the process gone."""
        self.running.samplers.canary.forget()
        if not ended.keep_unready:
            # Readiness needs a canary newer than the restart: take one now rather than at the
            # next interval (30 s by default), so a served-again model is routed to at once.
            self.spawn(self.running.sampling.canary())

    # -- views: the fold alone ---------------------------------------------------------------

    @property
    def suspects(self) -> dict[str, Any]:
        return {sp.uuid: sp for sp in self.history.edge.suspects}

    def states(self) -> frozenset[str]:
        return views.states(self.settings, self.history, self.clock())

    def snapshot(self) -> Snapshot:
        return views.snapshot(self.settings, self.history, self.clock())

    def healthy(self) -> tuple[bool, dict[str, Any]]:
        age = self.clock() - self._last_tick
        ok = age < max(10.0, TICK_S * 20)
        return ok, {"ok": ok, "last_tick_age_s": round(age, 3)}

    def ready(self) -> tuple[bool, dict[str, Any]]:
        return views.ready(self.settings, self.history, self.clock())

    def status(self) -> dict[str, Any]:
        return views.status(self.settings, self.history, self.clock(), self.cluster_clock())
