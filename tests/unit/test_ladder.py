"""Adaptive admission (AIMD) on traces: OOMs that a flush did not stop cut the limit, quiet time grows it."""

from __future__ import annotations

from dataclasses import replace

from watchdog import ladder
from watchdog.config import AdmissionSettings, Settings
from watchdog.policy import decide
from watchdog.samples import ActionRecord, History, TorchSample
from watchdog.state import AdmissionAnswered, AdmissionRequested, CacheFlushRequested, reduce

S = AdmissionSettings(recover_after=300.0, max_wait=3600.0)


def mem(at: float, ooms: int, limit: int, instance: str = "i1", mode: str = "slots") -> TorchSample:
    return TorchSample(at=at, reachable=True, device="cuda", total_bytes=80 << 30, reserved_bytes=10 << 30,
                       allocated_bytes=9 << 30, ooms=ooms, admission_limit=limit, admission_mode=mode,
                       instance_id=instance)


class Trace:
    """A server and the watchdog's view of it: the limit the server runs with follows our changes."""

    def __init__(self, limit: int, settings: AdmissionSettings = S, mode: str = "slots") -> None:
        self.h = History(started_at=0.0, epoch=0.0, served_at=0.0)
        self.settings, self.mode = settings, mode
        self.limit, self.ooms, self.changes = limit, 0, []  # type: ignore[var-annotated]
        self.sample(0.0)

    def sample(self, at: float, new_ooms: int = 0) -> None:
        self.ooms += new_ooms
        reduce(self.h, mem(at, self.ooms, self.limit, mode=self.mode), self.settings)

    def flush(self, at: float) -> None:
        reduce(self.h, CacheFlushRequested(at, "oom"), self.settings)

    def step(self, now: float) -> ladder.Change | None:
        change = ladder.decide(self.settings, self.h, now)
        if change is not None:
            reduce(self.h, AdmissionRequested(change), self.settings)
            reduce(self.h, AdmissionAnswered(now, change, ok=True), self.settings)
            self.limit = change.limit
            self.changes.append((now, change.action, change.limit))
            self.sample(now + 0.01)  # the server confirms
        return change


def test_ooms_despite_a_flush_halve_the_limit_and_a_flush_alone_does_not() -> None:
    t = Trace(16)
    t.sample(1, new_ooms=1)
    assert t.step(1.1) is None  # no flush tried yet: the cache rule flushes first
    t.flush(1.2)
    t.sample(2, new_ooms=1)
    change = t.step(2.1)
    assert change is not None and (change.action, change.limit) == (ladder.SHRINK, 8)
    assert change.detail["ooms"] == 2 and change.detail["from"] == 16
    # OOMs from before the change do not count against the new limit.
    assert t.step(3.0) is None
    t.sample(4, new_ooms=2)
    change = t.step(4.1)
    assert change is not None and (change.action, change.limit) == (ladder.SHRINK, 4)
    assert [c[1:] for c in t.changes] == [(ladder.SHRINK, 8), (ladder.SHRINK, 4)]


def test_below_the_threshold_nothing_changes() -> None:
    t = Trace(16)
    t.flush(0.5)
    t.sample(1, new_ooms=1)
    t.sample(100, new_ooms=1)  # the second comes outside the 60 s window
    assert t.step(100.5) is None and t.h.ladder is not None and t.h.ladder.limit == 16


def test_a_flush_that_cures_leaves_the_limit_alone() -> None:
    t = Trace(16)
    t.sample(1, new_ooms=1)
    t.flush(1.1)
    for at in range(2, 300, 5):
        t.sample(at)
        assert t.step(at + 0.1) is None
    assert t.changes == []


def test_settles_then_grows_one_step_per_quiet_wait_to_the_ceiling() -> None:
    t = Trace(6)
    t.flush(0.5)
    t.sample(1, new_ooms=2)
    t.step(1.1)
    assert t.limit == 3
    now = 1.1
    for _ in range(3):
        now += 300.0
        t.sample(now - 1)
        assert t.step(now) is not None
    assert t.limit == 6 and t.changes[-1][1] == ladder.GROW
    now += 301
    t.sample(now - 1)
    assert t.step(now) is None  # at the ceiling


def test_a_failed_probe_returns_to_what_held_and_doubles_the_wait() -> None:
    t = Trace(8)
    t.flush(0.5)
    t.sample(1, new_ooms=2)
    t.step(1.1)  # 8 -> 4
    t.sample(301.5)
    t.step(302.0)  # probe 4 -> 5
    assert (t.limit, t.h.ladder.probing) == (5, True)  # type: ignore[union-attr]
    t.flush(303)
    t.sample(304, new_ooms=2)
    change = t.step(304.1)
    assert change is not None and (change.action, change.limit) == (ladder.SHRINK, 4)  # not a halving
    assert t.h.ladder.wait == 600.0  # type: ignore[union-attr]
    t.sample(304.1 + 599)
    assert t.step(304.1 + 599.5) is None  # the next probe waits twice as long
    t.sample(304.1 + 600.5)
    assert t.step(304.1 + 601) is not None and t.limit == 5
    # Each failure doubles the wait, up to max_wait; a card that stays too small pays one OOM per probe.
    waits = []
    now = 304.1 + 601
    for _ in range(6):
        t.flush(now + 1)
        t.sample(now + 2, new_ooms=2)
        t.step(now + 2.1)
        waits.append(t.h.ladder.wait)  # type: ignore[union-attr]
        now = now + 2.1 + t.h.ladder.wait + 1  # type: ignore[union-attr]
        t.sample(now - 0.5)
        t.step(now)
    assert waits == [1200.0, 2400.0, 3600.0, 3600.0, 3600.0, 3600.0]


def test_a_probe_that_holds_resets_the_wait() -> None:
    t = Trace(8)
    t.h.ladder = replace(t.h.ladder, limit=4, last_good=4, wait=1200.0, changed_at=0.0)  # type: ignore[arg-type]
    t.limit = 4
    t.sample(1)
    t.sample(1200.5)
    t.step(1201)  # probe 4 -> 5 after the long wait
    t.sample(1201 + 1200)
    t.step(1201 + 1201)  # 5 held: 5 -> 6, and the wait is back to recover_after
    assert t.limit == 6 and t.h.ladder.wait == 300.0 and t.h.ladder.last_good == 5  # type: ignore[union-attr]


def test_an_operators_change_is_the_new_ceiling() -> None:
    t = Trace(16)
    t.flush(0.5)
    t.sample(1, new_ooms=2)
    t.step(1.1)  # 16 -> 8
    t.limit = 10  # an operator sets 10 through the control API
    t.sample(5)
    assert t.h.ladder is not None and (t.h.ladder.ceiling, t.h.ladder.limit) == (10, 10)
    t.sample(400)
    assert t.step(401) is None  # already at the (new) ceiling


def test_bytes_mode_grows_by_an_eighth_of_the_ceiling() -> None:
    t = Trace(40, mode="bytes")
    t.flush(0.5)
    t.sample(1, new_ooms=2)
    t.step(1.1)
    assert t.limit == 20
    t.sample(301.5)
    t.step(302)
    assert t.limit == 25


def test_a_new_process_starts_from_its_own_limit() -> None:
    t = Trace(16)
    t.flush(0.5)
    t.sample(1, new_ooms=2)
    t.step(1.1)
    reduce(t.h, mem(10, 0, 16, instance="i2"), S)
    assert t.h.ladder is not None and (t.h.ladder.instance_id, t.h.ladder.limit, t.h.ladder.ceiling) == ("i2", 16, 16)


def test_disabled_and_min_limit() -> None:
    off = Trace(16, replace(S, enabled=False))
    off.flush(0.5)
    off.sample(1, new_ooms=5)
    assert off.step(1.1) is None
    floor = Trace(1)
    floor.flush(0.5)
    floor.sample(1, new_ooms=5)
    assert floor.step(1.1) is None


def test_the_policy_shrinks_beside_the_flush_and_never_restarts_for_it() -> None:
    s = Settings().policy
    h = History(started_at=0.0, epoch=0.0, served_at=0.0)
    for at, ooms in ((0, 0), (5, 1), (10, 3)):
        reduce(h, mem(at, ooms, 16), s.admission)
    h.actions.append(ActionRecord(6, "empty_cache", "oom"))
    ds = decide(s, h, 10.5)
    assert [(d.action, d.reason, d.detail["limit"]) for d in ds] == [("shrink_admission", "oom", 8)]
    assert not any(d.action == "restart" for d in ds)
