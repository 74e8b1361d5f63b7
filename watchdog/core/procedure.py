"""One restart, of the watched target or of any other worker, as a pure progression.

A restart is a run of steps: what was in flight read and recorded (the query of death's evidence,
whatever the budget then says), the workload's budget read again and checked, a slot of its
ledger taken, the card kept out of the next placement where the pod goes, then the act — another
worker told to exit, or the restarter's rung — each step an effect whose answer decides the next.
`next_step` says which step comes next from the procedure so far, the history and a few facts of
the edge; `advance` folds a step's answer into the procedure. The edge (`watchdog.runtime.restarting`)
performs the steps and nothing else, so every path a restart can take is tested on traces
(tests/unit/test_procedure.py), the same for every rung and every worker.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from gpu_watchdog.watchdog.core import edges, policy
from gpu_watchdog.watchdog.core.escalation import CURING_REASONS
from gpu_watchdog.watchdog.core.history import History
from gpu_watchdog.watchdog.core.names import HANG, RUNG_CONTAINER, RUNG_POD, RUNG_WORKER
from gpu_watchdog.watchdog.core.policy import Decision
from gpu_watchdog.watchdog.core.samples import CanarySample, Untold
from gpu_watchdog.watchdog.core.settings import PolicySettings
from gpu_watchdog.watchdog.core.timing import BUDGET_FRESH_S, EXIT_TRIES, SLOT_WAIT_S

# The steps, in the order a restart meets them.
STACKS = "stacks"  # a hang: where the process is stuck, every thread's stack, kept before anything changes
EVIDENCE = "evidence"  # what the process had in flight, recorded against the workload's failures
READ_BUDGET = "read_budget"  # the workload's restart Events read again (another pod may have restarted)
BLOCKED = "blocked"  # the budget is spent: nothing is done (ends the procedure)
REPORTED = "reported"  # strategy none, another worker: said, nothing done (ends)
# Shadow (`policy.enforce`): said as it would have been done (a Normal Event), nothing done, no slot
# taken and no budget spent (ends). The evidence and the card's keep-out come first, each as its own
# enforcement says, so that the quarantine and the placement are decided as they would be.
WOULD = "would"
TAKE_SLOT = "take_slot"  # a slot of the workload's ledger for the rung
HELD = "held"  # the ledger said not now: nothing done, asked again after the hold's interval (ends)
KEEP_OUT = "keep_out"  # the card the evidence is about kept out of the pod's next placement
EXIT = "exit"  # another worker told to exit through its own control API; its server starts it again
EXITED = "exited"  # it left, or was gone already (ends)
EXIT_FAILED = "exit_failed"  # it was not told (or its Event was refused): tried again after its backoff (ends)
FALL_BACK = "fall_back"  # a worker that cannot be told: the container's rung (or the pod's) instead
SWAP_SLOT = "swap_slot"  # the worker's slot given back: the pod's rung needs the one its replacement frees
# (then TAKE_SLOT again, for the pod's rung)
# The pod's replacement must be created after our slot by either clock (`fleet.replaced`): the act
# waits until the slot is SLOT_WAIT_S old (asked again until then).
SLOT_WAIT = "slot_wait"
# Right before the pod goes, its wait over: the workload counted again as the cluster shows it now
# (`fleet.recount`); too many out since the slot was granted (a drain, a scale-down): the slot goes
# back and the restart is held (then HELD), asked again as any hold is.
RECOUNT = "recount"
# The watched target's new process served since the restart was decided (its container restarted in
# place: the process left on its poisoned context, the kubelet's probe): the cure came by itself, our
# slot goes back and nothing is done (ends). Never for a pod's rung: a new process was not the cure.
NOT_NEEDED = "not_needed"
RESTART = "restart"  # the restarter's rung: the watched target's, or a worker's fallback (ends)

ENDS = frozenset({BLOCKED, REPORTED, WOULD, HELD, EXIT_FAILED, EXITED, NOT_NEEDED, RESTART})



@dataclass(frozen=True)
class Facts:
    """What the edge knows as the next step is decided."""

    now: float
    strategy: str  # restart.strategy: evict | delete | container | none
    slot_held: bool = False  # our slot of the workload's ledger, held now
    in_place: bool = False  # another worker's in-place restart holds that slot until it serves again
    keep_out: bool = False  # policy.placement acts (a strategy other than off, an API to act through)
    slot_taken_at: float | None = None  # when our slot was granted, by this sidecar's clock


@dataclass(frozen=True)
class Procedure:
    """One restart so far: the steps performed and what they answered."""

    worker: int  # 0: the watched target
    decision: Decision  # as it stands: the evidence's fingerprints added, the fallback's rung
    from_events: bool = False  # the budget is the workload's, counted from its restart Events
    asked_again: bool = False  # begun while the fleet held it: recorded once already
    done: tuple[str, ...] = ()
    held: str | None = None  # why the ledger said not now
    untold: Untold | None = None  # the worker's process, failed to be told EXIT_TRIES times before
    exit: str | None = None  # what the worker's exit answered: one of EXIT_ANSWERS
    exit_detail: str = ""
    exit_recorded: bool = False  # the exit's Event was written
    begun_at: float = 0.0  # when it was decided (or asked again): what the target did since is after it

    def did(self, step: str) -> bool:
        return step in self.done

    @property
    def over(self) -> bool:
        return bool(self.done) and self.done[-1] in ENDS


# What telling a worker to exit answers.
LEFT, REFUSED, NOT_RECORDED, UNTOLD = "left", "refused", "not_recorded", "untold"
EXIT_ANSWERS = (LEFT, REFUSED, NOT_RECORDED, UNTOLD)


@dataclass(frozen=True)
class Step:
    kind: str
    decision: Decision


def begin(s: PolicySettings, h: History, worker: int, decision: Decision, now: float, from_events: bool,
          asked_again: bool = False) -> Procedure:
    """A restart of `worker` as decided. A worker whose process could not be told EXIT_TRIES times
    running gets the container's rung at once: that process is not told again."""
    untold = untold_now(h, worker, decision.instance_id) if worker else None
    if untold is not None:
        decision = fallback(s, h, decision, untold, now)
    taken = edges.stacks_taken(h.edge, worker, decision.reason, decision.instance_id)
    if taken is not None:  # asked again (held): its Event still says where the stacks are
        decision = dataclasses.replace(decision, detail={**decision.detail, **edges.stacks_detail(taken)})
    return Procedure(worker, decision, from_events, asked_again, untold=untold, begun_at=now)


def next_step(s: PolicySettings, h: History, p: Procedure, f: Facts) -> Step | None:
    """The step to perform now; None once the procedure is over."""
    if p.over:
        return None
    d = p.decision
    if d.reason == HANG and not p.did(STACKS) and edges.stacks_taken(h.edge, p.worker, d.reason, d.instance_id) \
            is None:
        return Step(STACKS, d)
    if not p.did(EVIDENCE) and d.reason in CURING_REASONS:
        return Step(EVIDENCE, d)
    if not p.did(READ_BUDGET) and p.from_events and d.allowed and _budget_stale(h, p, f.now):
        return Step(READ_BUDGET, d)
    if p.worker == 0 and served_anew(h, d, p.begun_at) is not None:
        return Step(NOT_NEEDED, d)
    if not p.did(TAKE_SLOT):
        # Again for each restart: the one before it (of another worker) spent the budget too.
        if d.allowed and budget_spent(s, h, f.now, p.from_events):
            d = dataclasses.replace(d, allowed=False, blocked_by=policy.budget_blocker(s, h, f.now, p.from_events))
        if not d.allowed:
            return Step(BLOCKED, d)
        if not d.enforced:
            if f.keep_out and not p.did(KEEP_OUT) and slot_rung(d, f.strategy) == RUNG_POD:
                return Step(KEEP_OUT, d)
            return Step(WOULD, d)
        if p.worker and f.strategy == "none":
            return Step(REPORTED, d)
        return Step(TAKE_SLOT, d)
    if p.held is not None:
        return Step(HELD, d)
    if p.worker and not p.did(FALL_BACK):
        if p.untold is not None:
            return Step(FALL_BACK, d)
        if not p.did(EXIT):
            return Step(EXIT, d)
        if p.exit == LEFT:
            return Step(EXITED, d)
        u = untold_now(h, p.worker, d.instance_id)
        if p.exit != UNTOLD or u is None:
            return Step(EXIT_FAILED, d)
        return Step(FALL_BACK, fallback(s, h, d, u, f.now))
    if p.did(EXIT) and not p.did(SWAP_SLOT) and slot_rung(d, f.strategy) == RUNG_POD and f.slot_held \
            and not f.in_place:
        return Step(SWAP_SLOT, d)
    if p.did(SWAP_SLOT) and p.done.count(TAKE_SLOT) < 2:
        return Step(TAKE_SLOT, d)
    if f.keep_out and not p.did(KEEP_OUT) and slot_rung(d, f.strategy) == RUNG_POD:
        return Step(KEEP_OUT, d)
    if slot_wait_left(d, f) > 0:
        return Step(SLOT_WAIT, d)
    if _replaces_pod(d, f) and not p.did(RECOUNT):
        return Step(RECOUNT, d)
    return Step(RESTART, d)


def served_anew(h: History, d: Decision, since: float) -> CanarySample | None:
    """The watched target's first canary served by a new process since `since` (`History.served_anew`),
    where the decision's cure is a new process (`RUNG_CONTAINER`); None otherwise."""
    return h.served_anew(d.instance_id, since) if d.rung == RUNG_CONTAINER else None


def slot_wait_left(d: Decision, f: Facts) -> float:
    """How long the act still waits for our slot to be SLOT_WAIT_S old: only where it replaces the pod
    (evict, delete) under a slot of the ledger."""
    if not _replaces_pod(d, f) or f.slot_taken_at is None:
        return 0.0
    return max(0.0, SLOT_WAIT_S - (f.now - f.slot_taken_at))


def _replaces_pod(d: Decision, f: Facts) -> bool:
    """The act replaces the pod (evict, delete) under a slot of the ledger."""
    return f.slot_held and f.strategy in ("evict", "delete") and d.rung != RUNG_WORKER


def advance(p: Procedure, step: Step, inflight: tuple[str, ...] | None = None, held: str | None = None,
            exit: str | None = None, exit_detail: str = "", exit_recorded: bool = False,
            stacks: dict[str, Any] | None = None) -> Procedure:
    """`p` once `step` was performed: `stacks`, what the restart's Event says of the stacks taken;
    `inflight`, the fingerprints its evidence read (None: none);
    `held`, why the ledger (or the recount) said not now (None: a slot was granted); `exit`, what the worker's exit
    answered (one of EXIT_ANSWERS) and why."""
    d = step.decision
    if step.kind == STACKS and stacks is not None:
        d = dataclasses.replace(d, detail={**d.detail, **stacks})
    if step.kind == EVIDENCE and inflight is not None:
        d = dataclasses.replace(d, detail={**d.detail, "inflight": list(inflight)})
    out = dataclasses.replace(p, decision=d, done=(*p.done, step.kind))
    if step.kind in (TAKE_SLOT, RECOUNT):
        out = dataclasses.replace(out, held=held)
    if step.kind == EXIT:
        if exit not in EXIT_ANSWERS:
            raise ValueError(f"a worker's exit answers one of {EXIT_ANSWERS}, not {exit!r}")
        out = dataclasses.replace(out, exit=exit, exit_detail=exit_detail, exit_recorded=exit_recorded)
    return out


def budget_spent(s: PolicySettings, h: History, now: float, from_events: bool) -> bool:
    return policy.budget_remaining(s, h, now, from_events) <= 0


def _budget_stale(h: History, p: Procedure, now: float) -> bool:
    """Whether the workload's Events are read again first: always for a restart newly decided, and
    for one asked again while held once the last read is BUDGET_FRESH_S old."""
    read_at = h.workload_read_at
    return (not p.asked_again and p.worker == 0) or read_at is None or now - read_at >= BUDGET_FRESH_S


def untold_now(h: History, worker: int, instance_id: str | None) -> Untold | None:
    """Worker k's process, if its control API failed to tell it EXIT_TRIES times running (the same
    process: the same instance id, or the same worker where either is unknown)."""
    u = h.untold.get(worker)
    return u if u is not None and u.same(instance_id) and u.tries >= EXIT_TRIES else None


def fallback(s: PolicySettings, h: History, decision: Decision, untold: Untold, now: float) -> Decision:
    """The container's rung for worker k's restart: in place, or the pod where in place no longer
    cures (`policy.rung_for`, as for the watched target). Drained: the watched worker serves, and a
    canary it served would clear the verdict before the kubelet reads it."""
    rung = policy.rung_for(s, h, decision, now)
    return dataclasses.replace(decision, rung=RUNG_CONTAINER if rung == RUNG_WORKER else rung, drain=True,
                               detail={**decision.detail, "exit_tries": untold.tries,
                                       "exit_error": untold.error[:200]})


def keeps_unready(rung: str, strategy: str) -> bool:
    """Whether a restart done on `rung` under `strategy` leaves the sidecar unready: a pod evicted or
    deleted is going away, and stays out of the Service until it has gone."""
    return rung == RUNG_POD and strategy in ("evict", "delete", "container")


def slot_rung(decision: Decision, strategy: str) -> str:
    """The rung a slot for this restart is taken for: only `container` restarts in place; evict and
    delete always replace the pod; a worker's restart is the worker's whatever the strategy."""
    return decision.rung if strategy == "container" or decision.rung == RUNG_WORKER else RUNG_POD
