from __future__ import annotations

import threading
import time

import pytest

from inference.admission import AdmissionGate


def _hammer(gate: AdmissionGate, weights: list[float], hold_s: float) -> tuple[float, int]:
    """Run one thread per weight through the gate; return the most weight and threads seen inside at once."""
    lock = threading.Lock()
    inside = {"weight": 0.0, "threads": 0}
    peak = {"weight": 0.0, "threads": 0}

    def worker(w: float) -> None:
        assert gate.acquire(w, timeout=30)
        try:
            with lock:
                inside["weight"] += gate.clamp(w)
                inside["threads"] += 1
                peak["weight"] = max(peak["weight"], inside["weight"])
                peak["threads"] = max(peak["threads"], inside["threads"])
            time.sleep(hold_s)
            with lock:
                inside["weight"] -= gate.clamp(w)
                inside["threads"] -= 1
        finally:
            gate.release(w)

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
    assert gate.acquire(100, timeout=1)
    assert not gate.acquire(1, timeout=0.05)
    gate.release(100)
    assert gate.acquire(1, timeout=0.05)


def test_timeout_and_release_errors() -> None:
    gate = AdmissionGate(1)
    assert gate.acquire(1, timeout=1)
    assert gate.acquire(1, timeout=0.05) is False
    gate.release(1)
    with pytest.raises(RuntimeError):
        gate.release(1)


def test_capacity_change_wakes_waiters() -> None:
    gate = AdmissionGate(1)
    assert gate.acquire(1, timeout=1)
    got: list[bool] = []
    t = threading.Thread(target=lambda: got.append(gate.acquire(1, timeout=5)))
    t.start()
    time.sleep(0.05)
    gate.set_capacity(2)
    t.join()
    assert got == [True]


def test_canary_slot_is_separate_from_traffic() -> None:
    gate = AdmissionGate(1)
    assert gate.acquire(1, timeout=1)
    assert gate.acquire_canary(timeout=0.1)
    assert not gate.acquire_canary(timeout=0.05)
    gate.release_canary()
    gate.release(1)
