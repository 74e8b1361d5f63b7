"""Leak or cache? Active memory at idle, against the same process's first idle figure.

`nvidia-smi` and `memory_reserved()` stay high after a burst: that is the caching allocator
keeping blocks, and it is harmless. A real leak (tensors kept alive by a cache, a list, a
reference in a finished request) shows as *active* bytes that no longer return to their
baseline once the server is idle. So: take the active bytes of the first allocator sample that
finds the process idle (nothing in flight, nothing queued) as its baseline, and follow the
idle figures after it. A new process (another instance id) starts a new baseline.

Pure: no I/O and no clock; the loop folds each allocator sample in.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from gpu_watchdog.watchdog.samples import TorchSample

# Growth of active memory at idle, as a share of the card, above which the watchdog logs a
# warning. The alert rule (GPUMemoryGrowsAtIdle) uses the same figure.
WARN_RATIO = 0.05


@dataclass(frozen=True)
class IdleMemory:
    instance_id: str | None
    baseline_bytes: int  # active bytes at this process's first idle sample
    current_bytes: int  # active bytes at its latest idle sample
    total_bytes: int
    first_at: float
    at: float
    idle_samples: int

    @property
    def growth_bytes(self) -> int:
        return self.current_bytes - self.baseline_bytes

    @property
    def growth_ratio(self) -> float:
        return self.growth_bytes / self.total_bytes if self.total_bytes > 0 else 0.0

    @property
    def growing(self) -> bool:
        return self.growth_ratio >= WARN_RATIO


def observe(prev: IdleMemory | None, sample: TorchSample) -> IdleMemory | None:
    """Fold one allocator sample in; None until a CUDA process has been seen idle."""
    if not sample.reachable or sample.device != "cuda" or sample.total_bytes <= 0 or sample.injected:
        return prev  # no allocator (CPU), no figures, or figures that are not measurements
    if prev is not None and prev.instance_id != sample.instance_id:
        prev = None  # a new process: the old baseline says nothing about it
    if sample.inflight > 0 or sample.queued > 0:
        return prev  # busy: active memory includes live requests
    if prev is None:
        return IdleMemory(sample.instance_id, sample.active_bytes, sample.active_bytes, sample.total_bytes,
                          sample.at, sample.at, 1)
    return replace(prev, current_bytes=sample.active_bytes, total_bytes=sample.total_bytes, at=sample.at,
                   idle_samples=prev.idle_samples + 1)
