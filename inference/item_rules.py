"""Request-level batching rules: which queued items form the next batch, how it splits into forward
passes, and what an out-of-memory error does to one. Pure: no torch, no clock, no locks.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class Item:
    """A queued item as the batch-taker sees it."""

    tokens: int  # its length: what padding and the token budget count
    weight: float  # its admission share (one slot, or predicted bytes)
    arrived: float  # when it was queued, on the loop's clock
    canary: bool = False


@dataclass(frozen=True)
class BatchLimits:
    max_items: int  # --max-batch-size
    max_tokens: int  # --max-batch-tokens: padded tokens in one forward pass
    window_s: float  # --batch-window-ms: how long the oldest item may wait for company
    capacity: float  # the admission budget now
    in_use: float = 0.0  # of it, held by others


@dataclass(frozen=True)
class Take:
    chosen: tuple[int, ...]  # indices into the queue, oldest first
    wait_s: float = 0.0  # nothing chosen: look again after this long (the window is still open)


def take(queue: Sequence[Item], limits: BatchLimits, now: float) -> Take:
    """The next batch from `queue` (oldest first).

    Window 0 takes what is queued and never waits; a wider window holds the batch back until
    the oldest item has waited that long or the batch is full. The canary never waits and always
    joins. Others join first come, first served while items, tokens and the admission budget
    last: the first that does not fit stops the rest, so a long item is not starved by short ones
    behind it. An item heavier than every budget still runs, alone.
    """
    if not queue:
        return Take(())
    chosen: list[int] = []
    items, tokens, in_use = 0, 0, limits.in_use
    full = False
    for i, item in enumerate(queue):
        if item.canary:
            chosen.append(i)
            continue
        if full:
            continue
        share = min(item.weight, limits.capacity)
        fits = (items < limits.max_items and tokens + item.tokens <= limits.max_tokens
                and in_use + share <= limits.capacity + 1e-9)
        if not fits and not (items == 0 and in_use <= 1e-9):
            full = True
            continue
        chosen.append(i)
        items, tokens, in_use = items + 1, tokens + item.tokens, in_use + share
        if not fits:
            full = True  # the lone oversized item
    if not full and items < limits.max_items and limits.window_s > 0 and not any(q.canary for q in queue):
        opens = min(q.arrived for q in queue)
        left = opens + limits.window_s - now
        if left > 0:
            return Take((), left)
    return Take(tuple(chosen))


def forwards(lengths: Sequence[int], max_tokens: int) -> list[list[int]]:
    """Cut a batch into forward passes: sorted by length (less padding), each at most `max_tokens`
    padded tokens (rows x the longest row). Indices into `lengths`, shortest first."""
    order = sorted(range(len(lengths)), key=lambda i: lengths[i])
    passes: list[list[int]] = []
    current: list[int] = []
    for i in order:
        # Sorted ascending: the newcomer is the longest, so it sets the padded width.
        if current and (len(current) + 1) * lengths[i] > max_tokens:
            passes.append(current)
            current = []
        current.append(i)
    if current:
        passes.append(current)
    return passes


def after_oom(size: int, retried: bool) -> list[tuple[int, int]] | None:
    """How to retry a forward pass of `size` items that ran out of memory: two halves as
    (start, stop) ranges, or None when its items get a clean 503 (alone, or already a retry)."""
    if size <= 1 or retried:
        return None
    half = size - size // 2
    return [(0, half), (half, size)]
