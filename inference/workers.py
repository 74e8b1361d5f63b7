"""`serve --workers N`: one server process per GPU, kept running by the parent.

Each worker is a whole `serve` of its own (its gate, measured budget, decode loop and control API
on `control_port + k`), pinned to its card by `CUDA_VISIBLE_DEVICES`, answering its public API on
a Unix socket only the parent uses. A worker that exits (a poisoned context exits with 3) is
started again after a backoff while the others serve; one that fails to start before it ever
served (a bad model path, a flag it refuses) stops the whole server, as a single `serve` would.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path

import aiohttp
import structlog

from gpu_watchdog.inference.poison import EXIT_POISONED, EXIT_TOLD
from gpu_watchdog.inference.settings import ServeSettings, SettingsError, to_argv

log = structlog.get_logger(__name__)

# A worker that ran this long before it exited was not crash-looping: its next start is not delayed.
STABLE_S = 60.0
BACKOFF_FIRST_S = 1.0
BACKOFF_MAX_S = 30.0
POLL_S = 0.25
# `serve`'s exit code when it could not start (settings, model, port).
EXIT_START_FAILED = 2
EXIT_REASONS = {EXIT_POISONED: "context_lost", EXIT_TOLD: "told"}


@dataclass(frozen=True)
class WorkerPlan:
    """Worker k as it is started: its card, its control port and its socket."""

    index: int
    gpu: str | None  # the CUDA_VISIBLE_DEVICES entry it is pinned to; None on CPU
    control_port: int
    socket: str

    def argv(self, settings: ServeSettings) -> list[str]:
        child = replace(settings, workers=1, unix_socket=self.socket, control_port=self.control_port,
                        host="127.0.0.1")
        return [sys.executable, "-m", "gpu_watchdog", "serve", *to_argv(child)]

    def env(self, base: Mapping[str, str]) -> dict[str, str]:
        env = {k: v for k, v in base.items() if k != "GPU_WATCHDOG_INSTANCE_ID"}  # each its own
        env["GPU_WATCHDOG_WORKER"] = str(self.index)
        if self.gpu is not None:
            env["CUDA_VISIBLE_DEVICES"] = self.gpu
        return env


def worker_gpus(settings: ServeSettings, env: Mapping[str, str], has_gpu: bool) -> list[str | None]:
    """The card each worker is pinned to: the k-th of those this process may see."""
    n = settings.workers
    if settings.device == "cpu" or (settings.device == "auto" and not has_gpu):
        return [None] * n
    visible = env.get("CUDA_VISIBLE_DEVICES", "").strip()
    if not visible:
        return [str(k) for k in range(n)]
    ids: list[str | None] = [v.strip() for v in visible.split(",") if v.strip()]
    if len(ids) < n:
        raise SettingsError(f"--workers {n}: CUDA_VISIBLE_DEVICES names {len(ids)} GPU(s) ({visible});"
                            " one worker per GPU")
    return ids[:n]


def plan_workers(settings: ServeSettings, socket_dir: Path, env: Mapping[str, str], has_gpu: bool
                 ) -> list[WorkerPlan]:
    if settings.control_port == 0:
        raise SettingsError("--workers needs a --control-port: worker k's control API is on --control-port + k")
    if settings.control_port + settings.workers - 1 > 65535:
        raise SettingsError(f"--control-port {settings.control_port} + --workers {settings.workers}: past port 65535")
    if settings.control_port <= settings.port < settings.control_port + settings.workers:
        raise SettingsError(f"--port {settings.port} is one of the workers' control ports"
                            f" ({settings.control_port}..{settings.control_port + settings.workers - 1})")
    gpus = worker_gpus(settings, env, has_gpu)
    return [WorkerPlan(k, gpus[k], settings.control_port + k, str(socket_dir / f"worker-{k}.sock"))
            for k in range(settings.workers)]


def backoff(failures: int) -> float:
    """Seconds before worker's next start after `failures` exits in a row that came quickly."""
    if failures <= 0:
        return 0.0
    return min(BACKOFF_FIRST_S * 2 ** (failures - 1), BACKOFF_MAX_S)


@dataclass
class Worker:
    plan: WorkerPlan
    generation: int = 0
    restarts: int = 0
    pid: int | None = None
    ready: bool = False  # its last report said ready (not loading, draining or poisoned)
    limit: int = 1
    inflight: int = 0  # requests the parent has sent it and not yet seen answered
    served: int = 0
    ever_ready: bool = False
    last_exit: int | None = None
    state: str = "starting"
    proc: asyncio.subprocess.Process | None = field(default=None, repr=False)

    @property
    def index(self) -> int:
        return self.plan.index

    @property
    def routable(self) -> bool:
        return self.proc is not None and self.proc.returncode is None and self.ready

    def view(self) -> dict[str, object]:
        return {"worker": self.index, "gpu": self.plan.gpu, "pid": self.pid, "state": self.state,
                "ready": self.routable, "generation": self.generation, "restarts": self.restarts,
                "inflight": self.inflight, "limit": self.limit, "last_exit": self.last_exit,
                "control_port": self.plan.control_port}


def pick(workers: Sequence[Worker], tried: set[int]) -> Worker | None:
    """The worker a new request goes to: a ready one with room before a full one, the least loaded
    first. A full worker still gets it (its own gate queues it) rather than a 503 from here."""
    ready = [w for w in workers if w.routable and w.index not in tried]
    if not ready:
        return None
    return min(ready, key=lambda w: (w.inflight >= w.limit, w.inflight / max(w.limit, 1), w.served, w.index))


class Supervisor:
    """Starts the workers, starts again the ones that exit, and follows each one's readiness."""

    def __init__(self, settings: ServeSettings, plans: Sequence[WorkerPlan],
                 on_change: Callable[[Worker], None] = lambda w: None,
                 on_exit: Callable[[Worker, str], None] = lambda w, reason: None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.settings = settings
        self.workers = [Worker(p) for p in plans]
        self.on_change = on_change
        self.on_exit = on_exit
        self.clock = clock
        self.stopping = False
        self.failed = asyncio.Event()
        self.failure: str | None = None
        self._wake = asyncio.Event()
        self._tasks: list[asyncio.Task[None]] = []
        self._sessions: dict[int, aiohttp.ClientSession] = {}

    async def start(self) -> None:
        for w in self.workers:
            self._tasks.append(asyncio.create_task(self._keep(w)))
            self._tasks.append(asyncio.create_task(self._follow(w)))

    def mark_refusing(self, w: Worker) -> None:
        """It refused new work (drained, poisoned) or did not answer: none until it reports ready again."""
        if w.ready:
            w.ready = False
            self.on_change(w)

    async def _keep(self, w: Worker) -> None:
        failures = 0
        while not self.stopping:
            w.generation += 1
            started = self.clock()
            try:
                proc = await asyncio.create_subprocess_exec(*w.plan.argv(self.settings), env=w.plan.env(os.environ))
            except OSError as exc:
                self._fail(f"worker {w.index} could not be started: {exc}")
                return
            w.proc, w.pid, w.state = proc, proc.pid, "starting"
            if self.stopping:  # stop() began while it was being started: it is not left behind
                with contextlib.suppress(ProcessLookupError):
                    proc.terminate()
            log.info("worker_started", worker=w.index, gpu=w.plan.gpu, pid=proc.pid, generation=w.generation,
                     control=f"127.0.0.1:{w.plan.control_port}")
            code = await proc.wait()
            w.proc, w.ready, w.last_exit = None, False, code
            w.state = "exited"
            self.on_change(w)
            if self.stopping:
                log.info("worker_stopped", worker=w.index, code=code)
                return
            if code == EXIT_START_FAILED and not w.ever_ready:
                self._fail(f"worker {w.index} (gpu {w.plan.gpu or 'cpu'}) could not start (exit {code});"
                           " its log lines above say why")
                return
            failures = 0 if self.clock() - started >= STABLE_S else failures + 1
            delay = backoff(failures)
            w.restarts += 1
            reason = EXIT_REASONS.get(code, "exited")
            log.warning("worker_exited", worker=w.index, gpu=w.plan.gpu, code=code, reason=reason,
                        generation=w.generation, restart_in_s=delay)
            self.on_exit(w, reason)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._wake.wait(), timeout=delay)

    async def _follow(self, w: Worker) -> None:
        """Its readiness and admission limit, from its own `/readyz`, several times a second. Not
        from its control API: a poisoned worker waits there for the watchdog's read before it exits."""
        while not self.stopping:
            ready, state = False, w.state
            if w.proc is not None and w.proc.returncode is None:
                body = await self._readyz(w)
                if body is None:
                    state = "starting"
                elif body.get("ready") is True:
                    ready, state = True, "ready"
                    limit = body.get("admission_limit")
                    if isinstance(limit, int) and not isinstance(limit, bool) and limit >= 1:
                        w.limit = limit
                else:
                    reason = body.get("reason")
                    state = reason if reason in ("poisoned", "draining") else "starting"
            if w.proc is not None:
                w.state = state
            if ready != w.ready:
                w.ready = ready
                if ready:
                    w.ever_ready = True
                log.info("worker_ready" if ready else "worker_not_ready", worker=w.index, gpu=w.plan.gpu,
                         pid=w.pid, state=w.state, limit=w.limit)
                self.on_change(w)
            await asyncio.sleep(POLL_S)

    async def _readyz(self, w: Worker) -> dict[str, object] | None:
        session = self._sessions.get(w.index)
        if session is None or session.closed:
            session = aiohttp.ClientSession("http://worker", connector=aiohttp.UnixConnector(path=w.plan.socket),
                                            timeout=aiohttp.ClientTimeout(total=2))
            self._sessions[w.index] = session
        try:
            async with session.get("/readyz") as r:
                data = await r.json(content_type=None)
        except (aiohttp.ClientError, TimeoutError, ValueError):
            return None
        return data if isinstance(data, dict) else None

    def _fail(self, why: str) -> None:
        self.failure = why
        log.error("worker_failed", error=why)
        self.failed.set()

    async def stop(self, grace_s: float) -> None:
        """SIGTERM to every worker (each drains its own in-flight requests), SIGKILL after `grace_s`."""
        self.stopping = True
        self._wake.set()
        procs = [w.proc for w in self.workers if w.proc is not None and w.proc.returncode is None]
        for p in procs:
            with contextlib.suppress(ProcessLookupError):
                p.terminate()
        if procs:
            _, pending = await asyncio.wait([asyncio.create_task(p.wait()) for p in procs], timeout=grace_s)
            for p in procs:
                if p.returncode is None:
                    with contextlib.suppress(ProcessLookupError):
                        p.kill()
            if pending:
                await asyncio.wait(pending, timeout=5)
        for t in self._tasks:
            t.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        for w in self.workers:  # one started while the others stopped
            if w.proc is not None and w.proc.returncode is None:
                with contextlib.suppress(ProcessLookupError):
                    w.proc.kill()
                await w.proc.wait()
        await asyncio.gather(*(s.close() for s in self._sessions.values()))
