"""The decision rules, driven by recorded traces: samples in, decisions out, time passed in."""

from __future__ import annotations

from dataclasses import replace

import pytest

from gpu_watchdog.watchdog.core.history import History
from gpu_watchdog.watchdog.core.names import (
    HANG,
    PROGRESS_UNKNOWN,
    RESTART_REASONS,
    SATURATED,
    STARTING,
    STARTUP_TIMEOUT,
    UNSERVABLE,
)
from gpu_watchdog.watchdog.core.policy import (
    Decision,
    budget_remaining,
    canary_delay,
    decide,
    max_age_jitter,
    our_gpus,
    progress_unknown,
    saturated,
    serviceable,
    target_state,
)
from gpu_watchdog.watchdog.core.samples import (
    ActionRecord,
    CanarySample,
    GpuSample,
    ServerSample,
    TorchSample,
    XidEvent,
)
from gpu_watchdog.watchdog.core.state import RestartBegun, RestartEnded, RestartWaiting, WorkloadRestarts, reduce
from gpu_watchdog.watchdog.edge.config import HangSettings, PolicySettings, Settings

GiB = 2**30
UUID = "GPU-aaaa"
OTHER = "GPU-bbbb"


def settings(**changes: object) -> PolicySettings:
    return replace(Settings().policy, **changes)  # type: ignore[arg-type]


def ok(at: float, latency: float = 0.05) -> CanarySample:
    return CanarySample(at=at, ok=True, latency_s=latency, error_class=None, instance_id="i1")


def failed(at: float, cls: str, latency: float = 10.0) -> CanarySample:
    return CanarySample(at=at, ok=False, latency_s=latency, error_class=cls, error=cls, instance_id="i1")


def work(at: float, progress: float, running: float = 0.0, waiting: float = 0.0) -> ServerSample:
    """A reading of the server's own /metrics (vLLM's names, already parsed)."""
    return ServerSample(at=at, reachable=True, server="vllm", requests_running=running, requests_waiting=waiting,
                        generated_tokens=progress, progress=progress)


def torch(at: float, reserved: float = 10 * GiB, allocated: float = 9 * GiB, total: float = 80 * GiB,
          ooms: int = 0, retries: int = 0, poisoned: bool = False, uptime: float = 100.0) -> TorchSample:
    frag = (reserved - allocated) / reserved if reserved else 0.0
    return TorchSample(at=at, reachable=True, device="cuda", uuid=UUID, total_bytes=int(total),
                       allocated_bytes=int(allocated), reserved_bytes=int(reserved), fragmentation_ratio=frag,
                       ooms=ooms, alloc_retries=retries, poisoned=poisoned, uptime_s=uptime, instance_id="i1")


def history(**kw: object) -> History:
    """A target that has served (most rules apply only then); pass served_at=None for one starting."""
    return History(started_at=0.0, epoch=0.0, **{"served_at": 0.0, **kw})  # type: ignore[arg-type]


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


def test_a_poisoned_flag_of_a_process_that_another_replaced_decides_nothing() -> None:
    # The server exited on its poisoned context and its container started it again in place: the
    # last reading of the allocator is still the old process's until the new one is read.
    h = history()
    h.torch.append(torch(1, poisoned=True))
    h.canaries.append(replace(ok(2), instance_id="i1"))  # the poisoned process still answers: no cure
    assert actions(decide(settings(), h, 2.5)) == [("restart", "context_loss", True)]
    h.canaries.append(failed(3, "unreachable"))
    h.canaries.append(replace(ok(9), instance_id="i2"))
    assert decide(settings(), h, 9.5) == []
    h.torch.append(replace(torch(10, poisoned=True), instance_id="i2"))  # the new one poisoned too
    assert actions(decide(settings(), h, 10.5)) == [("restart", "context_loss", True)]


def test_xid_app_fault_for_our_gpu_is_context_loss_other_gpu_ignored() -> None:
    h = history()
    h.torch.append(torch(1))
    h.xids.append(XidEvent(at=2, xid=31, uuid=OTHER))
    assert decide(settings(), h, 2.5) == []
    h.xids.append(XidEvent(at=3, xid=63, uuid=UUID))  # remap event: warn only
    h.xids.append(XidEvent(at=3, xid=43, uuid=UUID))  # the catalog's immediate action: IGNORE
    assert decide(settings(), h, 3.5) == []
    h.xids.append(XidEvent(at=4, xid=13, uuid=UUID))
    [d] = decide(settings(), h, 4.5)
    assert (d.reason, d.detail["xid"], d.detail["class"]) == ("context_loss", 13, "app_fault")


def test_gpu_lost_is_context_loss() -> None:
    h = history(gpus=(GpuSample(at=5, available=True, uuid=OTHER), GpuSample(at=5, available=True, uuid=UUID,
                                                                            lost=True)))
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


def test_an_oom_during_the_cooldown_is_flushed_once_it_is_over() -> None:
    h = history()
    h.torch.extend([torch(1), torch(2, ooms=1)])
    assert actions(decide(settings(), h, 2.1)) == [("empty_cache", "oom", True)]
    h.actions.append(ActionRecord(2.1, "empty_cache", "oom"))
    h.torch.extend([torch(7, ooms=1), torch(12, ooms=2)])
    assert decide(settings(), h, 12.1) == []  # within the 60 s cooldown
    for t in range(17, 62, 5):
        h.torch.append(torch(t, ooms=2))
        assert decide(settings(), h, t + 0.1) == []
    h.torch.append(torch(67, ooms=2))  # no OOM since the last sample, one since the last flush
    [d] = decide(settings(), h, 67.1)
    assert (d.action, d.reason, d.detail["new_ooms"]) == ("empty_cache", "oom", 1)
    h.actions.append(ActionRecord(67.1, "empty_cache", "oom"))
    for t in range(72, 300, 5):  # nothing new since: nothing more
        h.torch.append(torch(t, ooms=2))
        assert decide(settings(), h, t + 0.1) == []


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


def test_max_age_jitter_spreads_replicas_and_stays_with_the_pod() -> None:
    names = [f"model-7f9c6d-{i:05x}" for i in range(200)]
    shares = [max_age_jitter(n, 0.1) for n in names]
    assert all(0.0 <= j <= 0.1 for j in shares)
    # Replicas started together reach max_age spread over the jitter, not at once.
    assert len(set(shares)) == len(names) and max(shares) - min(shares) > 0.09
    assert sum(j < 0.05 for j in shares) in range(70, 131)
    # A restarted sidecar in the same pod keeps its pod's share; no jitter configured, none added.
    assert max_age_jitter(names[0], 0.1) == shares[0]
    assert max_age_jitter(names[0], 0.0) == 0.0
    s = settings(max_age=1000.0, max_age_jitter=0.1)


    def restarted_at(name: str) -> int:
        """The uptime at which this pod's first max_age restart is decided."""
        for age in range(900, 1200):
            h = history(jitter=max_age_jitter(name, s.max_age_jitter))
            h.torch.append(torch(1, uptime=age))
            if [d.reason for d in decide(s, h, 1.0)] == ["max_age"]:
                return age
        raise AssertionError(f"{name}: no max_age restart")

    ages = [restarted_at(n) for n in names[:20]]
    assert min(ages) >= 1000 and max(ages) <= 1101 and len(set(ages)) > 10


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


# -- busy is not hung: the server's own work counter ----------------------------------------------


def timeouts(h: History, starts: list[float], timeout: float = 1.0) -> None:
    for t in starts:
        h.canaries.append(failed(t + timeout, "timeout", latency=timeout))


def test_timeouts_while_tokens_flow_are_saturation_not_a_hang() -> None:
    h = history()
    h.canaries.append(ok(0.5))
    for t in range(0, 12):
        h.server.append(work(t, progress=1000.0 + 150 * t, running=8, waiting=88))
    timeouts(h, [2, 3, 4, 5, 6, 7, 8, 9, 10])  # nine in a row, far past the threshold of three
    assert decide(settings(), h, 11.5) == []
    busy, figures = saturated(h)
    assert busy and figures["canary_timeouts"] == 9 and figures["progress_to"] > figures["progress_from"]
    assert target_state(h, settings(), 11.5) == SATURATED and serviceable(h, settings(), 11.5)


def test_timeouts_with_the_counter_flat_are_a_hang() -> None:
    h = history()
    h.canaries.append(ok(0.5))
    for t in range(0, 6):  # an engine that stopped keeps its last gauge values
        h.server.append(work(t, progress=5000.0, running=3))
    timeouts(h, [2, 3])
    assert decide(settings(), h, 4.5) == []  # two timeouts: not yet
    assert not serviceable(h, settings(), 4.5)  # flat counter: not saturation, so not ready either
    timeouts(h, [4])
    [d] = decide(settings(), h, 5.5)
    assert (d.reason, d.drain, d.detail["server_progress"]) == (HANG, False, "flat")


def test_idle_server_with_a_stopped_engine_is_caught_too() -> None:
    h = history()
    h.canaries.append(ok(0.5))
    for t in range(0, 6):
        h.server.append(work(t, progress=42.0))  # nothing running, nothing waiting, nothing moving
    timeouts(h, [2, 3, 4])
    [d] = decide(settings(), h, 5.5)
    assert d.reason == HANG and d.detail["server_progress"] == "flat"


def test_without_metrics_timeouts_alone_decide_as_before() -> None:
    h = history()
    h.canaries.append(ok(0.5))
    timeouts(h, [2, 3, 4])
    [d] = decide(settings(), h, 5.5)
    assert d.reason == HANG and d.detail["server_progress"] == "no_metrics"


def dark(at: float) -> ServerSample:
    return ServerSample(at=at, reachable=False, error="timeout: no page within 5s")


def test_a_scrape_timeout_during_canary_timeouts_while_the_counter_was_advancing_is_not_a_hang() -> None:
    """The flood's onset: vLLM's page times out under the load that times out the canary."""
    s = settings()
    h = history()
    reduce(h, ok(0.5))
    for t in range(0, 3):
        reduce(h, work(t, progress=12_000.0 + 900 * t, running=8, waiting=88))
    for t in (3, 4, 5, 6, 7, 8, 9):
        reduce(h, dark(t))
    timeouts(h, [3, 4, 5, 6, 7, 8])  # six timeouts: twice the threshold
    assert decide(s, h, 9.5) == []
    unknown, figures = progress_unknown(s, h, 9.5)
    assert unknown and figures["last_progress"] == 13_800.0 and figures["last_reading_s_ago"] == 7.5
    assert target_state(h, s, 9.5) == PROGRESS_UNKNOWN and serviceable(h, s, 9.5)  # readiness held
    # A late reading then shows the counter moved: saturation, as it was all along.
    reduce(h, work(10, progress=57_355.0, running=8, waiting=88))
    assert decide(s, h, 10.5) == [] and target_state(h, s, 10.5) == SATURATED


def test_a_readable_counter_that_is_flat_across_the_timeouts_is_a_hang_even_after_dark_scrapes() -> None:
    h = history()
    reduce(h, ok(0.5))
    reduce(h, work(0, progress=500.0, running=2))
    reduce(h, dark(2))
    timeouts(h, [2, 3, 4])
    reduce(h, work(4.5, progress=500.0, running=2))  # readable again, and it did not move
    [d] = decide(settings(), h, 5.5)
    assert d.reason == HANG and d.detail["server_progress"] == "flat"


def test_no_metrics_ever_timeouts_alone_decide() -> None:
    h = history()
    reduce(h, ok(0.5))
    for t in (1, 2, 3, 4):
        reduce(h, dark(t))  # a page that never answered: the server exposes none we can read
    timeouts(h, [2, 3, 4])
    [d] = decide(settings(), h, 5.5)
    assert d.reason == HANG and d.detail["server_progress"] == "no_metrics"
    assert not progress_unknown(settings(), h, 5.5)[0]


@pytest.mark.parametrize("bound", [120.0, 30.0])
def test_metrics_lost_for_longer_than_the_bound_leave_the_timeouts_to_decide(bound: float) -> None:
    s = replace(settings(), hang=HangSettings(consecutive_timeouts=3, no_evidence_after=bound))
    h = history()
    reduce(h, ok(0.5))
    reduce(h, work(0, progress=10.0))
    reduce(h, work(1, progress=20.0))
    t = 2.0
    while t < bound + 1:  # the whole server went dark: every canary and every scrape times out
        reduce(h, dark(t))
        h.canaries.append(failed(t + 1, "timeout", latency=1.0))
        if t + 1.5 < 1 + bound:
            assert decide(s, h, t + 1.5) == [], t
            assert serviceable(h, s, t + 1.5)
        t += 2.0
    [d] = decide(s, h, 1 + bound)
    assert d.reason == HANG and d.detail["server_progress"] == "no_evidence"
    assert d.detail["last_reading_s_ago"] == bound and d.detail["no_evidence_after_s"] == bound
    assert not serviceable(h, s, 1 + bound)


def test_a_restart_reported_and_not_performed_leaves_the_target_as_it_was() -> None:
    """strategy none: said once, no new epoch, no `starting`, nothing spent from the budget."""
    s = settings()
    h = history()
    reduce(h, ok(0.5))
    timeouts(h, [2, 3, 4])
    [d] = decide(s, h, 5.5)
    reduce(h, RestartBegun(5.5))
    reduce(h, RestartEnded(at=5.6, reason=d.reason, done=False, keep_unready=False, reported_only=True))
    assert h.epoch == 0.0 and h.served_at == 0.0 and target_state(h, s, 6) == "canary_failing"
    assert budget_remaining(s, h, 6) == s.restart_budget.max_restarts
    timeouts(h, [6, 7])
    assert decide(s, h, 8.5) == []  # the same episode: not decided again
    reduce(h, ok(9))
    timeouts(h, [10, 11, 12])
    assert [x.reason for x in decide(s, h, 13.5)] == [HANG]  # a new episode is reported anew


def test_a_restart_that_failed_is_retried_after_a_growing_backoff_and_is_not_counted() -> None:
    s = settings()
    h = history()
    reduce(h, ok(0.5))
    timeouts(h, [2, 3, 4])
    reduce(h, RestartEnded(at=6.0, reason=HANG, done=False, keep_unready=False))
    assert h.epoch == 0.0 and budget_remaining(s, h, 7) == s.restart_budget.max_restarts
    assert decide(s, h, 35.0) == []
    assert [x.reason for x in decide(s, h, 36.5)] == [HANG]  # 30 s later
    reduce(h, RestartEnded(at=37.0, reason=HANG, done=False, keep_unready=False))
    assert decide(s, h, 96.0) == []
    assert [x.reason for x in decide(s, h, 97.5)] == [HANG]  # then 60 s


def test_a_single_reading_across_the_timeouts_waits_for_the_next() -> None:
    h = history()
    h.canaries.append(ok(0.5))
    h.server.append(work(2.5, 10.0))
    timeouts(h, [2, 3, 4])
    assert decide(settings(), h, 5.5) == []
    h.server.append(work(5.6, 10.0))
    [d] = decide(settings(), h, 5.7)
    assert d.reason == HANG


def test_a_counter_that_starts_again_is_a_new_server_starting() -> None:
    h = history()
    reduce(h, ok(0.5))
    for sample in (work(1, 900.0), work(3, 0.0), work(5, 0.0)):
        reduce(h, sample)
    timeouts(h, [2, 3, 4])
    # Replaced behind our back (its container restarted) and maybe loading: never restarted for
    # failing canaries before it serves once.
    assert target_state(h, settings(), 0.0) == STARTING
    assert decide(settings(), h, 5.5) == []


def test_the_counters_of_a_process_we_restarted_starting_again_do_not_make_it_start_anew_twice() -> None:
    h = history()
    reduce(h, ok(0.5))
    reduce(h, work(1, 900.0))  # the old process
    reduce(h, RestartEnded(at=2.0, reason=HANG, done=True, keep_unready=False))
    reduce(h, ok(2.5))  # the new one serves...
    reduce(h, work(2.6, 0.0))  # ...and its first scrape, after that canary, counts from 0
    timeouts(h, [3, 4, 5])
    reduce(h, work(6, 0.0))
    # It served once since our restart: failing canaries now are a hang, not a start that takes
    # until the startup timeout.
    assert target_state(h, settings(), 6.5) != STARTING
    assert [x.reason for x in decide(settings(), h, 6.5)] == [HANG]


def test_stall_requests_pending_and_no_token_for_the_window() -> None:
    s = settings()
    h = history()
    h.canaries.append(ok(0.5))
    for t in range(0, 60, 5):
        h.server.append(work(t, progress=777.0, running=2, waiting=5))
    assert decide(s, h, 56.0) == []  # flat for 55 s: under the 60 s window
    h.server.append(work(60, progress=777.0, running=2, waiting=5))
    [d] = decide(s, h, 60.5)
    assert (d.reason, d.detail["evidence"], d.detail["flat_s"]) == (HANG, "stall", 60.0)


def test_no_stall_when_idle_or_when_tokens_move() -> None:
    h = history()
    h.canaries.append(ok(0.5))
    for t in range(0, 120, 5):
        h.server.append(work(t, progress=777.0))  # flat but nothing pending: idle
    assert decide(settings(), h, 121.0) == []
    h2 = history()
    h2.canaries.append(ok(0.5))
    for t in range(0, 120, 5):
        h2.server.append(work(t, progress=777.0 + (t // 30), running=4))  # slow but moving
    assert decide(settings(), h2, 121.0) == []


def test_one_long_request_under_a_counter_of_answers_is_no_stall_while_the_canary_serves() -> None:
    # A service whose work counter counts answered requests (the agent's `progress_metric`): one
    # request that runs for minutes leaves it flat while every canary is answered. It serves.
    h = history()
    for t in range(0, 180, 5):
        h.server.append(work(t, progress=12.0, running=1))
    for t in range(0, 180, 30):
        h.canaries.append(ok(t + 0.5))
    assert decide(settings(), h, 176.0) == []
    # Requests waiting behind it while the counter stays flat: clients starve, whatever the canary's
    # reserved slot says. That is the stall.
    h.server.append(work(180, progress=12.0, running=1, waiting=3))
    for t in range(185, 250, 5):
        h.server.append(work(t, progress=12.0, running=1, waiting=3))
    [d] = decide(settings(), h, 245.5)
    assert (d.reason, d.detail["evidence"]) == (HANG, "stall")
    # And with nothing waiting, a canary that is no longer answered leaves the stall rule to decide.
    h2 = history()
    h2.canaries.append(ok(0.5))
    for t in range(0, 70, 5):
        h2.server.append(work(t, progress=12.0, running=1))
    h2.canaries.append(failed(40.0, "timeout"))
    [d2] = decide(settings(), h2, 65.5)
    assert (d2.reason, d2.detail["evidence"]) == (HANG, "stall")


def test_confirm_fast_after_a_timeout_and_only_then() -> None:
    s = Settings()
    h = history()
    h.canaries.append(ok(1))
    assert canary_delay(s.canary, s.policy, h, 2) == s.canary.interval  # healthy: no extra canaries
    timeouts(h, [30], timeout=10)
    assert canary_delay(s.canary, s.policy, h, 40) == s.canary.timeout
    timeouts(h, [40, 50], timeout=10)  # the threshold is reached: back to the interval
    assert canary_delay(s.canary, s.policy, h, 60) == s.canary.interval
    busy = history()
    busy.canaries.append(ok(1))
    busy.server.extend([work(25, 100.0, running=8), work(35, 900.0, running=8)])
    timeouts(busy, [30], timeout=10)
    assert canary_delay(s.canary, s.policy, busy, 40) == s.canary.interval  # saturated: no extra load


def test_hang_at_defaults_is_decided_in_about_interval_plus_n_timeouts() -> None:
    """The canary loop as it runs: the next canary starts `canary_delay` after the last one began."""
    s = Settings()
    h = history()
    stopped_at, start = 1.0, 0.0  # the engine stops just after a successful canary
    while True:
        if start < stopped_at:
            end = start + 0.05
            h.canaries.append(ok(end))
        else:
            end = start + s.canary.timeout
            h.canaries.append(failed(end, "timeout", latency=s.canary.timeout))
        if [d for d in decide(s.policy, h, end) if d.reason == HANG]:
            break
        start += max(canary_delay(s.canary, s.policy, h, end), end - start)
    # interval + n x timeout = 30 + 3 x 10; it took n x interval (96.5 s measured) before.
    assert end - stopped_at <= s.canary.interval + 3 * s.canary.timeout


# -- starting, startup timeout, unservable -------------------------------------------------------


def test_a_server_that_never_served_is_starting_until_the_startup_timeout() -> None:
    s = settings()
    h = history(served_at=None)
    for t in range(10, 1800, 10):
        h.canaries.append(failed(t, "timeout" if t % 20 else "unreachable"))
        assert decide(s, h, t + 0.5) == [], t  # loading for many minutes: never a restart
        assert target_state(h, s, t + 0.5) == STARTING and not serviceable(h, s, t + 0.5)
    [d] = decide(s, h, 1800.5)
    assert (d.reason, d.drain) == (STARTUP_TIMEOUT, True)
    assert d.detail["startup_timeout_s"] == 1800.0


def test_the_first_success_ends_starting_and_a_restart_starts_it_again() -> None:
    h = History(started_at=0.0, epoch=0.0)
    reduce(h, failed(5, "unreachable"))
    assert h.served_at is None
    reduce(h, ok(6))
    assert h.served_at == 6 and target_state(h, settings(), 6) == "healthy"
    reduce(h, RestartEnded(at=100.0, reason=HANG, done=True, keep_unready=False))
    assert h.served_at is None and h.epoch == 100.0 and target_state(h, settings(), 100) == STARTING
    assert decide(settings(), h, 1800.0) == []  # the startup clock runs from the restart
    assert [d.reason for d in decide(settings(), h, 1900.5)] == [STARTUP_TIMEOUT]


def test_context_loss_is_decided_even_while_starting() -> None:
    h = history(served_at=None)
    h.torch.append(torch(1, poisoned=True))
    assert actions(decide(settings(), h, 1.5)) == [("restart", "context_loss", True)]


def test_every_canary_answered_with_an_error_for_the_window_is_unservable() -> None:
    s = settings()
    h = history()
    h.canaries.append(ok(1))
    for t in range(30, 630, 30):
        h.canaries.append(failed(t, "other" if t % 60 else "oom"))
        assert decide(s, h, t + 0.1) == [], t
    h.canaries.append(failed(630, "other"))
    [d] = decide(s, h, 630.5)
    assert (d.reason, d.drain, d.detail["canaries"]) == (UNSERVABLE, True, 21)


def test_unservable_needs_every_canary_to_fail() -> None:
    h = history()
    for t in range(0, 1200, 30):
        h.canaries.append(ok(t) if t % 300 == 0 else failed(t, "other"))
    assert decide(settings(), h, 1200.0) == []
    h2 = history()
    for t in range(0, 1200, 30):  # a closed port is the kubelet's to restart, not an answer
        h2.canaries.append(failed(t, "unreachable"))
    assert decide(settings(), h2, 1200.0) == []


# -- which GPUs are ours -------------------------------------------------------------------------


def test_xid_on_a_multi_gpu_node_with_unknown_gpus_never_restarts() -> None:
    h = history(gpus_visible=8)
    h.xids.append(XidEvent(at=2, xid=79, uuid=OTHER))
    h.xids.append(XidEvent(at=3, xid=13, uuid=None))
    assert our_gpus(h) is None and decide(settings(), h, 3.5) == []


def test_xid_on_any_of_the_pods_gpus_from_the_kubelet() -> None:
    third = "GPU-cccc"
    h = history(gpus_visible=8, pod_gpus=(UUID, third))
    h.xids.append(XidEvent(at=2, xid=79, uuid=OTHER))
    assert decide(settings(), h, 2.5) == []
    h.xids.append(XidEvent(at=3, xid=48, uuid=third))
    [d] = decide(settings(), h, 3.5)
    assert (d.reason, d.detail["uuid"], d.detail["class"]) == ("context_loss", third, "ecc")


def test_every_restart_reason_is_a_known_name() -> None:
    seen = {HANG, STARTUP_TIMEOUT, UNSERVABLE, "context_loss", "fragmentation_drift", "max_age", "corrupt"}
    assert seen == set(RESTART_REASONS)


def test_one_answer_to_whether_an_xid_is_ours() -> None:
    from gpu_watchdog.watchdog.core.policy import gpus_unknown, xid_is_ours

    unknown = history(gpus_visible=4)
    assert gpus_unknown(unknown) and xid_is_ours(unknown, OTHER) is None and xid_is_ours(unknown, None) is None
    single = history(gpus_visible=1)
    assert not gpus_unknown(single) and xid_is_ours(single, OTHER) is True
    known = history(gpus_visible=4, pod_gpus=(UUID,))
    assert (xid_is_ours(known, UUID), xid_is_ours(known, OTHER), xid_is_ours(known, None)) == (True, False, True)


# -- settings at other values than their defaults: a rule that hard-coded the default passes the
# -- tests above, not these ---------------------------------------------------------------------


@pytest.mark.parametrize("window", [20.0, 90.0])
def test_the_stall_window_is_the_setting(window: float) -> None:
    from gpu_watchdog.watchdog.edge.config import StallSettings

    s = settings(stall=StallSettings(window=window))
    h = history()
    h.canaries.append(ok(0.5))
    for t in range(0, int(window), 5):
        h.server.append(work(t, progress=777.0, running=2, waiting=5))
    assert decide(s, h, window - 4.5) == []  # flat for window - 5 s
    h.server.append(work(window, progress=777.0, running=2, waiting=5))
    [d] = decide(s, h, window + 0.5)
    assert (d.reason, d.detail["evidence"], d.detail["flat_s"]) == (HANG, "stall", window)


@pytest.mark.parametrize("n", [2, 5])
def test_the_hang_threshold_is_the_setting(n: int) -> None:
    from gpu_watchdog.watchdog.edge.config import HangSettings

    s = settings(hang=HangSettings(consecutive_timeouts=n))
    h = history()
    h.canaries.append(ok(0.5))
    timeouts(h, [float(t) for t in range(1, n)])  # no server metrics: the timeouts alone decide
    assert decide(s, h, n + 0.5) == []
    timeouts(h, [float(n)])
    [d] = decide(s, h, n + 1.5)
    assert (d.reason, d.detail["consecutive_timeouts"]) == (HANG, n)


def test_memory_pressure_ratio_and_cooldown_are_the_settings() -> None:
    from gpu_watchdog.watchdog.edge.config import MemoryPressureSettings

    s = settings(memory_pressure=MemoryPressureSettings(reserved_ratio=0.5, cooldown=10.0))
    h = history()
    h.torch.append(torch(10, reserved=45 * GiB, allocated=44 * GiB))  # 56 % of the card
    assert decide(settings(), h, 10.1) == []  # under the default 85 %
    assert actions(decide(s, h, 10.1)) == [("empty_cache", "memory_pressure", True)]
    h.actions.append(ActionRecord(10.1, "empty_cache", "memory_pressure"))
    h.torch.append(torch(15, reserved=45 * GiB, allocated=44 * GiB))
    assert decide(s, h, 15.1) == []  # within the 10 s cooldown
    h.torch.append(torch(21, reserved=45 * GiB, allocated=44 * GiB))
    assert actions(decide(s, h, 21.1)) == [("empty_cache", "memory_pressure", True)]


def test_fragmentation_ratio_and_attempts_are_the_settings() -> None:
    from gpu_watchdog.watchdog.edge.config import FragmentationSettings

    h = history()
    h.torch.append(torch(1, reserved=10 * GiB, allocated=6 * GiB))  # 40 % fragmented
    assert actions(decide(settings(), h, 1.1)) == [("empty_cache", "fragmentation_drift", True)]
    lenient = settings(fragmentation=FragmentationSettings(ratio=0.5))
    assert decide(lenient, h, 1.1) == []
    s = settings(fragmentation=FragmentationSettings(empty_cache_attempts=2))
    h = history()
    decided = []
    for t in range(1, 10):
        _drift(h, t, fixed=False)
        for d in decide(s, h, t + 0.1):
            decided.append((t, d.action))
            if d.action == "empty_cache":
                h.actions.append(ActionRecord(t + 0.1, "empty_cache", d.reason))
        if decided and decided[-1][1] == "restart":
            break
    assert decided == [(1, "empty_cache"), (2, "empty_cache"), (3, "restart")]


def test_fragmentation_attempts_count_within_the_window_setting() -> None:
    from gpu_watchdog.watchdog.edge.config import FragmentationSettings

    def restarted(s: PolicySettings) -> bool:
        h = history()
        for t in range(1, 600, 60):  # a drift no flush cures, flushed once a minute
            _drift(h, t, fixed=False)
            for d in decide(s, h, t + 0.1):
                if d.action == "restart":
                    return True
                h.actions.append(ActionRecord(t + 0.1, "empty_cache", d.reason))
        return False

    assert restarted(settings())  # three flushes within the default 10 min
    assert not restarted(settings(fragmentation=FragmentationSettings(window=100.0)))  # never three in 100 s


def test_the_startup_timeout_is_the_setting() -> None:
    s = settings(startup_timeout=300.0)
    h = history(served_at=None)
    for t in range(10, 300, 10):
        h.canaries.append(failed(t, "timeout"))
    assert decide(s, h, 290.5) == []
    h.canaries.append(failed(300, "timeout"))
    [d] = decide(s, h, 300.5)
    assert (d.reason, d.detail["startup_timeout_s"]) == (STARTUP_TIMEOUT, 300.0)
    assert decide(settings(), h, 300.5) == []


def test_the_unservable_window_is_the_setting() -> None:
    from gpu_watchdog.watchdog.edge.config import UnservableSettings

    s = settings(unservable=UnservableSettings(window=120.0))
    h = history()
    h.canaries.append(ok(1))
    for t in range(30, 150, 30):
        h.canaries.append(failed(t, "other"))
    assert decide(s, h, 140.5) == []  # failing for 110.5 s
    h.canaries.append(failed(150, "other"))
    [d] = decide(s, h, 150.5)
    assert d.reason == UNSERVABLE
    assert decide(settings(), h, 150.5) == []


def test_the_restart_budget_is_the_setting() -> None:
    from gpu_watchdog.watchdog.edge.config import RestartBudgetSettings

    s = settings(restart_budget=RestartBudgetSettings(max_restarts=1, window=600.0))
    h = history()
    h.canaries.append(failed(1, "fatal_cuda"))
    [d] = decide(s, h, 1.1)
    assert d.allowed
    h.actions.append(ActionRecord(1.2, "restart", "context_loss"))
    h.epoch = 1.3
    h.canaries.append(failed(100, "fatal_cuda"))
    [d] = decide(s, h, 100.1)
    assert (d.allowed, d.blocked_by) == (False, "restart_budget")  # one restart per window
    assert budget_remaining(settings(), h, 100.1) == 2
    assert budget_remaining(s, h, 601.1) == 0 and budget_remaining(s, h, 601.3) == 1  # refilled after 600 s


def test_a_refused_restart_of_a_serving_server_waits_out_its_backoff() -> None:
    """max_age refused by the disruption budget: the server serves on and its canaries succeed, which
    must not make the same restart be asked again at the next tick."""
    s = settings(max_age=1000.0, max_age_jitter=0.0)
    h = history()
    h.torch.append(torch(10, uptime=1001))
    [d] = decide(s, h, 10.5)
    assert d.reason == "max_age"
    reduce(h, RestartBegun(10.5))
    reduce(h, RestartEnded(at=20.0, reason=d.reason, done=False, keep_unready=False))
    reduce(h, ok(21.0))
    assert decide(s, h, 21.5) == []
    assert [x.reason for x in decide(s, h, 50.5)] == ["max_age"]  # 30 s after the failure


def test_a_restart_waiting_for_permission_is_ready_while_it_serves() -> None:
    s = settings(max_age=1000.0, max_age_jitter=0.0)
    h = history()
    reduce(h, ok(5.0))
    reduce(h, RestartBegun(10.0))
    # Asking the disruption budget and writing the Event (tens of seconds where the API is slow)
    # takes nothing out of service.
    assert serviceable(h, s, 10.1)
    reduce(h, RestartWaiting(10.2, False))  # allowed and recorded: drained for the eviction
    assert not serviceable(h, s, 10.3)
    reduce(h, RestartWaiting(10.4, True))  # refused after all: drain lifted, serving again
    assert serviceable(h, s, 10.5)
    reduce(h, failed(11.0, "timeout", latency=1.0))
    reduce(h, RestartWaiting(12.0, False))
    assert not serviceable(h, s, 12.1)
    reduce(h, RestartEnded(at=13.0, reason="max_age", done=False, keep_unready=False))
    assert not h.restart_waiting and not h.restart_in_progress


def test_own_restarts_count_where_the_events_lost_them() -> None:
    """Belt and braces: the Events read back show none, but this sidecar restarted twice."""
    s = settings()
    h = history()
    for at in (10.0, 20.0):
        reduce(h, RestartEnded(at=at, reason=HANG, done=True, keep_unready=False))
    reduce(h, WorkloadRestarts(at=30.0, wall_now=1e9, restarts=()))
    assert budget_remaining(s, h, 31.0, from_events=True) == s.restart_budget.max_restarts - 2


def test_a_drained_servers_answer_is_not_serving() -> None:
    """A drained server answers its canary (the canary bypasses the drain) and admits nothing: not
    ready, not "served" (a restarted container that answers drained has not been cured), and no end
    to a restart episode."""
    s = settings()
    h = history(served_at=None)
    reduce(h, CanarySample(at=1.0, ok=True, latency_s=0.01, error_class=None, draining=True))
    assert h.served_at is None and target_state(h, s, 1.1) == STARTING and not serviceable(h, s, 1.1)
    reduce(h, ok(2.0))
    assert target_state(h, s, 2.1) == "healthy" and serviceable(h, s, 2.1)
    reduce(h, CanarySample(at=3.0, ok=True, latency_s=0.01, error_class=None, draining=True))
    assert target_state(h, s, 3.1) == "draining" and not serviceable(h, s, 3.1)
