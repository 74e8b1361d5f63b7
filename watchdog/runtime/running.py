"""What exists only while the watchdog runs, built whole at start: the HTTP session, the samplers,
the effects' edges (the executor, the restart procedure's, the keep-out), the HTTP server and the
periodic tasks that drive the loop (`watchdog.runtime.app`)."""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import aiohttp
from aiohttp import web

from gpu_watchdog import logs
from gpu_watchdog.watchdog.core import edges, recording
from gpu_watchdog.watchdog.core.timing import BUDGET_READ_S, LAG_FOLD_S, LAG_PROBE_S, QUARANTINE_SYNC_S, TICK_S
from gpu_watchdog.watchdog.edge.executor import Executor
from gpu_watchdog.watchdog.edge.keep_out import KeepOut, lift_interval
from gpu_watchdog.watchdog.edge.samplers.assembly import Samplers, build_samplers
from gpu_watchdog.watchdog.edge.samplers.canary import CanarySampler, OpenAICanary
from gpu_watchdog.watchdog.edge.samplers.probe import ControlProber, OpenAIProber, Prober
from gpu_watchdog.watchdog.edge.server import build_app
from gpu_watchdog.watchdog.runtime.checking import AnswerCheck
from gpu_watchdog.watchdog.runtime.restarting import Restarts
from gpu_watchdog.watchdog.runtime.sampling import Sampling
from gpu_watchdog.watchdog.runtime.worker_rung import WorkerRung

if TYPE_CHECKING:
    from gpu_watchdog.watchdog.runtime.app import Watchdog

log = logs.get("watchdog")



@dataclass
class Running:
    session: aiohttp.ClientSession
    samplers: Samplers
    executor: Executor
    keep_out: KeepOut | None
    restarts: Restarts
    sampling: Sampling
    runner: web.AppRunner | None = None
    checking: AnswerCheck | None = None
    port: int | None = None
    tasks: list[asyncio.Task[Any]] = field(default_factory=list)


async def build(wd: Watchdog, serve_http: bool) -> Running:
    """Every part, and the tasks that drive them."""
    loop = asyncio.get_running_loop()
    s = wd.settings
    session = aiohttp.ClientSession()
    token = (wd.given_token or wd.read_token()) if s.target.http is None and s.target.openai_url is None else None
    samplers = build_samplers(s, session, wd.clock, token, wd.nvml_backend, wd.server_metrics_url)
    history = lambda: wd.history  # noqa: E731 - the fold as it stands at each read
    executor = Executor(
        settings=s, restarter=wd.restarter, metrics=wd.metrics, clock=wd.clock, wall_clock=wd.cluster_clock,
        control=samplers.control, history=history, fold=wd.fold, node=wd.node, restart_events=wd.restart_events,
        workload=wd.workload, pod_gpus=wd.pod_gpus, ledger=wd.ledger,
        worker_controls={k: c for k, _, c in samplers.workers.clients} if samplers.workers is not None else None)
    await asyncio.to_thread(samplers.nvml.open)
    wd.fold(edges.NvmlOpened(samplers.nvml.available))
    wd.fold(edges.CanaryDescribed(samplers.canary.describe()))
    sampling = Sampling(
        settings=s, samplers=samplers, executor=executor, restarter=wd.restarter, metrics=wd.metrics,
        episodes=wd.episodes, history=history, fold=wd.fold, evaluate=wd.evaluate, spawn=wd.spawn, clock=wd.clock,
        wall_clock=wd.wall_clock, read_token=wd.read_token, token=wd.given_token,
        server_metrics_url=wd.server_metrics_url)
    samplers.nvml.start_xid_watch(lambda ev: loop.call_soon_threadsafe(sampling.on_xid, ev))
    keep_out = KeepOut(settings=s, placer=wd.placer, ledger=wd.ledger, metrics=wd.metrics, wall_clock=wd.cluster_clock,
                       workload=wd.workload or "", history=history, fold=wd.fold, clock=wd.clock) \
        if wd.placer is not None and wd.ledger is not None and s.policy.placement.strategy != "off" else None
    restarts = Restarts(
        settings=s, executor=executor, metrics=wd.metrics, fold=wd.fold, record_decision=wd.record_decision,
        clock=wd.clock, history=history, read_budget=wd.read_budget if wd.restart_events is not None else None,
        keep_out=keep_out,
        worker_control=lambda k: samplers.workers.client(k) if samplers.workers is not None and k else samplers.control,
        spawn=wd.spawn, restarted=wd.restarted, escalate=wd.escalate)
    run = Running(session, samplers, executor, keep_out, restarts, sampling,
                  checking=_answer_check(wd, samplers, session, executor))
    if serve_http:
        run.runner, run.port = await _serve_http(wd)
    return run


def _answer_check(wd: Watchdog, samplers: Samplers, session: aiohttp.ClientSession, executor: Executor
                  ) -> AnswerCheck | None:
    """The correctness probes where they are on and the target can answer one (the bundled server's
    control canary, or an OpenAI-compatible completions route)."""
    s = wd.settings
    if not s.policy.correctness.enabled:
        return None
    prober: Prober
    if isinstance(samplers.canary, CanarySampler) and samplers.control is not None:
        prober = ControlProber(samplers.control, s.canary.timeout)
    elif isinstance(samplers.canary, OpenAICanary):
        prober = OpenAIProber(samplers.canary, session, s.canary.timeout)
    else:
        log.warning("correctness_not_possible", canary=samplers.canary.route,
                    action="target.http answers no probe: policy.correctness is off for this target")
        return None
    return AnswerCheck(settings=s, prober=prober, ledger=wd.ledger, metrics=wd.metrics, history=lambda: wd.history,
                       fold=wd.fold, evaluate=wd.evaluate, clock=wd.clock, wall_clock=wd.cluster_clock,
                       template=executor.own_template,
                       pod=s.kubernetes.pod_name, node=s.kubernetes.node_name or None,
                       device_reported=isinstance(prober, ControlProber))


def start_tasks(wd: Watchdog, run: Running) -> None:
    """The loop's periodic steps, each as often as its settings say."""
    s, samplers, sampling = wd.settings, run.samplers, run.sampling
    loop = asyncio.get_running_loop()

    def periodic(name: str, interval: Callable[[], float], step: Callable[[], Awaitable[Any]]) -> None:
        run.tasks.append(loop.create_task(_periodic(wd, name, interval, step)))

    periodic("nvml", lambda: s.sampling.nvml_interval, sampling.nvml)
    periodic("canary", sampling.canary_delay, sampling.canary)
    periodic("tick", lambda: TICK_S, wd.tick)
    run.tasks.append(loop.create_task(_watch_loop_lag(wd)))
    if wd.restart_events is not None:
        periodic("budget", lambda: BUDGET_READ_S, wd.read_budget)
    if wd.history.edge.pod_gpus_error is not None:
        run.tasks.append(loop.create_task(_retry_pod_gpus(wd)))
    if samplers.allocator is not None:
        periodic("torch", lambda: s.sampling.torch_interval, sampling.torch)
    if samplers.server_metrics is not None:
        periodic("server", sampling.server_delay, sampling.server)
    if samplers.workers is not None:
        periodic("workers", lambda: s.sampling.torch_interval, sampling.workers)
        rung = WorkerRung(settings=s, sampler=samplers.workers, executor=run.executor, restarts=run.restarts,
                          fold=wd.fold, clock=wd.clock, budget_from_events=wd.restart_events is not None,
                          decided=lambda now, decisions: wd.decided(now, decisions, recording.WORKERS))
        periodic("worker_canaries", lambda: s.canary.interval, lambda: rung.sample(lambda: wd.history))
    if samplers.device_health is not None:
        periodic("device_health", lambda: s.sampling.device_health_interval, sampling.device_health)
    if run.keep_out is not None:
        periodic("placement", lambda: lift_interval(s.policy.placement.ttl), run.keep_out.reconcile)
    if run.checking is not None:
        periodic("correctness", run.checking.interval, run.checking.round)
    if s.policy.quarantine.enabled and samplers.control is not None:
        periodic("quarantine", lambda: QUARANTINE_SYNC_S, run.executor.sync_quarantine)


async def _serve_http(wd: Watchdog) -> tuple[web.AppRunner, int]:
    s = wd.settings
    runner = web.AppRunner(build_app(wd.metrics.registry, wd.healthy, wd.ready, wd.status),
                           handle_signals=False, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, s.server.host, s.server.port)
    await site.start()
    server = getattr(site, "_server", None)
    sockets = getattr(server, "sockets", None) or []
    return runner, sockets[0].getsockname()[1] if sockets else s.server.port


async def stop(run: Running, actions: set[asyncio.Task[Any]]) -> None:
    for task in [*run.tasks, *actions]:
        task.cancel()
    await asyncio.gather(*run.tasks, *actions, return_exceptions=True)
    if run.runner is not None:
        await run.runner.cleanup()
    await run.session.close()
    await asyncio.to_thread(run.samplers.nvml.close)


async def _periodic(wd: Watchdog, name: str, interval: Callable[[], float], step: Callable[[], Awaitable[Any]]) -> None:
    while True:
        start = wd.clock()
        try:
            await step()
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # a sampler must never take the loop down
            log.exception("loop_step_failed", step=name, error=repr(exc))
        elapsed = wd.clock() - start
        if name != "tick":
            wd.metrics.sample_duration.labels(sampler=name).observe(elapsed)
        await asyncio.sleep(max(0.0, interval() - elapsed))


async def _watch_loop_lag(wd: Watchdog) -> None:
    lags: deque[float] = deque(maxlen=1200)
    folded_at = float("-inf")
    while True:
        before = wd.clock()
        await asyncio.sleep(LAG_PROBE_S)
        now = wd.clock()
        lag = max(0.0, now - before - LAG_PROBE_S)
        lags.append(lag)
        wd.metrics.event_loop_lag.observe(lag)
        if now - folded_at >= LAG_FOLD_S:
            folded_at = now
            ordered = sorted(lags)
            p99 = ordered[int(0.99 * (len(ordered) - 1))]
            wd.fold(edges.LoopLag(now, round(lags[-1], 4), round(p99, 4), round(ordered[-1], 4), len(ordered)))


async def _retry_pod_gpus(wd: Watchdog) -> None:
    """The kubelet may come up after us, or its socket be fixed: ask again, ever less often."""
    while wd.history.edge.pod_gpus_error is not None:
        await asyncio.sleep(edges.pod_gpus_wait(wd.history.edge.pod_gpus_tries))
        await wd.learn_pod_gpus()
