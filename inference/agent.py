"""The in-process agent: the watchdog's view into a user's own Python service, in a few lines.

It brings to any FastAPI/Starlette or aiohttp app what `serve` has: the admission gate (the same
`AdmissionGate`) around the GPU-bound section, OOM recording (count, empty the cache, 503) and the
poison rule (sticky CUDA error: termination log, exit code 3), the control API (the same
`ControlAPI`, routes and token) on 127.0.0.1 on its own port, a canary that runs a function the
app registers through the gate's reserved slot, the `gpu_inference_` metrics, and, when asked
for, the same fault injector applied where the gate admits work.

    agent = Agent(AgentSettings(limit=4, control_port=8001))
    agent.register_canary(lambda: model(tiny_input))
    with agent.admit():            # in the worker thread, around the model call
        y = model(x)

The control API runs on an event loop of its own in a daemon thread, so it answers whatever the
app's loop and thread pool are doing, and the agent works the same under any framework.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import sys
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from types import TracebackType
from typing import Any

import structlog
import torch
from aiohttp import web
from prometheus_client import generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST

from gpu_watchdog.contract import AdmissionReport, CanaryResult, MemoryReport, ensure_token
from gpu_watchdog.inference import allocator
from gpu_watchdog.inference.admission import AdmissionGate, Grant
from gpu_watchdog.inference.drain import Drain
from gpu_watchdog.inference.errors import (
    AdmissionTimeout,
    ContextLost,
    Draining,
    FatalCudaError,
    InferenceOOM,
    QueueFull,
    classify,
    is_fatal_cuda,
    is_oom,
)
from gpu_watchdog.inference.faults import FaultInjector
from gpu_watchdog.inference.http_control import ControlAPI
from gpu_watchdog.inference.metrics import InferenceMetrics
from gpu_watchdog.inference.poison import EXIT_POISONED, write_termination_log
from gpu_watchdog.inference.screen import FAILURE_READ_WAIT_S, MARKED, Screen

log = structlog.get_logger(__name__)

METRICS_CONTENT_TYPE = CONTENT_TYPE_LATEST


@dataclass(frozen=True)
class AgentSettings:
    limit: int = 4  # requests in the GPU-bound section at once (slots; weights are in slots too)
    queue_timeout: float = 30.0  # the longest a request waits for admission before a 503
    max_queue: int = 256  # waiting beyond this gets a 503 at once
    retry_after_s: int = 1
    control_host: str = "127.0.0.1"
    control_port: int = 8001
    token_file: str | None = None  # GPU_WATCHDOG_TOKEN wins; generated (mode 0600) when neither
    fault_injection: bool = False
    device: str | None = None  # whose allocator to report; default cuda when present, else cpu
    model: str = "app"
    # After a sticky CUDA error, wait this long at most for the watchdog to read the poisoned
    # state (so its restart carries the real reason) before exiting.
    poison_linger_s: float = 10.0

    def __post_init__(self) -> None:
        if self.limit < 1:
            raise ValueError("limit: must be at least 1")
        if self.queue_timeout <= 0:
            raise ValueError("queue_timeout: must be greater than 0")
        if self.max_queue < 0:
            raise ValueError("max_queue: must not be negative")


class Admitted:
    """`agent.admit()`: a context manager for a worker thread (`with`) or a coroutine (`async with`).

    Either way: wait for admission (503 past the queue timeout or bound), apply an injected fault
    where the work starts, record an OOM or a poisoned context raised inside, give the slot back.
    """

    __slots__ = ("_agent", "_grant", "_weight")

    def __init__(self, agent: Agent, weight: float) -> None:
        self._agent = agent
        self._weight = weight
        self._grant: Grant | None = None

    def __enter__(self) -> None:
        a = self._agent
        a._check_admitting()
        grant = a.gate.acquire(self._weight, a.settings.queue_timeout, max_waiting=a.settings.max_queue)
        if grant is None:
            raise AdmissionTimeout("no admission slot within the queue timeout")
        self._grant = grant
        if a.faults is not None:
            self._guarded(a.faults.before_forward, a.gate.stats().holders, MARKED.get())

    async def __aenter__(self) -> None:
        a = self._agent
        a._check_admitting()
        grant = await a.gate.acquire_async(self._weight, a.settings.queue_timeout,
                                           max_waiting=a.settings.max_queue)
        if grant is None:
            raise AdmissionTimeout("no admission slot within the queue timeout")
        self._grant = grant
        if a.faults is not None:
            # An injected hang or delay blocks a thread, never the app's event loop.
            await asyncio.to_thread(self._guarded, a.faults.before_forward, a.gate.stats().holders, MARKED.get())

    def _guarded(self, fn: Callable[[int, frozenset[str]], None], arg: int, marks: frozenset[str]) -> None:
        try:
            fn(arg, marks)
        except BaseException as exc:
            self._release()
            replacement = self._agent._recorded(exc)
            if replacement is not None:
                raise replacement from exc
            raise

    def _release(self) -> None:
        if self._grant is not None:
            self._agent.gate.release(self._grant)
            self._grant = None

    def __exit__(self, et: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None) -> None:
        self._release()
        if exc is not None:
            replacement = self._agent._recorded(exc)
            if replacement is not None:
                raise replacement from exc
        # Anything else goes on as it was raised: the same object, for the app to answer.

    async def __aexit__(self, et: type[BaseException] | None, exc: BaseException | None,
                        tb: TracebackType | None) -> None:
        self.__exit__(et, exc, tb)


class Agent:
    def __init__(self, settings: AgentSettings | None = None, canary: Callable[[], object] | None = None,
                 fingerprint: Callable[[bytes], object] | None = None) -> None:
        """`fingerprint`: what determines a request's work, from its body (anything JSON can write;
        None: not fingerprinted); the agent hashes it with the workload's key. Default: the body's
        computation fields where it is JSON (`inference.fingerprint.WORK_FIELDS`), else its bytes."""
        self.settings = s = settings or AgentSettings()
        self.gate = AdmissionGate(float(s.limit))
        self.limit = s.limit
        self.metrics = InferenceMetrics()
        # Tokens and batch sizes are the decode loop's; an app's model call has neither. A
        # counter stuck at 0 would read to the watchdog as an engine making no progress.
        for family in (self.metrics.tokens, self.metrics.prompt_tokens, self.metrics.batch_size):
            self.metrics.registry.unregister(family)
        self.metrics.admission_limit.set(s.limit)
        # Read at scrape time from the gate: no per-request cost, no I/O in a scrape.
        self.metrics.inflight.set_function(lambda: self.gate.stats().holders)
        self.metrics.queued.set_function(lambda: self.gate.stats().waiting)
        self.faults = FaultInjector() if s.fault_injection else None
        self.device = torch.device(s.device or ("cuda" if torch.cuda.is_available() else "cpu"))
        self.instance_id = os.environ.get("GPU_WATCHDOG_INSTANCE_ID") or uuid.uuid4().hex[:12]
        self.screen = Screen(self.instance_id, s.model, self.faults)
        self.screen.on_refused = self.metrics.quarantined.inc
        self._describe_work = fingerprint
        self.drain = Drain()
        self.oom_count = 0
        self.empty_cache_count = 0
        self.poison_reason: str | None = None
        self._canary_fn = canary
        self._canary_pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="agent-canary")
        self._started_at = time.monotonic()
        self._lock = threading.Lock()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._runner: web.AppRunner | None = None
        self.poison_reported = asyncio.Event()  # set on the control loop only
        self.token: str | None = None
        self.token_file: str | None = None
        self.control_port: int | None = None

    # -- what the app calls ------------------------------------------------------------------

    def admit(self, weight: float = 1.0) -> Admitted:
        return Admitted(self, weight)

    def register_canary(self, fn: Callable[[], object]) -> Callable[[], object]:
        """The health inference (a tiny input, one token), run in a thread of its own; usable as a decorator."""
        self._canary_fn = fn
        return fn

    @contextlib.contextmanager
    def guard(self) -> Iterator[None]:
        """OOM and poison recording alone, for GPU work outside `admit`; `@agent.guard()` decorates too."""
        try:
            yield
        except BaseException as exc:
            replacement = self._recorded(exc)
            if replacement is not None:
                raise replacement from exc
            raise

    def metrics_page(self) -> bytes:
        return generate_latest(self.metrics.registry)

    def screen_body(self, scope: dict[str, Any], raw: bytes) -> None:
        """One request's body, for the framework glue: fingerprinted, refused (`Quarantined`, 422)
        if quarantined, else booked in flight until `request_done`."""
        self.screen.screened(scope, self.screen.of_raw(raw, self._describe_work))

    def request_done(self, scope: dict[str, Any], code: int) -> None:
        self.screen.done(scope.get("ticket"), ok=code < 400)

    def observe(self, route: str, code: int, seconds: float) -> None:
        """One answered request, for the framework glue."""
        self.metrics.requests.labels(route=route, code=str(code)).inc()
        self.metrics.duration.labels(route=route).observe(seconds)

    # -- failures ----------------------------------------------------------------------------

    def _check_admitting(self) -> None:
        if self.poison_reason is not None:
            raise ContextLost(f"the GPU context was lost ({self.poison_reason[:120]}); the process is restarting")
        if self.draining:
            raise Draining("the server is draining")

    def _recorded(self, exc: BaseException) -> BaseException | None:
        """Record an OOM or a poisoned context raised inside; what to raise instead, or None to let
        `exc` go on as it is. By type (`inference.errors`): an app's own exception is never either,
        whatever its message says.
        """
        if isinstance(exc, InferenceOOM | AdmissionTimeout | QueueFull | Draining):
            return None  # already answered (a nested admit)
        if isinstance(exc, FatalCudaError):
            self.poison(str(exc)[:300] or type(exc).__name__)  # idempotent: a nested admit's, or injected
            return None
        if is_oom(exc):
            with self._lock:
                self.oom_count += 1
            self.metrics.ooms.inc()
            freed = self.empty_cache()
            log.warning("oom", error=str(exc)[:200], freed_bytes=freed)
            return InferenceOOM("out of memory; the allocator cache was emptied")
        if is_fatal_cuda(exc):
            self.poison(str(exc)[:300] or type(exc).__name__)
            return FatalCudaError(self.poison_reason or "")
        return None

    def poison(self, reason: str) -> None:
        with self._lock:
            if self.poison_reason is not None:
                return
            self.poison_reason = reason
        self.metrics.fatal.inc()
        at_failure = self.screen.book.failed()
        log.error("fatal_cuda_error", reason=reason, action="exit", instance_id=self.instance_id,
                  inflight=at_failure["inflight"])
        write_termination_log(reason, at_failure["inflight"])
        if self._loop is not None:
            asyncio.run_coroutine_threadsafe(self._exit_when_reported(), self._loop)
        else:
            self._exit()

    async def _exit_when_reported(self) -> None:
        # Linger until the watchdog has seen the poisoned state, never longer than the bound.
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self.poison_reported.wait(), self.settings.poison_linger_s)
        if not self.poison_reported.is_set():
            log.warning("poison_not_reported", linger_s=self.settings.poison_linger_s)
        elif not await asyncio.to_thread(self.screen.book.wait_read):
            log.warning("inflight_not_read", wait_s=FAILURE_READ_WAIT_S)
        await asyncio.sleep(0.3)  # the control answer that reported it goes out first
        self._exit()

    def _exit(self) -> None:
        log.error("exiting", reason="cuda_context_poisoned", detail=self.poison_reason, code=EXIT_POISONED)
        sys.stdout.flush()
        sys.stderr.flush()
        # Worker threads may sit in a hung kernel: a normal exit would wait for them forever.
        os._exit(EXIT_POISONED)

    # -- the control API's target (inference.http_control.ControlTarget) -----------------------

    @property
    def started(self) -> bool:
        return True

    @property
    def poisoned(self) -> bool:
        return self.poison_reason is not None

    @property
    def inflight(self) -> int:
        return self.gate.stats().holders

    @property
    def queued(self) -> int:
        return self.gate.stats().waiting

    @property
    def admission_capacity(self) -> float:
        return self.gate.capacity

    @property
    def draining(self) -> bool:
        return self.drain.active

    def set_admission_limit(self, limit: int) -> None:
        self.gate.set_capacity(float(limit))
        self.limit = limit
        self.metrics.admission_limit.set(limit)
        log.info("admission_limit_changed", limit=limit, capacity=self.gate.capacity)

    def empty_cache(self) -> int:
        freed = allocator.empty_cache(self.device)
        if self.faults is not None:
            self.faults.on_empty_cache()
        with self._lock:
            self.empty_cache_count += 1
        self.metrics.empty_cache.inc()
        return freed

    def _run_canary(self) -> None:
        fn = self._canary_fn
        assert fn is not None
        try:
            if self.faults is not None:
                self.faults.before_forward(self.gate.stats().holders + 1)
            fn()
        except BaseException as exc:
            replacement = self._recorded(exc)
            if replacement is not None:
                raise replacement from exc
            raise

    async def canary(self, timeout: float) -> CanaryResult:
        """The registered function on the canary's reserved slot: a busy app still answers it."""
        loop = asyncio.get_running_loop()
        start = loop.time()
        if self._canary_fn is None:
            return CanaryResult(False, 0.0, "other", "no canary function registered (agent.register_canary)")
        if self.poison_reason is not None:
            return CanaryResult(False, 0.0, "fatal_cuda", self.poison_reason)
        # One canary at a time: wait (off the event loop) for an earlier one still running.
        if not await asyncio.to_thread(self.gate.acquire_canary, timeout):
            return CanaryResult(False, loop.time() - start, "timeout", "the previous canary has not finished")
        left = max(0.0, timeout - (loop.time() - start))
        future = loop.run_in_executor(self._canary_pool, self._run_canary)
        future.add_done_callback(lambda _: self.gate.release_canary())
        try:
            await asyncio.wait_for(asyncio.shield(future), timeout=left)
        except TimeoutError:
            return CanaryResult(False, loop.time() - start, "timeout", f"no answer within {timeout:g} s")
        except Exception as exc:
            return CanaryResult(False, loop.time() - start, classify(exc), str(exc)[:300] or type(exc).__name__)
        return CanaryResult(True, loop.time() - start, None)

    def memory_report(self) -> dict[str, Any]:
        figures = allocator.with_fragmentation(allocator.figures(self.device),
                                               None if self.faults is None else self.faults.fragmentation)
        stats = self.gate.stats()
        return MemoryReport(
            **figures,
            ooms_caught=self.oom_count,
            empty_cache_count=self.empty_cache_count,
            uptime_s=round(time.monotonic() - self._started_at, 3),
            poisoned=self.poisoned,
            poison_reason=self.poison_reason,
            inflight=stats.holders,
            queued=stats.waiting,
            draining=self.drain.active,
            drain_deadline_left_s=self.drain.left_s(),
            ready=not self.poisoned and not self.drain.active,
            instance_id=self.instance_id,
            pid=os.getpid(),
            model=self.settings.model,
            time=time.time(),
            admission=AdmissionReport(
                mode="slots", limit=self.limit, capacity=stats.capacity, in_use=stats.in_use,
                holders=stats.holders, waiting=stats.waiting, peak_holders=stats.peak_holders,
                canary_busy=stats.canary_busy, source="agent"),
            faults=None if self.faults is None else self.faults.describe(),
        ).to_json()

    # -- the control API's thread ------------------------------------------------------------

    def start(self) -> None:
        """Serve the control API on its own loop in a daemon thread; returns once it listens."""
        if self._thread is not None:
            return
        s = self.settings
        self.token, self.token_file = ensure_token(s.token_file)
        ready: list[BaseException | None] = []
        listening = threading.Event()

        def run() -> None:
            loop = asyncio.new_event_loop()
            asyncio.set_event_loop(loop)
            try:
                loop.run_until_complete(self._listen())
                self._loop = loop
                ready.append(None)
            except BaseException as exc:
                ready.append(exc)
                listening.set()
                return
            listening.set()
            loop.run_forever()

        self._thread = threading.Thread(target=run, name="gpu-watchdog-agent", daemon=True)
        self._thread.start()
        listening.wait()
        if ready and ready[0] is not None:
            self._thread = None
            raise ready[0]
        log.info("agent_listening", control=f"http://{s.control_host}:{self.control_port}", limit=s.limit,
                 token_file=self.token_file, token_source="env" if self.token_file is None else "file",
                 fault_injection=s.fault_injection, device=str(self.device), instance_id=self.instance_id)

    async def _listen(self) -> None:
        assert self.token is not None
        self._runner = web.AppRunner(ControlAPI(self, self.token).app(), handle_signals=False, access_log=None)
        await self._runner.setup()
        site = web.TCPSite(self._runner, self.settings.control_host, self.settings.control_port)
        await site.start()
        server = getattr(site, "_server", None)
        sockets = getattr(server, "sockets", None) or []
        self.control_port = sockets[0].getsockname()[1] if sockets else self.settings.control_port

    def stop(self) -> None:
        loop, runner = self._loop, self._runner
        if loop is None or runner is None:
            return
        asyncio.run_coroutine_threadsafe(runner.cleanup(), loop).result(timeout=10)
        loop.call_soon_threadsafe(loop.stop)
        self._canary_pool.shutdown(wait=False)
        self._loop = None
        self._thread = None
