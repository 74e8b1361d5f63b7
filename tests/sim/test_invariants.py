"""The fleet's invariants over seeded runs of the simulated workload (see `tests/sim/world.py`):
fixed seeds (derandomized, so CI explores the same runs every time), each run checked after every
move; a failing run prints its shrunk moves."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, settings

from tests.sim.machine import machine
from tests.sim.world import Knobs

# Seeded runs of each fleet, 60 moves each, within CI's 3 minutes; each run's settling (30 simulated
# seconds at least, every sidecar stepping 3 times a second) is most of its cost. The benchmark
# (`gpu_watchdog.benchmarks.fleet_sim`) runs thousands more.
RUNS = 40
SLOW = 32  # the fleet of 8, whose moves cost twice as much, and the API that refuses 10 % (its retries)
PLACING = 30  # keep-out on: each run settles until its taints' expiry has passed (twice the cost)
HOSTILE = 22  # the API that refuses, loses answers and races, clocks a minute off, keep-out on


def runs(n: int) -> settings:
    return settings(max_examples=n, stateful_step_count=60, derandomize=True, deadline=None,
                    suppress_health_check=list(HealthCheck))


FLEETS: list[tuple[Knobs, int]] = [
    # Keep-out on (node taints of device-plugin GPUs), another workload's sidecars on our nodes keeping
    # their own cards out: cards failing by the batch, the bound and the lifts judged (I9).
    (Knobs(replicas=4, max_unavailable="1", decoys=0, placement=True, neighbour=True), PLACING),
    # The chart's default rung: the container restarted in place by its liveness probe on our verdict,
    # the pod evicted once in place did not cure.
    (Knobs(replicas=6, max_unavailable="2", decoys=4, strategy="container"), RUNS),
    (Knobs(replicas=5, max_unavailable="1", decoys=8, api_error_rate=0.1), SLOW),
    # Readiness probed as Kubernetes defaults it (3 failures, 10 s apart): a Deployment written by hand.
    (Knobs(replicas=4, max_unavailable="1", decoys=2, popular_every_tick=False, probes=(3, 10)), RUNS),
    # A rollout surging by 2 with 2 unavailable, evictions answered by a PodDisruptionBudget.
    (Knobs(replicas=8, max_unavailable="1", surge=2, rollout_unavailable=2, pdb=True), SLOW),
    # The API refusing, losing answers and racing writes, pods deleted (not evicted), clocks a minute off,
    # keep-out and the other workload on.
    (Knobs(replicas=6, max_unavailable="2", decoys=4, api_error_rate=0.05, lost_rate=0.05, race_rate=0.2, skew_s=60,
           strategy="delete", placement=True, neighbour=True), HOSTILE),
]


def name(k: Knobs) -> str:
    extra = [f"{label}{value}" for label, value in (("lost", k.lost_rate), ("race", k.race_rate), ("skew", k.skew_s),
                                                     ("surge", k.surge if k.surge != 1 else 0)) if value]
    return "-".join([f"{k.replicas}x", f"mu{k.max_unavailable}", f"d{k.decoys}", f"err{k.api_error_rate}", *extra,
                     *(["pdb"] if k.pdb else []), *(["placement"] if k.placement else []),
                     *(["neighbour"] if k.neighbour else []),
                     *([f"probes{k.probes[0]}x{k.probes[1]}s"] if k.probes else []),
                     *([] if k.strategy == "evict" else [k.strategy]),
                     *([] if k.popular_every_tick else ["popular-once"])])


@pytest.mark.parametrize(("knobs", "n"), FLEETS, ids=[name(k) for k, _ in FLEETS])
def test_the_invariants_hold_over_seeded_runs(knobs: Knobs, n: int) -> None:
    from hypothesis.stateful import run_state_machine_as_test
    run_state_machine_as_test(machine(knobs), settings=runs(n))
