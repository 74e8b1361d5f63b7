"""The fleet's invariants, each a function of the simulated world that raises `Broken` naming what
broke. Checked after every step of every run (`test_invariants.py`) and of the benchmark's."""

from __future__ import annotations

import bisect

from gpu_watchdog.watchdog.core import fleet, quarantine
from gpu_watchdog.watchdog.core.names import FLEET_HOLDS
from gpu_watchdog.watchdog.core.timing import BUDGET_READ_S
from tests.sim.world import STEP_S, Sidecar, World

# A killer with up to MAX_TIED - 2 decoys (and a popular request beside it) is refused by then.
KILLER_FAILURES = 3


class Broken(AssertionError):
    pass


def i1_max_unavailable(world: World) -> None:
    """I1, judged as each pod we restart leaves, on which pods serve then: never more than
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
    """I2: no restart without its recorded Event: every pod its sidecar evicted had a restart Event
    (a Warning regarding it) in the API server when the eviction was accepted (in the server's own
    order of writes: both may fall in one second)."""
    events = world.restart_events()
    for r in world.removals:
        if r.by_us and not any(e["regarding"].get("name") == r.pod
                               and int(e["metadata"]["resourceVersion"]) <= r.version for e in events):
            raise Broken(f"I2: {r.pod} evicted by its sidecar at {r.at:.0f} with no restart Event before it")


def i5_lineage_bounded(world: World) -> None:
    """I5: the pods of one lineage (here a node: a pod we restarted is replaced on its node) that their
    sidecars evicted within `restart_budget.window` are at most `max_restarts`, however many
    generations of pods took part."""
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
    """I6, on what happened: a request a replica answered is refused by no server whose sidecar has
    synced since the answering replica's sidecar said so, within the quarantine's window of the
    answer. A sidecar says what its server answered at its first sync after both the answer and the
    request falling under suspicion (a failure it was in flight at standing in the Lease, within the
    window), or as it stops, into the Lease; a Lease lost since loses what it said (until it says it
    again). So the reach is two syncs (5 s each) at the sidecars' cadence, however long a starved
    sidecar takes to make them; a replica that left before anything suspected the request took its
    answer along. Order is the world's (syncs counted), not seconds, which many moves share."""
    window = world.q_settings.window
    start, world.i6_checked = world.i6_checked, len(world.popular_refused)
    for at, pod, after in world.popular_refused[start:]:  # each refusal judged once, as it happened
        suspected = min((n for when, n in world.popular_suspected.values() if at - window <= when <= at), default=None)
        pushed = max((seq for seq, _ in world.syncs.get(pod, []) if seq <= after), default=0)
        first = bisect.bisect_left(world.popular_answers, at - window, key=lambda a: a[0])
        for answered, by, n in world.popular_answers[first:]:
            if answered > at:
                break
            since = n if suspected is None else max(n, suspected)
            for seq, when in world.syncs.get(by, []):
                if not since < seq < pushed or any(when <= lost <= at for lost in world.leases_lost_at):
                    continue
                raise Broken(f"I6: {pod} refused the popular request at {at:.0f}, answered at {answered:.0f}"
                             f" by {by}, whose sidecar said so at {when:.0f}")


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
    no replica ever answered, is in force (or lifted since), whatever decoys came with it. Failures
    within a window after the Lease was lost do not count: nothing new is quarantined then (the
    successes lost with it may have been any suspect's, and refusing an innocent request is the
    worse mistake)."""
    records = world.records()
    at = {k for k in world.killer_failures_recorded(records) if not world.forgetting(world.crashed_at[k])}
    if len(at) >= KILLER_FAILURES and not world.killer_prints & {q.fingerprint
                                                                  for q in quarantine.active(records, world.now)}:
        raise Broken(f"I7: the killer was in flight at {len(at)} recorded failures with {len(world.decoys)}"
                     " decoys and is not refused")


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


EVERY_STEP = (i1_max_unavailable, i2_event_first, i5_lineage_bounded, i6_answered_is_never_refused,
              i7_killer_refused, i8_lift_holds)
SETTLED = (i4_no_zombie, i6_settled)


def check(world: World) -> None:
    for invariant in EVERY_STEP:
        invariant(world)
