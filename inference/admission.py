"""The admission gate: a thread-safe, memory-weighted budget, held by every sequence in the GPU.

The decode loop takes a share (`try_acquire`) when a sequence joins the batch and gives it back
the moment the sequence leaves; the control API can lower or raise the budget at any time
(`set_capacity`) from another thread, which is why the gate is a `threading.Condition`, not an
asyncio primitive. Each sequence weighs its predicted peak memory; in slot mode one slot. The
canary has a slot of its own: a busy but healthy server must not look hung to the watchdog.
"""

from __future__ import annotations

import threading
from collections import deque
from dataclasses import dataclass


@dataclass(frozen=True)
class GateStats:
    capacity: float
    in_use: float
    holders: int
    waiting: int
    peak_holders: int
    canary_busy: bool


@dataclass(frozen=True)
class Grant:
    """What one holder took from the gate: its weight, clamped to the budget when it got in."""

    amount: float


class AdmissionGate:
    def __init__(self, capacity: float) -> None:
        if capacity <= 0:
            raise ValueError("admission capacity must be positive")
        self._capacity = float(capacity)
        self._in_use = 0.0
        self._holders = 0
        self._peak_holders = 0
        self._queue: deque[object] = deque()
        self._cond = threading.Condition()
        self._canary = threading.BoundedSemaphore(1)
        self._canary_busy = False

    @property
    def capacity(self) -> float:
        return self._capacity

    def acquire(self, weight: float, timeout: float | None) -> Grant | None:
        """Block the calling thread until `weight` fits; None when `timeout` seconds pass first.

        A request heavier than the whole budget still runs, alone. "The whole budget" is the one
        in force when the request gets its turn: the limit can shrink while it waits (the watchdog
        lowers it on OOMs), and a weight clamped to the old budget would never fit the new one.
        """
        weight = max(weight, 0.0)
        ticket = object()
        with self._cond:
            self._queue.append(ticket)
            try:
                ok = self._cond.wait_for(
                    lambda: self._queue[0] is ticket and self._in_use + min(weight, self._capacity)
                    <= self._capacity + 1e-9,
                    timeout=timeout,
                )
            finally:
                self._queue.remove(ticket)
                self._cond.notify_all()
            if not ok:
                return None
            grant = Grant(min(weight, self._capacity))
            self._in_use += grant.amount
            self._holders += 1
            self._peak_holders = max(self._peak_holders, self._holders)
            return grant

    def try_acquire(self, weight: float) -> Grant | None:
        """Take `weight` now if it fits and nobody waits ahead; never blocks (the decode loop's way in)."""
        weight = max(weight, 0.0)
        with self._cond:
            amount = min(weight, self._capacity)
            if self._queue or self._in_use + amount > self._capacity + 1e-9:
                return None
            grant = Grant(amount)
            self._in_use += amount
            self._holders += 1
            self._peak_holders = max(self._peak_holders, self._holders)
            return grant

    def release(self, grant: Grant) -> None:
        """Give back exactly what was taken, whatever the budget is now."""
        with self._cond:
            if self._holders <= 0:
                raise RuntimeError("admission gate released more often than acquired")
            self._in_use = max(0.0, self._in_use - grant.amount)
            self._holders -= 1
            self._cond.notify_all()

    def set_capacity(self, capacity: float) -> None:
        if capacity <= 0:
            raise ValueError("admission capacity must be positive")
        with self._cond:
            self._capacity = float(capacity)
            self._cond.notify_all()

    def acquire_canary(self, timeout: float | None) -> bool:
        ok = self._canary.acquire(timeout=timeout) if timeout is not None else self._canary.acquire()
        if ok:
            self._canary_busy = True
        return ok

    def release_canary(self) -> None:
        self._canary_busy = False
        self._canary.release()

    def stats(self) -> GateStats:
        with self._cond:
            return GateStats(
                capacity=self._capacity,
                in_use=self._in_use,
                holders=self._holders,
                waiting=len(self._queue),
                peak_holders=self._peak_holders,
                canary_busy=self._canary_busy,
            )
