"""What the samplers observed: plain immutable records, shared by samplers, policy and metrics."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


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
    # NVML's GPU recovery action (`xid_catalog.RECOVERY_ACTIONS`); None: this driver has no such field.
    recovery_action: int | None = None
    driver: str | None = None  # the driver's version (NVML)


@dataclass(frozen=True)
class GpuReadout:
    """One NVML round: the pod's GPUs, or one entry saying why they could not be read."""

    gpus: tuple[GpuSample, ...]
    visible: int


@dataclass(frozen=True)
class XidEvent:
    at: float
    xid: int
    uuid: str | None


@dataclass(frozen=True)
class DeviceHealth:
    """One device of our pod as the kubelet reports it in the pod's status (KEP-4680)."""

    container: str
    resource: str  # nvidia.com/gpu (or a MIG slice)
    resource_id: str  # the device plugin's ID: the GPU's UUID for NVIDIA's, `::N` added when shared
    health: str  # Healthy | Unhealthy | Unknown
    message: str | None = None

    @property
    def uuid(self) -> str:
        return self.resource_id.split("::")[0]


@dataclass(frozen=True)
class DeviceHealthSample:
    """Our pod's devices' health; no devices: the status says nothing of them (nothing is known)."""

    at: float
    read: bool  # the pod's status could be read
    devices: tuple[DeviceHealth, ...] = ()
    error: str | None = None


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
    admission_mode: str = ""  # slots | bytes


@dataclass(frozen=True)
class WorkerSample:
    """One of the service's other workers as its control API answered (`memory`), on its own port."""

    worker: int
    url: str
    memory: TorchSample


@dataclass(frozen=True)
class WorkersSample:
    """Every other worker of the service, read at once (`target.workers`)."""

    at: float
    workers: tuple[WorkerSample, ...]


@dataclass(frozen=True)
class WorkerCanaries:
    """A canary through each other worker's own control API, run at once."""

    at: float
    canaries: tuple[tuple[int, CanarySample], ...]


@dataclass(frozen=True)
class WorkerUntold:
    """Another worker's control API could not tell its process (`instance_id`) to exit: why."""

    at: float
    worker: int
    instance_id: str | None
    error: str


@dataclass(frozen=True)
class Untold:
    """A worker process its control API could not tell to exit: how many times running, and why."""

    instance_id: str | None
    tries: int
    error: str

    def same(self, instance_id: str | None) -> bool:
        """Whether `instance_id` is this process (where either is unknown, the worker's is taken for it)."""
        return self.instance_id is None or instance_id is None or self.instance_id == instance_id


@dataclass(frozen=True)
class WorkerRestarted:
    """Another worker's rung as it ended: carried out (`restart`: told to exit, or found gone; its
    server starts it again), or not (RESTART_FAILED, RESTART_REPORTED, RESTART_HELD with `why`)."""

    at: float
    worker: int
    reason: str
    instance_id: str | None
    action: str = "restart"
    why: str = ""
    detail: str | None = None  # what its exit answered
    recorded: bool | None = None  # its Event written (True), refused (False), or not tried


@dataclass(frozen=True)
class CanarySample:
    at: float
    ok: bool
    latency_s: float
    error_class: str | None  # oom | fatal_cuda | timeout | other | unreachable
    error: str | None = None
    instance_id: str | None = None
    route: str | None = None  # /control/canary, /v1/completions or /v1/chat/completions
    draining: bool = False  # the bundled server answered while refusing traffic (drained)

    @property
    def started_at(self) -> float:
        return self.at - self.latency_s

    @property
    def served(self) -> bool:
        """Answered and admitting: a drained server answers its canary but serves no one."""
        return self.ok and not self.draining


@dataclass(frozen=True)
class ProbeSample:
    """One correctness probe compared with the fleet's agreed reference (`watchdog.core.correctness`):
    `result` of correctness.RESULTS, and what differed (probe ids and token ids, never a prompt)."""

    at: float
    result: str
    detail: dict[str, Any] = field(default_factory=dict)
    instance_id: str | None = None


@dataclass(frozen=True)
class ServerSample:
    """The target server's own signals from its Prometheus page (None: the server has no such figure)."""

    at: float
    reachable: bool
    error: str | None = None
    server: str = "unknown"  # vllm | tgi | sglang | bundled | unknown
    requests_running: float | None = None
    requests_waiting: float | None = None
    generated_tokens: float | None = None
    # A counter of engine work whose advance proves the engine runs: generated tokens where the
    # server counts them per step (vLLM, SGLang, ours); forward steps for TGI, which counts tokens
    # only when a request ends.
    progress: float | None = None
    kv_cache_usage_ratio: float | None = None
    preemptions: float | None = None
    # Steps the engine failed because their logits held NaN or infinities (the bundled server's count).
    nonfinite: float | None = None

    @property
    def pending(self) -> float:
        return (self.requests_running or 0.0) + (self.requests_waiting or 0.0)


# A restart that was decided and not carried out: reported only (strategy none), or it failed; or
# held by the workload's ledger (`why`: which of names.FLEET_HOLDS), to be asked again shortly.
RESTART_REPORTED, RESTART_FAILED, RESTART_HELD = "restart_reported", "restart_failed", "restart_held"
# A restart decided and not needed: the target's container came back in place by itself (a new process
# served before the act). Nothing of ours was restarted, but the container was: it counts toward the
# in-place restarts that did not cure (`policy.rung_for`), never toward the restart budget.
RESTART_NOT_NEEDED = "restart_not_needed"


@dataclass(frozen=True)
class ActionRecord:
    at: float
    action: str  # empty_cache | restart | restart_reported | restart_failed | restart_held | restart_not_needed
    reason: str
    rung: str = ""  # restarts: container | pod | process
    why: str = ""  # held restarts: the hold


@dataclass(frozen=True)
class DecisionRecord:
    """One decision the loop acted on (or found blocked), with what became of it: `/status` shows
    the latest, and a blocked restart is reported once until a restart starts."""

    at: float  # seconds since the watchdog started
    action: str
    reason: str
    outcome: str  # started | done | failed | blocked_by_budget | held ... (the executor's record)
    detail: dict[str, Any] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        return {"at": self.at, "action": self.action, "reason": self.reason, "outcome": self.outcome,
                "detail": self.detail}


@dataclass(frozen=True)
class PastRestart:
    """One of the workload's restarts as read back from its Event: enough to tell its lineage."""

    at: float
    pod: str = ""
    node: str | None = None
    gpus: tuple[str, ...] = ()
    reason: str = ""


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
