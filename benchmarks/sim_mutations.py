"""Whether the simulation catches a broken rule: each mutation breaks one production function the
simulated sidecars run (a slot never given back, any pod taken for a replacement, a budget never
spent, ties never taken, lifts ignored, answered requests never cleared, the unavailable count
zeroed, the pod evicted before its restart Event is written, keep-out's cap off, a node taint never
lifted, another workload's entry taken with ours), the seeded runs go again, then the
regression traces (`tests/sim/test_regressions.py`, each a run that once broke an invariant), and
the first invariant that broke is named with what broke it. A mutation nothing
catches is a hole in the simulation or its invariants, printed as such (`survived`); one the
simulation cannot reach at all (it performs that part itself) says so (`not reached`).

    python -m gpu_watchdog.benchmarks.sim_mutations [--runs N] [--steps N] [--only NAME ...]

Run from the repository's root (it imports the simulation from tests/). Prints one JSON object:
per mutation, `caught` with the invariant's message and `by` (the seeds, or the regression trace),
`survived`, or `not reached` with why; and the
unmutated baseline, which must hold. Exits non-zero when the baseline breaks.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import logging
import re
import sys
import time
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager, redirect_stdout
from pathlib import Path
from typing import Any
from unittest import mock

import pytest
import structlog
from hypothesis import HealthCheck, Phase, settings
from hypothesis.stateful import run_state_machine_as_test

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from gpu_watchdog.watchdog.core import fleet, placement, policy, quarantine
from gpu_watchdog.watchdog.core.policy import Decision
from gpu_watchdog.watchdog.edge.effects.restart import DrainHandle, KubeRestarter, RestartOutcome
from tests.sim.machine import machine
from tests.sim.world import Knobs

CONFIGS = (Knobs(replicas=4, max_unavailable="1", decoys=0),
           Knobs(replicas=6, max_unavailable="2", decoys=4, strategy="container"),
           Knobs(replicas=4, max_unavailable="1", decoys=2, popular_every_tick=False),
           Knobs(replicas=6, max_unavailable="2", decoys=4, api_error_rate=0.05, lost_rate=0.05, race_rate=0.2,
                 skew_s=60, strategy="delete"),
           Knobs(replicas=4, max_unavailable="1", placement=True, neighbour=True),
           # The admission limit: the killer with 61 decoys in one step of `serve`'s CPU default of 64.
           Knobs(replicas=4, max_unavailable="1", decoys=61))


def _give_back_drops_every_slot(ledger: fleet.Ledger, pod: str, restarted: bool) -> fleet.Ledger:
    return dataclasses.replace(ledger, slots=())


def _replaced_takes_any_pod(ledger: fleet.Ledger, pod: str, started_at: float, **_: Any
                            ) -> tuple[fleet.Ledger, fleet.Slot | None]:
    slots = [s for s in ledger.slots if s.pod != pod]
    if not slots:
        return ledger, None
    slot = slots[-1]
    restarts = tuple(dataclasses.replace(r, returned_as=pod) if r.pod == slot.pod and r.at == slot.at else r
                     for r in ledger.restarts)
    return dataclasses.replace(ledger, slots=tuple(s for s in ledger.slots if s is not slot), restarts=restarts), slot


def _nothing_out(census: fleet.Census, ledger: fleet.Ledger, pod: str) -> tuple[int, dict[str, Any]]:
    return 0, {}


async def _evict_then_record(self: KubeRestarter, decision: Decision, drain: DrainHandle) -> RestartOutcome:
    """The act first, its Event after: what I2 forbids."""
    await asyncio.to_thread(self._act, None, False)
    await self.record_event(decision, "Evict")
    return RestartOutcome(True, f"{self.strategy} accepted", recorded=True)


def _whole_taint_lifted(taints: list[dict[str, Any]], owner: str, now: float, card: str | None = None,
                        force: bool = False) -> list[dict[str, Any]] | None:
    """A node's taint holding our expired entry lifted whole: another workload's entry in force goes too."""
    kept = [t for t in taints if not (t.get("key") == placement.NODE_TAINT_KEY and (
        (entries := placement.node_entries(t.get("value"))) and owner in entries and (entries[owner] <= now or force)))]
    return kept if len(kept) != len(taints) else None


def _lift_ignored(records: quarantine.Records, fingerprint: str, now: float) -> tuple[quarantine.Records, bool]:
    return records, True


# name -> the patches (module, attribute, replacement); or the reason the simulation cannot reach it.
MUTATIONS: dict[str, list[tuple[Any, str, Any]] | str] = {
    "give_back drops every slot": [(fleet, "give_back", _give_back_drops_every_slot)],
    "replaced takes any pod": [(fleet, "replaced", _replaced_takes_any_pod)],
    "out_after counts nothing out": [(fleet, "out_after", _nothing_out)],
    "the budget is never spent": [(policy, "budget_remaining", lambda *a, **k: 99)],
    "ties are never taken": [(quarantine, "MAX_TIED", 1), (quarantine, "MAX_TOGETHER", 1)],
    "lifts are ignored": [(quarantine, "lift_records", _lift_ignored)],
    "the cleared set is dropped": [(quarantine, "cleared_in", lambda *a, **k: set())],
    "evicting before the Event": [(KubeRestarter, "restart", _evict_then_record)],
    "placement's cap off": [(placement, "cap", lambda settings, scope: 64)],
    "a node taint never lifted": [(placement, "without_node_taint", lambda *a, **k: None)],
    "another workload's entry lifted with ours": [(placement, "without_node_taint", _whole_taint_lifted)],
}


@contextmanager
def patched(patches: list[tuple[Any, str, Any]]) -> Iterator[None]:
    with ExitStack() as stack:
        for module, attr, value in patches:
            stack.enter_context(mock.patch.object(module, attr, value))
        yield


def run_seeds(runs: int, steps: int) -> str | None:
    """The first invariant broken over the configs' seeded runs (its message), or None."""
    for knobs in CONFIGS:
        try:
            run_state_machine_as_test(machine(knobs), settings=settings(
                max_examples=runs, stateful_step_count=steps, deadline=None, database=None, derandomize=True,
                phases=(Phase.explicit, Phase.generate), suppress_health_check=list(HealthCheck)))
        except Exception as exc:  # an invariant's Broken, or the rules' own assertion
            text = str(exc)
            found = re.search(r"I\d+:[^\n]*", text)
            return (found.group(0) if found else f"{type(exc).__name__}: {text.splitlines()[0] if text else ''}")[:300]
    return None


REGRESSIONS = Path(__file__).resolve().parents[1] / "tests" / "sim" / "test_regressions.py"


class _FirstFailure:
    """A pytest plugin: the first test that failed, and the invariant's message (or its error)."""

    def __init__(self) -> None:
        self.broke: str | None = None

    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        if report.failed and self.broke is None:
            # The error's own lines ("E   ..."), not the source the traceback quotes.
            errors = [line[1:].strip() for line in str(report.longrepr).splitlines() if line.startswith("E ")]
            found = next((m.group(0) for line in errors if (m := re.search(r"I\d+:.*", line))), None)
            self.broke = f"{report.nodeid.split('::')[-1]}: {found or (errors[0] if errors else '?')}"[:300]


def run_regressions() -> str | None:
    """The first regression trace broken (its name and the invariant's message), or None."""
    catch = _FirstFailure()
    with redirect_stdout(sys.stderr):  # stdout carries the JSON alone
        pytest.main(["-q", "-x", "-p", "no:cacheprovider", str(REGRESSIONS)], plugins=[catch])
    quiet()  # the tests' configuration of the logs is theirs: the seeds that follow log nothing again
    return catch.broke


def quiet() -> None:
    """The simulated sidecars log each decision by the thousand: the figures are the output here."""
    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(logging.CRITICAL))


def first_broken(runs: int, steps: int) -> str | None:
    """What catches the rules as they are now: the seeds first, then the regression traces."""
    broke = run_seeds(runs, steps)
    if broke is not None:
        return f"{broke} (by the seeds)"
    broke = run_regressions()
    return None if broke is None else f"{broke} (by the regression trace)"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="sim_mutations", description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=80, help="seeded runs per config (default 80)")
    parser.add_argument("--steps", type=int, default=60, help="moves per run (default 60)")
    parser.add_argument("--only", nargs="*", default=None, metavar="NAME", help="these mutations only")
    args = parser.parse_args(argv)
    unknown = [n for n in args.only or () if n not in MUTATIONS]
    if unknown:
        parser.error(f"--only: no mutation named {unknown[0]!r}; one of: {', '.join(MUTATIONS)}")
    quiet()
    started = time.perf_counter()
    out: dict[str, Any] = {"runs": args.runs, "steps": args.steps, "configs": len(CONFIGS)}
    baseline = first_broken(args.runs, args.steps)
    out["baseline"] = "holds" if baseline is None else f"broke: {baseline}"
    results: dict[str, str] = {}
    for name, how in MUTATIONS.items():
        if args.only is not None and name not in args.only:
            continue
        if isinstance(how, str):
            results[name] = f"not reached: {how}"
            continue
        with patched(how):
            broke = first_broken(args.runs, args.steps)
        results[name] = "survived" if broke is None else f"caught: {broke}"
    out["mutations"] = results
    out["caught"] = sum(1 for v in results.values() if v.startswith("caught"))
    out["seconds"] = round(time.perf_counter() - started, 1)
    print(json.dumps(out, indent=2))
    return 0 if baseline is None else 1

if __name__ == "__main__":
    raise SystemExit(main())
