"""Which GPUs are suspect, from the restart records read back: pure, on traces, with settings other
than the defaults (a rule that hard-coded 2 restarts in 24 h passes the integration tests, not these)."""

from __future__ import annotations

from gpu_watchdog.watchdog.core.escalation import RestartRecord, suspects
from gpu_watchdog.watchdog.core.names import CONTEXT_LOSS, HANG, MAX_AGE
from gpu_watchdog.watchdog.edge.config import EscalationSettings

GPU, OTHER = "GPU-1111", "GPU-2222"


def restart(at: float, reason: str = HANG, gpu: str = GPU) -> RestartRecord:
    return RestartRecord(at=at, reason=reason, gpus=(gpu,), pod=f"pod-{at:g}")


def test_the_number_of_restarts_is_the_setting() -> None:
    s = EscalationSettings(restarts=3, window=3600.0)
    records = [restart(100), restart(200, CONTEXT_LOSS)]
    assert suspects(s, records, 300, ours=None) == []  # two: enough at the default, not at 3
    [suspect] = suspects(s, [*records, restart(250)], 300, ours=None)
    assert suspect.uuid == GPU and suspect.reasons == [CONTEXT_LOSS, HANG]


def test_the_window_is_the_setting() -> None:
    s = EscalationSettings(restarts=2, window=600.0)
    records = [restart(100), restart(600)]
    assert [x.uuid for x in suspects(s, records, 650, ours=None)] == [GPU]
    assert suspects(s, records, 750, ours=None) == []  # the first is 650 s old: outside a 10 min window


def test_only_curing_restarts_of_our_gpus_count() -> None:
    s = EscalationSettings(restarts=2, window=600.0)
    records = [restart(100, MAX_AGE), restart(150, MAX_AGE), restart(120, gpu=OTHER), restart(130, gpu=OTHER)]
    assert suspects(s, records, 200, ours=(GPU,)) == []
    assert [x.uuid for x in suspects(s, records, 200, ours=None)] == [OTHER]
