"""What an out-of-memory error during a step does to the sequences in it. Pure.

The batch shrinks and retries: the newest half steps out and waits at the head of the queue
(keeping its admission, its generated tokens and its place), the oldest half goes on. A
sequence that meets a second OOM, the canary, or a sequence alone in its step gets a clean
503 (`InferenceOOM`) instead: recovery is bounded, never a loop. Until every sequence present
at the OOM has finished, at most `ceiling` decode together.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class Row:
    retried: bool  # already stepped out once after an OOM
    canary: bool = False


@dataclass(frozen=True)
class Recovery:
    preempt: tuple[int, ...]  # step out, retry later
    fail: tuple[int, ...]  # answer with InferenceOOM
    ceiling: int  # the most sequences that may decode together for now


def plan(rows: Sequence[Row]) -> Recovery:
    """`rows` oldest first, as admitted."""
    n = len(rows)
    if n <= 1:
        return Recovery((), tuple(range(n)), 1)
    victims = range(n - n // 2, n)
    preempt = tuple(i for i in victims if not rows[i].retried and not rows[i].canary)
    fail = tuple(i for i in victims if rows[i].retried or rows[i].canary)
    return Recovery(preempt, fail, max(1, n - len(victims)))
