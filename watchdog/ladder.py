"""The remedy ladder's first rung: adaptive admission (AIMD), decided purely from (settings, history, now).

The seed plans a concurrency limit from a memory budget before the server starts; reality drifts
(longer prompts, another process on the card, a fragmented allocator). When OOMs keep coming
although the cache was flushed, the limit is cut (multiplicative decrease); each quiet
`recover_after` it grows by one step (additive increase) up to its ceiling — the limit the server
started with, or the last one an operator set. A grow is a probe: OOMs at the new limit send it
back to the last limit that held and double the wait before the next probe, so a card that stays
too small costs one OOM per probe, with probes ever further apart.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass, replace
from typing import Any

from watchdog.config import AdmissionSettings
from watchdog.samples import History, TorchSample

SHRINK, GROW = "shrink_admission", "grow_admission"


@dataclass(frozen=True)
class Ladder:
    """What the watchdog knows of one server process's admission limit."""

    instance_id: str | None
    mode: str  # slots | bytes
    ceiling: int
    limit: int  # what the server runs with now
    last_good: int  # the highest limit that held
    probing: bool  # the last change was a grow, not yet confirmed by a quiet wait
    wait: float  # quiet time before the next grow
    changed_at: float  # the last change (ours or an operator's), or first sight of this process
    pending: int | None = None  # a limit asked for, not yet confirmed by the server


@dataclass(frozen=True)
class Change:
    action: str  # SHRINK | GROW
    limit: int
    detail: dict[str, Any]


def observe(ladder: Ladder | None, sample: TorchSample, settings: AdmissionSettings) -> Ladder | None:
    """Fold one allocator sample in: a new process, or an operator's change, sets a new ceiling."""
    if not sample.reachable or sample.admission_limit <= 0:
        return ladder
    limit = sample.admission_limit
    if ladder is None or ladder.instance_id != sample.instance_id:
        return Ladder(sample.instance_id, sample.admission_mode or "slots", ceiling=limit, limit=limit,
                      last_good=limit, probing=False, wait=settings.recover_after, changed_at=sample.at)
    if ladder.pending is not None:
        if limit == ladder.pending:
            return replace(ladder, pending=None)
        return ladder  # taken before our change landed
    if limit != ladder.limit and sample.at > ladder.changed_at:
        # Someone else set it (an operator through the control API): that is the new ceiling.
        return Ladder(ladder.instance_id, ladder.mode, ceiling=limit, limit=limit, last_good=limit, probing=False,
                      wait=settings.recover_after, changed_at=sample.at)
    return ladder


def requested(ladder: Ladder, change: Change) -> Ladder:
    """A change is on its way: decide nothing more until the server confirms it."""
    return replace(ladder, pending=change.limit)


def answered(ladder: Ladder, change: Change, at: float, ok: bool, settings: AdmissionSettings) -> Ladder:
    """The server's answer to our change."""
    if not ok:
        return replace(ladder, pending=None)
    if change.action == GROW:
        # The limit grown from held for a whole wait; a probe that held resets the wait.
        return replace(ladder, limit=change.limit, last_good=ladder.limit, probing=True,
                       wait=settings.recover_after if ladder.probing else ladder.wait, changed_at=at)
    # Back from a failed probe: the next one waits twice as long.
    wait = min(ladder.wait * 2, settings.max_wait) if ladder.probing else ladder.wait
    return replace(ladder, limit=change.limit, last_good=change.limit, probing=False, wait=wait, changed_at=at)


def _ooms_since(h: History, since: float, instance_id: str | None) -> list[tuple[float, int]]:
    """(when seen, how many) for every rise of the OOM counter between two samples both taken after
    `since`, this process only: a rise that straddles a change may be the old limit's."""
    out: list[tuple[float, int]] = []
    samples = [t for t in h.torch_since_epoch() if t.instance_id == instance_id]
    for prev, cur in itertools.pairwise(samples):
        if prev.at >= since and cur.ooms > prev.ooms:
            out.append((cur.at, cur.ooms - prev.ooms))
    return out


def decide(settings: AdmissionSettings, h: History, now: float) -> Change | None:
    ladder = h.ladder
    if not settings.enabled or ladder is None or ladder.pending is not None:
        return None
    # Only OOMs seen after the last change count against the limit in force.
    ooms = _ooms_since(h, ladder.changed_at, ladder.instance_id)
    recent = sum(n for at, n in ooms if now - at < settings.window)
    flushed = any(a.action == "empty_cache" and now - a.at < settings.window for a in h.actions)
    if recent >= settings.oom_threshold and flushed and ladder.limit > settings.min_limit:
        if ladder.probing:
            target = max(settings.min_limit, ladder.last_good)
            why = "the probe failed: back to the last limit that held"
        else:
            target = max(settings.min_limit, math.floor(ladder.limit * settings.decrease_factor))
            why = "OOMs despite a cache flush"
        if target < ladder.limit:
            return Change(SHRINK, target, {"from": ladder.limit, "to": target, "ooms": recent,
                                           "window_s": settings.window, "why": why,
                                           "next_probe_in_s": min(ladder.wait * 2, settings.max_wait)
                                           if ladder.probing else ladder.wait})
    if ladder.limit >= ladder.ceiling:
        return None
    quiet_since = max([ladder.changed_at, *(at for at, _ in ooms)])
    if now - quiet_since < ladder.wait:
        return None
    step = max(1, math.ceil(ladder.ceiling / 8)) if ladder.mode == "bytes" else 1
    target = min(ladder.ceiling, ladder.limit + step)
    return Change(GROW, target, {"from": ladder.limit, "to": target, "quiet_s": round(now - quiet_since, 1),
                                 "ceiling": ladder.ceiling, "probe": True})
