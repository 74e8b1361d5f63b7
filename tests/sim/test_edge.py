"""The sidecar's Kubernetes clients, as the simulation runs them, against the simulated API server:
what a flaky API costs them, and the API server's clock they learn."""

from __future__ import annotations

import pytest

from gpu_watchdog.watchdog.core import quarantine
from gpu_watchdog.watchdog.core.timing import API_TRIES
from gpu_watchdog.watchdog.edge.effects.fleet import LeaseLedger, LedgerUnavailable
from tests.sim.api import NS, WORKLOAD, SimApi, api_error
from tests.sim.world import LEASE, Knobs, World


def ledger_of(w: World, faults: list[str | None], seen: list[tuple[str, str]], skew: float = 0.0) -> LeaseLedger:
    """A client of the Lease whose requests meet `faults` in turn (then none), each logged in `seen`."""
    def fault(caller: str, method: str, path: str) -> str | None:
        seen.append((method, path))
        return faults.pop(0) if faults else None

    w.cluster.faults = fault
    api = SimApi(w.cluster, "p1", lambda: w.now + skew)
    return LeaseLedger(api, NS, LEASE, WORKLOAD, "p1", 5.0, wall_clock=api.now, sleep=lambda s: None)


def test_a_read_the_api_refused_is_tried_again_within_the_call() -> None:
    w, seen = World(Knobs()), []
    ledger = ledger_of(w, ["refused", "refused"], seen)
    assert ledger.read_records() == quarantine.Records()
    assert [m for m, _ in seen] == ["GET"] * 3


def test_a_read_refused_every_time_is_unavailable_after_its_tries() -> None:
    w, seen = World(Knobs()), []
    ledger = ledger_of(w, ["refused"] * API_TRIES, seen)
    with pytest.raises(LedgerUnavailable, match="500"):
        ledger.read_records()
    assert len(seen) == API_TRIES


def test_a_refusal_the_server_means_is_not_tried_again() -> None:
    w, seen = World(Knobs()), []
    ledger = ledger_of(w, [], seen)

    def forbidden(*_: object) -> dict[str, object]:
        seen.append(("GET", "forbidden"))
        raise api_error(403, "Forbidden", 'leases.coordination.k8s.io "x" is forbidden')

    w.cluster.answer = forbidden  # type: ignore[method-assign]
    with pytest.raises(LedgerUnavailable, match="403"):
        ledger.read_records()
    assert seen == [("GET", "forbidden")]


def test_a_write_refused_is_decided_again_and_written_and_one_whose_answer_was_lost_is_not_written_twice() -> None:
    w, seen = World(Knobs()), []
    failure = quarantine.Failure(w.now, "p1", "p1-1", "hang", ("fp",), "fp")

    def add(records: quarantine.Records, now: float) -> tuple[quarantine.Records, int]:
        out, _ = quarantine.record(w.q_settings, records, failure, now)
        return out, len(out.failures)

    ledger = ledger_of(w, [None, "refused"], seen)  # the read answered, the write refused once
    assert ledger.update_records(add) == 1
    assert [m for m, _ in seen] == ["GET", "POST", "GET", "POST"] and len(w.records().failures) == 1
    seen.clear()
    ledger = ledger_of(w, [None, "lost"], seen)  # written, its answer lost: said unavailable, done once
    second = quarantine.Failure(w.now, "p2", "p2-1", "hang", ("fp",), "fp")
    with pytest.raises(LedgerUnavailable):
        ledger.update_records(lambda r, now: (quarantine.record(w.q_settings, r, second, now)[0], None))
    assert [(f.pod) for f in w.records().failures] == ["p1", "p2"]


def test_a_client_on_a_node_a_minute_slow_stamps_by_the_servers_clock_once_it_answered() -> None:
    w, seen = World(Knobs()), []
    ledger = ledger_of(w, [], seen, skew=-60.0)
    assert abs(ledger.wall_clock() - (w.now - 60)) < 1e-9
    ledger.read_records()
    assert abs(ledger.wall_clock() - w.now) <= 1.0
