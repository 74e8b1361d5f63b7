"""What the sidecar knows: the samplers' records and the fold's, in one history the policy reads
and `state.reduce` alone writes."""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from gpu_watchdog.watchdog.core.edges import EdgeFacts
from gpu_watchdog.watchdog.core.ladder_state import Ladder
from gpu_watchdog.watchdog.core.samples import (
    ActionRecord,
    CanarySample,
    DecisionRecord,
    DeviceHealthSample,
    GpuSample,
    IdleMemory,
    PastRestart,
    ProbeSample,
    ServerSample,
    TorchSample,
    Untold,
    WorkersSample,
    XidEvent,
)


@dataclass
class History:
    """Everything the policy may look at. The loop appends; the policy only reads."""

    started_at: float
    jitter: float = 0.0  # this pod's fraction of max_age jitter, fixed at start
    epoch: float = 0.0  # evidence older than the last restart is about a process that is gone
    canaries: deque[CanarySample] = field(default_factory=lambda: deque(maxlen=256))
    # Correctness probes compared with the fleet's reference (`policy.correctness`).
    probes: deque[ProbeSample] = field(default_factory=lambda: deque(maxlen=64))
    torch: deque[TorchSample] = field(default_factory=lambda: deque(maxlen=256))
    # NVML readings of the pod's GPUs (one entry saying why, when NVML cannot be read).
    gpus: tuple[GpuSample, ...] = ()
    gpus_visible: int = 0  # how many GPUs NVML sees on the node (from this container)
    pod_gpus: tuple[str, ...] | None = None  # UUIDs the kubelet gave this pod; None: not known
    server: deque[ServerSample] = field(default_factory=lambda: deque(maxlen=256))
    # The latest reading of the server's work counter, kept however long its page stays dark:
    # it tells a server that never exposed one from one whose page stopped answering.
    last_progress: ServerSample | None = None
    # The workload's restarts (every pod generation's, seconds on this loop's clock) as read back
    # from the restart Events at `workload_read_at`; None until read, or while they cannot be.
    workload_restarts: tuple[PastRestart, ...] | None = None
    workload_read_at: float | None = None
    # Who we are, for the lineage of a restart loop: our pod and its node.
    pod: str = ""
    node: str | None = None
    # The workload's desired replicas (its controller's spec.replicas); None: not known (counted as 1).
    replicas: int | None = None
    # First successful canary since the last restart: before it the target is still starting.
    served_at: float | None = None
    ladder: Ladder | None = None  # the admission limit and its probes
    xids: deque[XidEvent] = field(default_factory=lambda: deque(maxlen=256))
    device_health: DeviceHealthSample | None = None  # the latest read of our pod's status
    actions: deque[ActionRecord] = field(default_factory=lambda: deque(maxlen=256))
    decisions: deque[DecisionRecord] = field(default_factory=lambda: deque(maxlen=50))
    # The service's other workers as last read (`target.workers` > 1); worker 0 is the one decided for.
    workers: WorkersSample | None = None
    worker_count: int = 1  # `target.workers`: more than one, and a fault of one process is that worker's
    gone_instance: str | None = None  # the process the last worker-rung restart replaced
    # The other workers' canaries since each one's last restart (worker k >= 1).
    worker_canaries: dict[int, deque[CanarySample]] = field(default_factory=dict)
    # What became of each other worker's restarts: its own backoff, apart from the watched target's.
    worker_actions: dict[int, deque[ActionRecord]] = field(default_factory=dict)
    # Each other worker's process its control API failed to tell to exit, and how many times running:
    # counted anew once it serves again, or once a restart made it a new process.
    untold: dict[int, Untold] = field(default_factory=dict)
    # Decisions reported and not performed (shadow, `policy.enforce`), counted by `action:reason` since the
    # sidecar started: the would-have record `/status` and gpu_watchdog_shadow_actions_total show.
    would: dict[str, int] = field(default_factory=dict)
    # The reason of the restart last reported blocked by the budget: reported once until one starts.
    blocked_reported: str | None = None
    restart_in_progress: bool = False
    # A restart in progress that waits for permission (the disruption budget) with nothing drained:
    # the server serves as before, and is ready while its evidence says it can serve.
    restart_waiting: bool = False
    # Active memory at idle against this process's first idle figure (`watchdog.core.idle_memory`).
    idle_memory: IdleMemory | None = None
    # Who we are beyond the pod: how restarts are carried out, whether the budget is the workload's
    # (counted from its restart Events), the workload, and the server's metrics page if any.
    strategy: str = "none"
    budget_from_events: bool = False
    workload: str | None = None
    server_metrics_url: str | None = None
    keeps_out: bool = False  # a card the evidence is about is kept out of placement (`policy.placement`)
    # What the edges said (the API, the ledger, the kubelet, the control API): `watchdog.core.edges`.
    edge: EdgeFacts = field(default_factory=EdgeFacts)

    @property
    def restart_acting(self) -> bool:
        """A restart under way past its waiting (drained, acting): what the server answers now says
        nothing of the process to come, so no canary is taken and no state is read from it. While a
        restart waits, the server serves as before and is watched as before."""
        return self.restart_in_progress and not self.restart_waiting

    def served_anew(self, instance_id: str | None, since: float) -> CanarySample | None:
        """The first canary served by a new process that started after `since`: one of another
        instance id than `instance_id`; where either side names none, one that served after the port
        refused connections (the process went away). The same process serving again is not a new
        one: a poisoned context can still answer."""
        went_away = False
        for c in self.canaries:
            if c.started_at < since:
                continue
            if c.error_class == "unreachable":
                went_away = True
            elif c.served and (c.instance_id != instance_id if instance_id is not None and c.instance_id is not None
                               else went_away):
                return c
        return None

    def canaries_since_epoch(self) -> list[CanarySample]:
        # `_gone` inlined: every rule reads this at every decision, over up to 256 canaries.
        epoch, gone = self.epoch, self.gone_instance
        return [c for c in self.canaries if c.at >= epoch and (gone is None or c.instance_id != gone)]

    def probes_since_epoch(self) -> list[ProbeSample]:
        return [p for p in self.probes if p.at >= self.epoch and not self._gone(p.instance_id)]

    def _gone(self, instance_id: str | None) -> bool:
        """From the process a worker rung restarted: it lives on a moment (a poisoned one until it
        exits by itself), and what it says then is not about the worker that replaces it."""
        return instance_id is not None and instance_id == self.gone_instance

    def torch_uuid(self) -> str | None:
        """The GPU the inference process last said it runs on."""
        for t in reversed(self.torch):
            if t.uuid:
                return t.uuid
        return None

    def server_since_epoch(self) -> list[ServerSample]:
        return [s for s in self.server if s.at >= self.epoch and s.reachable]

    def torch_since_epoch(self) -> list[TorchSample]:
        return [t for t in self.torch if t.at >= self.epoch and t.reachable and not self._gone(t.instance_id)]

    def restarts_within(self, now: float, window: float) -> list[ActionRecord]:
        """Restarts this sidecar carried out (not those only reported, nor those that failed)."""
        return [a for a in self.actions if a.action == "restart" and now - a.at < window]
