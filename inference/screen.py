"""What the server knows of its requests for the query of death: the fingerprints in flight, the
newest admitted, those answered lately, what was in flight when the context was lost or when the
engine's loop stopped advancing, and the quarantine list it refuses by. Shared by `serve` and the
in-process agent (`RequestBook`, `QuarantineList`, `Screen`), so the sidecar reads one shape from
either through the control API.

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
from collections import deque
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import structlog

from gpu_watchdog.inference.faults import FaultInjector
from gpu_watchdog.inference.fingerprint import digest, fingerprint
from gpu_watchdog.inference.validation import BadRequest

log = structlog.get_logger(__name__)

KEY_ENV = "GPU_WATCHDOG_FINGERPRINT_KEY"
# After a lost context, the process waits this long at most (once the watchdog saw the poisoned
# state) for the watchdog to read what was in flight, before it exits.
FAILURE_READ_WAIT_S = 3.0
SCREEN_MAX_BYTES = 16 * 1024 * 1024  # the agent's glue fingerprints bodies up to this size
REPORTED = 32  # fingerprints in flight reported (and written to the termination log) at most
COMPLETED_KEPT = 256  # fingerprints answered successfully, kept for the sidecar's bystander evidence
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


def workload_key(model: str) -> bytes:
    """The fingerprint key: `GPU_WATCHDOG_FINGERPRINT_KEY` (the chart's Secret, one per release, so
    every replica computes the same fingerprint and nobody else can), else one derived from the
    model's name (the same across replicas; guessable by whoever knows the model)."""
    secret = os.environ.get(KEY_ENV, "").strip()
    if secret:
        return secret.encode()
    return hashlib.sha256(f"gpu-watchdog fingerprint key for {model}".encode()).digest()


class RequestBook:
    """The fingerprints in flight (admitted, not answered), the newest admitted, the last answered
    successfully, and a snapshot taken at the moment the context was lost."""

    def __init__(self, instance_id: str) -> None:
        self.instance_id = instance_id
        self._lock = threading.Lock()
        self._inflight: dict[int, str] = {}
        self._next = 0
        self._newest: str | None = None
        self._completed: deque[str] = deque(maxlen=COMPLETED_KEPT)
        self._at_failure: dict[str, Any] | None = None
        self._at_stall: dict[str, Any] | None = None
        self.failure_read = threading.Event()  # the watchdog read `at_failure`

    def begin(self, fp: str) -> int:
        with self._lock:
            self._next += 1
            self._inflight[self._next] = fp
            self._newest = fp
            return self._next

    def end(self, ticket: int, ok: bool) -> None:
        with self._lock:
            fp = self._inflight.pop(ticket, None)
            # Nothing completes on a lost context: a stream already answered 200 ends in an error.
            if ok and fp is not None and self._at_failure is None:
                if fp in self._completed:
                    self._completed.remove(fp)  # the most recent completions are the ones kept
                self._completed.append(fp)

    def _now(self) -> dict[str, Any]:
        inflight = list(dict.fromkeys(reversed(self._inflight.values())))  # newest first, once each
        return {"inflight": inflight[:REPORTED], "inflight_total": len(self._inflight), "newest": self._newest,
                "at": time.time()}

    def failed(self) -> dict[str, Any]:
        """Freeze what is in flight now, and what had completed: the context was lost (the first
        call wins)."""
        with self._lock:
            if self._at_failure is None:
                self._at_failure = {**self._now(), "completed": list(self._completed)}
            return dict(self._at_failure)

    def stalled(self) -> dict[str, Any]:
        """Freeze what is in flight now, and what had completed: the engine's loop stopped advancing
        (the first call of a stall wins; a request that ends afterwards stays in it)."""
        with self._lock:
            if self._at_stall is None:
                self._at_stall = {**self._now(), "completed": list(self._completed)}
            return dict(self._at_stall)

    def resumed(self) -> bool:
        """The loop advanced again: the stall's snapshot is no evidence and goes. Whether there was one."""
        with self._lock:
            had, self._at_stall = self._at_stall is not None, None
            return had

    def wait_read(self) -> bool:
        """Block until the watchdog read what was in flight at the failure (bounded); True if it did
        or there was nothing to read."""
        with self._lock:
            nothing = self._at_failure is None or not self._at_failure["inflight"]
        return nothing or self.failure_read.wait(FAILURE_READ_WAIT_S)

    def report(self) -> dict[str, Any]:
        with self._lock:
            if self._at_failure is not None:
                self.failure_read.set()
            return {"instance_id": self.instance_id, **self._now(), "completed": list(self._completed),
                    "at_failure": self._at_failure, "at_stall": self._at_stall}


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

    def describe(self) -> dict[str, Any]:
        return {"fingerprint": self.fingerprint, "until": self.until, "failures": self.failures,
                "pods": list(self.pods)}


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
    return Entry(fp, float(until), failures, tuple(pods[:16]))


class QuarantineList:
    """The fingerprints this server refuses, each until its time."""

    def __init__(self, clock: Callable[[], float] = time.time) -> None:
        self._lock = threading.Lock()
        self._entries: dict[str, Entry] = {}
        self._clock = clock

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


def refusal_body(entry: Entry) -> dict[str, Any]:
    until = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(entry.until))
    seen = f"{entry.failures} failures" if entry.failures else "failures"
    return {"error": {
        "message": f"this request was in flight at {seen} of this service and is refused until {until}"
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

    def __init__(self, entry: Entry) -> None:
        self.entry = entry
        body = refusal_body(entry)
        super().__init__(422, None, body["error"]["message"], code="request_quarantined")

    def body(self) -> dict[str, Any]:
        return refusal_body(self.entry)


@dataclass
class RequestAccount:
    """One request's account, filled in as it is served, for its log line and the screen: typed,
    and the same in `serve` (under `http_public.ACCOUNT`) and in the agent's glue."""

    rid: str = ""
    fingerprint: str | None = None
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
        self.on_refused: Callable[[], None] | None = None  # the metrics' counter

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
            if self.faults is not None:
                MARKED.set(self.faults.marks(prompt_text(body)))
            work = describe(raw)
            return None if work is None else digest(self.key, work)
        except Exception as exc:  # a body nested past the parser, an app's function that raises:
            log.warning("fingerprint_failed", error=repr(exc)[:200])  # no fingerprint, the request goes on
            return None

    def of_body(self, body: Any) -> str | None:
        """A parsed JSON body's fingerprint (the computation it asks for, `fingerprint.fingerprint`),
        and the faults its prompt triggers set for the request (`MARKED`)."""
        try:
            if self.faults is not None:
                MARKED.set(self.faults.marks(prompt_text(body)))
            return fingerprint(self.key, body)
        except Exception as exc:  # whatever a client sent costs its fingerprint, never the request
            log.warning("fingerprint_failed", error=repr(exc)[:200])
            return None

    def check(self, fp: str | None) -> None:
        """Refuse a quarantined fingerprint: `QuarantinedRequest` (422), counted and logged once."""
        entry = None if fp is None else self.quarantine.lookup(fp)
        if entry is None:
            return
        self.refused += 1
        if self.on_refused is not None:
            self.on_refused()
        log.warning("request_quarantined", fingerprint=fp, until=entry.until, failures=entry.failures,
                    pods=list(entry.pods))
        raise QuarantinedRequest(entry)

    def admit(self, fp: str | None) -> int | None:
        """Book a fingerprint in flight (after `check`): the ticket `done` takes."""
        return None if fp is None else self.book.begin(fp)

    def request(self, account: RequestAccount, body: Any) -> None:
        """One parsed request: fingerprint it, refuse it if quarantined, else book it in flight; what
        the request log and `done` need goes into its account."""
        self.screened(account, self.of_body(body))

    def screened(self, account: RequestAccount, fp: str | None) -> None:
        account.fingerprint = fp
        self.check(fp)
        account.ticket = self.admit(fp)

    def done(self, ticket: int | None, ok: bool) -> None:
        if ticket is not None:
            self.book.end(ticket, ok)

    def describe(self) -> dict[str, Any]:
        return {"entries": self.quarantine.describe(), "refused": self.refused}
