"""The admission gate: a thread-safe, memory-weighted budget, held by every sequence in the GPU.

The decode loop takes a share (`try_acquire`) when a sequence joins the batch and gives it back
the moment the sequence leaves; the control API can lower or raise the budget at any time
(`set_capacity`) from another thread, which is why the gate is a `threading.Condition`, not an
asyncio primitive. Each sequence weighs its predicted peak memory; in slot mode one slot. The
canary has a slot of its own: a busy but healthy server must not look hung to the watchdog.

Threads wait in `acquire`; coroutines in `acquire_async`, in the same first-come queue, without
holding a thread while they wait (a thread per waiter would starve the pool the holders run in).
"""

from __future__ import annotations

import asyncio
import threading
from collections import deque
from dataclasses import dataclass

from gpu_watchdog.inference.errors import QueueFull


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


class _AsyncTicket:
    """A coroutine's place in the queue: woken from whichever thread changes the gate."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self.event = asyncio.Event()

    def wake(self) -> None:
        try:
            self.loop.call_soon_threadsafe(self.event.set)
        except RuntimeError:  # the waiter's loop is closed: nobody left to wake
            pass


class AdmissionGate:
    def __init__(self, capacity: float) -> None:
        if capacity <= 0:
            raise ValueError("admission capacity must be positive")
        self._capacity = float(capacity)
        self._in_use = 0.0
        self._holders = 0
        self._peak_holders = 0
        self._queue: deque[object] = deque()
        self._async_waiters: set[_AsyncTicket] = set()
        self._cond = threading.Condition()
        self._canary = threading.BoundedSemaphore(1)
        self._canary_busy = False

    @property
    def capacity(self) -> float:
        return self._capacity

    def _turn(self, ticket: object, weight: float) -> bool:
        return self._queue[0] is ticket and self._in_use + min(weight, self._capacity) <= self._capacity + 1e-9

    def _take(self, weight: float) -> Grant:
        grant = Grant(min(weight, self._capacity))
        self._in_use += grant.amount
        self._holders += 1
        self._peak_holders = max(self._peak_holders, self._holders)
        return grant

    def _notify(self) -> None:
        """Wake every waiter, threads and coroutines alike; called with the lock held."""
        self._cond.notify_all()
        for waiter in self._async_waiters:
            waiter.wake()

    def _enqueue(self, ticket: object, max_waiting: int | None) -> None:
        if max_waiting is not None and len(self._queue) >= max_waiting:
            raise QueueFull(f"{len(self._queue)} requests already waiting")
        self._queue.append(ticket)

    def acquire(self, weight: float, timeout: float | None, max_waiting: int | None = None) -> Grant | None:
        """Block the calling thread until `weight` fits; None when `timeout` seconds pass first.

        A request heavier than the whole budget still runs, alone. "The whole budget" is the one
        in force when the request gets its turn: the limit can shrink while it waits (the watchdog
        lowers it on OOMs), and a weight clamped to the old budget would never fit the new one.
        Raises `QueueFull` at once when `max_waiting` are already waiting.
        """
        weight = max(weight, 0.0)
        ticket = object()
        with self._cond:
            self._enqueue(ticket, max_waiting)
            try:
                ok = self._cond.wait_for(lambda: self._turn(ticket, weight), timeout=timeout)
            finally:
                self._queue.remove(ticket)
                self._notify()
            return self._take(weight) if ok else None

    async def acquire_async(self, weight: float, timeout: float | None,
                            max_waiting: int | None = None) -> Grant | None:
        """`acquire` for a coroutine: waits on the event loop without blocking it or holding a thread.

        Cancellation while waiting leaves the queue with nothing taken.
        """
        weight = max(weight, 0.0)
        loop = asyncio.get_running_loop()
        ticket = _AsyncTicket(loop)
        deadline = None if timeout is None else loop.time() + timeout
        with self._cond:
            self._enqueue(ticket, max_waiting)
            self._async_waiters.add(ticket)
        try:
            while True:
                # Cleared before looking: a wake-up after the look is scheduled on this loop and
                # so sets the event only once we wait on it.
                ticket.event.clear()
                with self._cond:
                    if self._turn(ticket, weight):
                        return self._take(weight)
                left = None if deadline is None else deadline - loop.time()
                if left is not None and left <= 0:
                    return None
                try:
                    await asyncio.wait_for(ticket.event.wait(), left)
                except TimeoutError:
                    pass
        finally:
            with self._cond:
                self._async_waiters.discard(ticket)
                self._queue.remove(ticket)
                self._notify()

    def try_acquire(self, weight: float) -> Grant | None:
        """Take `weight` now if it fits and nobody waits ahead; never blocks (the decode loop's way in)."""
        weight = max(weight, 0.0)
        with self._cond:
            amount = min(weight, self._capacity)
            if self._queue or self._in_use + amount > self._capacity + 1e-9:
                return None
            return self._take(weight)

    def release(self, grant: Grant) -> None:
        """Give back exactly what was taken, whatever the budget is now."""
        with self._cond:
            if self._holders <= 0:
                raise RuntimeError("admission gate released more often than acquired")
            self._in_use = max(0.0, self._in_use - grant.amount)
            self._holders -= 1
            self._notify()

    def set_capacity(self, capacity: float) -> None:
        if capacity <= 0:
            raise ValueError("admission capacity must be positive")
        with self._cond:
            self._capacity = float(capacity)
            self._notify()

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
