"""The watchdog loop: samplers -> policy -> actions, plus its HTTP server."""

from __future__ import annotations

import asyncio
import dataclasses
import hashlib
import random
import signal
import sys
from collections.abc import Callable
from typing import Any

import aiohttp
from aiohttp import web

from watchdog import idle_memory, logs, policy
from watchdog.actions.restart import ReportOnlyRestarter, Restarter
from watchdog.config import ConfigError, Settings, load
from watchdog.control_client import ControlClient, ControlError
from watchdog.metrics import Snapshot, WatchdogMetrics
from watchdog.policy import Decision
from watchdog.samplers.allocator import AllocatorSampler
from watchdog.samplers.canary import CanarySampler
from watchdog.samplers.nvml import NvmlBackend, NvmlSampler, PynvmlBackend
from watchdog.samples import ActionRecord, CanarySample, History, TorchSample, XidEvent
from watchdog.server import build_app
from watchdog.token import read_token

log = logs.get("watchdog")

TICK_S = 0.5


class Watchdog:
    def __init__(
        self,
        settings: Settings,
        restarter: Restarter,
        nvml_backend: NvmlBackend | None = None,
        token: str | None = None,
    ) -> None:
        self.settings = settings
        self.restarter = restarter
        self._nvml_backend = nvml_backend or PynvmlBackend()
        self._token = token
        self.clock: Callable[[], float] = lambda: 0.0
        self.history = History(started_at=0.0)
        self.metrics = WatchdogMetrics(self.snapshot)
        self.decisions: list[dict[str, Any]] = []
        self.restart_failed: str | None = None
        self.idle_memory: idle_memory.IdleMemory | None = None
        self._last_tick = 0.0
        self._blocked_reported: str | None = None
        self._tasks: list[asyncio.Task[Any]] = []
        self._actions: set[asyncio.Task[Any]] = set()
        self._session: aiohttp.ClientSession | None = None
        self._runner: web.AppRunner | None = None
        self._eval_lock = asyncio.Lock()
        self.nvml: NvmlSampler | None = None
        self.control: ControlClient | None = None
        self.allocator: AllocatorSampler | None = None
        self.canary: CanarySampler | None = None
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
        token = self._token or self._read_token()
        self.control = ControlClient(s.target.control_url, token, self._session)
        self.allocator = AllocatorSampler(self.control, self.clock)
        self.canary = CanarySampler(self.clock, s.canary.timeout, client=self.control, session=self._session,
                                    openai_url=s.target.openai_url, openai_model=s.target.openai_model)
        self.nvml = NvmlSampler(self._nvml_backend, self.clock)
        await asyncio.to_thread(self.nvml.open)
        self.nvml.start_xid_watch(lambda ev: loop.call_soon_threadsafe(self._on_xid, ev))
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
            loop.create_task(self._periodic("nvml", s.sampling.nvml_interval, self._sample_nvml)),
            loop.create_task(self._periodic("canary", s.canary.interval, self._sample_canary)),
            loop.create_task(self._periodic("tick", TICK_S, self._tick)),
        ]
        if s.target.openai_url is None:
            self._tasks.append(loop.create_task(self._periodic("torch", s.sampling.torch_interval, self._sample_torch)))
        log.info("watchdog_started", control_url=s.target.control_url, openai_url=s.target.openai_url,
                 strategy=self.restarter.strategy, nvml=self.nvml.available, port=self.port,
                 canary_interval_s=s.canary.interval, canary_timeout_s=s.canary.timeout)

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

    async def _periodic(self, name: str, interval: float, step: Callable[[], Any]) -> None:
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
            await asyncio.sleep(max(0.0, interval - elapsed))

    # -- samplers ----------------------------------------------------------------------------

    async def _sample_nvml(self) -> None:
        assert self.nvml is not None
        self.history.gpu = await self.nvml.sample(self.history.torch_uuid())
        if self.history.gpu.lost:
            log.error("gpu_lost", uuid=self.history.gpu.uuid, reason=self.history.gpu.reason)
        await self._evaluate()

    def _on_xid(self, ev: XidEvent) -> None:
        gpu = self.history.gpu
        index = "" if gpu is None or gpu.index is None or gpu.uuid != ev.uuid else str(gpu.index)
        self.metrics.xid_errors.labels(gpu=index, uuid=ev.uuid or "", xid=str(ev.xid)).inc()
        ours = self.history.torch_uuid()
        log.warning("xid_event", xid=ev.xid, uuid=ev.uuid, ours=ours is None or ev.uuid == ours,
                    critical=ev.xid in policy.XID_CRITICAL)
        self.history.xids.append(ev)
        self._spawn(self._evaluate())

    async def _sample_torch(self) -> None:
        assert self.allocator is not None and self.control is not None
        sample = await self.allocator.sample()
        if not sample.reachable and sample.error and sample.error.startswith("unauthorized"):
            self.control.set_token(self._read_token())
        self.history.torch.append(sample)
        self._follow_idle_memory(sample)
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
        self.history.canaries.append(sample)
        if sample.ok:
            self.metrics.canary_duration.observe(sample.latency_s)
        else:
            self.metrics.canary_failures.labels(error_class=sample.error_class or "other").inc()
            log.warning("canary_failed", error_class=sample.error_class, latency_s=round(sample.latency_s, 4),
                        error=sample.error)
        await self._evaluate()

    async def _tick(self) -> None:
        self._last_tick = self.clock()
        await self._evaluate()

    # -- decisions ---------------------------------------------------------------------------

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
            self.history.restart_in_progress = True
            self._record(decision, "started", now)
            self._spawn(self._restart(decision))
        elif decision.action == "empty_cache":
            self.history.actions.append(ActionRecord(now, "empty_cache", decision.reason))
            self._record(decision, "started", now)
            self._spawn(self._empty_cache(decision))

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
        keep_unready = False
        try:
            if decision.drain and self.restarter.strategy != "none" and self.control is not None:
                try:
                    drained = await self.control.drain(s.restart.drain_timeout)
                    log.info("drained", **{k: drained.get(k) for k in ("drained", "inflight", "queued")})
                except ControlError as exc:
                    log.warning("drain_failed", error=str(exc))
            outcome = await self.restarter.restart(decision)
            now = self.clock()
            self.history.actions.append(ActionRecord(now, "restart", decision.reason))
            if outcome.done:
                self.restart_failed = None
                self.metrics.restarts.labels(reason=decision.reason).inc()
                # After an eviction the pod is going away: stay unready until it does.
                keep_unready = self.restarter.strategy in ("evict", "delete")
            elif not isinstance(self.restarter, ReportOnlyRestarter):
                self.restart_failed = outcome.detail
            self._record(decision, "done" if outcome.done else "failed", now)
            log.warning("restart_finished", reason=decision.reason, strategy=self.restarter.strategy,
                        done=outcome.done, detail=outcome.detail, attempts=outcome.attempts,
                        seconds=round(now - started, 3))
        except Exception as exc:
            self.restart_failed = repr(exc)
            log.exception("restart_failed", reason=decision.reason, error=repr(exc))
        finally:
            self.history.epoch = self.clock()
            self.history.restart_in_progress = keep_unready
            if not keep_unready:
                # Readiness needs a canary newer than the restart: take one now rather than at the
                # next interval (30 s by default), so a served-again model is routed to at once.
                self._spawn(self._sample_canary())

    # -- views -------------------------------------------------------------------------------

    def states(self) -> frozenset[str]:
        h = self.history
        states: set[str] = set()
        last_canary = h.canaries[-1] if h.canaries else None
        last_torch = h.torch[-1] if h.torch else None
        if h.restart_in_progress:
            states.add("restarting")
        if last_canary is not None and not last_canary.ok:
            states.add("canary_failing")
        if (last_canary is not None and last_canary.error_class == "unreachable") or (
                last_torch is not None and not last_torch.reachable):
            states.add("target_unreachable")
        if policy.budget_remaining(self.settings.policy, h, self.clock()) <= 0:
            states.add("budget_exhausted")
        if self.nvml is not None and not self.nvml.available:
            states.add("nvml_unavailable")
        if last_canary is not None and last_canary.ok and not h.restart_in_progress:
            states.add("healthy")
        return frozenset(states)

    def snapshot(self) -> Snapshot:
        h = self.history
        return Snapshot(
            gpu=h.gpu,
            torch=next((t for t in reversed(h.torch) if t.reachable), None),
            canary=h.canaries[-1] if h.canaries else None,
            budget_remaining=policy.budget_remaining(self.settings.policy, h, self.clock()),
            states=self.states(),
            idle_memory=self.idle_memory,
        )

    def healthy(self) -> tuple[bool, dict[str, Any]]:
        age = self.clock() - self._last_tick
        ok = age < max(10.0, TICK_S * 20)
        return ok, {"ok": ok, "last_tick_age_s": round(age, 3)}

    def ready(self) -> tuple[bool, dict[str, Any]]:
        h = self.history
        last: CanarySample | None = h.canaries[-1] if h.canaries else None
        ok = last is not None and last.ok and last.at >= h.epoch and not h.restart_in_progress
        reason = None if ok else ("restarting" if h.restart_in_progress else "no successful canary yet"
                                  if last is None or last.at < h.epoch else f"canary failed: {last.error_class}")
        return ok, {"ready": ok, "reason": reason}

    def status(self) -> dict[str, Any]:
        h = self.history
        now = self.clock()
        last_torch: TorchSample | None = h.torch[-1] if h.torch else None

        def asdict(obj: Any) -> Any:
            return None if obj is None else dataclasses.asdict(obj)

        return {
            "states": sorted(self.states()),
            "ready": self.ready()[0],
            "strategy": self.restarter.strategy,
            "nvml": {"available": self.nvml is not None and self.nvml.available,
                     "reason": None if h.gpu is None else h.gpu.reason},
            "uptime_s": round(now - h.started_at, 3),
            "restart_budget_remaining": policy.budget_remaining(self.settings.policy, h, now),
            "restart_in_progress": h.restart_in_progress,
            "restart_failed": self.restart_failed,
            "last_samples": {"gpu": asdict(h.gpu), "torch": asdict(last_torch),
                             "canary": asdict(h.canaries[-1] if h.canaries else None)},
            "idle_memory": None if self.idle_memory is None else {
                **dataclasses.asdict(self.idle_memory), "growth_bytes": self.idle_memory.growth_bytes,
                "growth_ratio": round(self.idle_memory.growth_ratio, 6), "growing": self.idle_memory.growing},
            "last_decisions": self.decisions[-20:],
            "restarts": [dataclasses.asdict(a) for a in h.actions if a.action == "restart"][-20:],
        }


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
    except ConfigError as exc:
        for line in exc.errors:
            print(f"error: {line}", file=sys.stderr)
        print(f"gpu-watchdog run: invalid config {config_path}", file=sys.stderr)
        return 2
    except Exception as exc:  # kubeconfig missing, refused pod, ...
        print(f"gpu-watchdog run: {exc}", file=sys.stderr)
        return 2
    try:
        asyncio.run(run_until_signal(Watchdog(settings, restarter)))
    except OSError as exc:
        print(f"gpu-watchdog run: cannot listen on {settings.server.host}:{settings.server.port}: {exc.strerror}",
              file=sys.stderr)
        return 2
    return 0
