"""What the server knows of its requests for the query of death: the fingerprints in flight (each
with its input fingerprint), the newest admitted, those answered within ANSWERED_FOR_S, what ran in
the step that lost the context or was in flight when the engine's loop stopped advancing, and the
quarantine list it refuses by. Shared by `serve` and the in-process agent (`RequestBook`,
`QuarantineList`, `Screen`), so the sidecar reads one shape from either through the control API.

Thread-safe: the agent's requests run in worker threads, `serve`'s failure comes from its decode
thread.
"""

from __future__ import annotations

import contextvars
import hashlib
import json
import os
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import structlog

from gpu_watchdog.inference.faults import FaultInjector
from gpu_watchdog.inference.fingerprint import digest, fingerprint, input_fingerprint
from gpu_watchdog.inference.validation import BadRequest

log = structlog.get_logger(__name__)

KEY_ENV = "GPU_WATCHDOG_FINGERPRINT_KEY"
# After a lost context, the process waits this long at most (once the watchdog saw the poisoned
# state) for the watchdog to read what was in flight, before it exits.
FAILURE_READ_WAIT_S = 3.0
SCREEN_MAX_BYTES = 16 * 1024 * 1024  # the agent's glue fingerprints bodies up to this size
# Requests in flight reported (and frozen at a failure) at most, the oldest where there are more:
# more than the engine runs in one step unless `--max-batch-size` is set above it (256 by default),
# so what ran in a failed step is whole; the sidecar keeps as many (`quarantine.INFLIGHT_KEPT`).
REPORTED = 2048
# Fingerprints answered successfully, each with the time of its last success, kept this long: the
# sidecar's evidence window (`policy.quarantine.window`, one hour by default) is what a success
# must be remembered for, however many answers come after it, and five minutes more, so that a
# sidecar whose clock runs behind this node's never takes an answer forgotten by age for one inside
# its window. A window longer than this makes the sidecar's rule quarantine nothing once a process
# has forgotten an answer younger than the window.
ANSWERED_FOR_S = 3600.0 + 300.0
# And this many at most (exact and input fingerprints counted apart: about 45 MB at most, the hour
# of 33 distinct requests a second); past it the oldest go, and the report says until when it forgot
# (`forgot_until`), so that the sidecar's rule refuses to quarantine rather than frame a request
# answered within its window.
ANSWERED_MAX = 1 << 18
UNTIL_MAX = 32503680000.0  # the year 3000: a time, not an overflow
QUARANTINE_MAX = 256  # entries a server holds; the sidecar's rule quarantines a few per episode
# Work in flight and the engine's forward-pass counter flat this long: the server freezes what is in
# flight (`RequestBook.stalled`), the evidence of a hang. Well under the sidecar's canary timeout
# (10 s by default; a hang is decided after several, 30-60 s), so the snapshot precedes any hang
# decision and is taken before a client that gives up has left; well over a normal step (a decode
# step takes milliseconds, a prefill chunk well under a second), so a busy server does not take one.
STALL_AFTER_S = 5.0

# Whether the request being handled matches an injected fault's `when_prompt_contains`: set by the
# HTTP layer for the request's task (and the threads it hands its work to), read where work starts.
MARKED: contextvars.ContextVar[frozenset[str]] = contextvars.ContextVar("gpu_watchdog_marked", default=frozenset())
# The request's booking in the RequestBook (its ticket), set where it is screened for the request's
# task, read where the engine takes its work: a step that loses the context names what ran in it.
BOOKING: contextvars.ContextVar[int | None] = contextvars.ContextVar("gpu_watchdog_booking", default=None)


def workload_key(model: str) -> bytes:
    """The fingerprint key: `GPU_WATCHDOG_FINGERPRINT_KEY` (the chart's Secret, one per release, so
    every replica computes the same fingerprint and nobody else can), else one derived from the
    model's name (the same across replicas; guessable by whoever knows the model)."""
    secret = os.environ.get(KEY_ENV, "").strip()
    if secret:
        return secret.encode()
    return hashlib.sha256(f"gpu-watchdog fingerprint key for {model}".encode()).digest()


class RequestBook:
    """The fingerprints in flight (admitted, not answered), the newest admitted, those answered
    successfully within ANSWERED_FOR_S, and the snapshots taken when the context was lost and when
    the engine's loop stalled.

    Each booking is a fingerprint and its input fingerprint (None where it has none: its fingerprint
    stands for its input); reports list them in two lists of one order, `inflight` and `inputs`."""

    def __init__(self, instance_id: str, clock: Callable[[], float] = time.time) -> None:
        self.instance_id = instance_id
        self._clock = clock
        self._lock = threading.Lock()
        self._inflight: dict[int, tuple[str, str | None]] = {}
        self._next = 0
        self._newest: str | None = None
        # Fingerprint -> its last success, oldest first: bounded by time, so that no amount of other
        # traffic flushes a success the sidecar's window still needs.
        self._answered: OrderedDict[str, float] = OrderedDict()
        self._last_answer = 0.0
        self._forgot_until: float | None = None  # the newest success forgotten (by age or by count)
        self._at_failure: dict[str, Any] | None = None
        self._at_stall: dict[str, Any] | None = None
        self.failure_read = threading.Event()  # the watchdog read `at_failure`

    def begin(self, fp: str, input_fp: str | None = None) -> int:
        with self._lock:
            self._next += 1
            self._inflight[self._next] = (fp, input_fp)
            self._newest = fp
            return self._next

    def end(self, ticket: int, ok: bool) -> None:
        with self._lock:
            booked = self._inflight.pop(ticket, None)
            # Nothing completes on a lost context: a stream already answered 200 ends in an error.
            if ok and booked is not None and self._at_failure is None:
                # Never before an answer already kept, so the oldest stay first when the clock steps back.
                now = self._last_answer = max(self._clock(), self._last_answer)
                for fp in booked:
                    if fp is not None:
                        self._answered[fp] = now
                        self._answered.move_to_end(fp)
                self._forget(now)

    def _forget(self, now: float) -> None:
        """Called with the lock held: the answers older than ANSWERED_FOR_S go, and the oldest past
        ANSWERED_MAX; the newest of them is remembered as forgotten."""
        while self._answered:
            fp, at = next(iter(self._answered.items()))
            if at > now - ANSWERED_FOR_S and len(self._answered) <= ANSWERED_MAX:
                return
            del self._answered[fp]
            self._forgot_until = at if self._forgot_until is None else max(self._forgot_until, at)

    def _snapshot(self, tickets: Iterable[int] | None = None) -> dict[str, Any]:
        """Called with the lock held: these bookings (all in flight where None), newest first and once
        each (the oldest REPORTED where there are more: those are running, the newest may be waiting),
        with the answers kept now."""
        if tickets is None:
            booked = list(self._inflight.values())
        else:
            booked = [self._inflight[t] for t in sorted(set(tickets)) if t in self._inflight]
        pairs = list(dict.fromkeys(reversed(booked)))[-REPORTED:]
        self._forget(self._clock())
        return {"inflight": [fp for fp, _ in pairs], "inputs": [i or "" for _, i in pairs],
                "inflight_total": len(booked), "newest": self._newest, "at": self._clock(),
                "completed": list(self._answered), "forgot_until": self._forgot_until}

    def failed(self, ran: Iterable[int] | None = None) -> dict[str, Any]:
        """Freeze the failure's evidence: the bookings that ran in the step that lost the context
        (`ran`, told by the engine before anything else), else everything in flight (the agent, a
        failure outside a step). The first call wins."""
        with self._lock:
            if self._at_failure is None:
                self._at_failure = self._snapshot(ran)
            return dict(self._at_failure)

    def stalled(self) -> dict[str, Any]:
        """Freeze what is in flight now, and what had completed: the engine's loop stopped advancing
        (the first call of a stall wins; a request that ends afterwards stays in it)."""
        with self._lock:
            if self._at_stall is None:
                self._at_stall = self._snapshot()
            return dict(self._at_stall)

    def resumed(self) -> bool:
        """The loop advanced again: the stall's snapshot is no evidence and goes. Whether there was one."""
        with self._lock:
            had, self._at_stall = self._at_stall is not None, None
            return had

    def wait_read(self) -> bool:
        """Block until the watchdog took what was in flight at the failure (`report(evidence=True)`,
        bounded); True if it did or there was nothing to take."""
        with self._lock:
            nothing = self._at_failure is None or not self._at_failure["inflight"]
        return nothing or self.failure_read.wait(FAILURE_READ_WAIT_S)

    def report(self, evidence: bool = False) -> dict[str, Any]:
        """What is in flight, answered, and at the failure or stall. `evidence`: this read takes the
        failure's evidence (`wait_read` is over); a read for anything else leaves it waiting."""
        with self._lock:
            if evidence and self._at_failure is not None:
                self.failure_read.set()
            return {"instance_id": self.instance_id, **self._snapshot(), "at_failure": self._at_failure,
                    "at_stall": self._at_stall}


class StallRule:
    """Whether the engine's loop has stalled, from samples of its forward-pass counter and whether
    work is in flight (running or waiting), on an injected clock: stalled once work has been in
    flight with the counter flat for `after_s`; over only when the counter advances (a wedged loop's
    work never leaves it, and a canary that passes advances it)."""

    def __init__(self, now: Callable[[], float] = time.monotonic, after_s: float = STALL_AFTER_S) -> None:
        self.now = now
        self.after_s = after_s
        self.stalled = False
        self._forwards: int | None = None
        self._since = 0.0  # since when the counter has been flat with work in flight

    def observe(self, forwards: int, busy: bool) -> bool:
        """One sample; whether the loop is stalled now."""
        t = self.now()
        if forwards != self._forwards:
            self._forwards, self._since, self.stalled = forwards, t, False
        elif not busy and not self.stalled:
            self._since = t  # idle: a flat counter is no stall, and the wait starts with the work
        elif busy and t - self._since >= self.after_s:
            self.stalled = True
        return self.stalled


@dataclass(frozen=True)
class Entry:
    fingerprint: str
    until: float  # wall clock
    failures: int = 0
    pods: tuple[str, ...] = ()
    # False: shadow (the sidecar's policy.enforce): served, and logged as the refusal it would have been.
    enforce: bool = True

    def describe(self) -> dict[str, Any]:
        return {"fingerprint": self.fingerprint, "until": self.until, "failures": self.failures,
                "pods": list(self.pods), **({} if self.enforce else {"enforce": False})}


class QuarantineError(ValueError):
    """A quarantine entry the control API cannot take: names the field."""

    def __init__(self, param: str, message: str) -> None:
        super().__init__(message)
        self.param = param


def parse_entry(data: Any, where: str = "") -> Entry:
    if not isinstance(data, Mapping):
        raise QuarantineError(where or "body", f"{where or 'body'}: must be an object")
    fp = data.get("fingerprint")
    if not isinstance(fp, str) or not 1 <= len(fp) <= 64 or not all(c in "0123456789abcdef" for c in fp):
        raise QuarantineError(f"{where}fingerprint", f"{where}fingerprint: must be a lowercase hex string")
    until = data.get("until")
    if isinstance(until, bool) or not isinstance(until, int | float) or not 0 <= until <= UNTIL_MAX:
        raise QuarantineError(f"{where}until", f"{where}until: must be a time (seconds since the epoch)")
    failures = data.get("failures", 0)
    if isinstance(failures, bool) or not isinstance(failures, int) or failures < 0:
        raise QuarantineError(f"{where}failures", f"{where}failures: must be a count")
    pods = data.get("pods", [])
    if not isinstance(pods, list) or not all(isinstance(p, str) for p in pods):
        raise QuarantineError(f"{where}pods", f"{where}pods: must be a list of pod names")
    enforce = data.get("enforce", True)
    if not isinstance(enforce, bool):
        raise QuarantineError(f"{where}enforce", f"{where}enforce: must be true or false")
    return Entry(fp, float(until), failures, tuple(pods[:16]), enforce)


class QuarantineList:
    """The fingerprints this server refuses, each until its time."""

    def __init__(self, clock: Callable[[], float] = time.time) -> None:
        self._lock = threading.Lock()
        self._entries: dict[str, Entry] = {}
        self._clock = clock
        # Whether a whole list was set (the sidecar's PUT): until then a process started while the
        # fleet's quarantine is in force may not know of it (`Guard.awaiting_quarantine`).
        self.received = False

    def lookup(self, fp: str) -> Entry | None:
        with self._lock:
            entry = self._entries.get(fp)
        return entry if entry is not None and self._clock() < entry.until else None

    def add(self, entry: Entry) -> None:
        with self._lock:
            self._entries[entry.fingerprint] = entry
            self._trim()

    def replace(self, entries: list[Entry]) -> None:
        with self._lock:
            self._entries = {e.fingerprint: e for e in entries}
            self.received = True
            self._trim()

    def lift(self, fp: str) -> bool:
        with self._lock:
            return self._entries.pop(fp, None) is not None

    def _trim(self) -> None:
        now = self._clock()
        self._entries = {k: e for k, e in self._entries.items() if e.until > now}
        while len(self._entries) > QUARANTINE_MAX:  # the soonest to end go first
            del self._entries[min(self._entries.values(), key=lambda e: e.until).fingerprint]

    def describe(self) -> list[dict[str, Any]]:
        now = self._clock()
        with self._lock:
            return [e.describe() for e in self._entries.values() if e.until > now]


def refusal_body(entry: Entry, by_input: bool = False) -> dict[str, Any]:
    """The 422's body. `by_input`: refused by its input fingerprint (the input failed under other
    settings or spellings), not by its own."""
    until = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(entry.until))
    seen = f"{entry.failures} failures" if entry.failures else "failures"
    what = ("this request's input (its prompt, messages or input, whatever its other parameters) was"
            if by_input else "this request was")
    return {"error": {
        "message": f"{what} in flight at {seen} of this service and is refused until {until}"
                   f" (fingerprint {entry.fingerprint}); an operator can lift it",
        "type": "request_quarantined", "param": None, "code": "request_quarantined",
        "fingerprint": entry.fingerprint, "until": until}}


def _texts(value: Any, out: list[str]) -> None:
    if isinstance(value, str):
        out.append(value)
    elif isinstance(value, Mapping):
        for v in value.values():
            _texts(v, out)
    elif isinstance(value, list):
        for v in value:
            _texts(v, out)


def prompt_text(body: Any) -> str:
    """Every string of the request's prompt, messages or input (the fault injector matches on it)."""
    out: list[str] = []
    if isinstance(body, Mapping):
        for name in ("prompt", "messages", "input", "inputs", "text", "items"):
            if name in body:
                _texts(body[name], out)
    else:
        _texts(body, out)
    return "\n".join(out)


class QuarantinedRequest(BadRequest):
    """A request on the quarantine list: 422, with why and until when."""

    def __init__(self, entry: Entry, by_input: bool = False) -> None:
        self.entry = entry
        self.by_input = by_input
        body = refusal_body(entry, by_input)
        super().__init__(422, None, body["error"]["message"], code="request_quarantined")

    def body(self) -> dict[str, Any]:
        return refusal_body(self.entry, self.by_input)


@dataclass
class RequestAccount:
    """One request's account, filled in as it is served, for its log line and the screen: typed,
    and the same in `serve` (under `http_public.ACCOUNT`) and in the agent's glue."""

    rid: str = ""
    fingerprint: str | None = None
    input_fingerprint: str | None = None  # of its input alone (`fingerprint.input_fingerprint`)
    ticket: int | None = None  # its booking in flight, for `Screen.done`
    prompt_tokens: int | None = None
    completion_tokens: int | None = None
    user: str | None = None
    client_gone: bool = False


class Screen:
    """The per-request half, one per process: fingerprint, refuse if quarantined, book in flight."""

    def __init__(self, instance_id: str, model: str, faults: FaultInjector | None = None) -> None:
        self.faults = faults
        self.key = workload_key(model)
        self.book = RequestBook(instance_id)
        self.quarantine = QuarantineList()
        self.refused = 0
        self.would_refuse = 0  # requests a shadow entry would have refused, served
        self.on_refused: Callable[[], None] | None = None  # the metrics' counter
        # Raises while the list is not in force yet (`Guard.check_list_in_force`): asked before each check.
        self.in_force: Callable[[], None] = lambda: None
        # The model's tokenizer where the server has one (the causal LM's engine sets it): a prompt
        # sent as token ids has the input fingerprint of the text it reads as.
        self.decode: Callable[[list[int]], str] | None = None

    def of_raw(self, raw: bytes, describe: Callable[[bytes], object] | None = None) -> str | None:
        """A raw body's fingerprint (the agent's: it sees bytes): over all of what `describe` (the app's
        function) says determines the work, else as `of_body` (JSON) or over its text.
        None: nothing to fingerprint (no body, or `describe` said None)."""
        if not raw.strip():
            return None
        try:
            try:
                body: Any = json.loads(raw)
            except ValueError:
                body = raw.decode("utf-8", "replace")
            if describe is None:
                return self.of_body(body)
            self.mark(body)
            work = describe(raw)
            return None if work is None else digest(self.key, work)
        except Exception as exc:  # a body nested past the parser, an app's function that raises:
            log.warning("fingerprint_failed", error=repr(exc)[:200])  # no fingerprint, the request goes on
            return None

    def of_body(self, body: Any) -> str | None:
        """A parsed JSON body's fingerprint (the computation it asks for, `fingerprint.fingerprint`),
        and the faults its prompt triggers set for the request (`MARKED`)."""
        self.mark(body)
        return self._fingerprint(body)

    def _fingerprint(self, body: Any) -> str | None:
        try:
            return fingerprint(self.key, body)
        except Exception as exc:  # whatever a client sent costs its fingerprint, never the request
            log.warning("fingerprint_failed", error=repr(exc)[:200])
            return None

    def prints(self, body: Any) -> tuple[str | None, str | None]:
        """A parsed JSON body's fingerprint and input fingerprint (None where it has none). Touches
        nothing of the request's context: callable off the event loop (a large body's decoding)."""
        fp = self._fingerprint(body)
        if fp is None:
            return None, None
        try:
            return fp, input_fingerprint(self.key, body, self.decode)
        except Exception as exc:
            log.warning("fingerprint_failed", error=repr(exc)[:200], which="input")
            return fp, None

    def mark(self, body: Any) -> None:
        """The faults the body's prompt triggers, set for the request's task (`MARKED`)."""
        if self.faults is not None:
            try:
                MARKED.set(self.faults.marks(prompt_text(body)))
            except Exception as exc:  # a body nested past what can be walked: no marks
                log.warning("fault_marks_failed", error=repr(exc)[:200])

    def check(self, fp: str | None, input_fp: str | None = None) -> None:
        """Refuse a request whose fingerprint or input fingerprint is quarantined: `QuarantinedRequest`
        (422), counted and logged once."""
        entry = None if fp is None else self.quarantine.lookup(fp)
        by_input = False
        if entry is None and input_fp is not None:
            entry, by_input = self.quarantine.lookup(input_fp), True
        if entry is None:
            return
        if not entry.enforce:
            self.would_refuse += 1
            log.warning("would_quarantine", fingerprint=fp, input_fingerprint=input_fp, by_input=by_input,
                        until=entry.until, failures=entry.failures, pods=list(entry.pods),
                        action="served: the quarantine is in shadow")
            return
        self.refused += 1
        if self.on_refused is not None:
            self.on_refused()
        log.warning("request_quarantined", fingerprint=fp, input_fingerprint=input_fp, by_input=by_input,
                    until=entry.until, failures=entry.failures, pods=list(entry.pods))
        raise QuarantinedRequest(entry, by_input)

    def admit(self, fp: str | None, input_fp: str | None = None) -> int | None:
        """Book a fingerprint in flight (after `check`): the ticket `done` takes."""
        return None if fp is None else self.book.begin(fp, input_fp)

    def request(self, account: RequestAccount, body: Any) -> None:
        """One parsed request: fingerprint it, refuse it if quarantined, else book it in flight; what
        the request log and `done` need goes into its account."""
        self.mark(body)
        self.screened(account, *self.prints(body))

    def screened(self, account: RequestAccount, fp: str | None, input_fp: str | None = None) -> None:
        """A fingerprinted request (`prints`): refused if quarantined, else booked in flight, its booking
        set for the request's task (`BOOKING`) for the engine to tell what ran at a failure."""
        account.fingerprint, account.input_fingerprint = fp, input_fp
        self.in_force()
        self.check(fp, input_fp)
        account.ticket = self.admit(fp, input_fp)
        BOOKING.set(account.ticket)

    def done(self, ticket: int | None, ok: bool) -> None:
        if ticket is not None:
            self.book.end(ticket, ok)

    def describe(self) -> dict[str, Any]:
        return {"entries": self.quarantine.describe(), "refused": self.refused, "would_refuse": self.would_refuse,
                "received": self.quarantine.received}
