"""Whether the process refuses new work, and until when: one state for `serve` and the agent.

A drain asked for through the control API ends: at its deadline by itself, or at once when lifted
(`DELETE /control/drain`), so a sidecar that dies mid-restart cannot leave the pod drained. The
shutdown drain (SIGTERM) is for good: neither a deadline nor a lift ends it.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable


class Drain:
    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._lock = threading.Lock()
        self._until: float | None = None  # the control drain's deadline, on `clock`
        self._shutdown = False

    @property
    def active(self) -> bool:
        # Read against the clock, so the drain ends at its deadline even before anyone lifts it.
        with self._lock:
            return self._shutdown or (self._until is not None and self._clock() < self._until)

    @property
    def shutdown(self) -> bool:
        return self._shutdown

    def begin(self, deadline_s: float) -> None:
        """A control drain until `deadline_s` from now; a second one replaces the first's deadline."""
        with self._lock:
            self._until = self._clock() + deadline_s

    def begin_shutdown(self) -> None:
        with self._lock:
            self._shutdown = True

    def lift(self) -> bool:
        """End the control drain now; whether one was in force. The shutdown drain stays."""
        with self._lock:
            was = self._until is not None and self._clock() < self._until
            self._until = None
            return was

    def left_s(self) -> float | None:
        """Seconds until the control drain ends by itself; None with none in force or when shutting down."""
        with self._lock:
            if self._shutdown or self._until is None:
                return None
            left = self._until - self._clock()
            return left if left > 0 else None

    def lapse(self) -> bool:
        """Forget a control drain whose deadline has passed; True when this one did."""
        with self._lock:
            if self._until is None or self._clock() < self._until:
                return False
            self._until = None
            return True
