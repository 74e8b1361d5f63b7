"""The simulated workload under Hypothesis's stateful testing: each rule is one move of the world
(time, a sidecar's step, a fault, a rollout, a scale, the killer's try, an operator's lift); the
invariants are checked after every move; a failing run is shrunk to its shortest form and printed
as the moves that broke it."""

from __future__ import annotations

from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule

from tests.sim import invariants
from tests.sim.world import Knobs, World


class FleetMachine(RuleBasedStateMachine):
    knobs = Knobs()

    def __init__(self) -> None:
        super().__init__()
        self.world = World(self.knobs)

    @initialize(seed=st.integers(0, 2**16))
    def seeded(self, seed: int) -> None:
        self.world = World(self.knobs, seed)

    @rule(ticks=st.integers(1, 8))
    def time_passes(self, ticks: int) -> None:
        for _ in range(ticks):
            self.world.tick()

    @rule(which=st.integers(0, 63))
    def a_sidecar_steps(self, which: int) -> None:
        names = list(self.world.sidecars)
        if names:
            self.world.sidecar_step(names[which % len(names)])

    @rule()
    def every_sidecar_steps(self) -> None:
        for name in list(self.world.sidecars):
            self.world.sidecar_step(name)

    @rule(seconds=st.integers(1, 6))
    def time_passes_with_every_sidecar_acting(self, seconds: int) -> None:
        for _ in range(seconds):
            self.world.tick()
            for _ in range(2):
                for name in list(self.world.sidecars):
                    self.world.sidecar_step(name)

    @rule()
    def scaled_up_by_one(self) -> None:
        self.world.scale(self.world.desired + 1)

    @rule(which=st.integers(0, 63))
    def a_replica_hangs(self, which: int) -> None:
        pods = [p for p in self.world.alive() if p.serves(self.world.now)]
        if pods:
            self.world.hang(pods[which % len(pods)])

    @rule(which=st.integers(0, 63))
    def a_node_sickens(self, which: int) -> None:
        pods = self.world.alive()
        if pods:
            self.world.sicken(pods[which % len(pods)].node)

    @rule(replicas=st.integers(1, 8))
    def scaled(self, replicas: int) -> None:
        self.world.scale(replicas)

    @rule(which=st.integers(0, 63))
    def a_node_is_drained(self, which: int) -> None:
        pods = self.world.alive()
        if pods:
            self.world.drain(pods[which % len(pods)])

    @rule(which=st.integers(0, 63), seconds=st.integers(-60, 60))
    def a_nodes_clock_steps(self, which: int, seconds: int) -> None:
        pods = self.world.alive()
        if pods:
            self.world.clock_steps(pods[which % len(pods)], float(seconds))

    @rule(which=st.integers(0, 63), count=st.integers(1, 4))
    def cards_fail(self, which: int, count: int) -> None:
        pods = self.world.alive()
        if pods and self.knobs.placement:
            self.world.cards_fail([pods[(which + i) % len(pods)] for i in range(min(count, len(pods)))])

    @rule(which=st.integers(0, 63))
    def a_neighbours_card_fails(self, which: int) -> None:
        self.world.neighbours_card_fails(which)

    @rule()
    def the_lease_is_lost(self) -> None:
        self.world.lease_lost()

    @rule()
    def rolled_out(self) -> None:
        self.world.rollout()

    @rule()
    def popular_traffic(self) -> None:
        self.world.popular_traffic()

    @rule(which=st.integers(0, 63))
    def the_popular_request_sent_to_one_replica(self, which: int) -> None:
        pods = self.world.alive()
        if pods:
            self.world.popular_traffic(only=pods[which % len(pods)])

    @rule()
    def the_killer_tries(self) -> None:
        self.world.killer_try()

    @rule()
    def an_operator_lifts_the_killer(self) -> None:
        self.world.lift_killer()

    @invariant()
    def holds(self) -> None:
        invariants.check(self.world)

    def teardown(self) -> None:
        self.world.settle()
        invariants.check(self.world)
        for settled in invariants.SETTLED:
            settled(self.world)


def machine(knobs: Knobs) -> type[FleetMachine]:
    """A machine for these knobs (decoys, replicas, max_unavailable, the API's faults, clocks, surge)."""
    return type(f"FleetMachine_{knobs.replicas}_{knobs.max_unavailable}_{knobs.decoys}", (FleetMachine,),
                {"knobs": knobs})
