"""The watchdog loop: samplers -> policy -> actions, plus its HTTP server."""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import hashlib
import random
import signal
import sys
import time
from collections.abc import Callable
from typing import Any

import aiohttp
from aiohttp import web

from watchdog import escalation, idle_memory, ladder, logs, policy, views
from watchdog.actions.node import NodeReporter
from watchdog.actions.restart import ReportOnlyRestarter, Restarter
from watchdog.config import ConfigError, Settings, load, metrics_url
from watchdog.contract import read_token
from watchdog.control_client import ControlClient, ControlError
from watchdog.escalation import CURING_REASONS, Suspect
from watchdog.ladder import Change
from watchdog.metrics import Snapshot, WatchdogMetrics
from watchdog.policy import Decision
from watchdog.samplers.allocator import AllocatorSampler
from watchdog.samplers.canary import Canary, CanarySampler, OpenAICanary
from watchdog.samplers.http_canary import HttpCanary
from watchdog.samplers.nvml import NvmlBackend, NvmlSampler, PynvmlBackend
from watchdog.samplers.pod_resources import list_pod_gpus
from watchdog.samplers.server_metrics import ServerMetricsSampler
from watchdog.samples import History, TorchSample, XidEvent
from watchdog.selector import parse as parse_selector
from watchdog.server import build_app
from watchdog.state import (
    AdmissionAnswered,
    AdmissionRequested,
    CacheFlushRequested,
    Outcome,
    PodGpus,
    RestartBegun,
    RestartEnded,
    reduce,
)

log = logs.get("watchdog")

TICK_S = 0.5


class Watchdog:
    """Wiring and loops: samplers produce outcomes, `state.reduce` folds them in, `policy.decide`
    turns the history into decisions, and the executor methods perform them and report back."""

    def __init__(
        self,
        settings: Settings,
        restarter: Restarter,
        nvml_backend: NvmlBackend | None = None,
        token: str | None = None,
        pod_gpus: Callable[[], tuple[str, ...] | None] | None = None,
        node: NodeReporter | None = None,
        wall_clock: Callable[[], float] = time.time,
    ) -> None:
        self.settings = settings
        self.restarter = restarter
        self._nvml_backend = nvml_backend or PynvmlBackend()
        self._token = token
        self._pod_gpus = pod_gpus if pod_gpus is not None else _pod_gpus_reader(settings)
        self.clock: Callable[[], float] = lambda: 0.0
        self.history = History(started_at=0.0)
        self.metrics = WatchdogMetrics(self.snapshot)
        self.decisions: list[dict[str, Any]] = []
        self.restart_failed: str | None = None
        self.idle_memory: idle_memory.IdleMemory | None = None
        self.pod_gpus_error: str | None = None
        self.node = node
        self.wall_clock = wall_clock  # Events carry wall-clock times
        self.suspects: dict[str, Suspect] = {}
        self._escalation_errors: set[str] = set()
        self._escalation_retry_at = 0.0
        self._escalation_backoff = 30.0
        self.server_metrics_url = metrics_url(settings.target)
        self._last_tick = 0.0
        self._blocked_reported: str | None = None
        self._saturated = False
        self._tasks: list[asyncio.Task[Any]] = []
        self._actions: set[asyncio.Task[Any]] = set()
        self._session: aiohttp.ClientSession | None = None
        self._runner: web.AppRunner | None = None
        self._eval_lock = asyncio.Lock()
        self.nvml: NvmlSampler | None = None
        self.control: ControlClient | None = None
        self.allocator: AllocatorSampler | None = None
        self.canary: Canary | None = None
        self.server_metrics: ServerMetricsSampler | None = None
        self.port: int | None = None

    # -- lifecycle ---------------------------------------------------------------------------

    async def start(self, serve_http: bool = True) -> None:
        loop = asyncio.get_running_loop()
        self.clock = loop.time
        now = self.clock()
        s = self.settings
        self.history = History(started_at=now, epoch=now, jitter=self._jitter())
        self._last_tick = now
        self._session = aiohttp.ClientSession()
        if s.target.http is not None:
            self.canary = HttpCanary(s.target.http, self._session, self.clock, s.canary.timeout,
                                     api_key_file=s.target.api_key_file)
        elif s.target.openai_url is None:
            token = self._token or self._read_token()
            self.control = ControlClient(s.target.control_url, token, self._session)
            self.allocator = AllocatorSampler(self.control, self.clock)
            self.canary = CanarySampler(self.control, self.clock, s.canary.timeout)
        else:
            self.canary = OpenAICanary(s.target.openai_url, s.target.openai_model, s.target.api_key_file,
                                       self._session, self.clock, s.canary.timeout)
        if self.server_metrics_url is not None:
            headers = self.canary.headers if isinstance(self.canary, OpenAICanary | HttpCanary) else dict
            progress = None if s.target.progress_metric is None else parse_selector(s.target.progress_metric)
            self.server_metrics = ServerMetricsSampler(self.server_metrics_url, self._session, self.clock,
                                                       timeout=min(5.0, s.sampling.server_interval + 1.0),
                                                       headers=headers, progress=progress)
        self.nvml = NvmlSampler(self._nvml_backend, self.clock)
        await asyncio.to_thread(self.nvml.open)
        self.nvml.start_xid_watch(lambda ev: loop.call_soon_threadsafe(self._on_xid, ev))
        await self._learn_pod_gpus()
        if serve_http:
            app = build_app(self.metrics.registry, self.healthy, self.ready, self.status)
            self._runner = web.AppRunner(app, handle_signals=False, access_log=None)
            await self._runner.setup()
            site = web.TCPSite(self._runner, s.server.host, s.server.port)
            await site.start()
            server = getattr(site, "_server", None)
            sockets = getattr(server, "sockets", None) or []
            self.port = sockets[0].getsockname()[1] if sockets else s.server.port
        self._tasks = [
            loop.create_task(self._periodic("nvml", lambda: s.sampling.nvml_interval, self._sample_nvml)),
            loop.create_task(self._periodic("canary", self._canary_delay, self._sample_canary)),
            loop.create_task(self._periodic("tick", lambda: TICK_S, self._tick)),
        ]
        if self.allocator is not None:
            self._tasks.append(loop.create_task(
                self._periodic("torch", lambda: s.sampling.torch_interval, self._sample_torch)))
        if self.server_metrics is not None:
            self._tasks.append(loop.create_task(
                self._periodic("server", lambda: s.sampling.server_interval, self._sample_server)))
        if self.node is not None:
            self._spawn(self._escalate("start"))
        log.info("watchdog_started", control_url=s.target.control_url if self.control else None,
                 openai_url=s.target.openai_url, server_metrics_url=self.server_metrics_url,
                 strategy=self.restarter.strategy, nvml=self.nvml.available, port=self.port,
                 pod_gpus=self.history.pod_gpus, canary_interval_s=s.canary.interval,
                 canary_timeout_s=s.canary.timeout)

    async def stop(self) -> None:
        for task in [*self._tasks, *self._actions]:
            task.cancel()
        await asyncio.gather(*self._tasks, *self._actions, return_exceptions=True)
        if self._runner is not None:
            await self._runner.cleanup()
        if self._session is not None:
            await self._session.close()
        if self.nvml is not None:
            await asyncio.to_thread(self.nvml.close)
        log.info("watchdog_stopped")

    def _jitter(self) -> float:
        # Replicas started together must not all hit max_age at once; the pod name seeds it.
        seed = hashlib.sha256(self.settings.kubernetes.pod_name.encode()).digest()
        return random.Random(seed).uniform(0.0, self.settings.policy.max_age_jitter)

    def _read_token(self) -> str | None:
        try:
            return read_token(self.settings.target.token_file)
        except Exception as exc:
            log.warning("token_unreadable", error=str(exc))
            return None

    async def _learn_pod_gpus(self) -> None:
        try:
            uuids = await asyncio.to_thread(self._pod_gpus)
        except Exception as exc:  # the kubelet socket missing, refused, slow: say so, go on without
            self.pod_gpus_error = str(exc)[:300]
            log.warning("pod_gpus_unknown", error=self.pod_gpus_error)
            return
        self.pod_gpus_error = None
        if uuids is not None:
            self._fold(PodGpus(uuids))
            log.info("pod_gpus", uuids=list(uuids), source="kubelet")

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
        reduce(self.history, outcome, self.settings.policy.admission)

    def _canary_delay(self) -> float:
        return policy.canary_delay(self.settings.canary, self.settings.policy, self.history)

    # -- samplers ----------------------------------------------------------------------------

    async def _sample_nvml(self) -> None:
        assert self.nvml is not None
        readout = await self.nvml.sample(policy.our_gpus(self.history))
        self._fold(readout)
        for g in readout.gpus:
            if g.lost:
                log.error("gpu_lost", uuid=g.uuid, reason=g.reason)
        await self._evaluate()

    def _on_xid(self, ev: XidEvent) -> None:
        h = self.history
        gpu = next((g for g in h.gpus if g.uuid == ev.uuid and g.index is not None), None)
        index = "" if gpu is None else str(gpu.index)
        self.metrics.xid_errors.labels(gpu=index, uuid=ev.uuid or "", xid=str(ev.xid)).inc()
        log.warning("xid_event", xid=ev.xid, uuid=ev.uuid, critical=ev.xid in policy.XID_CRITICAL,
                    ours=policy.xid_is_ours(h, ev.uuid))
        self._fold(ev)
        self._spawn(self._evaluate())

    async def _sample_torch(self) -> None:
        assert self.allocator is not None and self.control is not None
        sample = await self.allocator.sample()
        if not sample.reachable and sample.error and sample.error.startswith("unauthorized"):
            self.control.set_token(self._read_token())
        self._fold(sample)
        self._follow_idle_memory(sample)
        await self._evaluate()

    async def _sample_server(self) -> None:
        assert self.server_metrics is not None
        sample = await self.server_metrics.sample()
        last = self.history.server[-1] if self.history.server else None
        if last is None or last.reachable != sample.reachable or last.server != sample.server:
            if sample.reachable:
                log.info("server_metrics", server=sample.server, url=self.server_metrics_url,
                         recognised=sample.server != "unknown")
            else:
                log.warning("server_metrics_unavailable", url=self.server_metrics_url, error=sample.error)
        self._fold(sample)
        await self._evaluate()

    def _follow_idle_memory(self, sample: TorchSample) -> None:
        before = self.idle_memory
        self.idle_memory = after = idle_memory.observe(before, sample)
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

    async def _sample_canary(self) -> None:
        assert self.canary is not None
        if self.history.restart_in_progress:
            return
        sample = await self.canary.sample()
        if not sample.ok and self.control is not None and (
                sample.error_class == "unreachable" or "(401)" in (sample.error or "")):
            # The inference container may have (re)written the token file since we last read it.
            self.control.set_token(self._read_token() or self._token)
        served_before = self.history.served_at is not None
        self._fold(sample)
        if sample.ok:
            self.metrics.canary_duration.observe(sample.latency_s)
            if not served_before:
                log.info("target_serving", route=sample.route, latency_s=round(sample.latency_s, 4),
                         starting_s=round(sample.at - max(self.history.started_at, self.history.epoch), 3))
        else:
            self.metrics.canary_failures.labels(error_class=sample.error_class or "other").inc()
            log.warning("canary_failed", error_class=sample.error_class, latency_s=round(sample.latency_s, 4),
                        error=sample.error, route=sample.route, starting=not served_before)
        self._follow_saturation()
        await self._evaluate()

    def _follow_saturation(self) -> None:
        now_saturated, figures = policy.saturated(self.history)
        if now_saturated and not self._saturated:
            self.metrics.saturation_episodes.inc()
            # Busy is not hung: no restart, readiness held. Logged once per episode.
            log.warning("saturated", action="none", **figures)
        elif self._saturated and not now_saturated:
            last = self.history.canaries[-1] if self.history.canaries else None
            log.info("saturation_ended", canary=None if last is None else ("ok" if last.ok else last.error_class))
        self._saturated = now_saturated

    async def _tick(self) -> None:
        self._last_tick = self.clock()
        await self._evaluate()

    # -- decisions and their effects ---------------------------------------------------------

    async def _evaluate(self) -> None:
        async with self._eval_lock:
            now = self.clock()
            for decision in policy.decide(self.settings.policy, self.history, now):
                self._act(decision, now)

    def _record(self, decision: Decision, outcome: str, now: float) -> None:
        entry = {"at": round(now - self.history.started_at, 3), "action": decision.action,
                 "reason": decision.reason, "outcome": outcome, "detail": decision.detail}
        self.decisions = [*self.decisions[-49:], entry]
        self.metrics.decisions.labels(action=decision.action, reason=decision.reason, outcome=outcome).inc()

    def _spawn(self, coro: Any) -> None:
        # Keep a reference: the loop holds tasks weakly, and an action must not vanish mid-way.
        task = asyncio.get_running_loop().create_task(coro)
        self._actions.add(task)
        task.add_done_callback(self._actions.discard)

    def _act(self, decision: Decision, now: float) -> None:
        if decision.action == "restart" and not decision.allowed:
            if self._blocked_reported != decision.reason:
                self._blocked_reported = decision.reason
                self._record(decision, "blocked_by_budget", now)
                log.error("restart_blocked", reason=decision.reason, blocked_by=decision.blocked_by,
                          budget_window_s=self.settings.policy.restart_budget.window, detail=decision.detail)
            return
        if decision.action == "restart":
            self._blocked_reported = None
            self._fold(RestartBegun(now))
            self._record(decision, "started", now)
            self._spawn(self._restart(decision))
        elif decision.action == "empty_cache":
            self._fold(CacheFlushRequested(now, decision.reason))
            self._record(decision, "started", now)
            self._spawn(self._empty_cache(decision))
        elif decision.action in (ladder.SHRINK, ladder.GROW):
            change = Change(decision.action, int(decision.detail["limit"]), decision.detail)
            self._fold(AdmissionRequested(change))
            self._record(decision, "started", now)
            self._spawn(self._set_admission(decision, change))

    async def _set_admission(self, decision: Decision, change: Change) -> None:
        assert self.control is not None
        try:
            await self.control.set_admission(change.limit)
            ok = True
        except ControlError as exc:
            ok = False
            log.warning("admission_change_failed", action=change.action, limit=change.limit, error=str(exc))
        self._fold(AdmissionAnswered(self.clock(), change, ok))
        if ok:
            direction = "down" if change.action == ladder.SHRINK else "up"
            self.metrics.admission_changes.labels(direction=direction).inc()
            # Never a restart, and the restart budget is not touched.
            log.warning("decision", action=change.action, reason=decision.reason, limit=change.limit,
                        detail=decision.detail, ladder=dataclasses.asdict(self.history.ladder)
                        if self.history.ladder is not None else None)

    async def _empty_cache(self, decision: Decision) -> None:
        assert self.control is not None
        self.metrics.empty_cache.labels(reason=decision.reason).inc()
        try:
            result = await self.control.empty_cache()
            freed = result.get("freed_bytes", 0)
            freed = freed if isinstance(freed, int) and freed >= 0 else 0
            self.metrics.empty_cache_freed.inc(freed)
            log.info("decision", action="empty_cache", reason=decision.reason, freed_bytes=freed,
                     detail=decision.detail)
        except ControlError as exc:
            log.warning("empty_cache_failed", reason=decision.reason, error=str(exc))

    async def _restart(self, decision: Decision) -> None:
        s = self.settings
        started = self.clock()
        log.warning("decision", action="restart", reason=decision.reason, strategy=self.restarter.strategy,
                    drain=decision.drain, detail=decision.detail,
                    budget_remaining=policy.budget_remaining(s.policy, self.history, started) - 1)
        done, keep_unready = False, False
        try:
            if decision.drain and self.restarter.strategy != "none" and self.control is not None:
                try:
                    drained = await self.control.drain(s.restart.drain_timeout)
                    log.info("drained", **{k: drained.get(k) for k in ("drained", "inflight", "queued")})
                except ControlError as exc:
                    log.warning("drain_failed", error=str(exc))
            outcome = await self.restarter.restart(decision)
            now = self.clock()
            done = outcome.done
            if outcome.done:
                self.restart_failed = None
                self.metrics.restarts.labels(reason=decision.reason).inc()
                keep_unready = self.restarter.strategy in ("evict", "delete")
            elif not isinstance(self.restarter, ReportOnlyRestarter):
                self.restart_failed = outcome.detail
            self._record(decision, "done" if outcome.done else "failed", now)
            if self.node is not None and decision.reason in CURING_REASONS:
                self._spawn(self._escalate(decision.reason))
            log.warning("restart_finished", reason=decision.reason, strategy=self.restarter.strategy,
                        done=outcome.done, detail=outcome.detail, attempts=outcome.attempts,
                        seconds=round(now - started, 3))
        except Exception as exc:
            self.restart_failed = repr(exc)
            log.exception("restart_failed", reason=decision.reason, error=repr(exc))
        finally:
            self._fold(RestartEnded(self.clock(), decision.reason, done, keep_unready))
            if self.canary is not None:
                self.canary.forget()
            if not keep_unready:
                # Readiness needs a canary newer than the restart: take one now rather than at the
                # next interval (30 s by default), so a served-again model is routed to at once.
                self._spawn(self._sample_canary())

    async def _escalate(self, why: str) -> None:
        """Read the namespace's restart Events back; report our GPUs that restarts did not cure."""
        assert self.node is not None
        if self.clock() < self._escalation_retry_at:
            return
        try:
            records = await asyncio.to_thread(self.node.restart_records)
        except Exception as exc:  # 403, timeouts, garbage: reported once per kind, retried later
            self._escalation_failed("list_events", exc)
            return
        found = escalation.suspects(self.settings.policy.escalation, records, self.wall_clock(),
                                    policy.our_gpus(self.history))
        for suspect in found:
            if suspect.uuid in self.suspects:
                continue
            log.error("gpu_suspect", uuid=suspect.uuid, node=self.node.node_name, restarts=len(suspect.restarts),
                      reasons=suspect.reasons, xids=suspect.xids, action="report", trigger=why,
                      node_condition=self.node.node_condition)
            try:
                await asyncio.to_thread(self.node.report, suspect, self.settings.kubernetes.pod_name)
            except Exception as exc:
                self._escalation_failed("report", exc)
                continue  # not marked: reported again on the next look
            self.suspects[suspect.uuid] = suspect
        self._escalation_backoff = 30.0

    def _escalation_failed(self, step: str, exc: BaseException) -> None:
        status = getattr(exc, "status", None)
        key = f"{step}:{status or type(exc).__name__}"
        if key not in self._escalation_errors:
            self._escalation_errors.add(key)
            log.warning("escalation_failed", step=step, status=status, error=str(exc)[:300],
                        retry_in_s=self._escalation_backoff)
        self._escalation_retry_at = self.clock() + self._escalation_backoff
        self._escalation_backoff = min(self._escalation_backoff * 2, 3600.0)

    # -- views -------------------------------------------------------------------------------

    def _extras(self) -> views.Extras:
        return views.Extras(
            nvml_available=self.nvml is not None and self.nvml.available,
            server_metrics_url=self.server_metrics_url,
            canary={} if self.canary is None else self.canary.describe(),
            strategy=self.restarter.strategy, restart_failed=self.restart_failed, decisions=self.decisions,
            idle_memory=self.idle_memory, pod_gpus_error=self.pod_gpus_error,
            suspects=tuple(self.suspects.values()),
        )

    def states(self) -> frozenset[str]:
        return views.states(self.settings, self.history, self.clock(), self._extras())

    def snapshot(self) -> Snapshot:
        return views.snapshot(self.settings, self.history, self.clock(), self._extras())

    def healthy(self) -> tuple[bool, dict[str, Any]]:
        age = self.clock() - self._last_tick
        ok = age < max(10.0, TICK_S * 20)
        return ok, {"ok": ok, "last_tick_age_s": round(age, 3)}

    def ready(self) -> tuple[bool, dict[str, Any]]:
        return views.ready(self.history)

    def status(self) -> dict[str, Any]:
        return views.status(self.settings, self.history, self.clock(), self._extras())


def _pod_gpus_reader(settings: Settings) -> Callable[[], tuple[str, ...] | None]:
    k = settings.kubernetes
    socket_path = k.pod_resources_socket
    if socket_path is None:
        return lambda: None
    return functools.partial(list_pod_gpus, socket_path, k.pod_name, k.namespace, k.request_timeout)


def build_restarter(settings: Settings) -> Restarter:
    from watchdog.actions.kube import PodActions, load_api_client
    from watchdog.actions.restart import KubeRestarter

    strategy = settings.restart.strategy
    if strategy == "none":
        return ReportOnlyRestarter()
    if strategy == "local":
        raise ConfigError(["restart.strategy: local only works under `gpu-watchdog up`, which owns the process"])
    k = settings.kubernetes
    api = load_api_client(k.kubeconfig, k.request_timeout)
    return KubeRestarter(PodActions(api, k.pod_name, k.namespace, k.request_timeout), settings.restart)


def build_node_reporter(settings: Settings) -> NodeReporter | None:
    """Only where restarts go through Kubernetes: the Events to read back are written there."""
    if settings.restart.strategy not in ("evict", "delete"):
        return None
    from watchdog.actions.kube import load_api_client

    k = settings.kubernetes
    return NodeReporter(load_api_client(k.kubeconfig, k.request_timeout), k.namespace, k.node_name,
                        k.request_timeout, settings.policy.escalation.node_condition)


async def run_until_signal(watchdog: Watchdog) -> None:
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    await watchdog.start()
    await stop.wait()
    # Stopping never acts: no drain, no restart, just leave.
    await watchdog.stop()


def run_main(config_path: str) -> int:
    logs.configure("watchdog")
    try:
        settings = load(config_path)
        restarter = build_restarter(settings)
        node = build_node_reporter(settings)
    except ConfigError as exc:
        for line in exc.errors:
            print(f"error: {line}", file=sys.stderr)
        print(f"gpu-watchdog run: invalid config {config_path}", file=sys.stderr)
        return 2
    except Exception as exc:  # kubeconfig missing, refused pod, ...
        print(f"gpu-watchdog run: {exc}", file=sys.stderr)
        return 2
    try:
        asyncio.run(run_until_signal(Watchdog(settings, restarter, node=node)))
    except OSError as exc:
        print(f"gpu-watchdog run: cannot listen on {settings.server.host}:{settings.server.port}: {exc.strerror}",
              file=sys.stderr)
        return 2
    return 0
