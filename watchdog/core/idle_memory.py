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

from dataclasses import replace

# The record lives with the history that holds it; its rule is here.
from gpu_watchdog.watchdog.core.samples import WARN_RATIO, IdleMemory, TorchSample

__all__ = ["WARN_RATIO", "IdleMemory", "observe"]

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
