"""The query of death: which request fingerprints to refuse, from the failures of the workload.

Pure: failure records in (each a poison exit, a hang or a context loss of one process, with the
requests in flight at it: their fingerprints and input fingerprints, the newest admitted before it,
and those the process answered within its window), the fingerprints to quarantine out. No I/O, no
clock of its own; times are wall-clock seconds, since the records come from many pods.

Each request in flight at a failure stands for its input (its input fingerprint: the prompt, messages
or input alone, whatever the sampler, length or spelling) unless that input was answered somewhere or
is refused already; then for itself (its fingerprint). A request without an input fingerprint stands
for itself. An input stands as itself where none of its requests was at all of its failures (the
settings or the spelling changed from one failure to the next), and is then quarantined as the input,
every spelling of it refused; else each of its requests stands for itself, and one is quarantined (its
benign twins, and the same text sent beside it with other settings, are not). A suspect is what was
in flight at `failures` (2) failures of the workload within `window`, on two different pods or
processes, and that nothing clears:
- it completed successfully somewhere (a culprit never does): in a failing process's answers within
  its window, or on any replica of the workload, whose sidecar says so in the records (`Cleared`)
  when its server answered a fingerprint the records hold against. An entry whose fingerprint is
  cleared so is removed: a request (or an input) answered anywhere is no killer;
- a bystander (a retried innocent request that happened to be in flight twice) is told apart from
  the culprit: the culprit is in every failure it caused and bystanders come and go. The suspects at
  the most failures are taken when one stands alone; where several tie, one failure more than
  `failures` is waited for (it tells a bystander apart), and then all that still tie are taken, at
  most MAX_TIED, or MAX_TOGETHER where all were in flight together at the very same failures: a client
  that sends the killer with decoys of its own in flight each time (up to a server's admission limit)
  has them refused too, and being newest before a fault counts for nothing (a popular request sent right
  after the killer would be framed). A killer that changes its settings or spelling at every try is
  one suspect (its input) at as many failures as a bystander beside it, never fewer;
- a success forgotten within the window (a server's answers past its bound, or the records' past
  their budget) could be any suspect's: then nothing new is quarantined until it has left the window;
- a quarantine decided is in force `confirm` later (served meanwhile, while every replica's sync says
  whether it answered it, and dropped if one did: an innocent request beside the killer is not refused
  before the replicas that answered it were heard);
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

from gpu_watchdog.watchdog.core import lease_text
from gpu_watchdog.watchdog.core.names import HANG
from gpu_watchdog.watchdog.core.settings import QuarantineSettings
from gpu_watchdog.watchdog.core.timing import FUTURE_S

# A bound on the damage: suspects that tie are all taken up to this many (a killer with up to 15
# decoys of its own); more alike than that is no one request's doing, and none is taken, unless they
# were in flight together at the very same failures (a client sending the killer with decoys up to the
# server's admission limit each time): then up to MAX_TOGETHER, whose entries fit the annotation's
# budget beside the failures that are their evidence.
MAX_TIED = 16
MAX_TOGETHER = 128
ANNOTATION = "gpu-watchdog.io/quarantine"  # on the workload's Lease, beside the fleet's ledger
VERSION = 1
FAILURES_KEPT = 64  # failures within the window, newest kept (and fewer where the budget says so)
LIFTS_KEPT = 64  # lifted entries kept past their TTL (the fingerprint and the lift's time), newest kept
# Requests of one failure kept: more than a step runs unless the server's --max-batch-size is set
# above it (the server reports as many: `inference.screen.REPORTED`), and small enough that one
# failure with its input fingerprints fits the annotation's budget well (about 80 KiB).
INFLIGHT_KEPT = 2048
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
    completed: tuple[str, ...] = ()  # fingerprints the process answered successfully (those that matter)
    # The input fingerprint of each request in `inflight`, in its order ("" where it has none); empty
    # where the server gave none (an older one): each request then stands for itself.
    inputs: tuple[str, ...] = ()
    # The newest success the process had forgotten (its `completed` is whole after it); None: none.
    forgot_until: float | None = None

    def requests(self) -> list[tuple[str, str]]:
        """Each request in flight: its fingerprint and its input fingerprint (the fingerprint where it
        has none)."""
        return [(fp, (self.inputs[i] if i < len(self.inputs) else "") or fp) for i, fp in enumerate(self.inflight)]


@dataclass(frozen=True)
class Cleared:
    """A fingerprint the records hold against that a replica answered successfully."""

    fingerprint: str
    at: float
    pod: str


@dataclass(frozen=True)
class Records:
    """What the workload knows: its failures (with their fingerprints), its quarantine list, the
    suspects answered somewhere, and the newest of those it had to forget for its budget."""

    failures: tuple[Failure, ...] = ()
    quarantined: tuple[Quarantined, ...] = ()
    cleared: tuple[Cleared, ...] = ()
    forgot_until: float | None = None


@dataclass(frozen=True)
class Quarantined:
    fingerprint: str
    since: float
    until: float
    failures: tuple[Failure, ...]  # the evidence
    lifted_at: float | None = None  # an operator's lift
    input: bool = False  # an input fingerprint: every request with that input is refused
    # The failures on record at the lift (`pod/process`): the evidence it forgave, by identity, so a
    # failure stamped by a node whose clock runs ahead does not pass for one after the lift. None
    # (records written before this was kept): the stamps decide.
    lifted_over: tuple[str, ...] | None = None
    # In force from then (`settings.confirm` after it was decided, on the API server's clock its writer
    # learned): until then every replica serves it, and one that answers it says so and drops it. None
    # (records written before this was kept): in force as written.
    in_force_at: float | None = None

    @property
    def pods(self) -> list[str]:
        return sorted({f.pod for f in self.failures})

    def active(self, now: float) -> bool:
        """Refused by every replica now."""
        return self.lifted_at is None and (self.in_force_at is None or self.in_force_at <= now) and now < self.until

    def pending(self, now: float) -> bool:
        """Decided, and waiting for a replica's word that it answered it before it is refused."""
        return self.lifted_at is None and self.in_force_at is not None and now < self.in_force_at

    def standing(self, now: float) -> bool:
        """In force or waiting to be (`pending`): neither lifted nor expired."""
        return self.lifted_at is None and now < self.until


def _distinct(failures: Iterable[Failure]) -> int:
    return len({(f.pod, f.process) for f in failures})


def _recent(settings: QuarantineSettings, failures: Iterable[Failure], now: float) -> list[Failure]:
    return [f for f in failures if now - settings.window < f.at <= now + FUTURE_S]


def forgetting(settings: QuarantineSettings, failures: Iterable[Failure], now: float,
               forgot_until: float | None = None) -> bool:
    """Whether a success within the window may have been forgotten (by a failing process, past its
    bound, or by the records, past their budget, `forgot_until`): it could be any suspect's, so
    nothing new is quarantined meanwhile."""
    times = [f.forgot_until for f in _recent(settings, failures, now) if f.forgot_until is not None]
    if forgot_until is not None:
        times.append(forgot_until)
    return any(t > now - settings.window for t in times)


def suspects(settings: QuarantineSettings, failures: list[Failure], now: float,
             cleared: Iterable[str] = (), refused: Iterable[str] = (),
             forgot_until: float | None = None) -> list[tuple[str, list[Failure]]]:
    """The fingerprints to quarantine (an input's or a request's), with the failures each stood at."""
    return [(fp, fs) for fp, fs, _ in _suspects(settings, failures, now, cleared, refused, forgot_until)]


def _suspects(settings: QuarantineSettings, failures: list[Failure], now: float, cleared: Iterable[str],
              refused: Iterable[str], forgot_until: float | None) -> list[tuple[str, list[Failure], bool]]:
    """`suspects`, each with whether it is an input.

    Each request in flight stands for its input, unless the input was answered (here or anywhere
    `cleared` says) or is `refused` already; then for itself, unless it was answered. An input stands
    as itself where none of its requests was at all of its failures (its settings or spelling changed
    from one to the next); else each of its requests stands for itself (one may be the killer, the
    others the same text sent beside it). Of those at enough failures, those at the most: one alone is
    taken; several that tie are taken all (MAX_TIED at most) once they tie at one failure more than
    needed, which a bystander rarely survives; before that, none. Those refused already compete with
    nothing: decoys refused beside a killer whose entry was lifted would otherwise outnumber its new
    failures and hide it. Nothing while a success within the window may have been forgotten
    (`forgetting`)."""
    recent = _recent(settings, failures, now)
    if forgetting(settings, recent, now, forgot_until):
        return []
    answered = {fp for f in recent for fp in f.completed} | set(cleared)
    refused = set(refused)
    stood: dict[str, dict[str, list[Failure]]] = {}  # input (or request) -> its requests -> their failures
    for f in recent:
        for fp, input_fp in f.requests():
            if fp in answered:
                continue
            key = fp if input_fp in answered or input_fp in refused else input_fp
            at = stood.setdefault(key, {}).setdefault(fp, [])
            if not at or at[-1] is not f:
                at.append(f)
    candidates: list[tuple[str, list[Failure], bool]] = []
    for key, requests in stood.items():
        at = list({id(f): f for fs in requests.values() for f in fs}.values())
        if len(requests) > 1 and all(len(fs) < len(at) for fs in requests.values()):
            candidates.append((key, at, True))
        else:
            candidates += [(fp, fs, False) for fp, fs in requests.items() if fp not in refused]
    need = max(2, settings.failures)
    qualified = [c for c in candidates if _distinct(c[1]) >= need]
    if not qualified:
        return []
    top = max(_distinct(fs) for _, fs, _ in qualified)
    best = [c for c in qualified if _distinct(c[1]) == top]
    if len(best) > 1 and (top < need + 1 or (len(best) > MAX_TIED and not _together(best))):
        return []
    return sorted(best, key=lambda c: (-max(f.at for f in c[1]), c[0]))


def _together(tied: list[tuple[str, list[Failure], bool]]) -> bool:
    """Whether these suspects were in flight at the very same failures, and are few enough to list."""
    sets = {frozenset((f.pod, f.process, f.reason) for f in fs) for _, fs, _ in tied}
    return len(sets) == 1 and len(tied) <= MAX_TOGETHER


def cleared_in(settings: QuarantineSettings, records: Records, now: float) -> set[str]:
    """The fingerprints answered somewhere within the window."""
    return {c.fingerprint for c in records.cleared if now - settings.window < c.at <= now + FUTURE_S}


def _held(failures: Iterable[Failure], quarantined: Iterable[Quarantined]) -> set[str]:
    """Every fingerprint and input fingerprint in flight at these failures, and these entries'."""
    return {fp for f in failures for pair in f.requests() for fp in pair} | {q.fingerprint for q in quarantined}


def held_against(settings: QuarantineSettings, records: Records, now: float) -> set[str]:
    """The fingerprints a replica's answers could clear: in flight at a failure within the window
    (requests' and inputs'), or quarantined now, and not cleared yet."""
    return _held(_recent(settings, records.failures, now), standing(records, now)) - cleared_in(settings, records, now)


def clear(settings: QuarantineSettings, records: Records, answered: Iterable[str], pod: str, now: float
          ) -> tuple[Records, list[Quarantined]]:
    """`pod`'s server answered these fingerprints successfully: those the records hold against are
    cleared (never quarantined within the window, however many are cleared after them: the records'
    budget alone bounds them, see `_fit`) and their active entries removed; the new records and the
    entries removed."""
    against = held_against(settings, records, now)
    new = sorted(set(answered) & against)
    if not new:
        return records, []
    kept = tuple(c for c in records.cleared if now - settings.window < c.at <= now + FUTURE_S)
    cleared = (*kept, *(Cleared(fp, now, pod) for fp in new))
    removed = [q for q in records.quarantined if q.fingerprint in new and q.standing(now)]
    quarantined = tuple(q for q in records.quarantined if q.fingerprint not in new)
    return _fit(Records(records.failures, quarantined, cleared, records.forgot_until)), removed


def _key(f: Failure) -> str:
    return f"{f.pod}/{f.process}"


def _before(f: Failure, q: Quarantined) -> bool:
    """`f` was on record when `q` was lifted: the Lease's order decides, not two nodes' clocks."""
    if q.lifted_over is not None:
        return _key(f) in q.lifted_over
    return q.lifted_at is not None and f.at <= q.lifted_at


def _after_lifts(failures: list[Failure], lifted: dict[str, Quarantined]) -> list[Failure]:
    """A lifted fingerprint's failures before its lift are no longer evidence against it (nor against
    the requests of a lifted input, nor the input of a lifted request)."""
    out = []
    for f in failures:
        gone = {fp for fp, q in lifted.items() if _before(f, q)}
        keep = [i for i, pair in enumerate(f.requests()) if not gone & set(pair)]
        if len(keep) == len(f.inflight):
            out.append(f)
            continue
        out.append(dataclasses.replace(f, inflight=tuple(f.inflight[i] for i in keep),
                                       inputs=tuple(f.inputs[i] for i in keep) if f.inputs else ()))
    return out


def _kept(settings: QuarantineSettings, current: list[Quarantined], now: float) -> list[Quarantined]:
    """The entries until their TTL; a lifted one after it too, for as long as a failure its lift
    covers can count (`window` after the lift, and FUTURE_S more: a failure may be stamped that far
    ahead), without its evidence and the newest LIFTS_KEPT of them."""
    lifts = sorted((q for q in current if q.until <= now and q.lifted_at is not None
                    and now < q.lifted_at + settings.window + FUTURE_S),
                   key=lambda q: q.lifted_at or 0.0)[-LIFTS_KEPT:]
    kept_lifts = {id(q) for q in lifts}
    return [q if now < q.until else dataclasses.replace(q, failures=()) for q in current
            if now < q.until or id(q) in kept_lifts]


def decide(settings: QuarantineSettings, failures: list[Failure], current: list[Quarantined],
           now: float, cleared: Iterable[str] = (), forgot_until: float | None = None) -> list[Quarantined]:
    """The quarantine list after these failures: the current entries until their TTL, plus new ones.
    A lifted entry stays, lifted, past its TTL as long as the failures before its lift can count, so
    that only failures after the lift count against it. `forgot_until`: the records' (`suspects`)."""
    if not settings.enabled:
        return []
    # A fingerprint answered somewhere is no killer: its entry goes, whenever that word arrived (a
    # failure recorded after the entry, whose process had answered it).
    answered = set(cleared) | {fp for f in _recent(settings, failures, now) for fp in f.completed}
    kept = [q for q in _kept(settings, current, now) if q.fingerprint not in answered or q.lifted_at is not None]
    known = {q.fingerprint: q for q in kept}
    lifted = {q.fingerprint: q for q in kept if q.lifted_at is not None}
    out = list(kept)
    refused = {q.fingerprint for q in kept if q.active(now)}
    for fp, fs, of_input in _suspects(settings, _after_lifts(failures, lifted), now, cleared, refused, forgot_until):
        old = known.get(fp)
        if old is not None and old.lifted_at is None:
            continue  # already quarantined
        out = [q for q in out if q.fingerprint != fp]
        evidence = tuple(dataclasses.replace(f, inflight=(), completed=(), inputs=())
                         for f in sorted(fs, key=lambda f: f.at))
        # Without a wait, in force as written, whatever its writer's clock said.
        out.append(Quarantined(fp, now, now + settings.confirm + settings.ttl, evidence, input=of_input,
                               in_force_at=now + settings.confirm if settings.confirm > 0 else None))
    return out


def lift(current: list[Quarantined], fingerprint: str, now: float, over: Iterable[Failure] | None = None
         ) -> list[Quarantined]:
    """`fingerprint`'s entry lifted now, forgiving the failures `over` (those on record; None: those
    stamped no later than now)."""
    keys = None if over is None else tuple(sorted({_key(f) for f in over}))
    return [dataclasses.replace(q, lifted_at=now, lifted_over=keys)
            if q.fingerprint == fingerprint and q.lifted_at is None else q for q in current]


def active(records: Records, now: float) -> list[Quarantined]:
    return [q for q in records.quarantined if q.active(now)]


def standing(records: Records, now: float) -> list[Quarantined]:
    """The entries in force or waiting to be (`Quarantined.standing`)."""
    return [q for q in records.quarantined if q.standing(now)]


def record(settings: QuarantineSettings, records: Records, failure: Failure, now: float
           ) -> tuple[Records, list[Quarantined]]:
    """`failure` added (once per process and reason), and the quarantine decided again: the new
    records and the entries this failure quarantined (in force once confirmed: `Quarantined.pending`)."""
    if any((f.pod, f.process, f.reason) == (failure.pod, failure.process, failure.reason)
           for f in records.failures):
        return records, []
    suspects_now = _held((*records.failures, failure), ())
    # Of the failing process's successes, only those that clear a request or input in a failure
    # matter; all of them are kept (the annotation's budget bounds them, with the failures).
    kept = dataclasses.replace(failure, inflight=failure.inflight[:INFLIGHT_KEPT],
                               inputs=failure.inputs[:INFLIGHT_KEPT],
                               completed=tuple(fp for fp in failure.completed if fp in suspects_now))
    failures = [*_recent(settings, records.failures, now), kept][-FAILURES_KEPT:]
    before = {q.fingerprint for q in standing(records, now)}
    quarantined = decide(settings, failures, list(records.quarantined), now, cleared_in(settings, records, now),
                         records.forgot_until)
    new = [q for q in quarantined if q.standing(now) and q.fingerprint not in before]
    return _fit(Records(tuple(failures), tuple(quarantined), records.cleared, records.forgot_until)), new


def _fit(records: Records) -> Records:
    """The records within ANNOTATION_BUDGET. First the clears no failure or entry holds against go (a
    replica that still has the answer clears it again at its next sync), then the oldest failures
    (less evidence only quarantines less), down to the newest; then the oldest clears, remembered as
    forgotten (`Records.forgot_until`): nothing new is quarantined while that is within the window."""
    out = records
    while len(text := dump(out)) > ANNOTATION_BUDGET:
        held = _held(out.failures, out.quarantined)
        if any(c.fingerprint not in held for c in out.cleared):
            out = dataclasses.replace(out, cleared=tuple(c for c in out.cleared if c.fingerprint in held))
        elif len(out.failures) > 1:
            out = dataclasses.replace(out, failures=out.failures[1:])
        elif out.cleared:
            over, n = len(text) - ANNOTATION_BUDGET, 0
            while over > 0 and n < len(out.cleared):
                over -= len(_json(_cleared_json(out.cleared[n]))) + 1
                n += 1
            forgot = max([c.at for c in out.cleared[:n]] + [out.forgot_until or 0.0])
            out = dataclasses.replace(out, cleared=out.cleared[n:], forgot_until=forgot)
        else:
            break  # one failure alone: INFLIGHT_KEPT keeps it well within the budget
    return out


def lost(now: float) -> Records:
    """The records after the Lease that held them was deleted (or their annotation removed): empty,
    and remembered as forgotten from now (`Records.forgot_until`): a success they held may have been
    any suspect's, so nothing new is quarantined for a window from now (no success they held is
    older than that, and the replicas that answered say so again at their next syncs)."""
    return Records(forgot_until=now)


def lift_records(records: Records, fingerprint: str, now: float) -> tuple[Records, bool]:
    """An operator's lift: the entry stays (lifted) until its TTL and, past it, for as long as the
    failures before the lift count (see `decide`), so the same evidence does not quarantine it again;
    True when it was active."""
    was = any(q.fingerprint == fingerprint and q.standing(now) for q in records.quarantined)
    return dataclasses.replace(records, quarantined=tuple(lift(list(records.quarantined), fingerprint, now,
                                                               records.failures))), was


# -- the Lease annotation ------------------------------------------------------------------------


class RecordsError(ValueError):
    """The annotation is not one we wrote."""


def _failure_json(f: Failure) -> dict[str, Any]:
    out = {"at": f.at, "pod": f.pod, "process": f.process, "reason": f.reason, "inflight": list(f.inflight),
           "newest": f.newest, "completed": list(f.completed)}
    # Written only where there are some (an older sidecar reads the rest alike, and ignores these).
    if f.inputs:
        out["inputs"] = list(f.inputs)
    if f.forgot_until is not None:
        out["forgot_until"] = f.forgot_until
    return out


def _cleared_json(c: Cleared) -> dict[str, Any]:
    return {"fingerprint": c.fingerprint, "at": c.at, "pod": c.pod}


def _quarantined_json(q: Quarantined) -> dict[str, Any]:
    out = {"fingerprint": q.fingerprint, "since": q.since, "until": q.until, "lifted_at": q.lifted_at,
           "failures": [_failure_json(f) for f in q.failures]}
    if q.input:
        out["input"] = True
    if q.lifted_over is not None:
        out["lifted_over"] = list(q.lifted_over)
    if q.in_force_at is not None:
        out["in_force_at"] = q.in_force_at
    return out


def _json(value: Any) -> str:
    return json.dumps(value, sort_keys=True, separators=(",", ":"))


def dump(records: Records) -> str:
    out: dict[str, Any] = {"v": VERSION, "failures": [_failure_json(f) for f in records.failures],
                           "quarantined": [_quarantined_json(q) for q in records.quarantined],
                           "cleared": [_cleared_json(c) for c in records.cleared]}
    if records.forgot_until is not None:
        out["forgot_until"] = records.forgot_until
    return _json(out)


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


def _inputs(d: Any, inflight: tuple[str, ...]) -> tuple[str, ...]:
    inputs = _strs(d, "inputs")
    if inputs and len(inputs) != len(inflight):
        raise RecordsError("inputs: expected one for each fingerprint in flight")
    return inputs


def _failure(d: Any) -> Failure:
    if not isinstance(d, dict):
        raise RecordsError("failure: expected an object")
    inflight = _strs(d, "inflight")
    return Failure(_num(d, "at"), _str(d, "pod"), _str(d, "process"), _str(d, "reason"), inflight,
                   _str(d, "newest", optional=True), _strs(d, "completed"), _inputs(d, inflight),
                   _num(d, "forgot_until", optional=True))


def _keys(q: Any) -> tuple[str, ...] | None:
    return None if q.get("lifted_over") is None else _strs(q, "lifted_over")


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
        if not isinstance(q.get("input", False), bool):
            raise RecordsError("input: expected true or false")
        quarantined.append(Quarantined(_str(q, "fingerprint"), _num(q, "since"), _num(q, "until"),
                                       tuple(_failure(f) for f in _list(q, "failures")),
                                       _num(q, "lifted_at", optional=True), q.get("input", False),
                                       _keys(q), _num(q, "in_force_at", optional=True)))
    cleared = []
    for c in _list(data, "cleared"):
        if not isinstance(c, dict):
            raise RecordsError("cleared: expected objects")
        cleared.append(Cleared(_str(c, "fingerprint"), _num(c, "at"), _str(c, "pod")))
    return Records(failures, tuple(quarantined), tuple(cleared), _num(data, "forgot_until", optional=True))


def describe(q: Quarantined, now: float) -> dict[str, Any]:
    """An entry as /status and the CLI show it: the evidence without the other fingerprints."""
    return {"fingerprint": q.fingerprint, "input": q.input, "since": q.since, "until": q.until,
            "active": q.active(now), "pending": q.pending(now), "in_force_at": q.in_force_at,
            "lifted_at": q.lifted_at, "pods": q.pods,
            "failures": [{"at": f.at, "pod": f.pod, "process": f.process, "reason": f.reason,
                          "newest": f.newest == q.fingerprint, "inflight": len(f.inflight)} for f in q.failures]}


def failure_from(report: Any, pod: str, reason: str, at: float) -> Failure:
    """A failure from the server's `GET /control/requests`: what ran in the step that lost its context
    (or was in flight then) where it says; for a hang, what was in flight when its loop stopped
    advancing where it says (`at_stall`: the server froze it then, before a client that gave up had
    left); else what is in flight now. Each with its input fingerprint where the server gives them,
    and the answers the server had then (with until when it had forgotten some). Raises RecordsError
    on an answer that is not one."""
    if not isinstance(report, dict):
        raise RecordsError("expected an object")
    frozen = report.get("at_failure")
    if not isinstance(frozen, dict) and reason == HANG:
        frozen = report.get("at_stall")
    source = frozen if isinstance(frozen, dict) else report
    inflight = _strs(source, "inflight")
    inputs = _inputs(source, inflight)
    answers = source if "completed" in source else report
    return Failure(at, pod, _str(report, "instance_id"), reason, inflight[:INFLIGHT_KEPT],
                   _str(source, "newest", optional=True), _strs(answers, "completed"), inputs[:INFLIGHT_KEPT],
                   _num(answers, "forgot_until", optional=True))


def answered_in(report: Any) -> set[str]:
    """The fingerprints (and input fingerprints) a server's `GET /control/requests` says it answered
    successfully within its bound (`inference.screen.ANSWERED_FOR_S`).
    Raises RecordsError on an answer that is not one."""
    if not isinstance(report, dict):
        raise RecordsError("expected an object")
    return set(_strs(report, "completed"))


def server_entries(records: Records, now: float, refuse: bool = True) -> list[dict[str, Any]]:
    """The active quarantine as the server's control API takes it; `refuse` false: in shadow, each
    entry served and logged (`would_quarantine`) rather than refused."""
    shadow: dict[str, Any] = {} if refuse else {"enforce": False}
    return [{"fingerprint": q.fingerprint, "until": q.until, "failures": len(q.failures), "pods": q.pods, **shadow}
            for q in active(records, now)]
