"""The fleet's invariants over seeded runs of the simulated workload (see `tests/sim/world.py`):
fixed seeds (derandomized, so CI explores the same runs every time), each run checked after every
move; a failing run prints its shrunk moves."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, settings

from tests.sim.machine import machine
from tests.sim.world import Knobs

RUNS = settings(max_examples=300, stateful_step_count=60, derandomize=True, deadline=None,
                suppress_health_check=list(HealthCheck))


@pytest.mark.parametrize("knobs", [
    Knobs(replicas=4, max_unavailable="1", decoys=0),
    Knobs(replicas=6, max_unavailable="2", decoys=4),
    Knobs(replicas=5, max_unavailable="1", decoys=8, api_error_rate=0.1),
    Knobs(replicas=4, max_unavailable="1", decoys=2, popular_every_tick=False),
], ids=lambda k: f"{k.replicas}x-mu{k.max_unavailable}-d{k.decoys}-err{k.api_error_rate}"
                   f"{'' if k.popular_every_tick else '-popular-once'}")
def test_the_invariants_hold_over_seeded_runs(knobs: Knobs) -> None:
    from hypothesis.stateful import run_state_machine_as_test
    run_state_machine_as_test(machine(knobs), settings=RUNS)
