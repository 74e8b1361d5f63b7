"""The watchdog's own state records, carried in the history beside what the samplers observed.

A leaf: the history (`samples`) holds these, the fold (`state`) writes them, the ladder decides
from them, and none of those needs the others to name them.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class FailedLimit:
    """A limit that met OOMs, remembered until a long enough quiet period forgives it."""

    limit: int
    wait: float  # quiet time before probing this limit again: twice the wait before it last failed
    at: float  # when it last failed


@dataclass(frozen=True)
class Ladder:
    """What the watchdog knows of one server process's admission limit."""

    instance_id: str | None
    mode: str  # slots | bytes
    ceiling: int
    limit: int  # what the server runs with now
    # The limit a multiplicative cut chose, or one that stayed quiet for the longest remembered
    # wait. Above it a limit is on probation: one OOM sends it back a step.
    base: int
    wait: float  # quiet time before the next grow: the next limit's remembered wait, or recover_after
    changed_at: float  # the last change (ours or an operator's), or first sight of this process
    ooms: int = 0  # the process's OOM counter at the last sample
    oom_at: float | None = None  # the last sample that showed the counter rise
    # Seconds the limit in force has been in full use without an OOM, since it was set or since the
    # last OOM: time with fewer sequences than the limit proves nothing about it.
    used: float = 0.0
    seen_at: float | None = None  # the last sample
    failed: tuple[FailedLimit, ...] = ()  # limits that failed, one entry each
    pending: int | None = None  # a limit asked for, not yet confirmed by the server

    @property
    def probing(self) -> bool:
        return self.limit > self.base

    def remembered(self, limit: int) -> FailedLimit | None:
        return next((f for f in self.failed if f.limit == limit), None)
