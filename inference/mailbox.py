"""Calls from the decode thread to an event loop, handed over many per wake-up.

Each step hands a token to every streaming request. A `call_soon_threadsafe` apiece wakes the
loop once per row (a write to its self-pipe each, and as many hand-overs of the GIL between the
two threads); the mailbox wakes it once per step for all of them, in the order they were posted.
"""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import Callable
from typing import Any


class Mailbox:
    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        self._calls: deque[tuple[Callable[[Any], object], Any]] = deque()
        self._scheduled = False

    def post(self, fn: Callable[[Any], object], arg: Any) -> None:
        """From any thread: run fn(arg) on the loop, after everything posted before it."""
        self._calls.append((fn, arg))
        if not self._scheduled:
            self._scheduled = True
            self._loop.call_soon_threadsafe(self._deliver)

    def _deliver(self) -> None:
        # Cleared before draining: a call posted while this runs either is drained here or
        # schedules the next delivery, and a later call_soon_threadsafe (a future resolved after
        # its last piece was posted) still runs after this.
        self._scheduled = False
        calls = self._calls
        while calls:
            fn, arg = calls.popleft()
            fn(arg)
