"""The simulation's sidecars decide with the real policy on what they folded: a hang is a restart
only after `policy.hang.consecutive_timeouts` canary timeouts, and not before."""

from __future__ import annotations

import dataclasses

import pytest

from gpu_watchdog.watchdog.core.settings import HangSettings, PolicySettings
from tests.sim.world import CANARY_S, Knobs, World


def steps_until_restart_begins(timeouts: int) -> int:
    w = World(Knobs(replicas=4, max_unavailable="1"), seed=0,
              policy_settings=dataclasses.replace(PolicySettings(), hang=HangSettings(consecutive_timeouts=timeouts)))
    pod = w.alive()[0]
    car = w.sidecars[pod.name]
    w.hang(pod)
    for tick in range(1, 30):
        w.tick()
        for _ in range(3):
            w.sidecar_step(pod.name)
        if car.proc is not None or car.slot or not pod.alive:
            return tick
    raise AssertionError("the hung pod's restart never began")


@pytest.mark.parametrize("timeouts", [2, 3, 6])
def test_a_hang_is_restarted_after_the_policys_consecutive_timeouts(timeouts: int) -> None:
    assert steps_until_restart_begins(timeouts) == round(timeouts * CANARY_S)


def test_a_server_that_serves_again_is_never_restarted() -> None:
    w = World(Knobs(replicas=4, max_unavailable="1"), seed=0)
    pod = w.alive()[0]
    w.hang(pod)
    w.tick()
    w.tick()
    pod.server.hung_since = None  # it came back by itself before the third timeout
    for _ in range(20):
        w.tick()
        for name in list(w.sidecars):
            w.sidecar_step(name)
    assert pod.alive and w.sidecars[pod.name].proc is None and not w.restart_events()
