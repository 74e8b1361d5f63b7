"""A drain ends: at its deadline by itself, at once when lifted; the shutdown's drain never does."""

from __future__ import annotations

from gpu_watchdog.inference.drain import Drain


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_a_control_drain_ends_by_itself_at_its_deadline() -> None:
    clock = Clock()
    drain = Drain(clock)
    assert not drain.active and drain.left_s() is None
    drain.begin(10.0)
    clock.now += 4.0
    assert drain.active and drain.left_s() == 6.0
    assert not drain.lapse()  # not yet
    clock.now += 6.0
    # Over by the clock even before anyone lapses it.
    assert not drain.active and drain.left_s() is None
    assert drain.lapse() and not drain.lapse()


def test_a_second_drain_renews_the_deadline_and_a_lift_ends_it_at_once() -> None:
    clock = Clock()
    drain = Drain(clock)
    drain.begin(10.0)
    clock.now += 8.0
    drain.begin(10.0)
    clock.now += 5.0
    assert drain.active and drain.left_s() == 5.0
    assert drain.lift() and not drain.active
    assert not drain.lift()  # idempotent: nothing left to lift


def test_the_shutdown_drain_outlives_deadlines_and_lifts() -> None:
    clock = Clock()
    drain = Drain(clock)
    drain.begin(1.0)
    drain.begin_shutdown()
    clock.now += 100.0
    drain.lapse()
    drain.lift()
    assert drain.active and drain.shutdown and drain.left_s() is None
