"""The decision rules, driven by recorded traces: samples in, decisions out, time passed in."""

from __future__ import annotations

from dataclasses import replace

import pytest

from watchdog.config import PolicySettings, Settings
from watchdog.policy import Decision, budget_remaining, decide
from watchdog.samples import ActionRecord, CanarySample, GpuSample, History, TorchSample, XidEvent

GiB = 2**30
UUID = "GPU-aaaa"
OTHER = "GPU-bbbb"


def settings(**changes: object) -> PolicySettings:
    return replace(Settings().policy, **changes)  # type: ignore[arg-type]


def ok(at: float, latency: float = 0.05) -> CanarySample:
    return CanarySample(at=at, ok=True, latency_s=latency, error_class=None, instance_id="i1")


def failed(at: float, cls: str) -> CanarySample:
    return CanarySample(at=at, ok=False, latency_s=10.0, error_class=cls, error=cls, instance_id="i1")


def torch(at: float, reserved: float = 10 * GiB, allocated: float = 9 * GiB, total: float = 80 * GiB,
          ooms: int = 0, retries: int = 0, poisoned: bool = False, uptime: float = 100.0) -> TorchSample:
    frag = (reserved - allocated) / reserved if reserved else 0.0
    return TorchSample(at=at, reachable=True, device="cuda", uuid=UUID, total_bytes=int(total),
                       allocated_bytes=int(allocated), reserved_bytes=int(reserved), fragmentation_ratio=frag,
                       ooms=ooms, alloc_retries=retries, poisoned=poisoned, uptime_s=uptime, instance_id="i1")


def history(**kw: object) -> History:
    return History(started_at=0.0, epoch=0.0, **kw)  # type: ignore[arg-type]


def actions(ds: list[Decision]) -> list[tuple[str, str, bool]]:
    return [(d.action, d.reason, d.allowed) for d in ds]


def test_healthy_trace_decides_nothing() -> None:
    h = history()
    for t in range(0, 300, 5):
        h.torch.append(torch(t))
        h.canaries.append(ok(t))
        assert decide(settings(), h, t + 0.1) == []


def test_fatal_canary_is_context_loss_without_drain() -> None:
    h = history()
    h.canaries.extend([ok(1), failed(2, "fatal_cuda")])
    [d] = decide(settings(), h, 2.1)
    assert (d.action, d.reason, d.drain) == ("restart", "context_loss", False)
    assert d.detail["evidence"] == "canary"


def test_poisoned_flag_is_context_loss() -> None:
    h = history()
    h.torch.append(torch(1, poisoned=True))
    assert actions(decide(settings(), h, 1.5)) == [("restart", "context_loss", True)]


def test_xid_app_fault_for_our_gpu_is_context_loss_other_gpu_ignored() -> None:
    h = history()
    h.torch.append(torch(1))
    h.xids.append(XidEvent(at=2, xid=31, uuid=OTHER))
    assert decide(settings(), h, 2.5) == []
    h.xids.append(XidEvent(at=3, xid=63, uuid=UUID))  # remap event: warn only
    assert decide(settings(), h, 3.5) == []
    h.xids.append(XidEvent(at=4, xid=43, uuid=UUID))
    [d] = decide(settings(), h, 4.5)
    assert (d.reason, d.detail["xid"], d.detail["class"]) == ("context_loss", 43, "app_fault")


def test_gpu_lost_is_context_loss() -> None:
    h = history(gpu=GpuSample(at=5, available=True, uuid=UUID, lost=True))
    assert actions(decide(settings(), h, 5.5)) == [("restart", "context_loss", True)]


def test_hang_needs_consecutive_timeouts() -> None:
    h = history()
    h.canaries.extend([failed(1, "timeout"), failed(2, "timeout"), ok(3), failed(4, "timeout"),
                       failed(5, "timeout")])
    assert decide(settings(), h, 5.5) == []  # the success in between resets the count
    h.canaries.append(failed(6, "timeout"))
    [d] = decide(settings(), h, 6.5)
    assert (d.reason, d.drain) == ("hang", False)


def test_a_one_off_spike_does_not_restart() -> None:
    h = history()
    h.canaries.extend([ok(1), failed(2, "timeout"), failed(3, "oom"), ok(4)])
    h.torch.extend([torch(1), torch(2, reserved=79 * GiB, allocated=78 * GiB), torch(3)])
    ds = decide(settings(), h, 4.5)
    assert all(d.action != "restart" for d in ds)


def test_memory_pressure_flushes_with_cooldown() -> None:
    h = history()
    h.torch.append(torch(10, reserved=70 * GiB, allocated=60 * GiB))
    [d] = decide(settings(), h, 10.1)
    assert (d.action, d.reason) == ("empty_cache", "memory_pressure")
    h.actions.append(ActionRecord(10.1, "empty_cache", "memory_pressure"))
    h.torch.append(torch(15, reserved=70 * GiB, allocated=60 * GiB))
    assert decide(settings(), h, 15.1) == []  # within the 60 s cooldown
    h.torch.append(torch(75, reserved=70 * GiB, allocated=60 * GiB))
    assert actions(decide(settings(), h, 75.1)) == [("empty_cache", "memory_pressure", True)]


def test_new_ooms_flush_the_cache() -> None:
    h = history()
    h.torch.extend([torch(1), torch(2, ooms=1)])
    assert actions(decide(settings(), h, 2.1)) == [("empty_cache", "oom", True)]


def _drift(h: History, at: float, fixed: bool) -> None:
    h.torch.append(torch(at, reserved=10 * GiB, allocated=(9.5 if fixed else 5) * GiB))


def test_fragmentation_that_empty_cache_fixes_never_restarts() -> None:
    h = history()
    _drift(h, 1, fixed=False)
    [d] = decide(settings(), h, 1.1)
    assert (d.action, d.reason) == ("empty_cache", "fragmentation_drift")
    h.actions.append(ActionRecord(1.1, "empty_cache", "fragmentation_drift"))
    for t in range(2, 200):
        _drift(h, t, fixed=True)
        assert decide(settings(), h, t + 0.1) == []


def test_fragmentation_that_persists_restarts_after_the_attempts() -> None:
    s = settings()
    h = history()
    flushes = 0
    restarted_at = None
    for t in range(1, 60):
        _drift(h, t, fixed=False)
        for d in decide(s, h, t + 0.1):
            if d.action == "empty_cache":
                flushes += 1
                h.actions.append(ActionRecord(t + 0.1, "empty_cache", d.reason))
            elif d.action == "restart":
                assert d.reason == "fragmentation_drift" and d.drain
                restarted_at = t
        if restarted_at:
            break
    assert flushes == s.fragmentation.empty_cache_attempts
    assert restarted_at is not None and restarted_at == flushes + 1


def test_repeated_drift_that_each_flush_cures_never_restarts() -> None:
    s = settings()
    h = history()
    t = 0.0
    for _episode in range(6):  # more episodes than empty_cache_attempts, all inside one window
        t += 1
        _drift(h, t, fixed=False)
        [d] = decide(s, h, t + 0.1)
        assert (d.action, d.reason) == ("empty_cache", "fragmentation_drift")
        h.actions.append(ActionRecord(t + 0.1, "empty_cache", d.reason))
        for _ in range(3):
            t += 1
            _drift(h, t, fixed=True)
            assert decide(s, h, t + 0.1) == []


def test_alloc_retries_count_as_drift() -> None:
    h = history()
    h.torch.extend([torch(1, retries=0), torch(2, retries=4)])
    [d] = decide(settings(), h, 2.1)
    assert (d.action, d.reason, d.detail["alloc_retries_delta"]) == ("empty_cache", "fragmentation_drift", 4)


def test_latency_drift_only_when_enabled() -> None:
    h = history()
    h.canaries.extend([ok(t, 0.01) for t in range(5)] + [ok(t, 0.5) for t in range(5, 10)])
    h.torch.append(torch(10))
    assert decide(settings(), h, 10.1) == []
    enabled = settings(fragmentation=replace(Settings().policy.fragmentation, latency_factor=5.0))
    [d] = decide(enabled, h, 10.1)
    assert d.reason == "fragmentation_drift" and d.detail["canary_baseline_s"] == 0.01


def test_max_age_with_jitter_drains() -> None:
    s = settings(max_age=1000.0)
    h = history(jitter=0.05)
    h.torch.append(torch(10, uptime=1040))
    assert decide(s, h, 10.5) == []
    h.torch.append(torch(20, uptime=1051))
    [d] = decide(s, h, 20.5)
    assert (d.reason, d.drain) == ("max_age", True)


def test_budget_stops_a_restart_storm() -> None:
    s = settings()
    h = history()
    done = 0
    for i in range(10):
        t = 100.0 * i + 1
        h.canaries.append(failed(t, "fatal_cuda"))
        ds = decide(s, h, t + 0.1)
        restart = [d for d in ds if d.action == "restart"]
        assert restart, "context loss must always be decided"
        if restart[0].allowed:
            done += 1
            h.actions.append(ActionRecord(t + 0.2, "restart", "context_loss"))
            h.epoch = t + 0.3
        else:
            assert restart[0].blocked_by == "restart_budget"
    assert done == s.restart_budget.max_restarts
    assert budget_remaining(s, h, 1000.0) == 0
    # An hour after the first restarts the budget refills.
    assert budget_remaining(s, h, 3600.0 + 50) == 1


def test_evidence_from_before_a_restart_is_ignored() -> None:
    h = history()
    h.canaries.append(failed(1, "fatal_cuda"))
    h.actions.append(ActionRecord(2, "restart", "context_loss"))
    h.epoch = 3
    assert decide(settings(), h, 3.1) == []


def test_nothing_is_decided_while_a_restart_runs() -> None:
    h = history(restart_in_progress=True)
    h.canaries.append(failed(1, "fatal_cuda"))
    assert decide(settings(), h, 1.1) == []


@pytest.mark.parametrize("reason", ["timeout", "unreachable", "other"])
def test_unreachable_or_garbage_alone_never_restarts(reason: str) -> None:
    h = history()
    for t in range(1, 3):
        h.canaries.append(failed(t, reason))
        h.torch.append(TorchSample(at=t, reachable=False, error="bad_response: garbage"))
    assert [d for d in decide(settings(), h, 3.0) if d.action == "restart"] == []
