"""What the sidecar decided over flight recordings, per reason and per pod: the page an operator reads
after a week in shadow (`gpu-watchdog replay FILE... --summary`).

For each action and reason: how often it would have been taken and was not (shadow, `policy.enforce`),
how often it was performed, and what held it back (the restart budget, the fleet's ledger, an Event
that could not be written); what the would-have actions would have cost (restarts, requests refused,
request fingerprints quarantined, cards kept out); and the same per pod. The shadow counts come from
each sidecar's own tally (kept whole across a rotation), the rest from the decisions' records.

Pure: fed the replay's lines and histories, it returns a JSON object and its text.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import Any

from gpu_watchdog.watchdog.core.history import History
from gpu_watchdog.watchdog.core.names import (
    ADMISSION,
    BLOCKED_BY_BUDGET,
    EMPTY_CACHE,
    FLEET_HOLDS,
    PLACEMENT,
    QUARANTINE,
    RESTART,
    WOULD,
)

# What a decision's record says of it that is neither a shadow nor a performance: it was held back.
# `reported`: restart.strategy none, which reports a restart and performs none.
HELD_BACK = (BLOCKED_BY_BUDGET, *FLEET_HOLDS, "not_recorded", "failed", "reported")
# Every action performed is recorded `started` once (a restart then `done`, `failed`, ...).
PERFORMED = "started"


@dataclass
class PodReport:
    pod: str
    workload: str | None = None
    first: float | None = None  # wall clock
    last: float | None = None
    would: Counter[tuple[str, str]] = field(default_factory=Counter)
    performed: Counter[tuple[str, str]] = field(default_factory=Counter)
    held: Counter[tuple[str, str, str]] = field(default_factory=Counter)
    would_refuse: int = 0


@dataclass
class Report:
    pods: dict[str, PodReport] = field(default_factory=dict)
    enforce: tuple[str, ...] = ()
    _current: PodReport | None = None

    def start(self, history: History, enforce: tuple[str, ...]) -> None:
        """A recording (or a rotated file of it) begins: its pod's tally so far is in `history`."""
        name = history.pod or "local"
        self._current = self.pods.setdefault(name, PodReport(name, history.workload))
        self.enforce = enforce
        self.seen(history)

    def seen(self, history: History) -> None:
        """The sidecar's own tallies as they stand: whole since it started, whichever file came first."""
        pod = self._current
        if pod is None:
            return
        pod.would = Counter({_split(k): n for k, n in history.would.items()})
        pod.would_refuse = history.edge.would_refuse

    def at(self, wall: float) -> None:
        pod = self._current
        if pod is not None:
            pod.first = wall if pod.first is None else min(pod.first, wall)
            pod.last = wall if pod.last is None else max(pod.last, wall)

    def outcome(self, action: str, reason: str, outcome: str) -> None:
        """One decision's record, as the sidecar wrote it (an admission change counts as `admission`)."""
        pod = self._current
        if pod is None or outcome == WOULD:
            return
        action = ADMISSION if action.endswith("_admission") else action
        if outcome == PERFORMED:
            pod.performed[(action, reason)] += 1
        elif outcome in HELD_BACK:
            pod.held[(action, reason, outcome)] += 1

    def as_json(self) -> dict[str, Any]:
        would: Counter[tuple[str, str]] = Counter()
        on: dict[tuple[str, str], set[str]] = {}
        performed: Counter[tuple[str, str]] = Counter()
        held: Counter[tuple[str, str, str]] = Counter()
        for p in self.pods.values():
            would.update(p.would)
            performed.update(p.performed)
            held.update(p.held)
            for key in p.would:
                on.setdefault(key, set()).add(p.pod)
        firsts = [p.first for p in self.pods.values() if p.first is not None]
        lasts = [p.last for p in self.pods.values() if p.last is not None]
        return {
            "kind": "report", "enforce": list(self.enforce),
            "from": min(firsts) if firsts else None, "to": max(lasts) if lasts else None,
            "span_s": round(max(lasts) - min(firsts), 3) if firsts and lasts else 0.0,
            "would": [{"action": a, "reason": r, "count": n, "pods": len(on[(a, r)])}
                      for (a, r), n in sorted(would.items())],
            "cost": {"restarts": sum(n for (a, _), n in would.items() if a == RESTART),
                     "requests_refused": sum(p.would_refuse for p in self.pods.values()),
                     "quarantined": sum(n for (a, _), n in would.items() if a == QUARANTINE),
                     "cards_kept_out": sum(n for (a, _), n in would.items() if a == PLACEMENT),
                     "cache_flushes": sum(n for (a, _), n in would.items() if a == EMPTY_CACHE),
                     "admission_changes": sum(n for (a, _), n in would.items() if a == ADMISSION)},
            "performed": [{"action": a, "reason": r, "count": n} for (a, r), n in sorted(performed.items()) if n],
            "held_back": [{"action": a, "reason": r, "by": by, "count": n} for (a, r, by), n in sorted(held.items())],
            "pods": [{"pod": p.pod, "workload": p.workload, "from": p.first, "to": p.last,
                      "would": {f"{a}:{r}": n for (a, r), n in sorted(p.would.items())},
                      "performed": {f"{a}:{r}": n for (a, r), n in sorted(p.performed.items()) if n},
                      "held_back": {f"{a}:{r}:{by}": n for (a, r, by), n in sorted(p.held.items())},
                      "requests_refused": p.would_refuse} for p in sorted(self.pods.values(), key=lambda p: p.pod)],
        }


def _split(key: str) -> tuple[str, str]:
    action, _, reason = key.partition(":")
    return action, reason


def render(report: dict[str, Any], date: Any = str) -> str:
    """The report as a page of text; `date` writes a wall-clock time."""
    span = report["span_s"]
    head = (f"gpu-watchdog: what it decided over {_duration(span)}"
            + (f", {date(report['from'])} to {date(report['to'])}" if report["from"] is not None else "")
            + f"; {len(report['pods'])} pod(s); policy.enforce: {', '.join(report['enforce']) or '-'}")
    lines = [head, ""]
    if report["would"]:
        lines.append("Would have done, and did not (shadow):")
        lines += [f"  {w['action']:<12} {w['reason']:<22} {w['count']:>6}  on {w['pods']} pod(s)"
                  for w in report["would"]]
        c = report["cost"]
        lines += ["", "What that would have cost:",
                  f"  {c['restarts']} restart(s), {c['requests_refused']} request(s) refused,"
                  f" {c['quarantined']} request fingerprint(s) quarantined, {c['cards_kept_out']} card(s) kept out,"
                  f" {c['cache_flushes']} cache flush(es), {c['admission_changes']} admission change(s)"]
    else:
        lines.append("Nothing would have been done that was not.")
    lines += ["", "Performed:"]
    lines += [f"  {p['action']:<12} {p['reason']:<22} {p['count']:>6}" for p in report["performed"]] or ["  nothing"]
    lines += ["", "Held back:"]
    lines += [f"  {h['action']:<12} {h['reason']:<22} {h['count']:>6}  by {h['by']}"
              for h in report["held_back"]] or ["  nothing"]
    lines += ["", "Per pod:"]
    for p in report["pods"]:
        said = ", ".join(f"{k} x{n}" for k, n in p["would"].items()) or "nothing in shadow"
        lines.append(f"  {p['pod']}: {said}" + (f"; {p['requests_refused']} request(s) would have been refused"
                                                if p["requests_refused"] else ""))
    return "\n".join(lines) + "\n"


def _duration(seconds: float) -> str:
    s = int(seconds)
    days, s = divmod(s, 86400)
    hours, s = divmod(s, 3600)
    minutes, s = divmod(s, 60)
    if days:
        return f"{days}d {hours}h"
    if hours:
        return f"{hours}h {minutes}m"
    return f"{minutes}m {s}s" if minutes else f"{s}s"
