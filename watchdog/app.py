"""The watchdog's loops: samplers produce outcomes, `state.reduce` folds them in, `policy.decide`
turns the history into decisions, and the executor performs them and returns their outcomes.

Wiring (`watchdog.wiring`) builds the settings' parts; what exists only while running (the HTTP
session, the samplers, the executor, the HTTP server, the tasks) is built whole in `start`.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import aiohttp
from aiohttp import web

from gpu_watchdog import logs
from gpu_watchdog.token import read_token
from gpu_watchdog.watchdog import ladder, policy, recording, views
from gpu_watchdog.watchdog.actions.node import NodeReporter
from gpu_watchdog.watchdog.actions.restart import Restarter
from gpu_watchdog.watchdog.episodes import Episodes
from gpu_watchdog.watchdog.escalation import CURING_REASONS
from gpu_watchdog.watchdog.executor import Executor, FleetLedger, RestartEvents
from gpu_watchdog.watchdog.keep_out import CardPlacer, KeepOut, lift_interval
from gpu_watchdog.watchdog.ladder import Change
from gpu_watchdog.watchdog.metrics import Snapshot, WatchdogMetrics
from gpu_watchdog.watchdog.names import BLOCKED_BY_BUDGET
from gpu_watchdog.watchdog.policy import Decision, max_age_jitter
from gpu_watchdog.watchdog.recorder import FlightRecorder
from gpu_watchdog.watchdog.restarting import Restarts
from gpu_watchdog.watchdog.samplers.assembly import Samplers, build_samplers
from gpu_watchdog.watchdog.samplers.nvml import NvmlBackend, PynvmlBackend
from gpu_watchdog.watchdog.samplers.pod_resources import pod_gpus_reader
from gpu_watchdog.watchdog.samples import DecisionRecord, History
from gpu_watchdog.watchdog.sampling import TICK_S, Sampling
from gpu_watchdog.watchdog.server import build_app
from gpu_watchdog.watchdog.settings import Settings, metrics_url
from gpu_watchdog.watchdog.state import (
    AdmissionRequested,
    CacheFlushRequested,
    Outcome,
    RestartBegun,
    RestartEnded,
    reduce,
)
from gpu_watchdog.watchdog.worker_rung import WorkerRung

log = logs.get("watchdog")

LAG_PROBE_S = 0.25  # how often the loop measures its own lateness
BUDGET_READ_S = 60.0  # the workload's restart Events are read again this often (and before a restart)
# The workload's quarantine is read from its Lease and pushed to our server this often: a request
# quarantined by another replica is refused here within it.
QUARANTINE_SYNC_S = 5.0


@dataclass
class Running:
    """What exists while the watchdog runs, built whole in `start`."""

    session: aiohttp.ClientSession
    samplers: Samplers
    executor: Executor
    keep_out: KeepOut | None
    restarts: Restarts
    sampling: Sampling
    runner: web.AppRunner | None
    port: int | None
    tasks: list[asyncio.Task[Any]]


class Watchdog:
    def __init__(
        self,
        settings: Settings,
        restarter: Restarter,
        nvml_backend: NvmlBackend | None = None,
        token: str | None = None,
        pod_gpus: Callable[[], tuple[str, ...] | None] | None = None,
        node: NodeReporter | None = None,
        wall_clock: Callable[[], float] = time.time,
        restart_events: RestartEvents | None = None,
        workload: str | None = None,
        ledger: FleetLedger | None = None,
        placer: CardPlacer | None = None,
    ) -> None:
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
        self.server_metrics_url = metrics_url(settings.target)
        self._nvml_backend = nvml_backend or PynvmlBackend()
        self._token = token
        self._pod_gpus = pod_gpus if pod_gpus is not None else pod_gpus_reader(settings)
        self.clock: Callable[[], float] = lambda: 0.0
        self.history = History(started_at=0.0)
        self.metrics = WatchdogMetrics(self.snapshot)
        self.episodes = Episodes(self.metrics)
        self._last_tick = 0.0
        self._lags: deque[float] = deque(maxlen=1200)
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
        loop = asyncio.get_running_loop()
        self.clock = loop.time
        now = self.clock()
        s = self.settings
        k = s.kubernetes
        self.history = History(started_at=now, epoch=now, jitter=self._jitter(), pod=k.pod_name,
                               node=k.node_name or None, worker_count=s.target.workers)
        self._last_tick = now
        if s.recorder.path is not None:
            self.recorder = FlightRecorder(s.recorder.path, s.recorder.max_bytes, self._recording_header,
                                           lambda why: self.metrics.recorder_failures.labels(why=why).inc())
            self.recorder.start()
            log.info("recorder_started", path=s.recorder.path, max_bytes=s.recorder.max_bytes,
                     replay=f"gpu-watchdog replay {s.recorder.path}")
        session = aiohttp.ClientSession()
        token = self._token or self._read_token() if s.target.http is None and s.target.openai_url is None else None
        samplers = build_samplers(s, session, self.clock, token, self._nvml_backend, self.server_metrics_url)
        executor = Executor(s, self.restarter, self.metrics, self.clock, self.wall_clock, samplers.control,
                            self.node, self.restart_events, self.workload, self._pod_gpus, self.ledger,
                            {k: c for k, _, c in samplers.workers.clients} if samplers.workers is not None else None)
        await asyncio.to_thread(samplers.nvml.open)
        sampling = Sampling(
            settings=s, samplers=samplers, executor=executor, restarter=self.restarter, metrics=self.metrics,
            episodes=self.episodes, history=lambda: self.history, fold=self._fold, evaluate=self._evaluate,
            spawn=self._spawn, clock=self.clock, wall_clock=self.wall_clock, read_token=self._read_token,
            token=self._token, server_metrics_url=self.server_metrics_url)
        samplers.nvml.start_xid_watch(lambda ev: loop.call_soon_threadsafe(sampling.on_xid, ev))
        runner, port = await self._serve_http() if serve_http else (None, None)
        keep_out = KeepOut(s, self.placer, self.ledger, self.metrics, self.wall_clock, self.workload or "") \
            if self.placer is not None and self.ledger is not None and s.policy.placement.strategy != "off" else None
        restarts = Restarts(
            settings=s, executor=executor, metrics=self.metrics, fold=self._fold, record=self._record,
            clock=self.clock, history=lambda: self.history,
            read_budget=self._read_budget if self.restart_events is not None else None, keep_out=keep_out,
            worker_control=lambda k: samplers.workers.client(k) if samplers.workers is not None and k
            else samplers.control,
            spawn=self._spawn, restarted=self._restarted, escalate=self._escalate)
        self._run = run = Running(session, samplers, executor, keep_out, restarts, sampling, runner, port, [])
        await self._learn_pod_gpus()
        if self.restart_events is not None:
            await self._read_budget()
        def periodic(name: str, interval: Callable[[], float], step: Callable[[], Any]) -> None:
            run.tasks.append(loop.create_task(self._periodic(name, interval, step)))

        periodic("nvml", lambda: s.sampling.nvml_interval, sampling.nvml)
        periodic("canary", sampling.canary_delay, sampling.canary)
        periodic("tick", lambda: TICK_S, self._tick)
        run.tasks.append(loop.create_task(self._watch_loop_lag()))
        if self.restart_events is not None:
            periodic("budget", lambda: BUDGET_READ_S, self._read_budget)
        if executor.pod_gpus_error is not None:
            run.tasks.append(loop.create_task(self._retry_pod_gpus()))
        if samplers.allocator is not None:
            periodic("torch", lambda: s.sampling.torch_interval, sampling.torch)
        if samplers.server_metrics is not None:
            periodic("server", sampling.server_delay, sampling.server)
        if samplers.workers is not None:
            periodic("workers", lambda: s.sampling.torch_interval, sampling.workers)
            rung = WorkerRung(settings=s, sampler=samplers.workers, executor=executor, restarts=restarts,
                              fold=self._fold, clock=self.clock, budget_from_events=self.restart_events is not None,
                              decided=lambda now, decisions: self._decided(now, decisions, recording.WORKERS))
            periodic("worker_canaries", lambda: s.canary.interval, lambda: rung.sample(lambda: self.history))
        if samplers.device_health is not None:
            periodic("device_health", lambda: s.sampling.device_health_interval, sampling.device_health)
        if keep_out is not None:
            periodic("placement", lambda: lift_interval(s.policy.placement.ttl), keep_out.reconcile)
        if s.policy.quarantine.enabled and samplers.control is not None:
            periodic("quarantine", lambda: QUARANTINE_SYNC_S, executor.sync_quarantine)
        if self.node is not None:
            self._spawn(self._escalate("start"))
        log.info("watchdog_started", control_url=s.target.control_url if samplers.control else None,
                 openai_url=s.target.openai_url, server_metrics_url=self.server_metrics_url,
                 strategy=self.restarter.strategy, nvml=samplers.nvml.available, port=port,
                 pod_gpus=self.history.pod_gpus, canary_interval_s=s.canary.interval,
                 canary_timeout_s=s.canary.timeout, budget_scope="workload" if self.restart_events else "pod",
                 workers=s.target.workers,
                 workload=self.workload)

    async def _serve_http(self) -> tuple[web.AppRunner, int]:
        s = self.settings
        runner = web.AppRunner(build_app(self.metrics.registry, self.healthy, self.ready, self.status),
                               handle_signals=False, access_log=None)
        await runner.setup()
        site = web.TCPSite(runner, s.server.host, s.server.port)
        await site.start()
        server = getattr(site, "_server", None)
        sockets = getattr(server, "sockets", None) or []
        return runner, sockets[0].getsockname()[1] if sockets else s.server.port

    async def stop(self) -> None:
        run = self._run
        if run is None:
            return
        for task in [*run.tasks, *self._actions]:
            task.cancel()
        await asyncio.gather(*run.tasks, *self._actions, return_exceptions=True)
        if run.runner is not None:
            await run.runner.cleanup()
        await run.session.close()
        await asyncio.to_thread(run.samplers.nvml.close)
        if self.recorder is not None:
            await asyncio.to_thread(self.recorder.stop)
        log.info("watchdog_stopped")

    def _jitter(self) -> float:
        return max_age_jitter(self.settings.kubernetes.pod_name, self.settings.policy.max_age_jitter)

    def _read_token(self) -> str | None:
        try:
            return read_token(self.settings.target.token_file)
        except Exception as exc:
            log.warning("token_unreadable", error=str(exc))
            return None

    async def _periodic(self, name: str, interval: Callable[[], float], step: Callable[[], Any]) -> None:
        while True:
            start = self.clock()
            try:
                await step()
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # a sampler must never take the loop down
                log.exception("loop_step_failed", step=name, error=repr(exc))
            elapsed = self.clock() - start
            if name != "tick":
                self.metrics.sample_duration.labels(sampler=name).observe(elapsed)
            await asyncio.sleep(max(0.0, interval() - elapsed))

    def _fold(self, outcome: Outcome) -> None:
        if self.recorder is not None:
            self.recorder.record(recording.input_line(outcome))
        reduce(self.history, outcome, self.settings.policy.admission)

    def _decided(self, now: float, decisions: list[Decision], core: str = recording.POD) -> None:
        if self.recorder is not None:
            self.recorder.record(recording.tick_line(now, decisions, core))

    def _recording_header(self) -> dict[str, Any]:
        return recording.start_line(recording.settings_json(self.settings), self.history,
                                    self.restart_events is not None, self.clock(), self.wall_clock())

    def _spawn(self, coro: Any) -> None:
        # Keep a reference: the loop holds tasks weakly, and an action must not vanish mid-way.
        task = asyncio.get_running_loop().create_task(coro)
        self._actions.add(task)
        task.add_done_callback(self._actions.discard)

    # -- the loop's own health ------------------------------------------------------------------

    async def _watch_loop_lag(self) -> None:
        while True:
            before = self.clock()
            await asyncio.sleep(LAG_PROBE_S)
            lag = max(0.0, self.clock() - before - LAG_PROBE_S)
            self._lags.append(lag)
            self.metrics.event_loop_lag.observe(lag)

    def loop_lag(self) -> dict[str, float] | None:
        if not self._lags:
            return None
        ordered = sorted(self._lags)
        return {"last_s": round(self._lags[-1], 4), "p99_s": round(ordered[int(0.99 * (len(ordered) - 1))], 4),
                "max_s": round(ordered[-1], 4), "samples": len(ordered)}

    async def _tick(self) -> None:
        self._last_tick = self.clock()
        await self._evaluate()

    # -- outcomes of the executor's edges ---------------------------------------------------------

    async def _learn_pod_gpus(self) -> None:
        found = await self.executor.learn_pod_gpus()
        if found is not None:
            self._fold(found)

    async def _retry_pod_gpus(self) -> None:
        """The kubelet may come up after us, or its socket be fixed: ask again, ever less often."""
        executor = self.executor
        while executor.pod_gpus_error is not None:
            await asyncio.sleep(executor.next_pod_gpus_wait())
            await self._learn_pod_gpus()

    async def _read_budget(self) -> None:
        self._fold(await self.executor.read_budget())

    async def _escalate(self, why: str) -> None:
        await self.executor.escalate(why, policy.our_gpus(self.history))

    # -- decisions and their effects ---------------------------------------------------------

    async def _evaluate(self) -> None:
        async with self._eval_lock:
            now = self.clock()
            decisions = policy.decide(self.settings.policy, self.history, now, self.restart_events is not None)
            self._decided(now, decisions)
            for decision in decisions:
                self._act(decision, now)
            executor = self.executor
            # Held for the watched target or for another worker: over once neither wants a restart.
            if executor.fleet.held is not None and not self.history.restart_in_progress \
                    and policy.wanted_restart(self.settings.policy, self.history, now) is None \
                    and not policy.worker_restart_wanted(self.settings.policy, self.history, now,
                                                         self.restart_events is not None):
                self._spawn(executor.end_hold())

    def _record(self, decision: Decision, outcome: str, now: float) -> None:
        self._fold(DecisionRecord(round(now - self.history.started_at, 3), decision.action, decision.reason, outcome,
                                  decision.detail))
        self.metrics.decisions.labels(action=decision.action, reason=decision.reason, outcome=outcome).inc()

    def _act(self, decision: Decision, now: float) -> None:
        if decision.action == "restart" and not decision.allowed:
            if decision.reason in CURING_REASONS:
                # Nothing restarts, but a request may be what kills or wedges the engine: what was in
                # flight is the query of death's evidence all the same (recorded once per process).
                self._spawn(self.executor.record_failure(decision))
            if self.history.blocked_reported != decision.reason:
                self._record(decision, BLOCKED_BY_BUDGET, now)
                log.error("restart_blocked", reason=decision.reason, blocked_by=decision.blocked_by,
                          budget_window_s=self.settings.policy.restart_budget.window, detail=decision.detail,
                          workload=self.workload, budget_read_error=self.executor.budget_read_error)
            return
        if decision.action == "restart":
            if not self.executor.begin(0):
                return  # another worker's restart is under way: decided again once it has ended
            self._fold(RestartBegun(now))
            asked_again = self.executor.fleet.held is not None
            if not asked_again:  # asked again while held: recorded once, as held
                self._record(decision, "started", now)
            self._spawn(self.running.restarts.run(0, decision, asked_again))
        elif decision.action == "empty_cache":
            self._fold(CacheFlushRequested(now, decision.reason))
            self._record(decision, "started", now)
            self._spawn(self.executor.empty_cache(decision))
        elif decision.action in (ladder.SHRINK, ladder.GROW):
            change = Change(decision.action, int(decision.detail["limit"]), decision.detail)
            self._fold(AdmissionRequested(change))
            self._record(decision, "started", now)
            self._spawn(self._set_admission(decision, change))

    async def _set_admission(self, decision: Decision, change: Change) -> None:
        answered = await self.executor.set_admission(change)
        self._fold(answered)
        if answered.ok:
            # Never a restart, and the restart budget is not touched.
            log.warning("decision", action=change.action, reason=decision.reason, limit=change.limit,
                        detail=decision.detail, ladder=dataclasses.asdict(self.history.ladder)
                        if self.history.ladder is not None else None)

    def _restarted(self, ended: RestartEnded) -> None:
        """A restart done: the canary's verdict is about the process gone."""
        self.running.samplers.canary.forget()
        if not ended.keep_unready:
            # Readiness needs a canary newer than the restart: take one now rather than at the
            # next interval (30 s by default), so a served-again model is routed to at once.
            self._spawn(self.running.sampling.canary())

    # -- views -------------------------------------------------------------------------------

    def _extras(self) -> views.Extras:
        run = self._run
        executor = None if run is None else run.executor
        return views.Extras(
            nvml_available=run is not None and run.samplers.nvml.available,
            server_metrics_url=self.server_metrics_url,
            canary={} if run is None else run.samplers.canary.describe(),
            strategy=self.restarter.strategy,
            restart_failed=None if executor is None else executor.restart_failed,
            restart_not_recorded=None if executor is None else executor.not_recorded_now(),
            ignored_records=0 if executor is None else len(executor.ignored_records),
            idle_memory=self.episodes.idle_memory, pod_gpus_error=None if executor is None else executor.pod_gpus_error,
            suspects=() if executor is None else tuple(executor.suspects.values()),
            budget_from_events=self.restart_events is not None, workload=self.workload,
            fleet=executor.fleet if executor is not None and executor.ledger is not None else None,
            quarantine=None if executor is None else executor.quarantine_status(),
            placement=None if run is None or run.keep_out is None else run.keep_out.status(),
            budget_read_error=None if executor is None else executor.budget_read_error, loop_lag=self.loop_lag(),
        )

    @property
    def suspects(self) -> dict[str, Any]:
        return {} if self._run is None else self._run.executor.suspects

    def states(self) -> frozenset[str]:
        return views.states(self.settings, self.history, self.clock(), self._extras())

    def snapshot(self) -> Snapshot:
        return views.snapshot(self.settings, self.history, self.clock(), self._extras())

    def healthy(self) -> tuple[bool, dict[str, Any]]:
        age = self.clock() - self._last_tick
        ok = age < max(10.0, TICK_S * 20)
        return ok, {"ok": ok, "last_tick_age_s": round(age, 3)}

    def ready(self) -> tuple[bool, dict[str, Any]]:
        return views.ready(self.settings, self.history, self.clock())

    def status(self) -> dict[str, Any]:
        return views.status(self.settings, self.history, self.clock(), self._extras())
