"""How each outcome changes what the watchdog knows: pure functions of (history, outcome).

The loop performs I/O and hands every result here; nothing else writes the history. Like the
policy, these take the time as an argument and do no I/O, so traces can drive them.
"""

from __future__ import annotations

from dataclasses import dataclass

from watchdog import ladder
from watchdog.config import AdmissionSettings
from watchdog.samples import ActionRecord, CanarySample, GpuSample, History, ServerSample, TorchSample, XidEvent


@dataclass(frozen=True)
class GpuReadout:
    """One NVML round: the pod's GPUs, or one entry saying why they could not be read."""

    gpus: tuple[GpuSample, ...]
    visible: int


@dataclass(frozen=True)
class PodGpus:
    """The kubelet's answer: the UUIDs this pod got (empty when it got none)."""

    uuids: tuple[str, ...]


@dataclass(frozen=True)
class RestartBegun:
    at: float


@dataclass(frozen=True)
class RestartEnded:
    at: float
    reason: str
    done: bool
    # After an eviction the pod is going away: it stays unready until it does.
    keep_unready: bool


@dataclass(frozen=True)
class CacheFlushRequested:
    at: float
    reason: str


@dataclass(frozen=True)
class AdmissionRequested:
    change: ladder.Change


@dataclass(frozen=True)
class AdmissionAnswered:
    at: float
    change: ladder.Change
    ok: bool


Outcome = (CanarySample | ServerSample | TorchSample | GpuReadout | XidEvent | PodGpus | RestartBegun | RestartEnded
           | CacheFlushRequested | AdmissionRequested | AdmissionAnswered)


def reduce(h: History, outcome: Outcome, admission: AdmissionSettings = AdmissionSettings()) -> History:
    """Fold one outcome into the history (in place: the deques are bounded logs) and return it."""
    if isinstance(outcome, CanarySample):
        h.canaries.append(outcome)
        if outcome.ok and h.served_at is None and outcome.at >= h.epoch:
            h.served_at = outcome.at
    elif isinstance(outcome, ServerSample):
        last = next((x for x in reversed(h.server) if x.reachable and x.progress is not None), None)
        if (outcome.progress is not None and last is not None and last.progress is not None
                and outcome.progress < last.progress):
            # Its counters started again: the server process was replaced (a container restart,
            # an engine that exited and came back) and may be loading its model: starting anew.
            h.served_at = None
        h.server.append(outcome)
    elif isinstance(outcome, TorchSample):
        h.torch.append(outcome)
        h.ladder = ladder.observe(h.ladder, outcome, admission)
    elif isinstance(outcome, GpuReadout):
        h.gpus, h.gpus_visible = outcome.gpus, outcome.visible
    elif isinstance(outcome, XidEvent):
        h.xids.append(outcome)
    elif isinstance(outcome, PodGpus):
        h.pod_gpus = outcome.uuids or None
    elif isinstance(outcome, RestartBegun):
        h.restart_in_progress = True
    elif isinstance(outcome, RestartEnded):
        h.actions.append(ActionRecord(outcome.at, "restart", outcome.reason))
        # Evidence older than this is about a process that is gone; the new one starts anew.
        h.epoch = outcome.at
        h.served_at = None
        h.restart_in_progress = outcome.keep_unready
    elif isinstance(outcome, CacheFlushRequested):
        h.actions.append(ActionRecord(outcome.at, "empty_cache", outcome.reason))
    elif isinstance(outcome, AdmissionRequested) and h.ladder is not None:
        h.ladder = ladder.requested(h.ladder, outcome.change)
    elif isinstance(outcome, AdmissionAnswered) and h.ladder is not None:
        h.ladder = ladder.answered(h.ladder, outcome.change, outcome.at, outcome.ok, admission)
    return h
