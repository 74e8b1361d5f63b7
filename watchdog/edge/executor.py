"""The watchdog's effects: each performs one action at its edge and tells what happened.

It decides nothing and remembers nothing: the loop (`watchdog.runtime.app`) hands it a decision, and what an
edge answers is folded into the history (`state.reduce`, the edges' facts in `watchdog.core.edges`),
where the executor reads it back. It keeps its clients, and the work in flight (a lock that puts
the ledger's writes one at a time, the reports written beside the loop, the evidence being read)
and nothing else. Failures at an edge (an API that refuses, a control API that hangs) come back as
outcomes and log lines, never as exceptions that could take the loop down.
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
from collections.abc import Awaitable, Callable, Mapping
from typing import Any, Protocol, TypeVar

from gpu_watchdog import contract, logs
from gpu_watchdog.watchdog.core import (
    correctness,
    edges,
    escalation,
    fleet,
    ladder,
    placement,
    policy,
    procedure,
    quarantine,
    state,
)
from gpu_watchdog.watchdog.core.edges import EdgeFacts
from gpu_watchdog.watchdog.core.escalation import RestartRecord, Suspect, workload_restarts
from gpu_watchdog.watchdog.core.fleet import Breaker, FleetView, Ledger, OwnPod
from gpu_watchdog.watchdog.core.history import History
from gpu_watchdog.watchdog.core.ladder import Change
from gpu_watchdog.watchdog.core.names import (
    CONTEXT_LOSS,
    FLEET_BREAKER_OPEN,
    FLEET_LEDGER_UNKNOWN,
    QUARANTINE,
    RUNG_CONTAINER,
    RUNG_POD,
    RUNG_WORKER,
)
from gpu_watchdog.watchdog.core.policy import Decision
from gpu_watchdog.watchdog.core.samples import PastRestart
from gpu_watchdog.watchdog.core.settings import Settings
from gpu_watchdog.watchdog.core.state import (
    AdmissionAnswered,
    Outcome,
    PodGpus,
    RestartEnded,
    RestartWaiting,
    WorkloadRestarts,
)
from gpu_watchdog.watchdog.core.timing import (
    DRAIN_DEADLINE_MARGIN_S,
    LEAVING_WAIT_S,
    RECORD_RETRY_S,
    RECORD_WAIT_S,
)
from gpu_watchdog.watchdog.edge.control_client import ControlClient, ControlError
from gpu_watchdog.watchdog.edge.effects.node import NodeReporter
from gpu_watchdog.watchdog.edge.effects.restart import (
    NOT_RECORDED,
    WORKER_ACTION,
    WORKER_PREFIX,
    WOULD_ACTION,
    DrainHandle,
    Restarter,
    RestartOutcome,
)
from gpu_watchdog.watchdog.edge.metrics import WatchdogMetrics

T = TypeVar("T")

log = logs.get("watchdog")



class ServerDrain:
    """The bundled server's drain through its control API, told to the loop as it changes.

    `fold` hands the loop an outcome: while a restart waits, the server serves and is ready.
    Without a control API (or a restart that asks for no drain) only the waiting is told."""

    def __init__(self, control: ControlClient | None, timeout: float, fold: Callable[[Outcome], None],
                 clock: Callable[[], float], before_act: Callable[[float], Awaitable[None]] | None = None) -> None:
        self.control = control
        self._before_act = before_act
        self.timeout = timeout
        self.fold = fold
        self.clock = clock
        self.drained = False
        # The server refuses a deadline past its bound; a drain timeout that long keeps the bound.
        self.deadline = min(timeout + DRAIN_DEADLINE_MARGIN_S, contract.DRAIN_DEADLINE_MAX_S)

    async def begin(self) -> None:
        self.fold(RestartWaiting(self.clock(), False))
        if self.control is None or self.drained:
            return
        self.drained = True  # even a drain call that timed out may have reached the server
        try:
            drained = await self.control.drain(self.timeout, self.deadline)
            log.info("drained", **{k: drained.get(k) for k in ("drained", "inflight", "queued")})
        except ControlError as exc:
            log.warning("drain_failed", error=str(exc))

    async def before_act(self, at: float) -> None:
        if self._before_act is not None:
            await self._before_act(at)

    async def lift(self, why: str) -> None:
        self.fold(RestartWaiting(self.clock(), True))
        if self.control is None or not self.drained:
            return
        self.drained = False
        try:
            await self.control.undrain()
            log.warning("drain_lifted", why=why, by="watchdog")
        except ControlError as exc:
            log.error("drain_lift_failed", why=why, error=str(exc), deadline_s=self.deadline,
                      action="the server lifts it at its deadline")


class RestartEvents(Protocol):
    """The namespace's restart Events, read back (blocking; run in a thread)."""

    def restart_records(self) -> list[RestartRecord]: ...


class FleetLedger(Protocol):
    """The workload's shared ledger and what the cluster says of the workload (blocking; see
    `watchdog.edge.effects.fleet.LeaseLedger`). Failures raise; `update` raises LedgerUnavailable."""

    name: str

    def read(self) -> Ledger: ...
    def update(self, decide: Callable[[Ledger, float], tuple[Ledger, T]]) -> T: ...
    def replicas(self) -> int | None: ...
    def census(self) -> fleet.Census | None: ...
    def own_pod(self) -> fleet.OwnPod: ...
    def report_breaker(self, breaker: fleet.Breaker) -> None: ...
    def read_records(self) -> quarantine.Records: ...
    def update_records(self, decide: Callable[[quarantine.Records, float], tuple[quarantine.Records, T]]) -> T: ...
    def report_quarantine(self, q: quarantine.Quarantined, lifted: bool = False) -> None: ...
    def read_placement(self) -> placement.Records: ...
    def update_placement(self, decide: Callable[[placement.Records, float], tuple[placement.Records, T]]) -> T: ...
    def read_correctness(self) -> correctness.Records: ...
    def update_correctness(self, decide: Callable[[correctness.Records, float], tuple[correctness.Records, T]]
                           ) -> T: ...


class Executor:
    def __init__(self, *, settings: Settings, restarter: Restarter, metrics: WatchdogMetrics,
                 clock: Callable[[], float], wall_clock: Callable[[], float], control: ControlClient | None,
                 history: Callable[[], History], fold: Callable[[Outcome], None],
                 node: NodeReporter | None = None, restart_events: RestartEvents | None = None,
                 workload: str | None = None, pod_gpus: Callable[[], tuple[str, ...] | None] = lambda: None,
                 ledger: FleetLedger | None = None, worker_controls: Mapping[int, ControlClient] | None = None) -> None:
        self.settings = settings
        self.restarter = restarter
        self.metrics = metrics
        # The service's other workers' control APIs (k >= 1): the quarantine reaches each of them.
        self.worker_controls = dict(worker_controls or {})
        self.clock = clock
        self.wall_clock = wall_clock  # Events carry wall-clock times
        self.control = control
        self.history = history  # the fold, read back: every fact an edge said lives there
        self.fold = fold
        self.node = node
        self.restart_events = restart_events
        self.workload = workload
        self._pod_gpus = pod_gpus
        # The workload's ledger: replicas always (the budget grows with them); slots and the breaker
        # where `policy.fleet.enabled`.
        self.ledger = ledger
        self.fleet_on = ledger is not None and settings.policy.fleet.enabled
        # The work in flight, not facts: the ledger's writes one at a time, the reports written beside
        # the loop, and the evidence being read or written now (asked again meanwhile: a blocked
        # restart, at every evaluation, gets the first ask's fingerprints, and no second read).
        self._ledger_lock = asyncio.Lock()
        self._reports: set[asyncio.Task[None]] = set()
        self._failures_pending: dict[tuple[str, str | None], asyncio.Future[tuple[str, ...] | None]] = {}
        if ledger is not None and self.edge.fleet.lease != ledger.name:
            self.fold(edges.FleetSeen(dataclasses.replace(self.edge.fleet, lease=ledger.name)))

    @property
    def edge(self) -> EdgeFacts:
        return self.history().edge

    @property
    def fleet(self) -> FleetView:
        return self.edge.fleet

    @property
    def suspects(self) -> tuple[Suspect, ...]:
        return self.edge.suspects

    # -- the bundled server's control API ----------------------------------------------------

    async def empty_cache(self, decision: Decision) -> None:
        if self.control is None:
            return
        self.metrics.empty_cache.labels(reason=decision.reason).inc()
        try:
            result = await self.control.empty_cache()
            freed = result.get("freed_bytes", 0)
            freed = freed if isinstance(freed, int) and freed >= 0 else 0
            self.metrics.empty_cache_freed.inc(freed)
            log.info("decision", action="empty_cache", reason=decision.reason, freed_bytes=freed,
                     detail=decision.detail)
        except ControlError as exc:
            log.warning("empty_cache_failed", reason=decision.reason, error=str(exc))

    async def set_admission(self, change: Change) -> AdmissionAnswered:
        ok = False
        if self.control is not None:
            try:
                await self.control.set_admission(change.limit)
                ok = True
            except ControlError as exc:
                log.warning("admission_change_failed", action=change.action, limit=change.limit, error=str(exc))
        if ok:
            self.metrics.admission_changes.labels(direction="down" if change.action == ladder.SHRINK else "up").inc()
        return AdmissionAnswered(self.clock(), change, ok)

    # -- the query of death ----------------------------------------------------------------------

    async def record_failure(self, decision: Decision, control: ControlClient | None = None
                             ) -> tuple[str, ...] | None:
        """Before a restart for a hang or a lost context (or where the budget holds it back): what
        the server (or the worker `control` answers for) had in flight, added to the workload's
        failures, and the quarantine decided again (pushed to our server's workers).
        The fingerprints for the restart's Event; None where none could be read. Nothing here holds
        the restart: an unreadable server is said at once, and the records' write is waited for
        RECORD_WAIT_S at most (it goes on beside the restart after that)."""
        s = self.settings.policy.quarantine
        control = control or self.control
        if not s.enabled or control is None:
            return None
        key = (decision.reason, decision.instance_id)
        seen = edges.evidence_seen(self.edge, *key)
        if seen is not None:
            return seen.inflight  # asked again (held, blocked): recorded once
        pending = self._failures_pending.get(key)
        if pending is not None:
            return await asyncio.shield(pending)  # asked again while it is read or written
        refused = edges.refused_at(self.edge, *key)
        if refused is not None and self.clock() - refused < RECORD_RETRY_S:
            return None  # its record was refused a moment ago: tried again later, not at every evaluation
        loop = asyncio.get_running_loop()
        read: asyncio.Future[tuple[str, ...] | None] = loop.create_future()
        self._failures_pending[key] = read
        failure: quarantine.Failure | None = None
        try:
            failure = quarantine.failure_from(await control.requests(evidence=True), self.settings.kubernetes.pod_name
                                              or "local", decision.reason, self.wall_clock())
        except (ControlError, quarantine.RecordsError) as exc:
            log.warning("failure_fingerprints_unknown", reason=decision.reason, error=str(exc)[:300],
                        action="restarting without them")
            # Said once: a restart asked again does not ask again.
            self.fold(edges.EvidenceRead(edges.Evidence(decision.reason, decision.instance_id, None)))
        finally:
            read.set_result(None if failure is None else failure.inflight)
            if failure is None:
                del self._failures_pending[key]
        if failure is None:
            return None
        write = loop.create_task(self._write_failure(decision, key, failure))
        self._reports.add(write)
        write.add_done_callback(self._reports.discard)
        write.add_done_callback(lambda _: self._failures_pending.pop(key, None))  # written, or to be asked again
        try:
            await asyncio.wait_for(asyncio.shield(write), RECORD_WAIT_S)
        except TimeoutError:
            log.warning("failure_record_slow", reason=decision.reason, wait_s=RECORD_WAIT_S,
                        action="restarting; the record is written beside it")
        return failure.inflight

    async def _write_failure(self, decision: Decision, key: tuple[str, str | None],
                             failure: quarantine.Failure) -> None:
        s = self.settings.policy.quarantine

        def add(records: quarantine.Records, now: float) -> tuple[quarantine.Records, tuple[
                quarantine.Records, list[quarantine.Quarantined], list[quarantine.Quarantined]]]:
            # Stamped as it is written, on the API server's clock learned from the read just before:
            # read earlier, a node whose clock stepped (or a sidecar yet to hear the server) stamps it
            # that far off, and a failure stamped past FUTURE_S counts toward nothing.
            out, quarantined = quarantine.record(s, records, dataclasses.replace(failure, at=now), now)
            still = {q.fingerprint for q in quarantine.standing(out, now)}
            return out, (out, quarantined, [q for q in quarantine.standing(records, now) if q.fingerprint not in still])

        ledger = self.ledger
        try:
            records, new, removed = await self._update_records(add)
        except Exception as exc:
            error = str(exc)[:300]
            self.fold(edges.RecordsSeen(None, error))
            self.fold(edges.EvidenceRefused(edges.Refused(key[0], key[1], self.clock())))
            log.error("failure_not_recorded", reason=decision.reason, error=error,
                      action=f"this failure does not count toward a quarantine yet; tried again in {RECORD_RETRY_S:g}s"
                             " if it is asked again")
            return
        self.fold(edges.RecordsSeen(records))
        # Recorded once: a restart asked again while held neither reads nor writes again.
        self.fold(edges.EvidenceRead(edges.Evidence(key[0], key[1], failure.inflight), process=failure.process))
        log.warning("failure_recorded", reason=decision.reason, process=failure.process,
                    inflight=list(failure.inflight), newest=failure.newest,
                    workload_failures=len(records.failures))
        shadow = not policy.enforced(self.settings.policy, QUARANTINE, decision.reason)
        for q in new:
            if shadow:
                log.warning("would_quarantine", fingerprint=q.fingerprint, until=q.until, pods=q.pods,
                            failures=len(q.failures), workload=self.workload, shadow=True,
                            action="served as before: every replica logs would_quarantine for it until then")
                self.fold(state.would(self.history(), self.clock(), QUARANTINE, decision.reason,
                                      {"fingerprint": q.fingerprint, "pods": list(q.pods)}))
                continue
            log.error("request_quarantined", fingerprint=q.fingerprint, in_force_at=q.in_force_at, until=q.until,
                      pods=q.pods, failures=len(q.failures), workload=self.workload,
                      action="refused (422) by every replica from in_force_at until then, unless a replica says"
                             " first that it answered it; find the client by its fingerprint in the access log;"
                             " lift with `gpu-watchdog quarantine lift`")
            self.metrics.quarantines.inc()
            if ledger is not None:
                self._report(functools.partial(ledger.report_quarantine, q), "quarantine_event_failed")
        self._removed(removed, self.settings.kubernetes.pod_name or "local")
        if new or removed:
            await self.push_quarantine()

    async def _update_records(self, decide: Callable[[quarantine.Records, float], tuple[quarantine.Records, T]]) -> T:
        """The records as `decide` changes them: in the Lease (our writes one at a time), else this
        sidecar's own."""
        if self.ledger is None:
            return decide(self.edge.records, self.wall_clock())[1]
        async with self._ledger_lock:
            return await asyncio.to_thread(self.ledger.update_records, decide)

    async def sync_quarantine(self) -> None:
        """The workload's quarantine read from the Lease and pushed to our server; an unreadable Lease
        keeps the list last read (refusing a request that killed replicas stays the safe side)."""
        if not self.settings.policy.quarantine.enabled:
            return
        await self.read_records()
        await self._clear_answered()
        await self.push_quarantine()

    async def read_records(self) -> None:
        """The workload's quarantine records read from the Lease and folded (kept as last read where
        they cannot be)."""
        ledger = self.ledger
        if ledger is not None:
            try:
                # A read needs no turn of the ledger's lock: a restart's bookkeeping never waits on it.
                records = await asyncio.to_thread(ledger.read_records)
                if self.edge.records_error is not None:
                    log.info("quarantine_records_read", workload=self.workload)
                if records != self.edge.records or self.edge.records_error is not None:
                    self.fold(edges.RecordsSeen(records))
            except Exception as exc:
                if self.edge.records_error is None:
                    log.warning("quarantine_records_unknown", error=str(exc)[:300],
                                action="the list last read stays in force")
                if self.edge.records_error != str(exc)[:300]:
                    self.fold(edges.RecordsSeen(None, str(exc)[:300]))

    async def leaving(self) -> None:
        """The sidecar stops (its pod is removed): the suspects our server answered are cleared in the
        records once more, within LEAVING_WAIT_S, so that the evidence of a success leaves no sooner
        than the pod's grace period allows."""
        async def say() -> None:
            # Read first: the records last read may predate the failures that hold against what we answered.
            await self.read_records()
            await self._clear_answered()

        try:
            await asyncio.wait_for(say(), LEAVING_WAIT_S)
        except Exception as exc:  # stopping goes on whatever the API says
            log.warning("quarantine_clear_not_recorded", error=repr(exc)[:300], action="stopping")

    async def _clear_answered(self) -> None:
        """Of the fingerprints the records hold against, those our server (and its workers) answered
        lately are cleared in the records, fleet-wide: a request answered anywhere is no killer, and
        an entry of one is removed. Asked only while the records hold against some."""
        s = self.settings.policy.quarantine
        against = quarantine.held_against(s, self.edge.records, self.wall_clock())
        if self.control is None or not against:
            return
        answered: set[str] = set()
        for control in (self.control, *self.worker_controls.values()):
            try:
                answered |= quarantine.answered_in(await control.requests())
            except (ControlError, quarantine.RecordsError):
                continue  # a server starting, gone or garbled answers at the next sync
        new = answered & against
        if not new:
            return
        pod = self.settings.kubernetes.pod_name or "local"

        def add(records: quarantine.Records, now: float
                ) -> tuple[quarantine.Records, tuple[quarantine.Records, list[quarantine.Quarantined]]]:
            out, removed = quarantine.clear(s, records, new, pod, now)
            return out, (out, removed)

        try:
            records, removed = await self._update_records(add)
        except Exception as exc:
            log.warning("quarantine_clear_not_recorded", fingerprints=sorted(new), error=str(exc)[:300],
                        action="tried again at the next sync")
            return
        self.fold(edges.RecordsSeen(records, self.edge.records_error))
        log.info("quarantine_cleared", fingerprints=sorted(new), pod=pod,
                 why="answered successfully here: no longer a suspect anywhere in the workload")
        self._removed(removed, pod)

    def _removed(self, removed: list[quarantine.Quarantined], pod: str) -> None:
        for q in removed:
            log.warning("quarantine_removed", fingerprint=q.fingerprint, pod=pod,
                        why="a replica answered it successfully: it is no killer",
                        action="served again by every replica")
            if self.ledger is not None:
                self._report(functools.partial(self.ledger.report_quarantine, q, True), "quarantine_event_failed")

    async def push_quarantine(self, instance_id: str | None = None) -> None:
        """The workload's active quarantine to our server (`instance_id`: the process it reached, read
        afresh for it: the list last read may be a sync old, and a success recorded since must not be
        refused by the new process) and to each of its other workers: a request that killed one must
        not reach the next."""
        if self.control is None or not self.settings.policy.quarantine.enabled:
            return
        if instance_id is not None:
            await self.read_records()
        now = self.wall_clock()
        entries = self._entries(now)
        # What is refused: a shadow entry is served (gpu_watchdog_shadow_actions_total counts it).
        self.metrics.quarantined.labels(workload=self.workload or "").set(
            len([e for e in entries if e.get("enforce", True)]))
        for k in self.worker_controls:
            # Beside this: a hung worker slow to answer delays neither the target's list nor its canary.
            task = asyncio.get_running_loop().create_task(self.push_quarantine_to(k, None, entries))
            self._reports.add(task)
            task.add_done_callback(self._reports.discard)
        if await self._push(self.control, entries):
            fingerprints = tuple(e["fingerprint"] for e in entries)
            if fingerprints != self.edge.pushed or (instance_id is not None and instance_id != self.edge.pushed_to):
                self.fold(edges.QuarantinePushed(0, instance_id, fingerprints))

    async def push_quarantine_to(self, worker: int, instance_id: str | None,
                                 entries: list[dict[str, Any]] | None = None) -> None:
        """The quarantine to another worker (`instance_id`: a new process of it, seen by its canary)."""
        control = self.worker_controls.get(worker)
        if control is None or not self.settings.policy.quarantine.enabled:
            return
        if entries is None:
            entries = self._entries(self.wall_clock())
        if await self._push(control, entries, worker) and instance_id is not None:
            self.fold(edges.QuarantinePushed(worker, instance_id, tuple(e["fingerprint"] for e in entries)))

    def _entries(self, wall_now: float) -> list[dict[str, Any]]:
        """The active quarantine as our servers take it: refused, or in shadow served and logged."""
        # Whatever the failures' reasons: the quarantine answers to its own name in policy.enforce.
        refuse = policy.enforced(self.settings.policy, QUARANTINE, "")
        return quarantine.server_entries(self.edge.records, wall_now, refuse)

    async def _push(self, control: ControlClient, entries: list[dict[str, Any]], worker: int = 0) -> bool:
        try:
            listed = await control.quarantine()
            said = listed.get("would_refuse")
            if isinstance(said, int) and not isinstance(said, bool) and said != self.edge.would_refuse_said.get(
                    worker, 0):
                self.fold(edges.WouldRefuseCounted(worker, said))
            have = sorted((str(e.get("fingerprint")), e.get("enforce", True) is not False)
                          for e in listed.get("entries", []) if isinstance(e, dict))
            # A process started while the fleet's quarantine is in force serves only once it has a
            # list (`serve --quarantine-wait`): an empty one is sent to it all the same.
            if have != sorted((e["fingerprint"], e.get("enforce", True)) for e in entries) \
                    or listed.get("received") is False:
                await control.set_quarantine(entries)
                log.info("quarantine_pushed", fingerprints=[e["fingerprint"] for e in entries],
                         **({"worker": worker} if worker else {}))
        except ControlError as exc:
            if exc.kind != "unreachable":  # a server starting or gone is pushed to at the next sync
                log.warning("quarantine_not_pushed", error=str(exc)[:300], **({"worker": worker} if worker else {}))
            return False
        return True

    def _report(self, call: Callable[[], None], failed: str) -> None:
        async def report() -> None:
            try:
                await asyncio.to_thread(call)
            except Exception as exc:  # the log line, metric and /status still say it
                log.warning(failed, error=str(exc)[:300])

        task = asyncio.get_running_loop().create_task(report())
        self._reports.add(task)
        task.add_done_callback(self._reports.discard)

    # -- restarts ------------------------------------------------------------------------------

    async def restart(self, decision: Decision, fold: Callable[[Outcome], None]) -> tuple[RestartEnded, str]:
        """The restarter's strategy with the drain where asked and possible; the outcome and its record.

        A restart that did not happen lifts the drain it made: a drained server that is not going
        away serves nothing, the zombie this sidecar exists to prevent."""
        s = self.settings
        started = self.clock()
        reported_only = self.restarter.strategy == "none"
        done, keep_unready, rung, record = False, False, decision.rung, "failed"
        detail: str | None = None
        recorded: bool | None = None
        # A slot for our pod's replacement: the ledger hears when the pod goes (`fleet.acted`).
        marks = self.fleet_on and self.fleet.slot_held and self.slot_rung(decision) == RUNG_POD
        drain: DrainHandle = ServerDrain(self.control if decision.drain and not reported_only else None,
                                         s.restart.drain_timeout, fold, self.clock,
                                         self._mark if marks else None)
        try:
            outcome = await self.worker_exit(decision, 0, self.control) \
                if decision.rung == RUNG_WORKER and not reported_only else None
            if outcome is None:
                if decision.rung == RUNG_WORKER:
                    decision = dataclasses.replace(decision, rung=RUNG_CONTAINER)
                outcome = await self.restarter.restart(decision, drain)
            done, rung, detail = outcome.done, outcome.rung, outcome.detail
            if outcome.gone and marks:
                await self._mark(None)
            if done:
                self.metrics.restarts.labels(reason=decision.reason, rung=rung).inc()
                keep_unready = procedure.keeps_unready(rung, self.restarter.strategy)
                record = "done"
            elif reported_only:
                record = "reported"
            else:
                await drain.lift("restart_failed")
            episode = edges.not_recorded_now(self.edge, self.clock())
            if outcome.not_recorded:
                record, recorded = "not_recorded", False
                if episode is None:
                    log.error(NOT_RECORDED, reason=decision.reason, detail=outcome.detail,
                              action="no restart until its Event can be written; retried with backoff")
            elif outcome.recorded:
                recorded = True
                if episode is not None:
                    log.info("restart_recorded_again", reason=decision.reason)
            log.warning("restart_finished", reason=decision.reason, strategy=self.restarter.strategy, rung=rung,
                        done=done, detail=outcome.detail, attempts=outcome.attempts,
                        seconds=round(self.clock() - started, 3))
        except asyncio.CancelledError:
            # The sidecar is stopping mid-restart: leave the server serving, not drained until its deadline.
            await drain.lift("watchdog_stopping")
            raise
        except Exception as exc:
            detail = repr(exc)
            log.exception("restart_failed", reason=decision.reason, error=repr(exc))
            await drain.lift("restart_failed")
        return RestartEnded(self.clock(), decision.reason, done, keep_unready, reported_only, rung,
                            decision.instance_id, detail=detail, recorded=recorded), record

    async def take_stacks(self, decision: Decision, worker: int, control: ControlClient | None) -> dict[str, Any]:
        """Before a hang's restart: every thread's stack of the process (its control API writes them to
        its termination log too), folded (the flight recording keeps them); a server without our control
        API leaves its metrics page at the stall, recorded already. What the restart's Event says of them."""
        now = self.clock()
        if control is None:
            st = edges.Stacks(worker, decision.instance_id, decision.reason, now, "metrics")
        else:
            try:
                report = await control.stacks(decision.reason)
                st = _stacks_of(report, worker, decision, now)
            except ControlError as exc:
                st = edges.Stacks(worker, decision.instance_id, decision.reason, now, "control", error=str(exc)[:300])
        self.fold(edges.StacksTaken(st))
        if st.error is not None:
            log.warning("stacks_unreadable", reason=decision.reason, worker=worker, error=st.error,
                        action="restarting without them")
        else:
            log.warning("stacks_taken", reason=decision.reason, worker=worker, source=st.source, stuck=st.stuck,
                        threads=len(st.threads), termination_log=st.termination_log)
        return edges.stacks_detail(st)

    async def would_restart(self, decision: Decision) -> str:
        """A shadow restart's Normal Event on our pod: `written`, `none` where the restarter writes no
        Events, else why not. Nothing else is done: no drain, no slot, no budget spent."""
        if self.restarter.strategy in ("none", "local"):
            return "none"
        try:
            error = await self.restarter.record_event(decision, WOULD_ACTION, shadow=True)
        except Exception as exc:  # a refusal of the API's own rules: the log line and /status still say it
            error = repr(exc)[:300]
        if error is not None:
            log.warning("would_restart_event_failed", reason=decision.reason, error=error)
            return f"failed: {error}"
        return "written"

    async def _mark(self, at: float | None) -> None:
        """Our pod's eviction (or deletion) is asked now, at `at`: the ledger hears it first, so that
        only a pod created after it gives our slot back. None: our pod was gone already (removed by
        someone else, whenever), its replacement maybe older than any mark: the slot goes back as an
        unmarked one does. Where the ledger cannot be told the pod goes all the same: its slot,
        marked, is then given back by no pod and lapses at `slot_timeout` (the fleet waits longer;
        never two replicas down), rather than this one staying a zombie."""
        pod = self.settings.kubernetes.pod_name
        try:
            await self._update(lambda led, now: (fleet.acted(led, pod, at), None))
        except Exception as exc:
            log.warning("fleet_act_not_marked", error=str(exc)[:300],
                        action=("our pod was gone already" if at is None else "evicting all the same")
                        + f"; our slot lapses after {self.settings.policy.fleet.slot_timeout:g}s")

    async def worker_exit(self, decision: Decision, worker: int, control: ControlClient | None,
                          untold: Callable[[str], None] = lambda why: None) -> RestartOutcome | None:
        """Worker `worker` leaves and its server starts it again, its Event written first as for any
        restart (refused: nothing done, `not_recorded`); None when it cannot be told, `untold` hearing
        why (the watched worker gets the container's rung then, as for one worker; another, once
        `EXIT_TRIES` such tries ran for its process).

        A poisoned worker exits by itself once its in-flight requests were read: telling it would
        only race the new process that replaces it, and its Event is written all the same. A hung
        one is told, naming the process, so that a replacement already listening is never the one
        that leaves; one that is gone already (or was replaced) is what the rung wanted."""
        if decision.reason == CONTEXT_LOSS:
            error = await self.restarter.record_event(decision, WORKER_ACTION, WORKER_PREFIX)
            return RestartOutcome(True, "the poisoned worker exits by itself; its server starts it again"
                                  + ("" if error is None else f" (its Event was not written: {error})"),
                                  rung=RUNG_WORKER, recorded=error is None)
        if control is None:
            untold("no control API")
            return None
        error = await self.restarter.record_event(decision, WORKER_ACTION, WORKER_PREFIX)
        if error is not None:
            return RestartOutcome(False, f"{NOT_RECORDED}: {error}", rung=RUNG_WORKER, not_recorded=True)
        why = f"{decision.reason}: worker {worker}'s {decision.detail.get('evidence', 'canary timeouts')}"
        try:
            await control.exit(why, decision.instance_id)
        except ControlError as exc:
            if exc.kind in ("unreachable", "conflict"):
                return RestartOutcome(True, f"the worker is gone already ({exc})", rung=RUNG_WORKER, recorded=True)
            # Its Event stands: the container's rung that follows counts once more (spent sooner, never later).
            log.warning("worker_exit_failed", reason=decision.reason, worker=worker, error=str(exc))
            untold(str(exc))
            return None
        return RestartOutcome(True, "the worker was told to exit; its server starts it again", rung=RUNG_WORKER,
                              recorded=True)

    def not_recorded_said(self, decision: Decision, detail: str, recorded: bool) -> None:
        """A worker's Event refused (`recorded` False) or written again: the episode said when it starts
        and when it ends (the fold keeps it; see `NOT_RECORDED_HOLD_S`)."""
        episode = edges.not_recorded_now(self.edge, self.clock())
        if not recorded and episode is None:
            log.error(NOT_RECORDED, reason=decision.reason, detail=detail,
                      action="no restart until its Event can be written; retried with backoff")
        elif recorded and episode is not None:
            log.info("restart_recorded_again", reason=decision.reason)

    def not_recorded_now(self) -> str | None:
        """Why the last restart wanted was not carried out for want of its Event; None: no such episode."""
        return edges.not_recorded_now(self.edge, self.clock())

    async def read_budget(self) -> WorkloadRestarts:
        """The workload's restarts from the Events; unreadable, slow or partial means spent (fail safe)."""
        assert self.restart_events is not None
        try:
            records = await asyncio.to_thread(self.restart_events.restart_records)
        except Exception as exc:
            error = f"{getattr(exc, 'status', None) or type(exc).__name__}: {str(exc)[:200]}"
            if error != self.edge.budget_read_error:
                log.error("restart_budget_unknown", error=error, action="no restarts until the Events can be read",
                          workload=self.workload)
            return WorkloadRestarts(self.clock(), self.wall_clock(), None, error=error)
        if self.edge.budget_read_error is not None:
            log.info("restart_budget_read", workload=self.workload, restarts=len(records))
        await self.read_fleet()
        wall_now = self.wall_clock()
        past = tuple(PastRestart(r.at, r.pod, r.node, r.gpus, r.reason)
                     for r in workload_restarts(self._believable(records, wall_now), self.workload))
        return WorkloadRestarts(self.clock(), wall_now, past, self.edge.replicas)

    # -- the workload's ledger -------------------------------------------------------------------------
    # Every read and write of the ledger goes through `_ledger_lock`: a canary's bookkeeping (leaving
    # the waiting list, giving a slot back) must not interleave with a slot being taken.

    async def _update(self, decide: Callable[[Ledger, float], tuple[Ledger, T]]) -> T:
        assert self.ledger is not None
        async with self._ledger_lock:
            return await asyncio.to_thread(self.ledger.update, decide)

    def _seen(self, replicas: int | None, ledger: Ledger | None, error: str | None = None) -> None:
        self.fold(edges.FleetSeen(fleet.view_of(self.fleet, self.settings.policy.fleet, replicas, ledger, error)))

    async def read_fleet(self) -> None:
        """The replicas (kept from the last read when this one fails: a count that is briefly unreadable
        has not changed) and, where the ledger is on, the slots and the breaker as they stand."""
        if self.ledger is None:
            return
        try:
            replicas = await asyncio.to_thread(self.ledger.replicas)
            if self.edge.replicas_error is not None:
                log.info("replicas_read", workload=self.workload, replicas=replicas)
            self.fold(edges.ReplicasRead(replicas))
        except Exception as exc:
            # Keyed by status (or type) alone: a real API server's error text carries a fresh Audit-Id.
            error = str(getattr(exc, "status", None) or type(exc).__name__)
            if error != self.edge.replicas_error:
                log.warning("replicas_unknown", workload=self.workload, error=f"{error}: {str(exc)[:200]}",
                            replicas=self.edge.replicas, action="the last count stands; none read yet counts as one")
            self.fold(edges.ReplicasRead(None, error))
        replicas = self.edge.replicas
        if not self.fleet_on:
            self._seen(replicas, None)
            return
        try:
            async with self._ledger_lock:
                ledger = await asyncio.to_thread(self.ledger.read)
        except Exception as exc:
            self._seen(replicas, None, error=str(exc))
            return
        self._seen(replicas, fleet.prune(self.settings.policy.fleet, ledger, self.wall_clock()))
        self._breaker_seen(self.fleet.breaker, opened_here=False)

    def slot_rung(self, decision: Decision) -> str:
        """The rung a slot for this restart is taken for: only `container` restarts in place; evict and
        delete always replace the pod; a worker's restart is the worker's whatever the strategy."""
        return procedure.slot_rung(decision, self.restarter.strategy)

    async def take_slot(self, decision: Decision) -> str | None:
        """A slot for this restart from the workload's ledger; None: granted (or no ledger), else why not
        (one of names.FLEET_HOLDS), said once per episode (`fleet_episode` tells when one began)."""
        if not self.fleet_on or self.ledger is None:
            return None
        s = self.settings.policy.fleet
        pod, replicas = self.settings.kubernetes.pod_name, self.edge.replicas
        rung = self.slot_rung(decision)
        try:
            template = (await self._own_pod()).template
        except Exception as exc:  # the slot is still taken: unknown matches any replacement, as before
            template = None
            log.warning("own_pod_unknown", error=str(exc)[:300], action="the slot is taken without its template")
        try:
            # Counted afresh for every ask: availability is what the cluster shows now, not what the
            # ledger remembers (a Lease can vanish; pods come and go that no sidecar restarted).
            census = await asyncio.to_thread(self.ledger.census)
            if census is not None:
                replicas = census.desired
            ledger, verdict = await self._update(lambda led, now: _take(s, led, replicas, pod, decision.reason,
                                                                        rung, now, template, census))
        except Exception as exc:
            self._seen(replicas, None, error=str(exc))
            self._held(decision, FLEET_LEDGER_UNKNOWN, {"error": str(exc)})
            return FLEET_LEDGER_UNKNOWN
        self._seen(replicas, ledger)
        if verdict.granted:
            if self.fleet.held is not None:
                log.info("fleet_slot_taken", reason=decision.reason,
                         waited_s=round(self.clock() - self.edge.held_since, 3), **verdict.detail)
            # Its restart begins again: no longer one that holds the slot in place.
            self.fold(edges.SlotTaken(self.clock(), int(decision.detail.get("worker", 0))))
            return None
        if verdict.opened and ledger.breaker is not None:
            self._breaker_seen(ledger.breaker, opened_here=True)
        self._held(decision, verdict.outcome, verdict.detail)
        return verdict.outcome

    async def recount(self, decision: Decision) -> str | None:
        """The workload counted again right before our pod goes (`fleet.recount`); None: it may go, else
        why not (said as a hold is). Pods that cannot be listed hold it: the count is the licence."""
        if not self.fleet_on or self.ledger is None:
            return None
        pod = self.settings.kubernetes.pod_name
        try:
            census = await asyncio.to_thread(self.ledger.census)
            if census is None:
                return None  # no workload to count (as when the slot was taken): the slot alone stands
            ledger = await asyncio.to_thread(self.ledger.read)
        except Exception as exc:
            self._held(decision, FLEET_LEDGER_UNKNOWN, {"error": str(exc)[:300], "recounted": True})
            return FLEET_LEDGER_UNKNOWN
        verdict = fleet.recount(self.settings.policy.fleet, ledger, census, pod)
        if verdict.granted:
            return None
        self._held(decision, verdict.outcome, verdict.detail)
        return verdict.outcome

    def fleet_episode(self, why: str | None) -> bool:
        """Whether the hold just returned began a new episode (a new why or reason), to be recorded once."""
        return why is not None and self.edge.held_anew

    def _held(self, decision: Decision, why: str, detail: dict[str, Any]) -> None:
        if self.edge.held_episode != (why, decision.reason):
            log.warning(why, reason=decision.reason, workload=self.workload, lease=self.fleet.lease,
                        action="restart held" + (": the next slot that frees is taken" if why != FLEET_BREAKER_OPEN
                                                 else ": restarts stop fleet-wide until the breaker closes"),
                        **detail)
            self.metrics.fleet_held.labels(why=why).inc()
        self.fold(edges.Held(self.clock(), why, decision.reason, detail))

    async def end_hold(self) -> None:
        """No restart is wanted any more (the target recovered, or the rule no longer holds): the hold is
        over, and this replica no longer waits for a slot."""
        if self.fleet.held is None:
            return
        log.info("fleet_hold_over", why=self.fleet.held, action="no restart wanted any more")
        self.fold(edges.HoldEnded())
        if self.ledger is None or self.fleet.slot_held:
            return
        pod = self.settings.kubernetes.pod_name
        try:
            await self._update(lambda led, now: (fleet.leave_waiting(led, pod), None))
        except Exception as exc:
            log.warning("fleet_wait_not_withdrawn", error=str(exc)[:300],
                        action=f"it lapses after {self.settings.policy.fleet.slot_timeout:g}s")

    def _breaker_seen(self, breaker: Breaker | None, opened_here: bool) -> None:
        if breaker is None or breaker.opened_at in self.edge.breakers_said:
            return
        self.fold(edges.BreakerSaid(breaker.opened_at))
        log.error("fleet_breaker_opened" if opened_here else "fleet_breaker_open", workload=self.workload,
                  reason=breaker.reason, failed=list(breaker.restarted), replicas=breaker.replicas,
                  opened_by=breaker.opened_by, action="no restarts for this reason fleet-wide: reporting only;"
                  " reset with `gpu-watchdog fleet reset-breaker` once the fault is fixed")
        if opened_here and self.ledger is not None:
            self._report_breaker(breaker)

    def _report_breaker(self, breaker: Breaker) -> None:
        ledger = self.ledger
        assert ledger is not None
        self._report(lambda: ledger.report_breaker(breaker), "fleet_breaker_event_failed")

    def begin(self, worker: int) -> bool:
        """A restart of `worker` (0: the target) begins; False: another is under way (asked again later)."""
        if self.edge.acting:
            return False
        self.fold(edges.Acting(worker, True))
        return True

    def end(self, worker: int) -> None:
        if worker in self.edge.acting:
            self.fold(edges.Acting(worker, False))

    def acting(self) -> bool:
        return bool(self.edge.acting)

    async def release_slot(self, worker: int, why: str) -> None:
        """`worker`'s restart did not happen: our slot back (no restart of the fleet's either), unless
        another worker's restart holds it still."""
        if any(k != worker for k in self.edge.acting) or self.edge.in_place:
            return
        await self.give_back_slot(False, why)

    def restarting_workers(self) -> dict[int, str | None]:
        return {p.worker: p.instance_id for p in self.edge.in_place}

    async def served(self, worker: int, instance_id: str | None) -> None:
        """Worker `worker` served a canary (0: the watched target, with no restart of ours in
        progress): once every worker restarted in place serves again, our slot goes back."""
        if not edges.in_place_served(self.edge, worker, instance_id):
            return
        self.fold(edges.InPlaceServed(worker))
        if edges.slot_back_due(self.edge):
            await self.give_back_slot(True, "target_serves" if worker == 0 else f"worker_{worker}_serves")

    async def give_back_slot(self, restarted: bool, why: str) -> None:
        """Our slot back to the fleet: our target serves again after an in-place restart, or the restart
        did not happen (`restarted` false: then no restart of the fleet's either)."""
        if not self.fleet.slot_held or self.ledger is None:
            return
        pod = self.settings.kubernetes.pod_name
        # A give-back that failed is tried again as it was first asked.
        pending = self.edge.give_back_pending
        restarted = pending if pending is not None else restarted
        try:
            await self._update(lambda led, now: (fleet.give_back(led, pod, restarted), None))
        except Exception as exc:
            if self.edge.give_back_pending is None:  # said once: it is tried again at every canary served
                log.warning("fleet_slot_not_given_back", why=why, error=str(exc)[:300],
                            action=f"tried again; it lapses after {self.settings.policy.fleet.slot_timeout:g}s")
            self.fold(edges.SlotNotGivenBack(restarted))
            return
        self.fold(edges.SlotGivenBack())
        log.info("fleet_slot_given_back", why=why, restarted=restarted)

    async def target_served(self) -> None:
        """Our target served a canary, with no restart of ours in progress: a slot we hold for an
        in-place restart (or one whose give-back failed) is given back; and, until it succeeds once, a
        replica our pod replaced is back."""
        if not self.fleet_on:
            return
        if self.fleet.slot_held and self.edge.give_back_pending is not None:
            await self.give_back_slot(True, "target_serves")
        await self._slot_left_behind()
        await self.served(0, None)
        if not self.edge.came_back:
            told = await self.came_back()
            if told or not self.edge.came_back_failed:
                self.fold(edges.CameBack(told))

    async def _slot_left_behind(self) -> None:
        """A slot in our pod's name that this sidecar does not hold (it took it, then restarted; or an
        in-place restart whose give-back was lost with the process) while our target serves: nothing
        of ours is restarting, and the slot would hold the fleet for `slot_timeout`. Given back."""
        pod = self.settings.kubernetes.pod_name
        if self.ledger is None or self.fleet.slot_held or self.edge.acting or pod not in self.fleet.restarting:
            return
        try:
            ledger = await self._update(lambda led, now: (new := fleet.give_back(led, pod, True), new))
        except Exception as exc:
            log.warning("fleet_slot_not_given_back", why="left_behind", error=str(exc)[:300],
                        action="tried again at the next canary served")
            return
        self._seen(self.edge.replicas, ledger)
        log.info("fleet_slot_given_back", why="left_behind", restarted=True)

    async def came_back(self) -> bool:
        """Our target serves for the first time: if our pod replaced one that was restarting, that
        replica is back, and its slot is given back. False: not known yet (tried again)."""
        if not self.fleet_on or self.ledger is None:
            return True
        pod = self.settings.kubernetes.pod_name
        try:
            own = await self._own_pod()
            if own.created_at is None:
                return True
            created = own.created_at
            # The count wanted now, not the last periodic read: a scale-up's pods are growth, not
            # replacements, and this read is what tells them apart.
            replicas = await asyncio.to_thread(self.ledger.replicas)
            slot = await self._update(lambda led, now: fleet.replaced(led, pod, created, template=own.template,
                                                                      replicas=replicas))
        except Exception as exc:
            if not self.edge.came_back_failed:
                log.warning("fleet_replacement_not_recorded", error=str(exc)[:300],
                            action="tried again at the next canary served")
            return False
        if slot is not None:
            log.info("fleet_replica_back", replaced=slot.pod, reason=slot.reason,
                     restarting_s=round(self.wall_clock() - slot.at, 3))
        return True

    async def own_template(self) -> str | None:
        """Our pod's template (its pod-template-hash), None where it cannot be read."""
        if self.ledger is None:
            return None
        try:
            return (await self._own_pod()).template
        except Exception:  # an API that does not answer: the reference's key says `unknown`
            return None

    async def _own_pod(self) -> OwnPod:
        own = self.edge.own_pod
        if own is None:
            assert self.ledger is not None
            own = await asyncio.to_thread(self.ledger.own_pod)
            self.fold(edges.OwnPodRead(own))
        return own

    def _believable(self, records: list[RestartRecord], wall_now: float) -> list[RestartRecord]:
        kept, ignored = escalation.believable(records, wall_now)
        seen = tuple(sorted({(r.pod, r.at) for r in ignored}))
        if ignored and seen != self.edge.ignored_records:
            log.warning("restart_records_ignored", why="dated in the future", count=len(ignored),
                        pods=sorted({r.pod for r in ignored}),
                        ahead_s=round(max(r.at for r in ignored) - wall_now, 1))
        if seen != self.edge.ignored_records:
            self.fold(edges.RecordsIgnored(seen))
        return kept

    # -- which GPUs, and those restarts did not cure -------------------------------------------

    def next_pod_gpus_wait(self) -> float:
        """How long to wait before asking the kubelet again: doubled after each refusal, up to a bound."""
        return edges.pod_gpus_wait(self.edge.pod_gpus_tries)

    async def learn_pod_gpus(self) -> PodGpus:
        """The kubelet's answer (no UUIDs while it has none; the error said once)."""
        try:
            uuids = await asyncio.to_thread(self._pod_gpus)
        except Exception as exc:  # the kubelet socket missing, refused, slow: say so, go on without
            error = str(exc)[:300]
            if error != self.edge.pod_gpus_error:
                log.warning("pod_gpus_unknown", error=error,
                            retry_in_s=edges.pod_gpus_wait(self.edge.pod_gpus_tries + 1))
            return PodGpus(None, error)
        if uuids is not None:
            log.info("pod_gpus", uuids=list(uuids), source="kubelet")
        return PodGpus(uuids)

    async def escalate(self, why: str, ours: tuple[str, ...] | None) -> None:
        """Read the namespace's restart Events back; report our GPUs that restarts did not cure."""
        if self.node is None or self.clock() < self.edge.escalation_retry_at:
            return
        try:
            records = await asyncio.to_thread(self.node.restart_records)
        except Exception as exc:  # 403, timeouts, garbage: reported once per kind, retried later
            self._escalation_failed("list_events", exc)
            return
        wall_now = self.wall_clock()
        reported = {sp.uuid for sp in self.suspects}
        for suspect in escalation.suspects(self.settings.policy.escalation, self._believable(records, wall_now),
                                           wall_now, ours):
            if suspect.uuid in reported:
                continue
            log.error("gpu_suspect", uuid=suspect.uuid, node=self.node.node_name, restarts=len(suspect.restarts),
                      reasons=suspect.reasons, xids=suspect.xids, action="report", trigger=why,
                      node_condition=self.node.node_condition)
            try:
                await asyncio.to_thread(self.node.report, suspect, self.settings.kubernetes.pod_name)
            except Exception as exc:
                self._escalation_failed("report", exc)
                continue  # not marked: reported again on the next look
            self.fold(edges.SuspectReported(suspect))
        if self.edge.escalation_failures:
            self.fold(edges.EscalationLooked())

    async def report_driver_word(self, decision: Decision) -> None:
        """A restart decided on the driver's word that the GPU needs a reset or the node a reboot: the
        Node hears of it now (the same Event and opt-in condition as `escalate`), once per GPU."""
        suspect = escalation.driver_says(decision.reason, decision.detail) \
            or escalation.answers_wrong(decision.reason, decision.detail)
        if self.node is None or suspect is None or any(sp.uuid == suspect.uuid for sp in self.suspects) \
                or self.clock() < self.edge.escalation_retry_at:
            return
        self.fold(edges.SuspectReported(suspect))  # taken before the call: a second decision must not report it twice
        log.error("gpu_suspect", uuid=suspect.uuid, node=self.node.node_name, driver_says=suspect.driver_says,
                  node_action=suspect.node_action, xids=suspect.xids, answers=suspect.answers, action="report",
                  trigger="answers" if suspect.answers else "driver", node_condition=self.node.node_condition)
        try:
            await asyncio.to_thread(self.node.report, suspect, self.settings.kubernetes.pod_name)
        except Exception as exc:
            self.fold(edges.SuspectWithdrawn(suspect.uuid))  # not reported: said again at the next such decision
            self._escalation_failed("report", exc)

    def _escalation_failed(self, step: str, exc: BaseException) -> None:
        status = getattr(exc, "status", None)
        key = f"{step}:{status or type(exc).__name__}"
        if key not in self.edge.escalation_said:
            log.warning("escalation_failed", step=step, status=status, error=str(exc)[:300],
                        retry_in_s=edges.escalation_backoff(self.edge))
        self.fold(edges.EscalationFailed(self.clock(), key))


# A hung process's stacks as the recording keeps them: enough to find the stuck call, and bounded.
STACK_THREADS_KEPT, STACK_FRAMES_KEPT = 32, 24


def _stacks_of(report: dict[str, Any], worker: int, decision: Decision, now: float) -> edges.Stacks:
    """The control API's answer (`POST /control/stacks`) as the fold keeps it; garbage raises ControlError."""
    try:
        threads = tuple(
            (str(t["name"]), tuple(f"{f['file']}:{f['line']} in {f['function']}"
                                   for f in reversed(t["frames"][-STACK_FRAMES_KEPT:])))
            for t in report["threads"][:STACK_THREADS_KEPT])
        stuck = report.get("stuck")
        where = None if not stuck else f"{stuck['file']}:{stuck['line']} in {stuck['function']} ({stuck['thread']})"
        written = report.get("termination_log")
    except (KeyError, TypeError, AttributeError) as exc:
        raise ControlError(f"stacks: not an answer of ours ({exc!r})", "bad_response") from None
    return edges.Stacks(worker, decision.instance_id, decision.reason, now, "control", where,
                        written if isinstance(written, str) else None, threads)


def _take(s: Any, ledger: Ledger, replicas: int | None, pod: str, reason: str, rung: str,
          now: float, template: str | None, census: fleet.Census | None) -> tuple[Ledger, tuple[Ledger, fleet.Verdict]]:
    """`fleet.take`, also handing back the ledger as written (for the view)."""
    # Every pod's restart goes through `KubeRestarter`, which tells the ledger when the pod goes.
    new, verdict = fleet.take(s, ledger, replicas, pod, reason, rung, now, template=template, marks=True,
                              census=census)
    return new, (new, verdict)
