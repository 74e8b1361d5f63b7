"""Which waiting sequences join the running batch at the next step. Pure: no torch, no clock, no locks."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class Candidate:
    """A waiting sequence as the batch-taker sees it."""

    weight: float  # predicted peak memory (bytes) or one slot; what the admission gate would grant
    canary: bool = False  # the watchdog's probe: its own reserved slot, never queued behind load
    holds_grant: bool = False  # preempted by an OOM: admitted before, it keeps its share


@dataclass(frozen=True)
class Room:
    rows: int  # sequences decoding now
    max_rows: int  # the most that may decode together (--max-batch-size, or lower after an OOM)
    in_use: float  # of the admission budget
    capacity: float  # the admission budget
    can_join_running: bool = True  # False where the model's cache cannot be stitched


def take(waiting: Sequence[Candidate], room: Room) -> list[int]:
    """Indices of `waiting` (oldest first) that join now.

    The canary always joins. Others join first come, first served while rows and budget last:
    the first that does not fit stops the rest, so a heavy request is not starved by light ones
    behind it. A request heavier than the whole budget still runs, alone ("fits" is judged on
    its weight clamped to the budget, as the gate grants it). One stepped out by an OOM already
    holds its share and needs only a row: one waiting for budget never stops it, since the
    budget it waits for (lowered below what is held) frees only as those sequences finish.
    """
    chosen: list[int] = []
    rows, in_use = room.rows, room.in_use
    if rows and not room.can_join_running:
        return []
    blocked = False
    for i, c in enumerate(waiting):
        if c.canary:
            chosen.append(i)
            continue
        if rows >= room.max_rows:
            blocked = True
            continue
        if blocked and not c.holds_grant:
            continue
        share = 0.0 if c.holds_grant else min(c.weight, room.capacity)
        if not c.holds_grant and in_use + share > room.capacity + 1e-9:
            blocked = True
            continue
        chosen.append(i)
        rows += 1
        in_use += share
    return chosen
