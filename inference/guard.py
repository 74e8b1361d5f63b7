"""The guard: what `serve` and the in-process agent promise alike around the GPU-bound work.

One object holds the admission gate, the drain, the quarantine screen and the fault injector, and
keeps the process's failure state: OOMs caught (counted, the cache emptied, a 503), a poisoned
context (counted, the termination log with what was in flight, the exit once the watchdog has read
it), `empty_cache`, the canary on the gate's reserved slot and the memory report. `serve`'s engine
and the agent differ only in how work reaches the device (a decode loop, the app's own call); both
record through here, so a rule about failing safe is written once.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from concurrent.futures import Future
from types import TracebackType
from typing import Any

import structlog
import torch

from gpu_watchdog.contract import AdmissionReport, CanaryResult, MemoryReport
from gpu_watchdog.inference import allocator
from gpu_watchdog.inference.admission import AdmissionGate, Grant
from gpu_watchdog.inference.drain import Drain
from gpu_watchdog.inference.errors import (
    AdmissionTimeout,
    Draining,
    FatalCudaError,
    InferenceOOM,
    NonFiniteLogits,
    QueueFull,
    classify,
    context_lost,
    is_fatal_cuda,
    is_oom,
)
from gpu_watchdog.inference.faults import FaultInjector
from gpu_watchdog.inference.metrics import InferenceMetrics
from gpu_watchdog.inference.poison import EXIT_POISONED, write_termination_log
from gpu_watchdog.inference.screen import FAILURE_READ_WAIT_S, MARKED, Screen

log = structlog.get_logger(__name__)

# Wide open: the warm-up and the measuring runs go through before admission is sized.
UNSIZED_CAPACITY = float(1 << 30)


def new_instance_id() -> str:
    return os.environ.get("GPU_WATCHDOG_INSTANCE_ID") or uuid.uuid4().hex[:12]


class Guard:
    def __init__(self, *, gate: AdmissionGate | None = None, metrics: InferenceMetrics | None = None,
                 faults: FaultInjector | None = None, device: torch.device | None = None,
                 model: str = "model", instance_id: str | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.gate = gate if gate is not None else AdmissionGate(UNSIZED_CAPACITY)
        self.metrics = metrics if metrics is not None else InferenceMetrics()
        self.faults = faults
        self.device = device if device is not None else torch.device("cpu")
        self.model = model
        self.instance_id = instance_id or new_instance_id()
        # Fingerprints in flight and the quarantine list (the query of death): one key per model.
        self.screen = Screen(self.instance_id, model, faults)
        self.screen.on_refused = self.metrics.quarantined.inc
        self.screen.in_force = self.check_list_in_force
        # Whether new work is refused: the control API's drains and the shutdown's.
        self.drain = Drain(clock)
        self.oom_count = 0
        self.empty_cache_count = 0
        self.nonfinite_count = 0
        self.poison_reason: str | None = None
        # Called once, from whichever thread saw the sticky error, after it is recorded: the owner
        # schedules the exit (`linger`) on its own loop.
        self.on_poisoned: Callable[[], object] | None = None
        # Set once the poisoned state was reported through the control API (to the watchdog); set
        # and awaited on the control API's loop only.
        self.poison_reported = asyncio.Event()
        self._clock = clock
        self._started_at = clock()
        self._lock = threading.Lock()
        # Seconds a new process waits, refusing work and unready, for its sidecar's quarantine list
        # once its model is loaded (`serve --quarantine-wait`; 0: it serves at once): a request the
        # fleet quarantined must not reach a process before the list does. Bounded, so a sidecar that
        # is down costs a late start, never a replica that stays out.
        self.quarantine_wait = 0.0
        self._serving_since: float | None = None
        self._wait_over_said = False

    # -- admission ---------------------------------------------------------------------------

    @property
    def poisoned(self) -> bool:
        return self.poison_reason is not None

    def check_alive(self) -> None:
        if self.poison_reason is not None:
            raise context_lost(self.poison_reason)

    def check_admitting(self) -> None:
        """Refuse new work of a poisoned or draining process (a 500 or a 503, by type), or of one that
        still waits for the fleet's quarantine list (a 503)."""
        self.check_alive()
        if self.drain.active:
            raise Draining("the server is draining")
        self.check_list_in_force()

    def check_list_in_force(self) -> None:
        """A 503 while this process still waits for its sidecar's quarantine list. Asked before a
        request is checked against the list as well as at admission: a request checked against the
        empty list and admitted once the list came would run whatever the list says."""
        left = self.awaiting_quarantine()
        if left > 0:
            raise Draining(f"the server waits for its sidecar's quarantine list before it serves"
                           f" (at most {left:.0f} s more)")

    def serving(self) -> None:
        """The model is loaded: the wait for the quarantine list counts from now."""
        self._serving_since = self._clock()

    def awaiting_quarantine(self) -> float:
        """Seconds left of the wait for the sidecar's quarantine list (0: not waiting)."""
        if self.quarantine_wait <= 0 or self.screen.quarantine.received:
            return 0.0
        since = self._serving_since if self._serving_since is not None else self._clock()
        left = self.quarantine_wait - (self._clock() - since)
        if left > 0:
            return left
        if not self._wait_over_said:
            self._wait_over_said = True
            log.warning("quarantine_wait_over", waited_s=self.quarantine_wait,
                        action="serving without the fleet's quarantine list: the sidecar has not sent it")
        return 0.0

    def admit(self, weight: float, queue_timeout: float, max_waiting: int) -> Admitted:
        """Admission by the gate around an app's own GPU-bound call (`serve`'s loops admit a batch's
        rows themselves): refused at once when poisoned or draining, a 503 past `queue_timeout` or
        beyond `max_waiting` waiting."""
        return Admitted(self, weight, queue_timeout, max_waiting)

    def set_limit(self, limit: int, capacity: float) -> None:
        self.gate.set_capacity(capacity)
        self.metrics.admission_limit.set(limit)
        log.info("admission_limit_changed", limit=limit, capacity=self.gate.capacity)

    # -- failures ----------------------------------------------------------------------------

    @contextlib.contextmanager
    def __call__(self) -> Iterator[None]:
        """`with guard():` (or `@guard()`): OOM and poison recording for GPU work, as `recorded`."""
        try:
            yield
        except BaseException as exc:
            replacement = self.recorded(exc)
            if replacement is not None:
                raise replacement from exc
            raise

    def recorded(self, exc: BaseException) -> BaseException | None:
        """Record an OOM or a poisoned context that `exc` is; what to raise instead, or None to let
        `exc` go on as it is. By type (`inference.errors`): an app's own exception is never either,
        whatever its message says."""
        if isinstance(exc, InferenceOOM | AdmissionTimeout | QueueFull | Draining):
            return None  # already answered (a nested admission)
        if isinstance(exc, FatalCudaError):
            self.poison(str(exc)[:300] or type(exc).__name__)  # idempotent: a nested admission's, or injected
            return None
        if is_oom(exc):
            self.oom(exc)
            return InferenceOOM("out of memory; the allocator cache was emptied")
        if is_fatal_cuda(exc):
            self.poison(str(exc)[:300] or type(exc).__name__)
            return FatalCudaError(self.poison_reason or "")
        return None

    def oom(self, exc: BaseException) -> None:
        """An OOM was caught: counted, and the cache emptied so the next request finds memory."""
        with self._lock:
            self.oom_count += 1
        self.metrics.ooms.inc()
        freed = self.empty_cache()
        log.warning("oom", error=str(exc)[:200], freed_bytes=freed)

    def nonfinite_step(self) -> None:
        """A step's logits held NaN or infinities: its sequences failed. Counted and said; the process
        goes on (the correctness probe tells a passing glitch from a card that computes wrong)."""
        with self._lock:
            self.nonfinite_count += 1
        self.metrics.nonfinite.inc()
        log.error("nonfinite_logits", instance_id=self.instance_id, steps=self.nonfinite_count,
                  action="the step's sequences failed with an error")

    def poison(self, reason: str) -> None:
        """A sticky CUDA error: every later kernel would fail. Recorded once, in the thread that saw
        it, so what was in flight (the rows of the batch) is frozen before they are answered."""
        with self._lock:
            if self.poison_reason is not None:
                return
            self.poison_reason = reason
        self.metrics.fatal.inc()
        at_failure = self.screen.book.failed()
        log.error("fatal_cuda_error", reason=reason, action="exit", instance_id=self.instance_id,
                  inflight=at_failure["inflight"])
        write_termination_log(reason, at_failure["inflight"])
        if self.on_poisoned is not None:
            self.on_poisoned()

    async def linger(self, linger_s: float, stop: asyncio.Future[Any] | None = None) -> int:
        """Wait, after a poisoning, until the watchdog has seen the poisoned state and read what was
        in flight (so its restart and Event carry the real reason), never longer than `linger_s`:
        without a watchdog the process exits anyway. The exit code to leave with."""
        reported = asyncio.ensure_future(self.poison_reported.wait())
        waits: set[asyncio.Future[Any]] = {reported} if stop is None else {reported, stop}
        done, _ = await asyncio.wait(waits, timeout=linger_s, return_when=asyncio.FIRST_COMPLETED)
        reported.cancel()
        if not done:
            log.warning("poison_not_reported", linger_s=linger_s)
        elif not await asyncio.to_thread(self.screen.book.wait_read):
            log.warning("inflight_not_read", wait_s=FAILURE_READ_WAIT_S)
        await asyncio.sleep(0.3)  # the control answer that reported it goes out first
        log.error("exiting", reason="cuda_context_poisoned", detail=self.poison_reason, code=EXIT_POISONED)
        return EXIT_POISONED

    # -- the allocator -----------------------------------------------------------------------

    def empty_cache(self) -> int:
        """Return cached blocks to the driver; the bytes freed (0 on CPU)."""
        freed = allocator.empty_cache(self.device)
        if self.faults is not None:
            self.faults.on_empty_cache()
        with self._lock:
            self.empty_cache_count += 1
        self.metrics.empty_cache.inc()
        return freed

    # -- the canary --------------------------------------------------------------------------

    async def canary(self, timeout: float, start: Callable[[], Future[Any]],
                     answer: Callable[[Any], dict[str, Any]] | None = None) -> CanaryResult:
        """The health inference on the gate's reserved slot, so a busy but healthy process answers
        it: `start` begins it (a one-token generation queued at the head of the batch, an app's
        function in a thread) and returns its future."""
        loop = asyncio.get_running_loop()
        begun = loop.time()
        if self.poison_reason is not None:
            return CanaryResult(False, 0.0, "fatal_cuda", self.poison_reason[:300])
        # One canary at a time: wait (off the event loop) for an earlier one still running.
        if not await asyncio.to_thread(self.gate.acquire_canary, timeout):
            return CanaryResult(False, loop.time() - begun, "timeout", "the previous canary has not finished")
        left = max(0.0, timeout - (loop.time() - begun))
        try:
            future = start()
        except asyncio.CancelledError:
            self.gate.release_canary()
            raise
        except BaseException as exc:  # whatever the work raised is its answer, never the loop's end
            self.gate.release_canary()
            return CanaryResult(False, loop.time() - begun, classify(exc), str(exc)[:300] or type(exc).__name__)
        future.add_done_callback(lambda _: self.gate.release_canary())
        try:
            await asyncio.wait_for(asyncio.shield(asyncio.wrap_future(future)), timeout=left)
        except TimeoutError:
            return CanaryResult(False, loop.time() - begun, "timeout", f"no answer within {timeout:g} s")
        except asyncio.CancelledError:
            raise
        except BaseException as exc:
            return CanaryResult(False, loop.time() - begun, classify(exc), str(exc)[:300] or type(exc).__name__,
                                nonfinite=isinstance(exc, NonFiniteLogits))
        if answer is not None:
            return CanaryResult(True, loop.time() - begun, None, answer=answer(future.result()))
        return CanaryResult(True, loop.time() - begun, None)

    # -- the memory report -------------------------------------------------------------------

    def memory_report(self, *, admission: tuple[str, int, str], inflight: int | None, queued: int | None,
                      ready: bool, model: str, engine: dict[str, Any] | None = None,
                      prefix_cache: dict[str, Any] | None = None) -> dict[str, Any]:
        """The control API's `GET /control/memory` (`contract.MemoryReport`): `admission` is its
        (mode, limit, source); `engine` and `prefix_cache` are sections only `serve` has. `inflight`
        and `queued` None: the gate's holders and waiting, from the reading the admission figures
        come from."""
        figures = allocator.with_fragmentation(allocator.figures(self.device),
                                               None if self.faults is None else self.faults.fragmentation)
        stats = self.gate.stats()
        mode, limit, source = admission
        return MemoryReport(
            **figures,
            ooms_caught=self.oom_count,
            empty_cache_count=self.empty_cache_count,
            uptime_s=round(self._clock() - self._started_at, 3),
            poisoned=self.poisoned,
            poison_reason=self.poison_reason,
            inflight=stats.holders if inflight is None else inflight,
            queued=stats.waiting if queued is None else queued,
            draining=self.drain.active,
            drain_deadline_left_s=self.drain.left_s(),
            ready=ready and not self.poisoned and not self.drain.active and not self.awaiting_quarantine(),
            instance_id=self.instance_id,
            pid=os.getpid(),
            model=model,
            time=time.time(),
            admission=AdmissionReport(
                mode=mode, limit=limit, capacity=stats.capacity, in_use=stats.in_use, holders=stats.holders,
                waiting=stats.waiting, peak_holders=stats.peak_holders, canary_busy=stats.canary_busy,
                source=source),
            faults=None if self.faults is None else self.faults.describe(),
            engine=engine,
            prefix_cache=prefix_cache,
        ).to_json()


class Admitted:
    """`guard.admit()`: a context manager for a worker thread (`with`) or a coroutine (`async with`).

    Either way: wait for admission (503 past the queue timeout or bound), apply an injected fault
    where the work starts, record an OOM or a poisoned context raised inside, give the slot back.
    """

    __slots__ = ("_grant", "_guard", "_max_waiting", "_timeout", "_weight")

    def __init__(self, guard: Guard, weight: float, timeout: float, max_waiting: int) -> None:
        self._guard = guard
        self._weight = weight
        self._timeout = timeout
        self._max_waiting = max_waiting
        self._grant: Grant | None = None

    def __enter__(self) -> None:
        g = self._guard
        g.check_admitting()
        grant = g.gate.acquire(self._weight, self._timeout, max_waiting=self._max_waiting)
        if grant is None:
            raise AdmissionTimeout("no admission slot within the queue timeout")
        self._grant = grant
        if g.faults is not None:
            self._injected(g.faults.before_forward, g.gate.stats().holders, MARKED.get())

    async def __aenter__(self) -> None:
        g = self._guard
        g.check_admitting()
        grant = await g.gate.acquire_async(self._weight, self._timeout, max_waiting=self._max_waiting)
        if grant is None:
            raise AdmissionTimeout("no admission slot within the queue timeout")
        self._grant = grant
        if g.faults is not None:
            # An injected hang or delay blocks a thread, never the app's event loop.
            await asyncio.to_thread(self._injected, g.faults.before_forward, g.gate.stats().holders, MARKED.get())

    def _injected(self, fn: Callable[[int, frozenset[str]], None], arg: int, marks: frozenset[str]) -> None:
        try:
            fn(arg, marks)
        except BaseException as exc:
            self._release()
            replacement = self._guard.recorded(exc)
            if replacement is not None:
                raise replacement from exc
            raise

    def _release(self) -> None:
        if self._grant is not None:
            self._guard.gate.release(self._grant)
            self._grant = None

    def __exit__(self, et: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None) -> None:
        self._release()
        if exc is not None:
            replacement = self._guard.recorded(exc)
            if replacement is not None:
                raise replacement from exc
        # Anything else goes on as it was raised: the same object, for the app to answer.

    async def __aexit__(self, et: type[BaseException] | None, exc: BaseException | None,
                        tb: TracebackType | None) -> None:
        self.__exit__(et, exc, tb)
