from __future__ import annotations

import threading
import time

import pytest

from gpu_watchdog.inference.admission import AdmissionGate


def _hammer(gate: AdmissionGate, weights: list[float], hold_s: float) -> tuple[float, int]:
    """Run one thread per weight through the gate; return the most weight and threads seen inside at once."""
    lock = threading.Lock()
    inside = {"weight": 0.0, "threads": 0}
    peak = {"weight": 0.0, "threads": 0}

    def worker(w: float) -> None:
        grant = gate.acquire(w, timeout=30)
        assert grant is not None
        try:
            with lock:
                inside["weight"] += grant.amount
                inside["threads"] += 1
                peak["weight"] = max(peak["weight"], inside["weight"])
                peak["threads"] = max(peak["threads"], inside["threads"])
            time.sleep(hold_s)
            with lock:
                inside["weight"] -= grant.amount
                inside["threads"] -= 1
        finally:
            gate.release(grant)

    threads = [threading.Thread(target=worker, args=(w,)) for w in weights]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return peak["weight"], peak["threads"]


def test_slots_bound_threads_not_coroutines() -> None:
    gate = AdmissionGate(2)
    weight, threads = _hammer(gate, [1.0] * 16, 0.02)
    assert threads == 2 and weight == 2
    assert gate.stats().holders == 0 and gate.stats().peak_holders == 2


def test_weighted_admission_lets_light_requests_share() -> None:
    gate = AdmissionGate(10)
    weight, threads = _hammer(gate, [1.0] * 10 + [5.0] * 4, 0.02)
    assert weight <= 10
    assert threads >= 3  # light requests run several at a time


def test_request_heavier_than_the_budget_runs_alone() -> None:
    gate = AdmissionGate(4)
    heavy = gate.acquire(100, timeout=1)
    assert heavy is not None and heavy.amount == 4
    assert gate.acquire(1, timeout=0.05) is None
    gate.release(heavy)
    assert gate.acquire(1, timeout=0.05) is not None


def test_timeout_and_release_errors() -> None:
    gate = AdmissionGate(1)
    grant = gate.acquire(1, timeout=1)
    assert grant is not None
    assert gate.acquire(1, timeout=0.05) is None
    gate.release(grant)
    with pytest.raises(RuntimeError):
        gate.release(grant)


def test_a_waiter_still_gets_in_after_the_limit_shrinks_below_its_weight() -> None:
    """The watchdog lowers the limit on OOMs while batches wait: none may wait forever."""
    gate = AdmissionGate(8)
    holder = gate.acquire(8, timeout=1)
    assert holder is not None
    got: list[object] = []
    waiter = threading.Thread(target=lambda: got.append(gate.acquire(8, timeout=5)))
    waiter.start()
    time.sleep(0.05)
    gate.set_capacity(4)
    gate.release(holder)
    waiter.join(timeout=5)
    [grant] = got
    assert grant is not None and grant.amount == 4  # alone, under the budget in force now


def test_release_gives_back_what_was_taken_when_the_limit_changed_meanwhile() -> None:
    gate = AdmissionGate(16)
    grants = [gate.acquire(4, timeout=1) for _ in range(2)]
    gate.set_capacity(2)  # shrunk while both hold 4
    for g in grants:
        assert g is not None
        gate.release(g)
    assert gate.stats().in_use == 0 and gate.stats().holders == 0
    gate.set_capacity(16)
    assert [gate.acquire(4, timeout=0.05) is not None for _ in range(4)] == [True] * 4


def test_capacity_change_wakes_waiters() -> None:
    gate = AdmissionGate(1)
    assert gate.acquire(1, timeout=1) is not None
    got: list[bool] = []
    t = threading.Thread(target=lambda: got.append(gate.acquire(1, timeout=5) is not None))
    t.start()
    time.sleep(0.05)
    gate.set_capacity(2)
    t.join()
    assert got == [True]


def test_canary_slot_is_separate_from_traffic() -> None:
    gate = AdmissionGate(1)
    grant = gate.acquire(1, timeout=1)
    assert grant is not None
    assert gate.acquire_canary(timeout=0.1)
    assert not gate.acquire_canary(timeout=0.05)
    gate.release_canary()
    gate.release(grant)
