"""The remedy ladder's first rung: adaptive admission (AIMD), decided purely from (settings, history, now).

The seed plans a concurrency limit from a memory budget before the server starts; reality drifts
(longer prompts, another process on the card, a fragmented allocator). When OOMs keep coming
although the cache was flushed, the limit is cut (multiplicative decrease); after a quiet wait it
grows by one step (additive increase) up to its ceiling: the limit the server started with, or the
last one an operator set. Only time with the limit in full use counts as quiet: a limit that no
load (or the server's own OOM recovery) fills proves nothing.

The limit the ladder reasons about is what the card must hold: the bundled server runs its canary
in a row of its own beside the admitted sequences, so `limit` sequences put `limit + 1` rows on
the card whenever a canary coincides. A cut halves those rows, not the limit alone.

A limit that failed is remembered (`Ladder.failed`). A grow is a probe: the new limit is on
probation, and its first OOM sends it back one step. Probing back to a limit that failed waits
twice as long as the wait before its last failure (up to `max_wait`), and a probe that holds does
not erase that memory: a limit that fails only when the canary coincides would otherwise be
probed again at the shortest wait, forever. Only a quiet period as long as the longest remembered
wait confirms the limit in force and forgets the failures at or below it. So a card that stays
too small costs one OOM per probe, with probes ever further apart.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass
from typing import Any

from gpu_watchdog.watchdog.core.history import History
from gpu_watchdog.watchdog.core.ladder_state import Ladder
from gpu_watchdog.watchdog.core.names import ADMISSION
from gpu_watchdog.watchdog.core.settings import AdmissionSettings

SHRINK, GROW = "shrink_admission", "grow_admission"


def enforce_action(action: str) -> str:
    """The enforceable action (`names.ENFORCEABLE_ACTIONS`) a decision's action is: both admission
    changes are `admission`."""
    return ADMISSION if action in (SHRINK, GROW) else action


# The bundled server's canary joins the batch in a reserved row, outside the admission limit
# (inference/admission.py): on the card, `limit` sequences are `limit + CANARY_ROWS` rows.
CANARY_ROWS = 1


@dataclass(frozen=True)
class Change:
    action: str  # SHRINK | GROW
    limit: int
    detail: dict[str, Any]


def step(ladder: Ladder) -> int:
    """One additive step: a slot, or in bytes mode an eighth of the ceiling."""
    return max(1, math.ceil(ladder.ceiling / 8)) if ladder.mode == "bytes" else 1


def next_up(ladder: Ladder) -> int:
    return min(ladder.ceiling, ladder.limit + step(ladder))


def step_below(ladder: Ladder, limit: int) -> int:
    """The step under `limit` on the ladder that climbs from `base` (never below `base`)."""
    if limit <= ladder.base:
        return limit
    return ladder.base + (limit - ladder.base - 1) // step(ladder) * step(ladder)


def wait_for(ladder: Ladder, limit: int, settings: AdmissionSettings) -> float:
    """Quiet time before growing to `limit`: its remembered wait if it failed, else recover_after."""
    failure = ladder.remembered(limit)
    return settings.recover_after if failure is None else max(settings.recover_after, failure.wait)


def confirm_after(ladder: Ladder, settings: AdmissionSettings) -> float:
    """How long the limit in force must stay quiet to be confirmed: the longest remembered wait."""
    return max([settings.recover_after, *(f.wait for f in ladder.failed)])


def cut(limit: int, settings: AdmissionSettings) -> int:
    """The multiplicative decrease, on the rows the card holds (the canary's included)."""
    rows = limit + CANARY_ROWS
    return max(settings.min_limit, math.floor(rows * settings.decrease_factor) - CANARY_ROWS)


def _in_force_since(h: History, ladder: Ladder) -> float | None:
    """When the limit in force became the one the card runs with: after a cut, sequences admitted
    under the old limit still run until they finish, and their OOMs are the old limit's. None: not
    yet. In bytes mode a sequence weighs less than the worst case the limit counts, so the number
    in flight says nothing about the limit, and the change itself is the start."""
    if ladder.mode == "bytes":
        return ladder.changed_at
    for t in h.torch_since_epoch():
        if t.instance_id == ladder.instance_id and t.at >= ladder.changed_at and t.inflight <= ladder.limit:
            return t.at
    return None


def _ooms_since(h: History, since: float, instance_id: str | None, grown_to: int | None = None
                ) -> list[tuple[float, int]]:
    """(when seen, how many) for every rise of the OOM counter between two samples both taken after
    `since`, this process only: a rise that straddles a change may be the old limit's. After a grow
    (`grown_to`) it is the new one's: the lower limit had held a whole wait."""
    out: list[tuple[float, int]] = []
    samples = [t for t in h.torch_since_epoch() if t.instance_id == instance_id]
    for prev, cur in itertools.pairwise(samples):
        straddles_a_grow = grown_to is not None and cur.at >= since and 0 < prev.admission_limit < grown_to
        if (prev.at >= since or straddles_a_grow) and cur.ooms > prev.ooms:
            out.append((cur.at, cur.ooms - prev.ooms))
    return out


def decide(settings: AdmissionSettings, h: History, now: float) -> Change | None:
    ladder = h.ladder
    if not settings.enabled or ladder is None or ladder.pending is not None:
        return None
    since = _in_force_since(h, ladder)
    ooms = [] if since is None else _ooms_since(h, since, ladder.instance_id)
    figures = {"from": ladder.limit, "rows": ladder.limit + CANARY_ROWS, "base": ladder.base}
    probe_ooms = [] if since is None else _ooms_since(h, since, ladder.instance_id, grown_to=ladder.limit)
    if ladder.probing and probe_ooms:
        # On probation: one OOM is enough, and going back a step costs less than another OOM.
        target = step_below(ladder, ladder.limit)
        if target < ladder.limit:
            return Change(SHRINK, target, {
                **figures, "to": target, "ooms": sum(n for _, n in probe_ooms),
                "why": "a limit on probation met an OOM",
                "next_probe_in_s": min(settings.max_wait, 2 * wait_for(ladder, ladder.limit, settings))})
    recent = sum(n for at, n in ooms if now - at < settings.window)
    flushed = any(a.action == "empty_cache" and now - a.at < settings.window for a in h.actions)
    if recent >= settings.oom_threshold and flushed and ladder.limit > settings.min_limit:
        target = cut(ladder.limit, settings)
        if target < ladder.limit:
            return Change(SHRINK, target, {**figures, "to": target, "ooms": recent, "window_s": settings.window,
                                           "why": "OOMs despite a cache flush"})
    if ladder.limit >= ladder.ceiling:
        return None
    target = next_up(ladder)
    wait = wait_for(ladder, target, settings)
    if ladder.used < wait:
        return None
    return Change(GROW, target, {**figures, "to": target, "quiet_s": round(ladder.used, 1), "wait_s": wait,
                                 "ceiling": ladder.ceiling, "probe": True})
