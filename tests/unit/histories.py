"""A target that has served on our one GPU, as the fold holds it, with the default policy settings
and a worker's canary sample: the starting point the driver's-word rules are read from, shared by
their unit tests and the wedged worker's integration test, so both start from the same history."""

from __future__ import annotations

from typing import Any

from gpu_watchdog.watchdog.core.history import History
from gpu_watchdog.watchdog.core.samples import CanarySample, TorchSample
from gpu_watchdog.watchdog.edge.config import PolicySettings, Settings

UUID, OTHER = "GPU-aaaa", "GPU-bbbb"


def settings() -> PolicySettings:
    return Settings().policy


def history(**kw: Any) -> History:
    """A target that has served, on our one GPU (the inference process names it)."""
    h = History(started_at=0.0, epoch=0.0, served_at=0.0, **kw)
    h.torch.append(TorchSample(at=1, reachable=True, device="cuda", uuid=UUID, instance_id="i1"))
    h.canaries.append(CanarySample(at=1, ok=True, latency_s=0.05, error_class=None, instance_id="i1"))
    return h


def worker_canary(at: float, ok: bool, instance: str = "w1") -> CanarySample:
    return CanarySample(at=at, ok=ok, latency_s=0.05 if ok else 5.0, error_class=None if ok else "timeout",
                        instance_id=instance)
