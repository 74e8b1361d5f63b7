"""The fleet's invariants, each a function of the simulated world that raises `Broken` naming what
broke. Checked after every step of every run (`test_invariants.py`) and of the benchmark's."""

from __future__ import annotations

import bisect
import math

from gpu_watchdog.watchdog.core import fleet, quarantine
from gpu_watchdog.watchdog.core.names import FLEET_HOLDS
from gpu_watchdog.watchdog.core.timing import BUDGET_READ_S
from tests.sim.api import NODE_TAINT_KEY, taint_entries
from tests.sim.world import LIFT_BOUND_S, PLACEMENT, STEP_S, WORKLOAD, Sidecar, World

# A killer with up to MAX_TIED - 2 decoys (and a popular request beside it) is refused by then.
KILLER_FAILURES = 3


class Broken(AssertionError):
    pass


def i1_max_unavailable(world: World) -> None:
    """I1, judged as each pod we restart leaves (or its container is killed on our verdict, to start
    again in place), on which pods serve then: never more than
    `max_unavailable` replicas out because of us (restarted, their stand-in not serving yet) while
    fewer than the desired replicas less `max_unavailable` serve once it is gone (as a
    PodDisruptionBudget counts: pods a rollout surged or a scale-down has not removed yet stand in),
    through rollouts, surges, scale-ups and -downs, node drains, a Lease lost and lost races. What
    others do afterwards (a scale-up, a drain) is theirs, not a restart's."""
    for r in world.removals:
        if not r.by_us:
            continue
        limit = fleet.unavailable_slots(world.fleet_settings, r.desired)
        if r.out_after > limit and r.serving_after < r.desired - limit:
            raise Broken(f"I1: {r.pod} left at {r.at:.0f} with {r.out_after} replicas out because of us"
                         f" (max_unavailable {limit}) and {r.serving_after} of {r.desired} serving")


def i2_event_first(world: World) -> None:
    """I2: no restart without its recorded Event: every pod its sidecar evicted (or whose container the
    kubelet killed on its verdict) had a restart Event (a Warning regarding it) in the API server when
    the eviction was accepted (in the server's own order of writes: both may fall in one second)."""
    events = world.restart_events()
    for r in world.removals:
        if r.by_us and not any(e["regarding"].get("name") == r.pod
                               and int(e["metadata"]["resourceVersion"]) <= r.version for e in events):
            raise Broken(f"I2: {r.pod} evicted by its sidecar at {r.at:.0f} with no restart Event before it")


def i5_lineage_bounded(world: World) -> None:
    """I5: the restarts of one lineage (here a node: a pod we restarted is replaced on its node) within
    `restart_budget.window`, pods their sidecars evicted and containers restarted in place on their
    verdict, are at most `max_restarts`, however many generations of pods took part."""
    b = world.policy.restart_budget
    recent: dict[str, int] = {}
    for r in world.removals:
        if r.by_us and world.now - r.at < b.window:
            recent[r.node] = recent.get(r.node, 0) + 1
    for node, n in recent.items():
        if n > b.max_restarts:
            raise Broken(f"I5: {n} restarts on node {node} within {b.window:g}s (max_restarts {b.max_restarts})")


def budget_holds(car: Sidecar, now: float) -> bool:
    """Its restart is blocked by the budget (`restart_budget`, `restart_loop`), or by Events it could not
    read the last time, read again within a minute (`restart_budget_unknown`): a holder that ends by
    itself, once the window passes or the Events can be read."""
    read_at = car.history.workload_read_at
    return car.blocked and read_at is not None and (
        car.history.workload_restarts is not None or now - read_at <= BUDGET_READ_S + STEP_S)


def i4_no_zombie(world: World) -> None:
    """I4, once the world has settled (no new faults, every sidecar stepped, 600 s at most): a
    replica that cannot serve is restarted (or has its slot and is being), or held by a documented
    holder that says so: the fleet's (FLEET_HOLDS) or the budget (blocked for the rest of its window)."""
    for pod in world.alive():
        car = world.sidecars.get(pod.name)
        # One its sidecar never saw serve is still starting (`policy.startup_timeout` bounds that).
        hung = pod.server.hung_since is not None and world.seen_serving(pod)
        held = car is not None and (car.held in FLEET_HOLDS or car.slot or budget_holds(car, world.now))
        if hung and not held:
            raise Broken(f"I4: {pod.name} hung since {pod.server.hung_since:.0f}, neither restarted nor held"
                         f" ({None if car is None else car.held})")


def i6_answered_is_never_refused(world: World) -> None:
    """I6, as the clients see it: a request a replica answered is refused by no server within the
    quarantine's window of that answer, wherever it was answered and however many answers came after
    it. The popular request is innocent (it never kills); it rides beside every try of the killer, so
    it is at as many failures, tied with it, and the servers that restarted in place never answered
    it. Judged on what the servers answered and refused, each refusal once, as it happened."""
    window = world.q_settings.window
    start, world.i6_checked = world.i6_checked, len(world.popular_refused)
    for at, pod in world.popular_refused[start:]:
        first = bisect.bisect_left(world.popular_answers, at - window, key=lambda a: a[0])
        if first < len(world.popular_answers) and world.popular_answers[first][0] <= at:
            answered, by = world.popular_answers[first]
            raise Broken(f"I6: {pod} refused the popular request at {at:.0f}, answered at {answered:.0f} by {by}")


def i6_settled(world: World) -> None:
    """I6 once settled: the popular request, answered all along, is refused by no server that takes
    requests (their screens asked)."""
    if world.popular in world.answered_at:
        refusing = [p.name for p in world.alive() if p.server.admits(world.now)
                    and p.server.refuses(world.prints(world.popular_body))]
        if refusing:
            raise Broken(f"I6: the popular request is refused by {refusing}")


def i7_killer_refused(world: World) -> None:
    """I7: a request in flight at KILLER_FAILURES failures (on as many processes) of the workload, that
    no replica ever answered, is quarantined (or lifted since), whatever decoys came with it: in force
    `policy.quarantine.confirm` after the decision, by the clock alone. Failures within a window after
    the Lease was lost do not count: nothing new is quarantined then (the successes lost with it may
    have been any suspect's, and refusing an innocent request is the worse mistake)."""
    records = world.records()
    at = {k for k in world.killer_failures_recorded(records) if not world.forgetting(world.crashed_at[k])}
    if len(at) < KILLER_FAILURES:
        return
    entries = [q for q in quarantine.standing(records, world.now) if q.fingerprint in world.killer_prints]
    if not entries:
        raise Broken(f"I7: the killer was in flight at {len(at)} recorded failures with {len(world.decoys)}"
                     " decoys and is not quarantined")


def i8_lift_holds(world: World) -> None:
    """I8: an operator's lift, while the Lease still records it, holds until new evidence after it:
    two processes it crashed after the lift, in the world's own order (not by the records' stamps,
    which two events in one second share). A Lease lost forgets its lifts: the failures sidecars
    still retry may quarantine the request again."""
    for q in quarantine.active(world.records(), world.now):
        before = world.lifted_after.get(q.fingerprint)
        if before is None:
            continue
        after = set(world.crashes[before:])
        if len(after) < 2:
            raise Broken(f"I8: {q.fingerprint} in force again after its lift at {world.lifted[q.fingerprint]:.0f}"
                         f" with {len(after)} failures after it")


def _ours(taints: tuple[dict[str, object], ...]) -> dict[tuple[object, str], int]:
    """Each entry of our key's taints: (effect, owner) -> expiry."""
    return {(t.get("effect"), owner): until for t in taints if t.get("key") == NODE_TAINT_KEY
            for owner, until in taint_entries(t).items()}


def i9_never_anothers_and_capped(world: World) -> None:
    """I9, at each write of a node's taints the API server applied (its log): no write by a workload's
    sidecar takes away or shortens another workload's entry still in force, nor changes a taint that is
    not gpu-watchdog's; and once a write leaves an entry of the writer's workload in force, the nodes
    holding one are at most `max_nodes` and `max_percent` (rounded up) of the nodes the workload runs on
    (the bound as documented), unless one of them is a taint its sidecars cannot see (`_unseen`)."""
    s = PLACEMENT
    start, world.node_writes_checked = world.node_writes_checked, len(world.cluster.node_writes)
    for w in world.cluster.node_writes[start:]:
        if w.owner is None:
            continue
        theirs = [t for t in w.before if t.get("key") != NODE_TAINT_KEY]
        if any(t not in w.after for t in theirs):
            raise Broken(f"I9: {w.caller} changed {w.node}'s taints that are not gpu-watchdog's: {theirs} -> {w.after}")
        after = _ours(w.after)
        for (effect, owner), until in _ours(w.before).items():
            if owner != w.owner and until > w.at and after.get((effect, owner), 0) < until:
                raise Broken(f"I9: {w.caller} took another workload's entry {owner}-{until} ({effect}) off"
                             f" {w.node} at {w.at:.0f}, in force until then")
        cap = max(0, min(s.max_nodes, math.ceil(max(w.scope, 1) * s.max_percent / 100.0)))
        added = any(owner == w.owner and until > w.at for (_, owner), until in after.items())
        if added and w.held > cap and not _unseen(world, w.owner):
            raise Broken(f"I9: {w.caller} left {w.held} nodes tainted for its workload at {w.at:.0f}"
                         f" (cap {cap} of {w.scope} nodes)")


def _lost_at(world: World, owner: str) -> list[float]:
    return world.leases_lost_at if owner == world.owner_of(WORKLOAD) else world.neighbour_leases_lost_at


def _unseen(world: World, owner: str, node: str | None = None) -> bool:
    """The documented exception: a node taint of this owner's (on `node`, or any) whose records were lost
    (its workload's Lease deleted since it was written) on a node where no pod of that workload runs:
    no sidecar of the workload has a reason to read that node."""
    for name, o, until in world.our_entries():
        if o != owner or (node is not None and name != node):
            continue
        placed = world.placed_at(name, owner, until)
        runs_there = any(p.node == name for p in world.alive()) if owner == world.owner_of(WORKLOAD) else any(
            n.node == name for n in world.neighbours.values())
        if not runs_there and any(placed <= lost for lost in _lost_at(world, owner)):
            return True
    return False


def i9_lifted(world: World) -> None:
    """I9 once settled (every taint's expiry and LIFT_BOUND_S after it passed, the sidecars stepping):
    no gpu-watchdog taint on a node whose entries all expired more than LIFT_BOUND_S ago, but for the
    documented exception (`_unseen`)."""
    for node, body in world.cluster.nodes.items():
        for t in body["spec"].get("taints") or []:
            if t.get("key") != NODE_TAINT_KEY:
                continue
            entries = taint_entries(t)
            owner, until = max(entries.items(), key=lambda e: e[1]) if entries else ("?", 0)
            if until + LIFT_BOUND_S < world.now and not _unseen(world, owner, node):
                raise Broken(f"I9: {node}'s taint {t.get('value')} ({t.get('effect')}) still there at"
                             f" {world.now:.0f}, {world.now - until:.0f}s past its expiry")


EVERY_STEP = (i1_max_unavailable, i2_event_first, i5_lineage_bounded, i6_answered_is_never_refused,
              i7_killer_refused, i8_lift_holds, i9_never_anothers_and_capped)
SETTLED = (i4_no_zombie, i6_settled, i9_lifted)


def check(world: World) -> None:
    for invariant in EVERY_STEP:
        invariant(world)
