"""Classify what went wrong inside the engine: recoverable OOM, a poisoned CUDA context, or other."""

from __future__ import annotations

from typing import Literal

ErrorClass = Literal["oom", "fatal_cuda", "timeout", "other"]

# Sticky errors leave the CUDA context unusable: every later kernel fails, so the only cure is a
# new process. Out-of-memory is not among them.
_STICKY_MARKERS = (
    "illegal memory access",
    "device-side assert",
    "unspecified launch failure",
    "misaligned address",
    "uncorrectable ecc",
    "ecc error",
    "illegal instruction",
    "context is destroyed",
    "cuda error: an illegal",
    "cudaerrorlaunchfailure",
    "gpu has fallen off the bus",
    "cublas_status_execution_failed",
    "launch timed out",
)


class AdmissionTimeout(Exception):
    """The request waited longer than the queue timeout for a slot."""


class QueueFull(Exception):
    """The wait queue is at its bound."""


class Draining(Exception):
    """The process stopped admitting new work."""


class InferenceOOM(Exception):
    """Out of memory that survived emptying the cache (and splitting the batch)."""


class FatalCudaError(Exception):
    """The CUDA context is poisoned; the process must exit."""


def is_oom(exc: BaseException) -> bool:
    try:
        import torch

        if isinstance(exc, torch.OutOfMemoryError):
            return True
    except ImportError:  # pragma: no cover - torch is present wherever the engine runs
        pass
    return isinstance(exc, InferenceOOM) or "out of memory" in str(exc).lower()


def is_fatal_cuda(exc: BaseException) -> bool:
    if isinstance(exc, FatalCudaError):
        return True
    if is_oom(exc):
        return False
    accel = _accelerator_error_type()
    if accel is not None and isinstance(exc, accel):
        return True
    text = str(exc).lower()
    if "cuda error" in text or "cuda driver error" in text:
        return True
    return any(marker in text for marker in _STICKY_MARKERS) and isinstance(exc, RuntimeError)


def classify(exc: BaseException) -> ErrorClass:
    if isinstance(exc, TimeoutError | AdmissionTimeout):
        return "timeout"
    if is_oom(exc):
        return "oom"
    if is_fatal_cuda(exc):
        return "fatal_cuda"
    return "other"


def _accelerator_error_type() -> type[BaseException] | None:
    try:
        import torch
    except ImportError:  # pragma: no cover
        return None
    return getattr(torch, "AcceleratorError", None)
