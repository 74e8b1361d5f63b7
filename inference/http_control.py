"""The pod-local control API (127.0.0.1:8001, bearer token) that the watchdog drives.

One implementation for every process the watchdog talks to: `serve`'s inference service and the
in-process agent of a user's own service both satisfy `ControlTarget`.
"""

from __future__ import annotations

import asyncio
import hmac
from typing import Any, Protocol

import structlog
from aiohttp import web

from gpu_watchdog import contract
from gpu_watchdog.inference import stacks
from gpu_watchdog.inference.faults import FaultError
from gpu_watchdog.inference.guard import Guard
from gpu_watchdog.inference.http_errors import Route
from gpu_watchdog.inference.openapi import control_spec
from gpu_watchdog.inference.poison import EXIT_TOLD, exit_code, leave
from gpu_watchdog.inference.screen import Entry, QuarantineError, parse_entry
from gpu_watchdog.inference.validation import BadRequest, parse_json_object

log = structlog.get_logger(__name__)



def _bad(exc: BadRequest) -> web.Response:
    return web.json_response(exc.body(), status=exc.status)


def bearer_auth(token: str) -> Any:
    expected = token.encode()

    @web.middleware
    async def middleware(request: web.Request, handler: Route) -> web.StreamResponse:
        header = request.headers.get("Authorization", "")
        scheme, _, presented = header.partition(" ")
        # Constant-time comparison; the presented token is never logged.
        presented_bytes = presented.strip().encode()
        ok = scheme.lower() == "bearer" and bool(presented_bytes) and hmac.compare_digest(presented_bytes, expected)
        if not ok:
            log.warning("control_unauthorized", path=request.path, remote=request.remote,
                        had_header=bool(header))
            return web.json_response({"error": {"message": "missing or invalid bearer token", "type": "unauthorized"}},
                                     status=401, headers={"WWW-Authenticate": 'Bearer realm="gpu-watchdog"'})
        return await handler(request)

    return middleware

# Long enough for the answer to leave before the process does.
EXIT_AFTER_S = 0.2


async def _optional_body(request: web.Request) -> dict[str, Any]:
    raw = await request.read()
    return {} if not raw.strip() else parse_json_object(raw)


def _number(body: dict[str, Any], name: str, default: float, lo: float, hi: float) -> float:
    value = body.get(name, default)
    if isinstance(value, bool) or not isinstance(value, int | float) or not lo <= value <= hi:
        raise BadRequest(400, name, f"{name} must be a number between {lo} and {hi}")
    return float(value)


def _deadline(body: dict[str, Any]) -> float:
    value = body.get("deadline", contract.DRAIN_DEADLINE_DEFAULT_S)
    top = contract.DRAIN_DEADLINE_MAX_S
    if isinstance(value, bool) or not isinstance(value, int | float) or not 0 < value <= top:
        raise BadRequest(400, "deadline", f"deadline must be a number of seconds greater than 0 and at most {top:g}")
    return float(value)


class ControlTarget(Protocol):
    """What the control API drives. `memory_report` and `guard.empty_cache` run in a worker thread."""

    # The process's failure state, drain, quarantine screen, faults and allocator (`inference.guard`).
    guard: Guard

    @property
    def started(self) -> bool: ...
    @property
    def inflight(self) -> int: ...
    @property
    def queued(self) -> int: ...
    @property
    def admission_capacity(self) -> float: ...

    def memory_report(self) -> dict[str, Any]: ...
    async def canary(self, timeout: float, probe: contract.CanaryProbe | None = None) -> contract.CanaryResult: ...
    def set_admission_limit(self, limit: int) -> None: ...


class ControlAPI:
    def __init__(self, service: ControlTarget, token: str) -> None:
        self.service = service
        self.token = token
        # Wakes when the control drain's deadline passes, to lift it and say so.
        self._lapse: asyncio.TimerHandle | None = None

    def app(self) -> web.Application:
        app = web.Application(middlewares=[bearer_auth(self.token)], client_max_size=64 * 1024)
        r = app.router
        r.add_get(contract.MEMORY, self.memory)
        r.add_post(contract.EMPTY_CACHE, self.empty_cache)
        r.add_post(contract.CANARY, self.canary)
        r.add_post(contract.DRAIN, self.drain)
        r.add_delete(contract.DRAIN, self.undrain)
        r.add_post(contract.ADMISSION, self.admission)
        r.add_post(contract.FAULT, self.fault)
        r.add_post(contract.EXIT, self.exit)
        r.add_get(contract.REQUESTS, self.requests)
        r.add_post(contract.STACKS, self.stacks)
        r.add_get(contract.QUARANTINE, self.quarantine)
        r.add_post(contract.QUARANTINE, self.quarantine_add)
        r.add_put(contract.QUARANTINE, self.quarantine_replace)
        r.add_delete(contract.QUARANTINE, self.quarantine_lift)
        r.add_get(contract.CONTROL_OPENAPI, self.openapi)
        return app

    async def openapi(self, request: web.Request) -> web.Response:
        return web.json_response(control_spec())

    # -- the query of death -------------------------------------------------------------------

    async def requests(self, request: web.Request) -> web.Response:
        """The fingerprints in flight, the newest admitted, those answered lately, and what was in
        flight when the context was lost (`at_failure`) or when the engine's loop stopped advancing
        (`at_stall`); read by the sidecar before a restart, which asks with `?evidence=1`: a poisoned
        process leaves only once that read has its evidence, not on a read made for what it answered."""
        said = request.query.get(contract.REQUESTS_EVIDENCE, "0")
        if said not in ("0", "1", "true", "false"):
            return _bad(BadRequest(400, contract.REQUESTS_EVIDENCE,
                                   f"{contract.REQUESTS_EVIDENCE}: must be 1 or 0 (true or false), got {said[:40]!r}"))
        return web.json_response(self.service.guard.screen.book.report(evidence=said in ("1", "true")))

    async def quarantine(self, request: web.Request) -> web.Response:
        return web.json_response(self.service.guard.screen.describe())

    async def _entries(self, request: web.Request, many: bool) -> list[Entry]:
        body = await _optional_body(request)
        try:
            if not many:
                return [parse_entry(body)]
            entries = body.get("entries")
            if not isinstance(entries, list):
                raise QuarantineError("entries", "entries: must be a list of {fingerprint, until}")
            return [parse_entry(e, f"entries[{i}].") for i, e in enumerate(entries)]
        except QuarantineError as exc:
            raise BadRequest(400, exc.param, str(exc)) from None

    async def quarantine_add(self, request: web.Request) -> web.Response:
        try:
            entries = await self._entries(request, many=False)
        except BadRequest as exc:
            return _bad(exc)
        self.service.guard.screen.quarantine.add(entries[0])
        log.warning("quarantine_added", fingerprint=entries[0].fingerprint, until=entries[0].until, by="control")
        return web.json_response(self.service.guard.screen.describe())

    async def quarantine_replace(self, request: web.Request) -> web.Response:
        try:
            entries = await self._entries(request, many=True)
        except BadRequest as exc:
            return _bad(exc)
        listed = self.service.guard.screen.quarantine
        before, first = {e["fingerprint"] for e in listed.describe()}, not listed.received
        listed.replace(entries)
        if first:
            log.info("quarantine_received", entries=len(entries), by="control")
        after = {e.fingerprint for e in entries}
        if before != after:
            log.warning("quarantine_replaced", added=sorted(after - before), lifted=sorted(before - after),
                        by="control")
        return web.json_response(self.service.guard.screen.describe())

    async def quarantine_lift(self, request: web.Request) -> web.Response:
        fp = request.query.get("fingerprint")
        if fp is None:
            try:
                fp = (await _optional_body(request)).get("fingerprint")
            except BadRequest as exc:
                return _bad(exc)
        if not isinstance(fp, str) or not fp:
            return _bad(BadRequest(400, "fingerprint", "fingerprint: required (the query or the body)"))
        lifted = self.service.guard.screen.quarantine.lift(fp)
        log.warning("quarantine_lifted", fingerprint=fp, lifted=lifted, by="control")
        return web.json_response({**self.service.guard.screen.describe(), "lifted": lifted})

    def _require_started(self) -> None:
        if not self.service.started:
            raise web.HTTPServiceUnavailable(text='{"error": {"message": "model still loading"}}',
                                             content_type="application/json")

    async def stacks(self, request: web.Request) -> web.Response:
        """Where the process is stuck, before the watchdog restarts it: every thread's stack, kept in
        the termination log (the pod's status keeps it once the process is gone) and answered."""
        try:
            body = await _optional_body(request)
            reason = body.get("reason", "watchdog")
            if not isinstance(reason, str) or not reason.strip():
                raise BadRequest(400, "reason", "reason must be a non-empty string")
        except BadRequest as exc:
            return _bad(exc)
        report = stacks.collect()
        written = stacks.write(report, reason)
        stuck = report["stuck"]
        log.warning("stacks", reason=reason[:200], stuck=None if stuck is None else stacks.describe(stuck),
                    thread=None if stuck is None else stuck["thread"], threads=len(report["threads"]),
                    termination_log=written, instance_id=self.service.guard.instance_id)
        return web.json_response({**report, "termination_log": written,
                                  "instance_id": self.service.guard.instance_id})

    async def exit(self, request: web.Request) -> web.Response:
        """The worker rung: a hung or poisoned worker of several leaves (code 75), and its server
        starts it again while the others serve. Answered first, then the process is gone."""
        try:
            body = await _optional_body(request)
            reason = body.get("reason", "watchdog")
            if not isinstance(reason, str) or not reason.strip():
                raise BadRequest(400, "reason", "reason must be a non-empty string")
            instance = body.get("instance_id")
            if instance is not None and not isinstance(instance, str):
                raise BadRequest(400, "instance_id", "instance_id must be a string")
        except BadRequest as exc:
            return _bad(exc)
        if instance is not None and instance != self.service.guard.instance_id:
            # Meant for the process this one replaced: this one stays.
            return web.json_response({"error": {"message": f"instance {instance} is gone; this is"
                                                f" {self.service.guard.instance_id}", "type": "instance_mismatch",
                                                "param": "instance_id", "code": None}}, status=409)
        log.error("exiting", reason=reason[:200], code=exit_code(EXIT_TOLD), source="control",
                  inflight=self.service.inflight)
        asyncio.get_running_loop().call_later(EXIT_AFTER_S, leave, EXIT_TOLD)
        return web.json_response({"exiting": True, "code": EXIT_TOLD}, status=202)

    async def memory(self, request: web.Request) -> web.Response:
        self._require_started()
        report = await asyncio.to_thread(self.service.memory_report)
        if report["poisoned"]:
            self.service.guard.poison_reported.set()
        return web.json_response(report)

    async def empty_cache(self, request: web.Request) -> web.Response:
        self._require_started()
        freed = await asyncio.to_thread(self.service.guard.empty_cache)
        log.info("empty_cache", freed_bytes=freed, source="control")
        return web.json_response({"freed_bytes": freed})

    async def canary(self, request: web.Request) -> web.Response:
        self._require_started()
        try:
            body = await _optional_body(request)
            timeout = _number(body, "timeout", 10.0, 0.01, 600.0)
            probe = None
            if "probe" in body:
                try:
                    probe = contract.CanaryProbe.parse(body["probe"])
                except ValueError as exc:
                    field = str(exc).split(":", 1)[0]
                    raise BadRequest(400, field, str(exc)) from None
        except BadRequest as exc:
            return _bad(exc)
        result = await self.service.canary(timeout, probe)
        log.info("canary", ok=result.ok, latency_s=round(result.latency_s, 4), error_class=result.error_class,
                 probe=probe is not None)
        if self.service.guard.poisoned:
            self.service.guard.poison_reported.set()
        # The canary runs while drained (the model is still checked); the flag says the server refuses traffic.
        return web.json_response(result.to_json(self.service.guard.instance_id, self.service.guard.drain.active))

    async def drain(self, request: web.Request) -> web.Response:
        """Stop admitting (readyz turns 503) until `deadline` s from now at most, and wait, bounded
        by `timeout` s, for in-flight work to finish."""
        self._require_started()
        sched = self.service
        try:
            body = await _optional_body(request)
            timeout = _number(body, "timeout", 30.0, 0.0, 3600.0)
            deadline_s = _deadline(body)
        except BadRequest as exc:
            return _bad(exc)
        sched.guard.drain.begin(deadline_s)
        self._wake_in(deadline_s)
        log.info("drain_started", inflight=sched.inflight, queued=sched.queued, timeout_s=timeout,
                 deadline_s=deadline_s)
        loop = asyncio.get_running_loop()
        until = loop.time() + timeout
        while (sched.inflight or sched.queued) and loop.time() < until:
            await asyncio.sleep(0.05)
        drained = not (sched.inflight or sched.queued)
        log.info("drain_finished", drained=drained, inflight=sched.inflight, queued=sched.queued)
        return web.json_response({"drained": drained, "inflight": sched.inflight, "queued": sched.queued,
                                  "draining": sched.guard.drain.active, "deadline_left_s": sched.guard.drain.left_s()})

    async def undrain(self, request: web.Request) -> web.Response:
        """Lift the control drain now (idempotent). The shutdown's drain is not the control API's to lift."""
        sched = self.service
        if sched.guard.drain.shutdown:
            log.warning("drain_lift_refused", by="control", why="shutting down")
            return web.json_response({"error": {"message": "the process is shutting down; its drain stays",
                                                "type": "shutting_down", "param": None, "code": None},
                                      "draining": True}, status=409)
        self._note_lapse()  # one that ran out a moment ago is logged as such, not as lifted here
        lifted = sched.guard.drain.lift()
        if self._lapse is not None:
            self._lapse.cancel()
            self._lapse = None
        if lifted:
            log.info("drain_lifted", by="control", inflight=sched.inflight, queued=sched.queued)
        else:
            log.info("drain_lift_ignored", by="control", why="not draining")
        return web.json_response({"draining": sched.guard.drain.active, "lifted": lifted, "inflight": sched.inflight,
                                  "queued": sched.queued})

    def _wake_in(self, seconds: float) -> None:
        if self._lapse is not None:
            self._lapse.cancel()
        self._lapse = asyncio.get_running_loop().call_later(seconds, self._deadline_passed)

    def _deadline_passed(self) -> None:
        self._lapse = None
        if not self._note_lapse():
            left = self.service.guard.drain.left_s()
            if left is not None:  # woken a hair early
                self._wake_in(left)

    def _note_lapse(self) -> bool:
        """Log a control drain whose deadline has passed (once); whether there was one."""
        drain = self.service.guard.drain
        if not drain.lapse():
            return False
        if drain.shutdown:
            log.info("drain_deadline_passed", kept_by="shutdown")
        else:
            log.info("drain_lifted", by="deadline", inflight=self.service.inflight, queued=self.service.queued)
        return True

    async def admission(self, request: web.Request) -> web.Response:
        self._require_started()
        try:
            body = parse_json_object(await request.read())
            limit = body.get("limit")
            if isinstance(limit, bool) or not isinstance(limit, int) or not 1 <= limit <= 100_000:
                raise BadRequest(400, "limit", "limit must be an integer between 1 and 100000")
        except BadRequest as exc:
            return _bad(exc)
        self.service.set_admission_limit(limit)
        return web.json_response({"limit": limit, "capacity": self.service.admission_capacity})

    async def fault(self, request: web.Request) -> web.Response:
        faults = self.service.guard.faults
        if faults is None:
            return web.json_response(
                {"error": {"message": "fault injection is disabled; start with --fault-injection", "type": "disabled"}},
                status=404)
        try:
            body = parse_json_object(await request.read())
            kind = body.get("kind")
            if not isinstance(kind, str):
                raise BadRequest(400, "kind", "kind is required (a string)")
            state = faults.inject(kind, body)
        except BadRequest as exc:
            return _bad(exc)
        except FaultError as exc:
            field = str(exc).split(":", 1)[0]
            return _bad(BadRequest(400, field, str(exc)))
        log.warning("fault_injected", kind=kind, state=state)
        return web.json_response({"injected": kind, "faults": state})
