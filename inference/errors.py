"""Classify what went wrong inside the engine, by the exception's type: OOM, a poisoned CUDA context, or other.

Never by text alone: an application's own exception whose message merely contains "out of memory"
or "CUDA error" is an ordinary failure. OOM is `torch.OutOfMemoryError` (or our `InferenceOOM`).
A sticky error is our `FatalCudaError`, or an error torch raised from its own CUDA checks
(`torch.AcceleratorError`, or a plain `RuntimeError` whose message starts the way c10's checks
write it) *and* confirmed by the device: a sticky error makes every later CUDA call fail, so a
process that never initialised CUDA, or whose device still runs a one-element kernel, is not
poisoned.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Literal

import structlog

log = structlog.get_logger(__name__)

ErrorClass = Literal["oom", "fatal_cuda", "timeout", "other"]

# How c10's CUDA checks (C10_CUDA_CHECK, the driver and cuBLAS checks) and Triton's launcher begin
# their messages. Only a plain RuntimeError counts: that is the type torch raises them as.
_TORCH_CUDA_PREFIXES = ("CUDA error:", "CUDA driver error:", "Triton Error [CUDA]:")

# A device that cannot run one element within this long after a CUDA error is not serving.
PROBE_TIMEOUT_S = 5.0

# True while the CUDA context still runs work.
ContextProbe = Callable[[], bool]


class AdmissionTimeout(Exception):
    """The request waited longer than the queue timeout for a slot."""


class QueueFull(Exception):
    """The wait queue is at its bound."""


class Draining(Exception):
    """The process stopped admitting new work."""


class ContextLost(Draining):
    """The CUDA context was lost before this request was admitted: it never ran, so another replica
    can take it (503 + Retry-After; those in flight at the failure get `FatalCudaError`'s 500)."""


def context_lost(reason: str) -> ContextLost:
    """What new or still-queued work of a poisoned process is refused with (a 503 with Retry-After)."""
    return ContextLost(f"the GPU context was lost ({reason[:120]}); the process is restarting")


class InferenceOOM(Exception):
    """Out of memory that survived emptying the cache (and splitting the batch)."""


class FatalCudaError(Exception):
    """The CUDA context is poisoned; the process must exit."""


class NonFiniteLogits(Exception):
    """A step's logits held NaN or infinities: its sequences fail rather than answer noise.

    Not sticky: the context still runs, and whether the card computes wrong for good is the
    sidecar's correctness probe to judge (a restart, then the card kept out)."""


def is_oom(exc: BaseException) -> bool:
    if isinstance(exc, InferenceOOM):
        return True
    oom = _torch_type("OutOfMemoryError")
    return oom is not None and isinstance(exc, oom)


def sticky_candidate(exc: BaseException) -> bool:
    """Raised by torch's own CUDA checks, so possibly sticky: the device decides (`is_fatal_cuda`). Pure."""
    if is_oom(exc):
        return False
    accel = _torch_type("AcceleratorError")
    if accel is not None and isinstance(exc, accel):
        return True
    # Exactly RuntimeError: a subclass is someone's own exception class, not torch's.
    return type(exc) is RuntimeError and str(exc).lstrip().startswith(_TORCH_CUDA_PREFIXES)


def _touch_devices() -> None:
    """One element on every device this process holds memory on, on a stream of its own, waited for."""
    import torch

    devices = [i for i in range(torch.cuda.device_count()) if torch.cuda.memory_reserved(i) > 0]
    for index in devices or [torch.cuda.current_device()]:
        with torch.cuda.device(index):
            # A fresh stream: waiting on it does not wait for the other requests' kernels.
            stream = torch.cuda.Stream()
            with torch.cuda.stream(stream):
                torch.ones(1, device=f"cuda:{index}").add_(1)
            stream.synchronize()


def _cuda_initialized() -> bool:
    import torch

    return bool(torch.cuda.is_initialized())


def cuda_context_alive(initialized: Callable[[], bool] = _cuda_initialized,
                       touch: Callable[[], None] = _touch_devices, timeout_s: float = PROBE_TIMEOUT_S) -> bool:
    """Whether the CUDA context still runs work: never initialised, or a one-element kernel succeeds.

    The kernel runs in a thread of its own and is waited for at most `timeout_s`. No answer in time
    is no proof of a poisoned context (a busy card can keep a new stream waiting behind long
    kernels), and exiting is the one thing that cannot be taken back: the process stays, and a
    device that really stopped is the sidecar's canary and hang rule to find. An OOM while probing
    still proves the context alive.
    """
    if not initialized():
        return True
    outcome: list[BaseException | None] = []
    done = threading.Event()

    def run() -> None:
        try:
            touch()
            outcome.append(None)
        except BaseException as exc:  # whatever the device says is the answer
            outcome.append(exc)
        finally:
            done.set()

    threading.Thread(target=run, name="cuda-context-probe", daemon=True).start()
    if not done.wait(timeout_s):
        log.warning("cuda_probe_timeout", timeout_s=timeout_s, action="not taken as a poisoned context")
        return True
    failure = outcome[0]
    return failure is None or is_oom(failure)


def is_fatal_cuda(exc: BaseException, probe: ContextProbe = cuda_context_alive) -> bool:
    """Our own `FatalCudaError`, or a torch CUDA error the device confirms (`probe` False)."""
    if isinstance(exc, FatalCudaError):
        return True
    if not sticky_candidate(exc):
        return False
    if probe():
        log.warning("cuda_error_not_sticky", error_type=type(exc).__name__, error=str(exc)[:200],
                    why="the CUDA context still runs work (or was never initialised)")
        return False
    return True


def classify(exc: BaseException, probe: ContextProbe = cuda_context_alive) -> ErrorClass:
    if isinstance(exc, TimeoutError | AdmissionTimeout):
        return "timeout"
    if is_oom(exc):
        return "oom"
    if is_fatal_cuda(exc, probe):
        return "fatal_cuda"
    return "other"


def _torch_type(name: str) -> type[BaseException] | None:
    try:
        import torch
    except ImportError:  # pragma: no cover - torch is present wherever the engine runs
        return None
    found = getattr(torch, name, None)
    return found if isinstance(found, type) and issubclass(found, BaseException) else None
