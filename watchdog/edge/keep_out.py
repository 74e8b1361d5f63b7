"""Keeping a sick card out of the next placement: its taint placed before the pod rung acts, and lifted
at its expiry. The effects only: what to taint and whether the bound allows it is `watchdog.core.placement`'s.

Never in the way of the restart it comes before: a taint that cannot be placed (an API that refuses,
a card that cannot be named) is said and counted, and the restart goes on as it would have.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Iterable
from typing import Any, Protocol, TypeVar

from gpu_watchdog import logs
from gpu_watchdog.watchdog.core import edges, placement, policy, state
from gpu_watchdog.watchdog.core.escalation import Suspect
from gpu_watchdog.watchdog.core.history import History
from gpu_watchdog.watchdog.core.names import PLACEMENT
from gpu_watchdog.watchdog.core.placement import Card, Records, Remediation, Taint, Verdict
from gpu_watchdog.watchdog.core.policy import Decision
from gpu_watchdog.watchdog.core.settings import Settings
from gpu_watchdog.watchdog.core.timing import LIFT_SYNC_S
from gpu_watchdog.watchdog.edge.metrics import WatchdogMetrics

T = TypeVar("T")

log = logs.get("watchdog.placement")



def lift_interval(ttl: float) -> float:
    return min(LIFT_SYNC_S, max(1.0, ttl / 10))
RECENT_KEPT = 16  # what this sidecar did, for /status


class PlacementLedger(Protocol):
    """The workload's placement records (an annotation of its Lease; blocking, see `LeaseLedger`)."""

    def read_placement(self) -> Records: ...
    def update_placement(self, decide: Callable[[Records, float], tuple[Records, T]]) -> T: ...


class CardPlacer(Protocol):
    """The cluster's side (blocking; see `watchdog.edge.effects.placement.Placer`)."""

    def cards(self, pod_gpus: tuple[str, ...] | None, named: str | None = None) -> list[Card]: ...
    def scope(self, kind: str, cards_per_pod: int) -> tuple[int, frozenset[str]]: ...
    def place(self, taint: Taint, card: Card, now: float | None = None) -> str: ...
    def ensure(self, taint: Taint, now: float | None = None) -> str: ...
    def present(self, taint: Taint) -> bool: ...
    def lift(self, taint: Taint, now: float | None = None, force: bool = True) -> str: ...
    def held(self, nodes: Iterable[str], now: float, strict: bool = False) -> tuple[list[Taint], set[str]]: ...
    def sweep_node(self, name: str, now: float) -> str: ...
    def rules(self) -> list[dict[str, Any]]: ...


class KeepOut:
    def __init__(self, *, settings: Settings, placer: CardPlacer, ledger: PlacementLedger, metrics: WatchdogMetrics,
                 wall_clock: Callable[[], float], workload: str, history: Callable[[], History],
                 fold: Callable[[Any], None], clock: Callable[[], float] = time.monotonic) -> None:
        self.settings = settings
        self.placer = placer
        self.ledger = ledger
        self.metrics = metrics
        self.wall_clock = wall_clock
        self.clock = clock  # the loop's: a shadow taint's record is dated as every decision is
        self.pod = settings.kubernetes.pod_name
        self.node = settings.kubernetes.node_name
        self.namespace = settings.kubernetes.namespace
        self.workload = workload
        # What was done, the last error and the episodes said once (capped, a card not known, an edge's
        # error kind) are the fold's (`edges.EdgeFacts.placement_*`).
        self.history = history
        self.fold = fold
        # In flight, not a fact: a device's taint placed before our restart, to become NoExecute once
        # the restart is accepted (one restart at a time).
        self._escalate: Taint | None = None
        # The restart waits this long for its card's taint at most: a slow API never holds a dead GPU.
        self.deadline = max(5.0, 2 * settings.kubernetes.request_timeout)
        # The nodes this sidecar saw a taint of ours on (in the records or the cluster), and until when: a
        # node cannot be listed, so a record the Lease lost is found again on the nodes someone remembers.
        self._nodes: dict[str, float] = {}

    async def before_pod_rung(self, decision: Decision, pod_gpus: tuple[str, ...] | None,
                              suspects: Iterable[Suspect]) -> str | None:
        """The card a curing restart is about remembered, and tainted where the evidence is about it;
        what was done (an action of names.PLACEMENT_ACTIONS), None where nothing was to be done."""
        s = self.settings.policy.placement
        self._escalate = None
        if s.strategy == "off" or decision.reason not in placement.CURING:
            return None
        try:
            return await asyncio.wait_for(self._before_pod_rung(decision, pod_gpus, list(suspects)), self.deadline)
        except Exception as exc:  # an edge that failed or was too slow: said once per kind, the restart goes on
            self._failed("before_restart", exc if not isinstance(exc, TimeoutError) else
                         TimeoutError(f"no answer within {self.deadline:g}s; the restart goes on without it"))
            return "failed"

    async def after_pod_rung(self, done: bool) -> None:
        """Our restart was accepted (its Event written, the disruption budget asked): a device taint
        asked as NoExecute becomes it now, evicting whatever else still uses the card."""
        taint, self._escalate = self._escalate, None
        s = self.settings.policy.placement
        new = placement.escalated(s, taint) if taint is not None and done else None
        if taint is None or new is None:
            return
        try:
            if not await asyncio.to_thread(self.ledger.update_placement,
                                           lambda rec, at: placement.changed(rec, taint, new)):
                return  # lifted or renewed meanwhile: that record stands, as it is
            outcome = await asyncio.to_thread(self.placer.ensure, new)
            log.warning("placement_escalated", target=new.target, card=new.card, effect=new.effect, outcome=outcome)
        except Exception as exc:
            self._failed("escalate", exc)

    async def remember_restart(self, decision: Decision, pod_gpus: tuple[str, ...] | None) -> None:
        """An in-place restart for a curing reason: the card's history, in the records (a repeat offender
        is one remediated on different days, whatever the rung)."""
        s = self.settings.policy.placement
        if s.strategy == "off" or decision.reason not in placement.CURING:
            return
        try:
            cards = await asyncio.to_thread(self.placer.cards, pod_gpus, placement.named_card(decision.detail))
            card = placement.evidence_card(decision.detail, cards)
            if card is not None:
                xid = decision.detail.get("xid")
                await self._remember(Remediation(card.id, card.node, self.wall_clock(), decision.reason,
                                                 xid if isinstance(xid, int) else None))
        except Exception as exc:
            self._failed("remember", exc)

    async def _before_pod_rung(self, decision: Decision, pod_gpus: tuple[str, ...] | None,
                               suspects: list[Suspect]) -> str | None:
        s = self.settings.policy.placement
        cards = await asyncio.to_thread(self.placer.cards, pod_gpus, placement.named_card(decision.detail))
        card = placement.evidence_card(decision.detail, cards)
        if card is None:
            self._once("card_unknown", "placement_card_unknown", cards=[c.id for c in cards],
                       evidence=decision.detail.get("evidence"), action="nothing tainted: the card is not known")
            return None
        now = self.wall_clock()
        records = await asyncio.to_thread(self.ledger.read_placement)
        why = placement.card_evidence(decision.reason, decision.detail) or _suspect_evidence(card, cards, suspects)
        if why is None and placement.repeat_offender(s, records, card.id, now):
            days = placement.repeat_days(s, records, card.id, now)
            why = f"remediated on {len(days)} different days within {s.memory / 86400:g} days (a repeat offender)"
        xid = decision.detail.get("xid")
        remedied = Remediation(card.id, card.node, now, decision.reason, xid if isinstance(xid, int) else None)
        if why is None:
            await self._remember(remedied)
            return None
        shadow = not policy.enforced(self.settings.policy, PLACEMENT, decision.reason)
        wanted = placement.plan(s, card, self.pod, why, now, shadow)
        if wanted is not None and shadow:
            self.fold(state.would(self.history(), self.clock(), PLACEMENT, decision.reason, {
                "card": card.id, "node": card.node, "kind": wanted.kind, "target": wanted.target, "evidence": why}))
        if wanted is None or s.strategy == "none" or (shadow and wanted.kind == placement.NODE):
            await self._remember(remedied)
            action = "not_possible" if wanted is None else "would_taint"
            self._did(action, card, why, wanted)
            log.warning("placement_" + action, card=card.id, node=card.node, evidence=why,
                        taint=None if wanted is None else placement.describe(wanted, now),
                        action="reported only" if wanted is not None else
                        "a device-plugin GPU is kept out by its node's taint: policy.placement.strategy node")
            return action
        scope, nodes = await asyncio.to_thread(self.placer.scope, wanted.kind, len(cards))
        # The bound counts what the cluster holds of ours too, not only the records (which may be lost, or
        # new since a Lease was deleted): on every node the workload runs on as well as those we know of.
        # A count that cannot be made whole taints nothing (`placement_failed`): never past the bound blind.
        found = await asyncio.to_thread(self._held_now, records, now, nodes)

        def decide(rec: Records, at: float) -> tuple[Records, Verdict]:
            rebuilt = placement.adopt(placement.remember(s, rec, remedied, at), found, at)
            return placement.take(s, rebuilt, wanted, scope, at)

        verdict = await asyncio.to_thread(self.ledger.update_placement, decide)
        self.metrics.placement_tainted.set(verdict.tainted)
        if verdict.outcome == "capped":
            self.metrics.placement_capped.labels(workload=self.workload).set(1)
            self._did("capped", card, why, wanted)
            self._once("capped", "placement_capped", card=card.id, node=card.node, evidence=why,
                       tainted=verdict.tainted, cap=verdict.cap, scope=scope,
                       action="nothing more tainted: many cards failing at once is not many bad cards;"
                              " the restart goes on")
            return "capped"
        if "capped" in self.history().edge.placement_said:
            self.fold(edges.PlacementSaid("capped", said=False))
        taint = verdict.taint
        assert taint is not None
        if verdict.outcome == "already":
            # Recorded: in the cluster too (a record whose create was cut short by a deadline, say).
            outcome = await asyncio.to_thread(self.placer.ensure, taint)
            log.info("placement_already", card=card.id, target=taint.target, until=taint.until, outcome=outcome)
            return None
        try:
            placed = await asyncio.to_thread(self.placer.place, taint, card, self.wall_clock())
        except Exception as exc:
            # A write whose answer was lost may have landed: then it stands, recorded.
            there = await asyncio.to_thread(_quietly, self.placer.present, taint)
            if there is None or (not there and not _refused(exc)):
                # Unknown (no answer, or the check unanswered): the record stays, to be lifted at its expiry
                # (`absent` if it never landed) and counted meanwhile: never a taint nobody lifts (I9).
                if self.node:
                    self._nodes[taint.target if taint.kind == placement.NODE else self.node] = taint.until
                raise
            if not there:
                # Refused: out of the records again, so that it neither counts against the bound nor
                # is lifted; the expired one it renews, still placed, back in its place.
                await asyncio.to_thread(self.ledger.update_placement,
                                        lambda rec, at: (placement.forget(rec, taint, verdict.previous), None))
                raise
            placed = "present"
        if placement.escalated(s, taint) is not None:
            self._escalate = taint
        # A shadow rule (effect None) keeps nothing out: the API counts the pods it would evict.
        did = "would_taint" if taint.effect == placement.SHADOW_EFFECT else "tainted"
        self.metrics.placement_actions.labels(action=did).inc()
        self._did(did, card, why, taint)
        log.warning("placement_" + did, card=card.id, node=card.node, kind=taint.kind, target=taint.target,
                    effect=taint.effect, evidence=why, until=taint.until, repeat=taint.repeat, placed=placed,
                    tainted=verdict.tainted, cap=verdict.cap,
                    action=("shadow: the rule keeps nothing out; its status counts the pods it would evict"
                            if did == "would_taint" else "the replacement is placed elsewhere")
                    + f"; lifted after {s.ttl:g}s or by `gpu-watchdog placement clear {taint.target}`")
        if did == "would_taint":
            return did
        if taint.repeat:
            log.error("placement_repeat", card=card.id, target=taint.target,
                      action="tainted again within policy.placement.memory of its last lift: the card needs attention")
        return "tainted"

    async def _remember(self, remedied: Remediation) -> None:
        s = self.settings.policy.placement
        await asyncio.to_thread(self.ledger.update_placement,
                                lambda rec, at: (placement.remember(s, rec, remedied, at), None))

    async def reconcile(self) -> None:
        """The workload's taints as the cluster and its records say, whoever placed them (a sidecar that
        placed one is long gone). First the cluster's side, whatever the records say (they may be lost,
        or unreadable): each rule and node taint of ours past the expiry it states is lifted (a node's
        only once no other workload's entry in it is in force), and one in force that no record stands
        for is recorded again (I9; the bound counts it). Then the records': past their expiry lifted (the
        record out first, and only if no one renewed it; back in if the cluster refused); the others
        present as recorded on our node (a race with a lift, an operator's delete). A rule by our name
        that we did not place is left, and out of our records. Every sidecar reports the bound's episode."""
        s = self.settings.policy.placement
        records: Records | None = None
        try:
            records = await asyncio.to_thread(self.ledger.read_placement)
        except Exception as exc:
            self._failed("reconcile", exc)  # the cluster's side still runs: it needs no records
        if s.strategy == "none":
            if records is not None:
                self._report(records)
            return  # nothing placed: nothing to keep as recorded
        now = self.wall_clock()
        try:
            found, clear = await asyncio.to_thread(self.placer.held, self._watched(records, now), now)
        except Exception as exc:
            self._failed("reconcile", exc)
            found, clear = None, set()
        if found is not None:
            records = await self._from_cluster(records, found, clear, now)
        if records is None:
            return
        self._report(records)
        # Each taint on its own: one that fails (a node gone, a refusal) never stops the others.
        for taint in placement.expired(records, now):
            await self._guarded("lift", self._lift(taint))
        for taint in records.taints:
            if taint.until > now and taint.node == self.node:
                await self._guarded("ensure", self._ensure(taint))
        for lifted in placement.swept(records, now):
            await self._guarded("sweep", self._sweep(lifted))

    def _report(self, records: Records) -> None:
        now = self.wall_clock()
        self.metrics.placement_tainted.set(len({(t.kind, t.target) for t in records.taints}))
        self.metrics.placement_capped.labels(workload=self.workload).set(
            1 if records.capped(self.settings.policy.placement, now) else 0)

    def _watched(self, records: Records | None, now: float) -> set[str]:
        """The nodes to read for taints of ours (strategy node only: the chart grants nodes for it alone):
        ours, those the records name, and those this sidecar saw one on."""
        if self.settings.policy.placement.strategy != "node":
            return set()
        if records is not None:
            for node in placement.watched_nodes(records, now):
                self._nodes[node] = max(self._nodes.get(node, 0.0), now)
        return {n for n in (self.node, *self._nodes) if n}

    def _held_now(self, records: Records, now: float, nodes: frozenset[str]) -> list[Taint]:
        """`held` for a decision: what the cluster shows of ours, on `nodes` too (the workload's); raises
        where any of it cannot be read."""
        watched = self._watched(records, now)
        if self.settings.policy.placement.strategy == "node":
            watched |= nodes
        found, _ = self.placer.held(watched, now, strict=True)
        return found

    async def _from_cluster(self, records: Records | None, found: list[Taint], clear: set[str],
                            now: float) -> Records | None:
        for node in clear:
            self._nodes.pop(node, None)
        for t in found:
            if t.kind == placement.NODE:
                self._nodes[t.target] = max(self._nodes.get(t.target, 0.0), t.until)
        for node in sorted({t.target for t in found if t.kind == placement.NODE and t.until <= now}):
            await self._guarded("lift", self._sweep_node(node, now))
        for t in found:
            standing = None if records is None else placement.recorded(records, t)
            # A rule renewed in the records keeps its first expiry in its annotation: the record's stands.
            if t.kind == placement.DEVICE and t.until <= now and (standing is None or standing.until <= now):
                if standing is None:  # a recorded one is lifted below, with its record
                    await self._guarded("lift", self._lift_orphan(t))
        live = [t for t in found if t.until > now]
        if records is None or all(placement.recorded(records, t) is not None for t in live):
            return records
        def rebuild(rec: Records, at: float) -> tuple[Records, Records]:
            new = placement.adopt(rec, live, at)
            return new, new

        try:
            return await asyncio.to_thread(self.ledger.update_placement, rebuild)
        except Exception as exc:
            self._failed("reconcile", exc)
            return records

    async def _guarded(self, step: str, work: Any) -> None:
        try:
            await work
            if self.history().edge.placement_error is not None:
                self.fold(edges.PlacementFailed(None))
        except Exception as exc:
            self._failed(step, exc)

    async def _ensure(self, taint: Taint) -> None:
        """A recorded taint of our node's, present as recorded. Read again just before: a lift between
        the pass's read and now must not be undone (nor a renewal's record overwritten)."""
        current = placement.recorded(await asyncio.to_thread(self.ledger.read_placement), taint)
        if current is None or current.until <= self.wall_clock():
            return
        outcome = await asyncio.to_thread(self.placer.ensure, current, self.wall_clock())
        if outcome == "absent":  # its node is gone: nothing is left to keep out
            await self._lift(current)
        elif outcome != "present":
            log.warning("placement_restored", target=current.target, card=current.card, outcome=outcome)

    async def _sweep(self, lifted: Taint) -> None:
        """A recent lift, gone from the cluster: a sidecar that read the records before it may have put the
        taint back (nothing else would lift that one)."""
        outcome = await asyncio.to_thread(self.placer.lift, lifted, self.wall_clock(), lifted.pod == "operator")
        if outcome == "lifted":
            log.warning("placement_lifted", target=lifted.target, card=lifted.card, kind=lifted.kind,
                        outcome=outcome, why="put back after its lift")

    async def _sweep_node(self, node: str, now: float) -> None:
        """Our entries in a node's taints, past their expiry, whatever the records say."""
        outcome = await asyncio.to_thread(self.placer.sweep_node, node, now)
        if outcome == "lifted":
            self.metrics.placement_actions.labels(action="lifted").inc()
            log.warning("placement_lifted", target=node, kind=placement.NODE, outcome=outcome,
                        why="expired, as the node's taint states")

    async def _lift_orphan(self, orphan: Taint) -> None:
        outcome = await asyncio.to_thread(self.placer.lift, orphan)
        log.warning("placement_lifted", target=orphan.target, card=orphan.card, kind=orphan.kind, outcome=outcome,
                    why="expired and not in the records")

    async def _lift(self, taint: Taint) -> None:
        s = self.settings.policy.placement

        def out(rec: Records, at: float) -> tuple[Records, bool]:
            new = placement.lifted(s, rec, taint, at, self.pod)
            return new, new != rec

        if not await asyncio.to_thread(self.ledger.update_placement, out):
            return  # renewed or lifted by another sidecar meanwhile: theirs now
        try:
            outcome = await asyncio.to_thread(self.placer.lift, taint, self.wall_clock(), False)
        except Exception:
            await asyncio.to_thread(self.ledger.update_placement,
                                    lambda rec, at: (placement.restore(rec, taint), None))
            raise
        self.metrics.placement_actions.labels(action="lifted").inc()
        log.info("placement_lifted", card=taint.card, target=taint.target, kind=taint.kind, outcome=outcome,
                 why="expired", placed_by=taint.pod)

    def _did(self, action: str, card: Card, why: str, taint: Taint | None) -> None:
        if action != "tainted":
            self.metrics.placement_actions.labels(action=action).inc()
        self.fold(edges.PlacementDone({"at": self.wall_clock(), "action": action, "card": card.id, "node": card.node,
                                       "evidence": why, "target": None if taint is None else taint.target},
                                      RECENT_KEPT))

    def _once(self, key: str, event: str, **fields: Any) -> None:
        if key not in self.history().edge.placement_said:
            self.fold(edges.PlacementSaid(key))
            log.error(event, **fields)

    def _failed(self, step: str, exc: BaseException) -> None:
        status = getattr(exc, "status", None)
        self.metrics.placement_actions.labels(action="failed").inc()
        key = f"{step}:{status or type(exc).__name__}"
        said = key in self.history().edge.placement_said
        self.fold(edges.PlacementFailed(f"{step}: {status or type(exc).__name__}: {str(exc)[:200]}", key))
        if not said:
            log.warning("placement_failed", step=step, status=status, error=str(exc)[:300],
                        action="nothing tainted; the restart goes on" if step == "before_restart"
                        else "tried again at the next reconcile")


def _quietly(check: Callable[[Taint], bool], taint: Taint) -> bool | None:
    try:
        return check(taint)
    except Exception:  # unknown (None): the record stays, and is lifted at its expiry
        return None


def _refused(exc: BaseException) -> bool:
    """The API's answer says the write was not done: a 4xx other than a timeout or a throttle, or a node
    taint of our key that is not ours. Anything else (no answer, a 5xx) may have landed."""
    if isinstance(exc, RuntimeError):  # ours: NotOurs, a rule by our name not ours, no DeviceTaintRule served
        return True
    status = getattr(exc, "status", None)
    return isinstance(status, int) and 400 <= status < 500 and status not in (408, 429)


def _suspect_evidence(card: Card, cards: list[Card], suspects: list[Suspect]) -> str | None:
    """A GPU suspect (restarts on it that did not cure) that is this card: named by it, or our only card."""
    for sp in suspects:
        if sp.uuid == card.id or (len(cards) == 1 and sp.restarts):
            if sp.restarts:
                return f"{len(sp.restarts)} restarts on this card within the window did not cure it"
    return None
