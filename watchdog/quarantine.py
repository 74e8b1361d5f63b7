"""The query of death: which request fingerprints to refuse, from the failures of the workload.

Pure: failure records in (each a poison exit, a hang or a context loss of one process, with the
fingerprints in flight at it, the newest admitted before it, and those that completed lately), the
fingerprints to quarantine out. No I/O, no clock of its own; times are wall-clock seconds, since the
records come from many pods.

A fingerprint is quarantined when it was in flight at `failures` (2) failures of the workload within
`window`, on two different pods or processes, and nothing clears it:
- it completed successfully somewhere (a culprit never does): in a failing process's last answers, or
  on any replica of the workload, whose sidecar says so in the records (`Cleared`) when its server
  answered a fingerprint the records hold against. An entry whose fingerprint is cleared so is
  removed: a request answered anywhere is no killer;
- a bystander (a retried innocent request that happened to be in flight twice) is told apart from
  the culprit: the culprit is in every failure it caused and bystanders come and go. The
  fingerprints at the most failures are taken when one stands alone; where several tie, one
  failure more than `failures` is waited for (it tells a bystander apart), and then all that still
  tie are taken, at most MAX_TIED: a client that sends the killer with decoys of its own in flight
  each time has them refused too, and being newest before a fault counts for nothing (a popular
  request sent right after the killer would be framed);
- every quarantine lasts `ttl` and is listed and liftable by an operator; a lift holds until new
  evidence after it, whatever the TTL: it is kept as long as the failures it covers can count.
"""

from __future__ import annotations

import dataclasses
import json
import math
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from gpu_watchdog.watchdog import lease_text
from gpu_watchdog.watchdog.names import HANG
from gpu_watchdog.watchdog.settings import QuarantineSettings

# A bound on the damage: fingerprints that tie are all taken up to this many (a killer with up to 15
# decoys of its own); more alike than that is no one request's doing, and none is taken.
MAX_TIED = 16
CLEARED_KEPT = 256  # fingerprints answered somewhere in the window, newest kept
ANNOTATION = "gpu-watchdog.io/quarantine"  # on the workload's Lease, beside the fleet's ledger
VERSION = 1
FAILURES_KEPT = 64  # failures within the window, newest kept: the annotation stays small
LIFTS_KEPT = 64  # lifted entries kept past their TTL (the fingerprint and the lift's time), newest kept
INFLIGHT_KEPT = 32  # fingerprints of one failure (the server reports this many at most)
COMPLETED_KEPT = 32  # of a failing process's completions, those that clear a suspect
FUTURE_S = 60.0  # a failure dated this far ahead (another sidecar's clock) is still believed
ANNOTATION_BUDGET = 128 * 1024  # bytes of the annotation: a Lease's annotations hold 256 KiB in all


@dataclass(frozen=True)
class Failure:
    """One failure of one process: what was in flight at it."""

    at: float
    pod: str
    process: str  # the server process's instance id (a pod restarts its container in place too)
    reason: str
    inflight: tuple[str, ...]
    newest: str | None = None  # the last fingerprint admitted before the failure
    completed: tuple[str, ...] = ()  # fingerprints the process answered successfully lately


@dataclass(frozen=True)
class Cleared:
    """A fingerprint the records hold against that a replica answered successfully."""

    fingerprint: str
    at: float
    pod: str


@dataclass(frozen=True)
class Records:
    """What the workload knows: its failures (with their fingerprints), its quarantine list, and the
    suspects answered somewhere."""

    failures: tuple[Failure, ...] = ()
    quarantined: tuple[Quarantined, ...] = ()
    cleared: tuple[Cleared, ...] = ()


@dataclass(frozen=True)
class Quarantined:
    fingerprint: str
    since: float
    until: float
    failures: tuple[Failure, ...]  # the evidence
    lifted_at: float | None = None  # an operator's lift

    @property
    def pods(self) -> list[str]:
        return sorted({f.pod for f in self.failures})

    def active(self, now: float) -> bool:
        return self.lifted_at is None and self.since <= now < self.until


def _distinct(failures: Iterable[Failure]) -> int:
    return len({(f.pod, f.process) for f in failures})


def suspects(settings: QuarantineSettings, failures: list[Failure], now: float,
             cleared: Iterable[str] = (), refused: Iterable[str] = ()) -> list[tuple[str, list[Failure]]]:
    """The fingerprints to quarantine, with the failures each was in flight at.

    Of the fingerprints in flight at enough failures (none of which completed, here or anywhere
    `cleared` says, and none `refused` already), those at the most failures: one alone is taken;
    several that tie are taken all (MAX_TIED at most) once they tie at one failure more than
    needed, which a bystander rarely survives; before that, none. Those refused already compete
    with nothing: decoys refused beside a killer whose entry was lifted would otherwise outnumber
    its new failures and hide it."""
    recent = [f for f in failures if now - settings.window < f.at <= now + FUTURE_S]
    answered = {fp for f in recent for fp in f.completed} | set(cleared)
    at: dict[str, list[Failure]] = {}
    for f in recent:
        for fp in set(f.inflight):
            at.setdefault(fp, []).append(f)
    need = max(2, settings.failures)
    skip = answered | set(refused)
    qualified = [(fp, fs) for fp, fs in at.items() if fp not in skip and _distinct(fs) >= need]
    if not qualified:
        return []
    top = max(_distinct(fs) for _, fs in qualified)
    best = [(fp, fs) for fp, fs in qualified if _distinct(fs) == top]
    if len(best) > 1 and (top < need + 1 or len(best) > MAX_TIED):
        return []
    return sorted(best, key=lambda item: (-max(f.at for f in item[1]), item[0]))


def cleared_in(settings: QuarantineSettings, records: Records, now: float) -> set[str]:
    """The fingerprints answered somewhere within the window."""
    return {c.fingerprint for c in records.cleared if now - settings.window < c.at <= now + FUTURE_S}


def held_against(settings: QuarantineSettings, records: Records, now: float) -> set[str]:
    """The fingerprints a replica's answers could clear: in flight at a failure within the window,
    or quarantined now, and not cleared yet."""
    recent = {fp for f in records.failures if now - settings.window < f.at <= now + FUTURE_S for fp in f.inflight}
    return (recent | {q.fingerprint for q in active(records, now)}) - cleared_in(settings, records, now)


def clear(settings: QuarantineSettings, records: Records, answered: Iterable[str], pod: str, now: float
          ) -> tuple[Records, list[Quarantined]]:
    """`pod`'s server answered these fingerprints successfully: those the records hold against are
    cleared (never quarantined within the window) and their active entries removed; the new records
    and the entries removed."""
    against = held_against(settings, records, now)
    new = sorted(set(answered) & against)
    if not new:
        return records, []
    kept = tuple(c for c in records.cleared if now - settings.window < c.at <= now + FUTURE_S)
    cleared = (*kept, *(Cleared(fp, now, pod) for fp in new))[-CLEARED_KEPT:]
    removed = [q for q in records.quarantined if q.fingerprint in new and q.active(now)]
    quarantined = tuple(q for q in records.quarantined if q.fingerprint not in new)
    return Records(records.failures, quarantined, cleared), removed


def _after_lifts(failures: list[Failure], lifted: dict[str, float]) -> list[Failure]:
    """A lifted fingerprint's failures before its lift are no longer evidence against it."""
    out = []
    for f in failures:
        gone = {fp for fp, at in lifted.items() if f.at <= at}
        out.append(dataclasses.replace(f, inflight=tuple(fp for fp in f.inflight if fp not in gone))
                   if gone & set(f.inflight) else f)
    return out


def _kept(settings: QuarantineSettings, current: list[Quarantined], now: float) -> list[Quarantined]:
    """The entries until their TTL; a lifted one after it too, for as long as a failure its lift
    covers can count (`window` after the lift), without its evidence and the newest LIFTS_KEPT of them."""
    lifts = sorted((q for q in current if q.until <= now and q.lifted_at is not None
                    and now < q.lifted_at + settings.window), key=lambda q: q.lifted_at or 0.0)[-LIFTS_KEPT:]
    kept_lifts = {id(q) for q in lifts}
    return [q if now < q.until else dataclasses.replace(q, failures=()) for q in current
            if now < q.until or id(q) in kept_lifts]


def decide(settings: QuarantineSettings, failures: list[Failure], current: list[Quarantined],
           now: float, cleared: Iterable[str] = ()) -> list[Quarantined]:
    """The quarantine list after these failures: the current entries until their TTL, plus new ones.
    A lifted entry stays, lifted, past its TTL as long as the failures before its lift can count, so
    that only failures after the lift count against it."""
    if not settings.enabled:
        return []
    # A fingerprint answered somewhere is no killer: its entry goes, whenever that word arrived (a
    # failure recorded after the entry, whose process had answered it before it failed).
    recent = [f for f in failures if now - settings.window < f.at <= now + FUTURE_S]
    answered = set(cleared) | {fp for f in recent for fp in f.completed}
    kept = [q for q in _kept(settings, current, now) if q.fingerprint not in answered or q.lifted_at is not None]
    known = {q.fingerprint: q for q in kept}
    lifted = {q.fingerprint: q.lifted_at for q in kept if q.lifted_at is not None}
    out = list(kept)
    refused = {q.fingerprint for q in kept if q.active(now)}
    for fp, fs in suspects(settings, _after_lifts(failures, lifted), now, cleared, refused):
        old = known.get(fp)
        if old is not None and old.lifted_at is None:
            continue  # already quarantined
        out = [q for q in out if q.fingerprint != fp]
        evidence = tuple(dataclasses.replace(f, inflight=(), completed=()) for f in sorted(fs, key=lambda f: f.at))
        out.append(Quarantined(fp, now, now + settings.ttl, evidence))
    return out


def lift(current: list[Quarantined], fingerprint: str, now: float) -> list[Quarantined]:
    return [dataclasses.replace(q, lifted_at=now) if q.fingerprint == fingerprint and q.lifted_at is None else q
            for q in current]


def active(records: Records, now: float) -> list[Quarantined]:
    return [q for q in records.quarantined if q.active(now)]


def record(settings: QuarantineSettings, records: Records, failure: Failure, now: float
           ) -> tuple[Records, list[Quarantined]]:
    """`failure` added (once per process and reason), and the quarantine decided again: the new
    records and the entries this failure quarantined."""
    if any((f.pod, f.process, f.reason) == (failure.pod, failure.process, failure.reason)
           for f in records.failures):
        return records, []
    suspects_now = {fp for f in records.failures for fp in f.inflight} | set(failure.inflight)
    # Of the failing process's completions, only those that clear a fingerprint in a failure matter.
    kept = Failure(failure.at, failure.pod, failure.process, failure.reason, failure.inflight[:INFLIGHT_KEPT],
                   failure.newest, tuple(fp for fp in failure.completed if fp in suspects_now)[:COMPLETED_KEPT])
    failures = [f for f in records.failures if now - settings.window < f.at <= now + FUTURE_S] + [kept]
    failures = failures[-FAILURES_KEPT:]
    before = {q.fingerprint for q in active(records, now)}
    quarantined = decide(settings, failures, list(records.quarantined), now, cleared_in(settings, records, now))
    new = [q for q in quarantined if q.active(now) and q.fingerprint not in before]
    out = Records(tuple(failures), tuple(quarantined), records.cleared)
    while len(out.failures) > 1 and len(dump(out)) > ANNOTATION_BUDGET:
        out = Records(out.failures[1:], out.quarantined, out.cleared)  # the oldest evidence goes first
    return out, new


def lift_records(records: Records, fingerprint: str, now: float) -> tuple[Records, bool]:
    """An operator's lift: the entry stays (lifted) until its TTL and, past it, for as long as the
    failures before the lift count (see `decide`), so the same evidence does not quarantine it again;
    True when it was active."""
    was = any(q.fingerprint == fingerprint and q.active(now) for q in records.quarantined)
    return Records(records.failures, tuple(lift(list(records.quarantined), fingerprint, now)), records.cleared), was


# -- the Lease annotation ------------------------------------------------------------------------


class RecordsError(ValueError):
    """The annotation is not one we wrote."""


def _failure_json(f: Failure) -> dict[str, Any]:
    return {"at": f.at, "pod": f.pod, "process": f.process, "reason": f.reason, "inflight": list(f.inflight),
            "newest": f.newest, "completed": list(f.completed)}


def dump(records: Records) -> str:
    return json.dumps({"v": VERSION, "failures": [_failure_json(f) for f in records.failures],
                       "quarantined": [{"fingerprint": q.fingerprint, "since": q.since, "until": q.until,
                                        "lifted_at": q.lifted_at, "failures": [_failure_json(f) for f in q.failures]}
                                       for q in records.quarantined],
                       "cleared": [{"fingerprint": c.fingerprint, "at": c.at, "pod": c.pod} for c in records.cleared]},
                      sort_keys=True, separators=(",", ":"))


def _num(d: Any, key: str, optional: bool = False) -> Any:
    v = d.get(key)
    if optional and v is None:
        return None
    if isinstance(v, bool) or not isinstance(v, int | float) or not math.isfinite(v):
        raise RecordsError(f"{key}: expected a number, got {v!r}")
    return float(v)


def _strs(d: Any, key: str) -> tuple[str, ...]:
    v = d.get(key, [])
    if not isinstance(v, list) or not all(isinstance(x, str) for x in v):
        raise RecordsError(f"{key}: expected a list of strings")
    return tuple(v)


def _str(d: Any, key: str, optional: bool = False) -> Any:
    v = d.get(key)
    if optional and v is None:
        return None
    if not isinstance(v, str):
        raise RecordsError(f"{key}: expected a string, got {v!r}")
    return v


def _failure(d: Any) -> Failure:
    if not isinstance(d, dict):
        raise RecordsError("failure: expected an object")
    return Failure(_num(d, "at"), _str(d, "pod"), _str(d, "process"), _str(d, "reason"), _strs(d, "inflight"),
                   _str(d, "newest", optional=True), _strs(d, "completed"))


def _list(d: Any, key: str) -> list[Any]:
    v = d.get(key, [])
    if not isinstance(v, list):
        raise RecordsError(f"{key}: expected a list")
    return v


def parse(text: str | None) -> Records:
    """The records in the Lease's annotation; absent is empty. Raises RecordsError on anything else."""
    if not text:
        return Records()
    data = lease_text.opened(text, VERSION, "quarantine records", RecordsError)
    failures = tuple(_failure(f) for f in _list(data, "failures"))
    quarantined = []
    for q in _list(data, "quarantined"):
        if not isinstance(q, dict):
            raise RecordsError("quarantined: expected objects")
        quarantined.append(Quarantined(_str(q, "fingerprint"), _num(q, "since"), _num(q, "until"),
                                       tuple(_failure(f) for f in _list(q, "failures")),
                                       _num(q, "lifted_at", optional=True)))
    cleared = []
    for c in _list(data, "cleared"):
        if not isinstance(c, dict):
            raise RecordsError("cleared: expected objects")
        cleared.append(Cleared(_str(c, "fingerprint"), _num(c, "at"), _str(c, "pod")))
    return Records(failures, tuple(quarantined), tuple(cleared))


def describe(q: Quarantined, now: float) -> dict[str, Any]:
    """An entry as /status and the CLI show it: the evidence without the other fingerprints."""
    return {"fingerprint": q.fingerprint, "since": q.since, "until": q.until, "active": q.active(now),
            "lifted_at": q.lifted_at, "pods": q.pods,
            "failures": [{"at": f.at, "pod": f.pod, "process": f.process, "reason": f.reason,
                          "newest": f.newest == q.fingerprint, "inflight": len(f.inflight)} for f in q.failures]}



def failure_from(report: Any, pod: str, reason: str, at: float) -> Failure:
    """A failure from the server's `GET /control/requests`: what was in flight when its context was
    lost where it says; for a hang, what was in flight when its loop stopped advancing where it says
    (`at_stall`: the server froze it then, before a client that gave up had left); else what is in
    flight now. Raises RecordsError on an answer that is not one."""
    if not isinstance(report, dict):
        raise RecordsError("expected an object")
    frozen = report.get("at_failure")
    if not isinstance(frozen, dict) and reason == HANG:
        frozen = report.get("at_stall")
    source = frozen if isinstance(frozen, dict) else report
    inflight = _strs(source, "inflight")
    completed = _strs(source, "completed") if "completed" in source else _strs(report, "completed")
    return Failure(at, pod, _str(report, "instance_id"), reason, inflight[:INFLIGHT_KEPT],
                   _str(source, "newest", optional=True), completed)


def answered_in(report: Any) -> set[str]:
    """The fingerprints a server's `GET /control/requests` says it answered successfully lately.
    Raises RecordsError on an answer that is not one."""
    if not isinstance(report, dict):
        raise RecordsError("expected an object")
    return set(_strs(report, "completed"))


def server_entries(records: Records, now: float) -> list[dict[str, Any]]:
    """The active quarantine as the server's control API takes it."""
    return [{"fingerprint": q.fingerprint, "until": q.until, "failures": len(q.failures), "pods": q.pods}
            for q in active(records, now)]
