"""What the samplers observed: plain immutable records, shared by samplers, policy and metrics."""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field


@dataclass(frozen=True)
class GpuSample:
    at: float
    available: bool
    reason: str | None = None  # why NVML could not be read ("library not found", ...)
    index: int | None = None
    uuid: str | None = None
    name: str | None = None
    memory_used_bytes: int = 0
    memory_total_bytes: int = 0
    utilization_ratio: float = 0.0
    temperature_celsius: float = 0.0
    power_watts: float = 0.0
    ecc_uncorrected: int = 0
    lost: bool = False


@dataclass(frozen=True)
class XidEvent:
    at: float
    xid: int
    uuid: str | None


@dataclass(frozen=True)
class TorchSample:
    at: float
    reachable: bool
    error: str | None = None
    device: str = "cpu"
    uuid: str | None = None
    total_bytes: int = 0
    allocated_bytes: int = 0
    reserved_bytes: int = 0
    active_bytes: int = 0
    inactive_split_bytes: int = 0
    alloc_retries: int = 0
    ooms: int = 0
    fragmentation_ratio: float = 0.0
    injected: bool = False
    uptime_s: float = 0.0
    poisoned: bool = False
    poison_reason: str | None = None
    instance_id: str | None = None
    inflight: int = 0
    queued: int = 0
    admission_limit: int = 0


@dataclass(frozen=True)
class CanarySample:
    at: float
    ok: bool
    latency_s: float
    error_class: str | None  # oom | fatal_cuda | timeout | other | unreachable
    error: str | None = None
    instance_id: str | None = None


@dataclass(frozen=True)
class ActionRecord:
    at: float
    action: str  # empty_cache | restart
    reason: str


@dataclass
class History:
    """Everything the policy may look at. The loop appends; the policy only reads."""

    started_at: float
    jitter: float = 0.0  # this pod's fraction of max_age jitter, fixed at start
    epoch: float = 0.0  # evidence older than the last restart is about a process that is gone
    canaries: deque[CanarySample] = field(default_factory=lambda: deque(maxlen=256))
    torch: deque[TorchSample] = field(default_factory=lambda: deque(maxlen=256))
    gpu: GpuSample | None = None
    xids: deque[XidEvent] = field(default_factory=lambda: deque(maxlen=256))
    actions: deque[ActionRecord] = field(default_factory=lambda: deque(maxlen=256))
    restart_in_progress: bool = False

    def canaries_since_epoch(self) -> list[CanarySample]:
        return [c for c in self.canaries if c.at >= self.epoch]

    def torch_uuid(self) -> str | None:
        """The GPU the inference process last said it runs on."""
        for t in reversed(self.torch):
            if t.uuid:
                return t.uuid
        return None

    def torch_since_epoch(self) -> list[TorchSample]:
        return [t for t in self.torch if t.at >= self.epoch and t.reachable]

    def restarts_within(self, now: float, window: float) -> list[ActionRecord]:
        return [a for a in self.actions if a.action == "restart" and now - a.at < window]
