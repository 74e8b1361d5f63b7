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
    tokens: int = 0  # what its prefill feeds the model: the prompt (and what it generated, if preempted)


@dataclass(frozen=True)
class Room:
    rows: int  # sequences decoding now
    max_rows: int  # the most that may decode together (--max-batch-size, or lower after an OOM)
    in_use: float  # of the admission budget
    capacity: float  # the admission budget
    can_join_running: bool = True  # False where the model's cache cannot be stitched
    # Prompt tokens one step prefills (what the joiners compute, their cached beginnings left out); None: no limit.
    prefill_tokens: int | None = None


def take(waiting: Sequence[Candidate], room: Room) -> list[int]:
    """Indices of `waiting` (oldest first) that join now.

    The canary always joins. Others join first come, first served while rows and budget last:
    the first that does not fit stops the rest, so a heavy request is not starved by light ones
    behind it. A request heavier than the whole budget still runs, alone ("fits" is judged on
    its weight clamped to the budget, as the gate grants it). One stepped out by an OOM already
    holds its share and needs only a row: one waiting for budget never stops it, since the
    budget it waits for (lowered below what is held) frees only as those sequences finish.

    The prefill budget caps one step's prompt work, so that a burst of long prompts is prefilled
    over several steps, between which the running sequences decode and the first joiners already
    stream: once the next joiner would take the step's tokens past it, only the canary joins this
    step. The first joiner always fits: a prompt longer than the budget is prefilled alone (in
    chunks where the model allows, see `DecodeLoop`). Tokens, not padded rows, are what it
    counts: `passes` keeps the padding of each forward pass small.
    """
    chosen: list[int] = []
    rows, in_use = room.rows, room.in_use
    if rows and not room.can_join_running:
        return []
    blocked = False
    full = False  # the step's prefill budget is spent
    tokens = 0
    for i, c in enumerate(waiting):
        if c.canary:
            chosen.append(i)
            continue
        if full:
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
        if tokens and room.prefill_tokens is not None and tokens + c.tokens > room.prefill_tokens:
            full = True
            continue
        chosen.append(i)
        rows += 1
        in_use += share
        tokens += c.tokens
    return chosen


# A forward pass may pad its rows by up to this share of its padded tokens.
PADDING_SHARE = 0.25
# Passes of rows at most this long cost about their fixed overhead, padded or not: never split.
SHORT_PASS = 64


def passes(lengths: Sequence[int]) -> list[list[int]]:
    """The forward passes a step's joiners are prefilled in: indices into `lengths` (the tokens
    each computes), shortest pass first, each padded by at most `PADDING_SHARE` of its tokens,
    and none longer than `SHORT_PASS` holding a row under half as long as its longest.

    Rows of one pass are left-padded to its longest, so a prompt whose beginning was cached (a
    few tokens to compute) prefilled beside an uncached one would compute the whole width for
    nothing; apart, it costs its own few tokens, and its first token comes a long prefill sooner.
    """
    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    out: list[list[int]] = []
    current: list[int] = []
    for i in order:
        widest = lengths[current[0]] if current else lengths[i]
        padded = (len(current) + 1) * widest
        real = sum(lengths[j] for j in current) + lengths[i]
        mismatched = widest > SHORT_PASS and 2 * lengths[i] < widest
        if current and widest > SHORT_PASS and (padded - real > PADDING_SHARE * padded or mismatched):
            out.append(current)
            current = []
        current.append(i)
    if current:
        out.append(current)
    return [sorted(p) for p in reversed(out)]
