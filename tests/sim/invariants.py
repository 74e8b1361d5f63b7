"""The fleet's invariants, each a function of the simulated world that raises `Broken` naming what
broke. Checked after every step of every run (`test_invariants.py`) and of the benchmark's."""

from __future__ import annotations

from gpu_watchdog.watchdog.core import fleet, quarantine
from gpu_watchdog.watchdog.core.names import FLEET_HOLDS
from gpu_watchdog.watchdog.core.timing import BUDGET_READ_S
from tests.sim.world import STEP_S, SYNC_S, Sidecar, World

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
    """I2: no restart without its recorded Event: every pod a sidecar removed has its restart Event,
    written before the removal."""
    for r in world.removals:
        if r.by_us and not any(e.pod == r.pod and e.at <= r.at for e in world.events):
            raise Broken(f"I2: {r.pod} removed by its sidecar at {r.at:.0f} with no restart Event before it")


def i5_lineage_bounded(world: World) -> None:
    """I5: the restarts of one lineage (here a node: a pod we restarted is replaced on its node) within
    `restart_budget.window` are at most `max_restarts`, however many generations of pods took part."""
    b = world.policy.restart_budget
    recent: dict[str, int] = {}
    for e in world.events:
        if world.now - e.at < b.window:
            recent[e.node] = recent.get(e.node, 0) + 1
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
        hung = pod.server.hung_since is not None and pod.served_once
        held = car is not None and (car.held in FLEET_HOLDS or car.slot or budget_holds(car, world.now))
        if hung and not held:
            raise Broken(f"I4: {pod.name} hung since {pod.server.hung_since:.0f}, neither restarted nor held"
                         f" ({None if car is None else car.held})")


# How long a success takes to reach every server at most: its replica's sidecar clears it in the
# records at its next sync, and every sidecar pushes the list at its next.
I6_REACH_S = 2 * SYNC_S + 2 * STEP_S


def i6_answered_is_never_refused(world: World) -> None:
    """I6, on what happened: a request answered by any replica of the fleet is refused by no server
    from I6_REACH_S after that answer until the quarantine's window has passed since it."""
    window = world.q_settings.window
    for at, pod in world.popular_refused:
        answered = [a for a in world.popular_answers if at - window <= a <= at - I6_REACH_S]
        if answered:
            raise Broken(f"I6: {pod} refused the popular request at {at:.0f}, answered at {answered[-1]:.0f}")


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
    no replica ever answered, is in force (or lifted since), whatever decoys came with it."""
    records = world.records()
    at = world.killer_failures_recorded(records)
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
