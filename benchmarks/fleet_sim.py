"""The fleet's simulation at length: many more runs than CI's fixed seeds, each checked after every
move against the invariants (`tests/sim/invariants.py`), and the figures: runs (seeds) explored,
simulated seconds (one a tick) and how many a second of real time, the sidecars' steps and how many a
second, the restarts the budget blocked, the node drains, Leases lost, API errors, answers lost and
raced writes the runs went through, and
F (the killer's failures in the records when it was refused) at 0, 4 and 8 decoys and at the bundled
server's admission limit on a CPU (64 in one step: the killer, 61 decoys, the popular request and a
one-off), the killer sending another sampler or spelling at each try, and how often the popular
request (answered all along) was refused; with keep-out on, the node taint writes and the
restarts whose taint the bound refused.

    python -m gpu_watchdog.benchmarks.fleet_sim [--runs N] [--steps N] [--seed S]

Run from the repository's root (it imports the simulation from tests/). Exits non-zero when an
invariant broke, after printing the shrunk moves that broke it.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import sys
import time
from collections import Counter
from pathlib import Path
from typing import Any

import structlog
from hypothesis import HealthCheck, settings
from hypothesis.stateful import run_state_machine_as_test

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from gpu_watchdog.inference.settings import ServeSettings
from tests.sim.machine import machine
from tests.sim.world import Knobs

CONFIGS = (Knobs(replicas=4, max_unavailable="1", decoys=0),
           Knobs(replicas=6, max_unavailable="2", decoys=4, strategy="container"),
           Knobs(replicas=5, max_unavailable="1", decoys=8), Knobs(replicas=8, max_unavailable="2", decoys=8,
                                                                   api_error_rate=0.1),
           Knobs(replicas=4, max_unavailable="1", decoys=2, popular_every_tick=False),
           # A rollout surging by 2 with 2 unavailable, evictions answered by a PodDisruptionBudget.
           Knobs(replicas=8, max_unavailable="1", surge=2, rollout_unavailable=2, pdb=True),
           # The API refusing, losing answers and racing writes; clocks up to a minute off.
           Knobs(replicas=6, max_unavailable="2", decoys=4, api_error_rate=0.05, lost_rate=0.05, race_rate=0.2,
                 skew_s=60, strategy="delete"),
           # Keep-out on, another workload keeping its own cards out of our nodes; then with the API hostile.
           Knobs(replicas=4, max_unavailable="1", placement=True, neighbour=True),
           Knobs(replicas=6, max_unavailable="2", decoys=4, api_error_rate=0.05, lost_rate=0.05, race_rate=0.2,
                 skew_s=60, strategy="delete", placement=True, neighbour=True),
           # The admission limit: `serve`'s default concurrency on a CPU (`cpu_default_concurrency`).
           Knobs(replicas=4, max_unavailable="1", decoys=ServeSettings().cpu_default_concurrency - 3))


def explore(knobs: Knobs, runs: int, steps: int, seed: int) -> dict[str, Any]:
    figures: dict[str, Any] = {"runs": 0, "ticks": 0, "sidecar_steps": 0, "evictions": 0, "budget_blocks": 0,
                               "killer_failures": 0, "races": 0, "lost_answers": 0, "api_errors": 0, "drains": 0,
                               "leases_lost": 0, "killer_tries_refused": 0,
                               "popular_refused": 0, "node_taint_writes": 0, "taints_capped": 0, "F": Counter()}
    base = machine(knobs)

    class Counted(base):  # type: ignore[misc, valid-type]
        def teardown(self) -> None:
            super().teardown()
            w = self.world
            figures["runs"] += 1
            figures["ticks"] += w.steps
            figures["sidecar_steps"] += w.sidecar_steps
            figures["evictions"] += sum(1 for r in w.removals if r.by_us)
            figures["budget_blocks"] += w.budget_blocks
            figures["killer_failures"] += w.killer_failures
            figures["races"] += w.races
            figures["lost_answers"] += w.lost_answers
            figures["api_errors"] += w.api_errors
            figures["drains"] += w.drains
            figures["leases_lost"] += w.leases_lost
            figures["killer_tries_refused"] += w.killer_refused
            figures["popular_refused"] += len(w.popular_refused)
            figures["node_taint_writes"] += sum(1 for x in w.cluster.node_writes if x.owner is not None)
            figures["taints_capped"] += w.metrics_capped()
            figures["F"].update(w.killer_f)

    started = time.perf_counter()
    run_state_machine_as_test(Counted, settings=settings(
        max_examples=runs, stateful_step_count=steps, deadline=None, database=None,
        suppress_health_check=list(HealthCheck), derandomize=False))
    elapsed = time.perf_counter() - started
    f = figures.pop("F")
    return {**figures, "seconds": round(elapsed, 1), "simulated_s_per_s": round(figures["ticks"] / elapsed),
            "sidecar_steps_per_s": round(figures["sidecar_steps"] / elapsed),
            "F": {str(k): v for k, v in sorted(f.items())}, "F_max": max(f, default=None)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="fleet_sim", description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=2000, help="runs (seeds) per configuration")
    parser.add_argument("--steps", type=int, default=100, help="moves per run at most")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    # The servers' screens log each refusal and the sidecars each decision, thousands a run: the figures
    # are the output here.
    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(logging.CRITICAL))
    if args.runs < 1 or args.steps < 1:
        parser.error("--runs and --steps must be at least 1")
    failed = False
    for knobs in CONFIGS:
        name = " ".join(f"{k}={v}" for k, v in dataclasses.asdict(knobs).items()
                        if k in ("replicas", "max_unavailable", "decoys") or v != getattr(Knobs(), k))
        try:
            out = explore(knobs, args.runs, args.steps, args.seed)
        except (AssertionError, ExceptionGroup) as exc:
            failed = True
            # Hypothesis adds the shrunk moves to the exception as notes; several distinct failures come
            # as a group, each with its own.
            for one in exc.exceptions if isinstance(exc, ExceptionGroup) else (exc,):
                moves = [line for line in getattr(one, "__notes__", []) if "holds()" not in line]
                print(json.dumps({"config": name, "broken": str(one).splitlines()[0], "moves": moves}), flush=True)
            continue
        print(json.dumps({"config": name, **out}), flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
