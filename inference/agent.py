"""The in-process agent: the watchdog's view into a user's own Python service, in a few lines.

It brings to any FastAPI/Starlette or aiohttp app what `serve` has, through the same guard
(`inference.guard`): the admission gate around the GPU-bound section, OOM recording (count, empty
the cache, 503) and the poison rule (sticky CUDA error: termination log, exit code 3), the drain,
the quarantine screen, the control API (the same `ControlAPI`, routes and token) on 127.0.0.1 on
its own port, a canary that runs a function the app registers on the gate's reserved slot, the
`gpu_inference_` metrics, and, when asked for, the same fault injector applied where the gate
admits work.

    agent = Agent(AgentSettings(limit=4, control_port=8001))
    agent.register_canary(lambda: model(tiny_input))
    agent.register_probe(lambda prompt, n, k: my_greedy_answer(prompt, n, k))   # optional: answers checked
    with agent.admit():            # in the worker thread, around the model call
        y = model(x)

The control API runs on an event loop of its own in a daemon thread, so it answers whatever the
app's loop and thread pool are doing, and the agent works the same under any framework.
"""

from __future__ import annotations

import asyncio
import errno
import os
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import structlog
import torch
from aiohttp import web
from prometheus_client import generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST

from gpu_watchdog.contract import CanaryProbe, CanaryResult
from gpu_watchdog.inference import stacks
from gpu_watchdog.inference.admission import AdmissionGate
from gpu_watchdog.inference.faults import FaultInjector
from gpu_watchdog.inference.guard import Admitted, Guard
from gpu_watchdog.inference.http_control import ControlAPI
from gpu_watchdog.inference.metrics import InferenceMetrics
from gpu_watchdog.inference.poison import EXIT_POISONED, exit_code, leave
from gpu_watchdog.inference.screen import RequestAccount
from gpu_watchdog.token import ensure_token

# An app's answer to a correctness probe: (prompt, max_tokens, top_logprobs) -> {"tokens", "top"}.
ProbeFn = Callable[[str, int, int], dict[str, Any]]

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
    # The service's workers (uvicorn --workers, gunicorn, any pre-fork server) each take the first
    # free port of control_port .. control_port + control_ports - 1: worker k answers on the k-th.
    control_ports: int = 8
    token_file: str | None = None  # GPU_WATCHDOG_TOKEN wins; generated (mode 0600) when neither
    fault_injection: bool = False
    # Whose allocator to report, and where the app should run its model (`agent.device`): default the
    # worker's own GPU (the k-th worker on card k modulo the cards) where there is CUDA, else cpu.
    device: str | None = None
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
        if not 1 <= self.control_ports <= 256:
            raise ValueError("control_ports: must be between 1 and 256")
        if self.control_port != 0 and self.control_port + self.control_ports - 1 > 65535:
            raise ValueError("control_ports: control_port + control_ports - 1 must be a port (at most 65535)")


class PortsTaken(OSError):
    """Every port of the agent's range is held (by the service's other workers, or anything else)."""


class Agent:
    def __init__(self, settings: AgentSettings | None = None, canary: Callable[[], object] | None = None,
                 fingerprint: Callable[[bytes], object] | None = None) -> None:
        """`fingerprint`: what determines a request's work, from its body (anything JSON can write;
        None: not fingerprinted); the agent hashes it with the workload's key. Default: the body's
        computation fields where it is JSON (`inference.fingerprint.WORK_FIELDS`), else its bytes."""
        self.settings = s = settings or AgentSettings()
        metrics = InferenceMetrics()
        # Tokens and batch sizes are the decode loop's; an app's model call has neither. A
        # counter stuck at 0 would read to the watchdog as an engine making no progress.
        for family in (metrics.tokens, metrics.prompt_tokens, metrics.batch_size):
            metrics.registry.unregister(family)
        self.guard = Guard(gate=AdmissionGate(float(s.limit)), metrics=metrics,
                           faults=FaultInjector() if s.fault_injection else None,
                           device=torch.device(s.device or ("cuda" if torch.cuda.is_available() else "cpu")),
                           model=s.model)
        self.guard.on_poisoned = self._exit_soon
        self.gate = self.guard.gate
        self.metrics = metrics
        self.faults = self.guard.faults
        self.limit = s.limit
        metrics.admission_limit.set(s.limit)
        # Read at scrape time from the gate: no per-request cost, no I/O in a scrape.
        metrics.inflight.set_function(lambda: self.gate.stats().holders)
        metrics.queued.set_function(lambda: self.gate.stats().waiting)
        self._describe_work = fingerprint
        self._canary_fn = canary
        self._probe_fn: ProbeFn | None = None
        self._canary_pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="agent-canary")
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._runner: web.AppRunner | None = None
        self.token: str | None = None
        self.token_file: str | None = None
        self.control_port: int | None = None
        # Which of the service's workers this is: the index of its port in the range (None: no port).
        self.worker: int | None = None

    # -- what the app calls ------------------------------------------------------------------

    @property
    def device(self) -> torch.device:
        """Where this worker's model belongs (and whose allocator the watchdog is shown): known once started."""
        return self.guard.device

    def admit(self, weight: float = 1.0) -> Admitted:
        """Around the GPU-bound section (`with` in a worker thread, `async with` in a coroutine)."""
        return self.guard.admit(weight, self.settings.queue_timeout, self.settings.max_queue)

    def register_canary(self, fn: Callable[[], object]) -> Callable[[], object]:
        """The health inference (a tiny input, one token), run in a thread of its own; usable as a decorator."""
        self._canary_fn = fn
        return fn

    def register_probe(self, fn: ProbeFn) -> ProbeFn:
        """The app's answer to a correctness probe: `fn(prompt, max_tokens, top_logprobs)` returns
        `{"tokens": [...]}` (its greedy token ids or texts) and, where the app has them, `"top"`: per
        token, `[[token, logprob], ...]` best first. The sidecar compares it with the reference the
        replicas agreed; without `top`, the greedy tokens alone. Usable as a decorator."""
        self._probe_fn = fn
        return fn

    def metrics_page(self) -> bytes:
        return generate_latest(self.metrics.registry)

    def screen_body(self, account: RequestAccount, raw: bytes) -> None:
        """One request's body, for the framework glue: fingerprinted, refused (`QuarantinedRequest`, 422)
        if quarantined, else booked in flight until `request_done`."""
        screen = self.guard.screen
        screen.screened(account, screen.of_raw(raw, self._describe_work))

    def request_done(self, account: RequestAccount, code: int) -> None:
        self.guard.screen.done(account.ticket, ok=code < 400)

    def observe(self, route: str, code: int, seconds: float) -> None:
        """One answered request, for the framework glue."""
        self.metrics.requests.labels(route=route, code=str(code)).inc()
        self.metrics.duration.labels(route=route).observe(seconds)

    # -- failures ----------------------------------------------------------------------------

    @property
    def poisoned(self) -> bool:
        return self.guard.poisoned

    def _exit_soon(self) -> None:
        """The guard recorded a poisoned context: exit once the watchdog has read it (bounded)."""
        if self._loop is not None:
            asyncio.run_coroutine_threadsafe(self._exit_when_reported(), self._loop)
        else:
            self._exit()

    async def _exit_when_reported(self) -> None:
        await self.guard.linger(self.settings.poison_linger_s)
        self._exit()

    def _exit(self) -> None:
        if self._loop is None:
            log.error("exiting", reason="cuda_context_poisoned", detail=self.guard.poison_reason,
                      code=exit_code(EXIT_POISONED))
        leave(EXIT_POISONED)

    # -- the control API's target (inference.http_control.ControlTarget) -----------------------

    @property
    def started(self) -> bool:
        return True

    @property
    def inflight(self) -> int:
        return self.gate.stats().holders

    @property
    def queued(self) -> int:
        return self.gate.stats().waiting

    @property
    def admission_capacity(self) -> float:
        return self.gate.capacity

    def set_admission_limit(self, limit: int) -> None:
        self.guard.set_limit(limit, float(limit))
        self.limit = limit

    def _run_canary(self) -> None:
        fn = self._canary_fn
        assert fn is not None
        try:
            if self.faults is not None:
                self.faults.before_forward(self.gate.stats().holders + 1)
            fn()
        except BaseException as exc:
            replacement = self.guard.recorded(exc)
            if replacement is not None:
                raise replacement from exc
            raise

    def _run_probe(self, probe: CanaryProbe) -> Any:
        fn = self._probe_fn
        assert fn is not None
        try:
            if self.faults is not None:
                self.faults.before_forward(self.gate.stats().holders + 1)
            return fn(probe.prompt, probe.max_tokens, probe.top_logprobs)
        except BaseException as exc:
            replacement = self.guard.recorded(exc)
            if replacement is not None:
                raise replacement from exc
            raise

    async def canary(self, timeout: float, probe: CanaryProbe | None = None) -> CanaryResult:
        """The registered function on the canary's reserved slot: a busy app still answers it; with a
        correctness probe, the app's registered probe function (`register_probe`)."""
        if probe is not None:
            if self._probe_fn is None:
                return CanaryResult(False, 0.0, "other", "probe: no probe function registered (agent.register_probe)")
            return await self.guard.canary(timeout, lambda: self._canary_pool.submit(self._run_probe, probe),
                                           _probe_answer)
        if self._canary_fn is None:
            return CanaryResult(False, 0.0, "other", "no canary function registered (agent.register_canary)")
        return await self.guard.canary(timeout, lambda: self._canary_pool.submit(self._run_canary))

    def memory_report(self) -> dict[str, Any]:
        return self.guard.memory_report(admission=("slots", self.limit, "agent"), inflight=None, queued=None,
                                        ready=True, model=self.settings.model)

    # -- the control API's thread ------------------------------------------------------------

    def start(self) -> None:
        """Serve the control API on its own loop in a daemon thread; returns once it listens."""
        if self._thread is not None:
            return
        stacks.register_signal()  # `kill -USR2`: every thread's stack to stderr, even with the GIL held in C
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
                loop.close()
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
            if isinstance(ready[0], PortsTaken):
                # Another worker's port is never a reason to fail this one: it serves, unwatched, and
                # says so; with no index of its own, its card follows its pid (spread, not all on card 0).
                if s.device is None and torch.cuda.is_available():
                    self.guard.device = torch.device("cuda", os.getpid() % torch.cuda.device_count())
                log.error("agent_control_unavailable", ports=f"{s.control_port}-{s.control_port + s.control_ports - 1}",
                          error=str(ready[0]), action="serving without a control API: the watchdog cannot see this"
                          " worker; give the service's workers more control_ports", device=str(self.guard.device))
                return
            raise ready[0]
        log.info("agent_listening", control=f"http://{s.control_host}:{self.control_port}", worker=self.worker,
                 limit=s.limit,
                 token_file=self.token_file, token_source="env" if self.token_file is None else "file",
                 fault_injection=s.fault_injection, device=str(self.guard.device), instance_id=self.guard.instance_id)

    async def _listen(self) -> None:
        assert self.token is not None
        self._runner = web.AppRunner(ControlAPI(self, self.token).app(), handle_signals=False, access_log=None)
        await self._runner.setup()
        s = self.settings
        ports = [0] if s.control_port == 0 else list(range(s.control_port, s.control_port + s.control_ports))
        for worker, port in enumerate(ports):
            site = web.TCPSite(self._runner, s.control_host, port)
            try:
                await site.start()
            except OSError as exc:
                if exc.errno != errno.EADDRINUSE:
                    raise
                continue  # another worker of this service (or anything else) holds it: the next
            server = getattr(site, "_server", None)
            sockets = getattr(server, "sockets", None) or []
            self.control_port = sockets[0].getsockname()[1] if sockets else port
            self.worker = worker
            if s.device is None and torch.cuda.is_available():
                self.guard.device = torch.device("cuda", worker % torch.cuda.device_count())
            return
        await self._runner.cleanup()
        self._runner = None
        raise PortsTaken(f"every control port is in use ({', '.join(map(str, ports))})")

    def stop(self) -> None:
        loop, runner = self._loop, self._runner
        if loop is None or runner is None:
            return
        asyncio.run_coroutine_threadsafe(runner.cleanup(), loop).result(timeout=10)
        loop.call_soon_threadsafe(loop.stop)
        self._canary_pool.shutdown(wait=False)
        self._loop = None
        self._thread = None


def _probe_answer(value: Any) -> dict[str, Any]:
    """The app's probe answer as the control API returns it; an answer of another shape is the sidecar's
    to refuse (it reports it unanswered), never a failed canary."""
    return value if isinstance(value, dict) else {"tokens": None, "error": f"not an object: {type(value).__name__}"}
