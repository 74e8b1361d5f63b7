"""A deterministic simulation of one workload: its Deployment and ReplicaSet controller, its pods
with their servers, a request mix and a simulated clock; each pod's sidecar is the production core
*and* edge: the real fold (`state.reduce`), policy (`policy.decide`), restart procedure and its
performer (`watchdog.runtime.restarting.Restarts`), the executor (`watchdog.edge.executor`) with
the real Kubernetes clients (`LeaseLedger`, `PodActions` and `KubeRestarter`, `ContainerRestarter`'s
verdict under `container`, `NodeReporter`'s read of the restart Events), keep-out (`KeepOut` and
its `Placer`, `Knobs.placement`) and the readiness view (`views.ready`, what `/readyz` answers). A
second workload (`Knobs.neighbour`) shares our nodes: its pods' sidecars run their keep-out alone.

What is simulated is only what lies outside the sidecar's process:
- the Kubernetes API server (`tests/sim/api.py`): `resourceVersion` compare-and-swap, creation times
  stamped by the server, a Lease that vanishes, writes refused or applied with their answer lost,
  Events that expire, a PodDisruptionBudget;
- each server's HTTP: its canary's answer (served, timed out on a hung server, refused by one down or
  loading) and its control API (`SimControl`: the answers of `inference.http_control`'s routes, from
  the server's real request record and quarantine list, `inference.screen`, behind its real guard);
- each sidecar's clocks: the world's time, its wall clock skewed by `Knobs.skew_s` at most;
- the kubelet and the scheduler (a pod we restarted is replaced on its node: the lineage a restart
  loop is bounded in, unless a taint keeps new pods off it; a card gone bad reported Unhealthy; the
  inference container's liveness probe on our verdict, which restarts it in place), the nodes and
  their taints, and the Deployment controller.

The world is advanced by its scheduler (Hypothesis's stateful testing picks the moves and shrinks a
failing run to the shortest one). A sidecar's move is one step of its loop (a restart's next step,
its ledger's bookkeeping after a canary served, a quarantine sync, a budget read, or an evaluation);
its blocking API calls run inline, in order, so that a seed replays exactly. Every invariant is a
function of the world's own log (`invariants.py`): which pods served when, who removed which pod,
which Events the API server held, what was answered and refused.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import hashlib
import itertools
import json
import os
import random
import tempfile
from collections.abc import Awaitable, Callable, Coroutine
from dataclasses import dataclass, field
from typing import Any

from gpu_watchdog import contract
from gpu_watchdog.inference.fingerprint import fingerprint, input_fingerprint
from gpu_watchdog.inference.guard import Guard
from gpu_watchdog.inference.metrics import InferenceMetrics
from gpu_watchdog.inference.screen import (
    QuarantinedRequest,
    QuarantineList,
    RequestBook,
    Screen,
    parse_entry,
    workload_key,
)
from gpu_watchdog.watchdog.core import fleet, quarantine, state, views
from gpu_watchdog.watchdog.core.history import History
from gpu_watchdog.watchdog.core.names import CONTEXT_LOSS
from gpu_watchdog.watchdog.core.policy import Decision
from gpu_watchdog.watchdog.core.procedure import Procedure
from gpu_watchdog.watchdog.core.samples import DeviceHealth, DeviceHealthSample
from gpu_watchdog.watchdog.core.settings import (
    FleetSettings,
    KubernetesSettings,
    PlacementSettings,
    PolicySettings,
    QuarantineSettings,
    RestartSettings,
    Settings,
)
from gpu_watchdog.watchdog.core.state import Outcome, PodGpus
from gpu_watchdog.watchdog.core.timing import BUDGET_READ_S, QUARANTINE_SYNC_S
from gpu_watchdog.watchdog.edge.control_client import ControlError
from gpu_watchdog.watchdog.edge.effects.fleet import LeaseLedger, lease_name
from gpu_watchdog.watchdog.edge.effects.node import NodeReporter
from gpu_watchdog.watchdog.edge.effects.placement import Placer
from gpu_watchdog.watchdog.edge.effects.restart import ContainerRestarter, KubeRestarter
from gpu_watchdog.watchdog.edge.executor import Executor
from gpu_watchdog.watchdog.edge.keep_out import KeepOut, lift_interval
from gpu_watchdog.watchdog.edge.kube.kube import PodActions
from gpu_watchdog.watchdog.edge.metrics import WatchdogMetrics
from gpu_watchdog.watchdog.edge.samplers.assembly import Samplers
from gpu_watchdog.watchdog.edge.samplers.canary import CanarySampler
from gpu_watchdog.watchdog.runtime.app import Watchdog
from gpu_watchdog.watchdog.runtime.episodes import Episodes
from gpu_watchdog.watchdog.runtime.restarting import Restarts
from gpu_watchdog.watchdog.runtime.sampling import Sampling
from tests.sim.api import NODE_TAINT_KEY, NS, WORKLOAD, Cluster, SimApi, taint_entries

STEP_S = 1.0  # the clock advances this much per tick
CANARY_S = 1.0  # each sidecar's canary runs once a tick; on a hung server it times out after this long
# A hang is decided by the real rule: its consecutive canary timeouts, one a tick.
DETECT_S = PolicySettings().hang.consecutive_timeouts * CANARY_S
LOAD_S = (2.0, 12.0)  # a new pod's model loads for this long before it serves (seeded, per pod)
# The kubelet's readiness probes, as the chart sets them (periodSeconds 5, successThreshold 1; the
# sidecar's failureThreshold 1, the model server's 2): the API's Ready condition follows what the pod
# answers only at its probes, each pod at its own phase, so a failure shows there up to 10 s late.
PROBE_PERIOD_S = 5
PROBE_FAILURES = {"watchdog": 1, "inference": 2}
RESTART_IN_PLACE_S = 2.0  # a crashed server is started again in its pod after this long
# `restart.strategy: container` (the chart's default): the inference container's liveness probe as the
# chart sets it (every 10 s, failureThreshold 2), failing on a verdict the sidecar wrote after the
# container started (by more than 2 s) and within its time to live, each in the node's clock
# (helm/gpu-watchdog/files/verdict-probe.sh); the kubelet then starts the container again.
LIVENESS_PERIOD_S, LIVENESS_FAILURES = 10, 2
VERDICT_TTL_S = 300
VERDICTS = tempfile.TemporaryDirectory(prefix="gpu-watchdog-sim-")  # the pods' emptyDirs, one file each
WORLDS = itertools.count()  # each world's own files: never another's (an id can be reused)
SYNC_S = QUARANTINE_SYNC_S  # each sidecar reads the quarantine and pushes it to its server this often
# A new server process waits this long at most for its sidecar's list before it serves without it
# (`serve --quarantine-wait`, as the chart starts it).
QUARANTINE_WAIT_S = 60.0
MODEL = WORKLOAD  # every replica's: one fingerprint key for the workload
KILLER_PROMPT = "compute the shape that wedges the kernel"
LEASE = lease_name(WORKLOAD)
TIMEOUT_S = 5.0  # each API call's deadline (never reached: the simulated server answers at once)
START = 1_790_000_000.0  # the world's clock at the start: epoch seconds (a node taint states its expiry in them)
# Keep-out (`Knobs.placement`): node taints of device-plugin GPUs, each for this long (short enough that
# a run sees them placed, expire and lifted); one pass of the sidecars' reconcile then lifts them.
PLACEMENT = PlacementSettings(strategy="node", ttl=30.0)
LIFT_PASS_S = lift_interval(PLACEMENT.ttl)
# I9's bound past a taint's expiry: one pass, the expiry rounded up to a whole second, and the tick the
# sidecar's pass falls in.
LIFT_BOUND_S = LIFT_PASS_S + 2 * STEP_S
NEIGHBOUR = "neighbour"  # the second workload whose pods share our nodes (`Knobs.neighbour`)
# Someone else's taint on every node (a node pool's): never ours to lift.
OPERATOR_TAINT = {"key": "example.com/pool", "value": "inference", "effect": "PreferNoSchedule"}


Prints = tuple[str | None, str | None]  # a request's fingerprint and input fingerprint (`Screen.prints`)


class Inline(concurrent.futures.ThreadPoolExecutor):
    """The loop's executor for `asyncio.to_thread`: the blocking API call runs at once, on the loop's
    thread, so that the calls of every sidecar happen in one order a seed replays (no thread is
    ever started)."""

    def submit(self, fn: Callable[..., Any], /, *args: Any, **kwargs: Any) -> concurrent.futures.Future[Any]:
        done: concurrent.futures.Future[Any] = concurrent.futures.Future()
        try:
            done.set_result(fn(*args, **kwargs))
        except BaseException as exc:  # handed to the awaiting coroutine, as a thread's would be
            done.set_exception(exc)
        return done


def new_loop() -> asyncio.AbstractEventLoop:
    loop = asyncio.new_event_loop()
    loop.set_default_executor(Inline())
    return loop


LOOP = new_loop()  # every world's: a world's tasks end with each move (`World.run`)


async def _nothing(*_: Any) -> None:
    return None


def _spawn(work: Awaitable[Any]) -> None:
    """As `Watchdog.spawn`: beside the step that asked, ended before the move ends (`World.run`)."""
    async def run() -> None:
        await work

    LOOP.create_task(run())


@dataclass
class Server:
    """A pod's inference process: serving, hung, or down after a crash; its guard (the screen: the
    request record and the quarantine list; the wait for its sidecar's list) is the real one, on the
    world's clock."""

    process: str
    started_at: float
    guard: Guard
    hung_since: float | None = None
    down_until: float | None = None  # crashed: started again in place at this time
    drained: bool = False  # its sidecar drained it before a restart (`POST /control/drain`)

    @property
    def screen(self) -> Screen:
        return self.guard.screen

    def serving(self, now: float) -> bool:
        """Its model answers (the control canary too)."""
        return self.hung_since is None and self.down_until is None

    def admits(self, now: float) -> bool:
        """It takes clients' requests: serving, and its sidecar's quarantine list in force, or the wait
        for it over (`Guard.awaiting_quarantine`, as `serve --quarantine-wait` sets it)."""
        return self.serving(now) and not self.drained and self.guard.awaiting_quarantine() == 0

    def refuses(self, prints: Prints) -> bool:
        try:
            self.screen.check(*prints)
        except QuarantinedRequest:
            return True
        return False

    def run(self, requests: list[Prints], ok: bool) -> list[int]:
        """Admit these requests (those not refused) in one step; answered successfully when `ok`, else
        left in flight (the step failed). Their tickets."""
        tickets: list[int] = []
        for fp, input_fp in requests:
            try:
                self.screen.check(fp, input_fp)
            except QuarantinedRequest:
                continue
            ticket = self.screen.admit(fp, input_fp)
            if ticket is not None:
                tickets.append(ticket)
        if ok:
            for t in tickets:
                self.screen.done(t, True)
        return tickets


SERVER_METRICS = InferenceMetrics()  # every simulated server's: the figures are the world's log, not these


def new_server(process: str, now: float, clock: Callable[[], float]) -> Server:
    guard = Guard(model=MODEL, instance_id=process, clock=clock, metrics=SERVER_METRICS)
    guard.screen.book = RequestBook(process, clock)
    guard.screen.quarantine = QuarantineList(clock)
    guard.quarantine_wait = QUARANTINE_WAIT_S
    guard.serving()  # its model loaded: the wait counts from now
    return Server(process, now, guard)


def killer_body(rnd: random.Random) -> dict[str, object]:
    """The killer as its client sends it this time: its fatal prompt, as a completion or a chat, with a
    setting that changes nothing of the bug (another sampler, seed, length, a stop that never matches)."""
    spelt: dict[str, object] = {"prompt": KILLER_PROMPT} if rnd.random() < 0.5 else {
        "messages": [{"role": "user", "content": KILLER_PROMPT}]}
    settings: list[dict[str, object]] = [
        {"temperature": round(rnd.uniform(0.0, 1.5), 2)}, {"seed": rnd.randrange(1 << 30)},
        {"top_p": round(rnd.uniform(0.5, 1.0), 3)}, {"max_tokens": rnd.randint(1, 64)},
        {"stop": [f"never {rnd.randrange(1 << 30)}"]}, {"presence_penalty": 1e-9}]
    return {**spelt, **rnd.choice(settings)}


@dataclass
class Pod:
    name: str
    template: str
    node: str
    created_at: float
    ready_at: float  # its model serves from then
    server: Server
    starts: int = 1
    removed_at: float | None = None
    replaces: str | None = None  # ground truth: the pod removed by us that this one stands in for
    growth: bool = False  # ground truth: created by a scale-up or a rollout's surge, not a replacement
    first_served_at: float | None = None  # ground truth: when it first could serve
    probe_phase: int = 0  # its kubelet probes it at this second modulo the period: spread by name, not drawn
    out_in_place: bool = False  # ground truth: its container restarted on our verdict, not serving again yet
    liveness_failures: int = 0
    ready_seen: bool = False  # its Ready condition as the kubelet last set it
    # Per container: Ready as the kubelet last set it, and its failed probes in a row.
    containers_ready: dict[str, bool] = field(default_factory=lambda: dict.fromkeys(PROBE_FAILURES, False))
    probe_failures: dict[str, int] = field(default_factory=lambda: dict.fromkeys(PROBE_FAILURES, 0))

    @property
    def alive(self) -> bool:
        return self.removed_at is None

    def serves(self, now: float) -> bool:
        return self.alive and now >= self.ready_at and self.server.serving(now)


class SimControl:
    """A pod's control API as its server answers it: each route `inference.http_control` serves, answered
    from the server's real screen; a server that is down (or a pod gone) refuses the connection."""

    def __init__(self, world: World, pod: str) -> None:
        self.world = world
        self.pod = pod

    def _server(self, path: str) -> Server:
        pod = self.world.pods[self.pod]
        if not pod.alive or pod.server.down_until is not None:
            raise ControlError(f"{path}: connection refused", "unreachable")
        return pod.server

    def set_token(self, token: str | None) -> None:
        """The token file read again after a refusal: the simulated server asks for none."""

    async def canary(self, timeout: float) -> dict[str, Any]:
        """`POST /control/canary`: one token from a serving model; a hung one never answers (the client's
        deadline passes), one down or still loading its model refuses the connection."""
        pod = self.world.pods[self.pod]
        server = self._server("POST /control/canary")
        if server.hung_since is not None:
            raise ControlError(f"POST /control/canary: no answer within {timeout + 2.0:g}s", "timeout")
        if self.world.now < pod.ready_at:
            raise ControlError("POST /control/canary: connection refused", "unreachable")
        return contract.CanaryResult(True, 0.05, None).to_json(server.process, server.drained)

    async def requests(self, timeout: float = 3.0, evidence: bool = False) -> dict[str, Any]:
        return self._server("GET /control/requests").screen.book.report(evidence)

    async def quarantine(self, timeout: float = 3.0) -> dict[str, Any]:
        return self._server("GET /control/quarantine").screen.describe()

    async def set_quarantine(self, entries: list[dict[str, Any]], timeout: float = 3.0) -> dict[str, Any]:
        server = self._server("PUT /control/quarantine")
        server.screen.quarantine.replace([parse_entry(e, f"entries[{i}].") for i, e in enumerate(entries)])
        return server.screen.describe()

    async def stacks(self, reason: str, timeout: float = 5.0) -> dict[str, Any]:
        self._server("POST /control/stacks")
        frame = {"file": "engine.py", "line": 1, "function": "forward"}
        return {"threads": [{"name": "MainThread", "frames": [frame]}], "stuck": {**frame, "thread": "MainThread"},
                "termination_log": None}

    async def drain(self, timeout: float, deadline: float | None = None) -> dict[str, Any]:
        self._server("POST /control/drain").drained = True
        return {"drained": True, "inflight": 0, "queued": 0}

    async def undrain(self, timeout: float = 10.0) -> dict[str, Any]:
        self._server("DELETE /control/drain").drained = False
        return {"drained": False}


@dataclass
class Removal:
    pod: str
    node: str
    at: float
    reason: str
    by_us: bool  # its own sidecar removed it (the API server's log: who evicted it)
    # Ground truth as the pod left: the desired replicas, the pods that serve once it is gone, and the
    # replicas out because of us with it (restarted, their stand-in not serving yet).
    desired: int = 0
    serving_after: int = 0
    out_after: int = 0
    version: int = 0  # the API server's resourceVersion as it went: every write before it has one no greater


@dataclass(frozen=True)
class Knobs:
    replicas: int = 4
    max_unavailable: str = "1"
    decoys: int = 0
    api_error_rate: float = 0.0  # of the API's answers: refused (500), nothing done
    lost_rate: float = 0.0  # of the API's writes: done, their answer lost (a timeout)
    race_rate: float = 0.0  # of the Lease's writes: another writer's lands first (409, decided again)
    skew_s: float = 0.0  # each sidecar's wall clock is off by up to this much, either way (seeded)
    pdb: bool = False  # a PodDisruptionBudget with the fleet's max_unavailable guards evictions
    # `restart.strategy`: evict (the budget answers), delete (nothing but our rules), or container (in place
    # first, the chart's default; the pod rung evicts)
    strategy: str = "evict"
    surge: int = 1  # the Deployment's RollingUpdate maxSurge
    rollout_unavailable: int = 0  # and its maxUnavailable
    popular_every_tick: bool = True  # False: the popular request only when a move sends it
    # The pods' readiness probes: the chart's (None), or every container's failureThreshold and
    # periodSeconds as a Deployment written by hand sets them (Kubernetes' defaults are 3 and 10 s).
    probes: tuple[int, int] | None = None
    placement: bool = False  # keep-out on: a card the kubelet calls Unhealthy gets its node tainted
    neighbour: bool = False  # a second workload on our nodes, keeping its own cards out of them


@dataclass
class Sidecar:
    """One pod's sidecar: its history (the fold) and the production edge that acts on it."""

    pod: str
    history: History
    settings: Settings
    skew: float  # its wall clock less the world's time
    executor: Executor = field(init=False)
    restarts: Restarts = field(init=False)
    proc: Procedure | None = None  # the restart under way
    blocked: bool = False  # its restart is blocked by the budget (said; decided again after the next read)
    synced_at: float = -1e9
    sampling: Sampling = field(init=False)
    # What its loop spawned beside a canary (the ledger's bookkeeping after one served): its own task,
    # run at the sidecar's next step.
    spawned: list[Coroutine[Any, Any, Any]] = field(default_factory=list)
    keep_out: KeepOut | None = None
    reconciled_at: float = -1e9
    watchdog: Watchdog = field(init=False)
    world: World | None = None

    def decided(self, now: float, decisions: list[Decision], core: str = "") -> None:
        """What `Watchdog.evaluate` decided, observed (its recorder's hook): a restart the budget blocks."""
        restart = next((d for d in decisions if d.action == "restart"), None)
        if restart is not None and not restart.allowed:
            if not self.blocked and self.world is not None:
                self.world.budget_blocks += 1
            self.blocked = True

    def fold(self, outcome: Outcome) -> None:
        """Through the loop's own fold (`Watchdog.fold`)."""
        self.watchdog.fold(outcome)

    @property
    def held(self) -> str | None:
        return self.history.edge.fleet.held

    @property
    def slot(self) -> bool:
        return self.history.edge.fleet.slot_held


def _folded(history: History, outcome: Outcome, settings: Settings) -> None:
    state.reduce(history, outcome, settings.policy.admission)


def gpu_of(node: str) -> str:
    """The one GPU of a node, as its device plugin names it."""
    return f"GPU-{node}"


def card_failed(gpu: str, at: float) -> DeviceHealthSample:
    """The kubelet's report of a card gone bad (KEP-4680's allocatedResourcesStatus)."""
    return DeviceHealthSample(at, True, (DeviceHealth("inference", "nvidia.com/gpu", gpu, "Unhealthy",
                                                      "Xid 79: GPU has fallen off the bus"),))


@dataclass
class Neighbour:
    """A pod of the other workload on one of our nodes: its sidecar's keep-out alone (the production
    `KeepOut` and `Placer` on its own Lease), the rest of that workload being outside this world."""

    pod: str
    node: str
    keep_out: KeepOut
    reconciled_at: float = -1e9


class Stepwise:
    """What `Watchdog` reaches through `running`: the executor, and the restarts, whose `run` begins the
    restart as `Restarts.run` does; its steps are then taken one a move by the sidecar (`World._next`),
    so that other sidecars and the world move between them."""

    def __init__(self, car: Sidecar, executor: Executor) -> None:
        self.car = car
        self.executor = executor
        self.restarts = self

    async def run(self, worker: int, decision: Decision, asked_again: bool = False) -> None:
        self.car.proc = self.car.restarts.begin(worker, decision, asked_again)


class World:
    def __init__(self, knobs: Knobs, seed: int = 0, policy_settings: PolicySettings | None = None) -> None:
        self.knobs = knobs
        self.serial = next(WORLDS)
        self.random = random.Random(seed)
        self.now = START
        self.fleet_settings = FleetSettings(max_unavailable=knobs.max_unavailable)
        self.q_settings = QuarantineSettings()
        self.policy = dataclasses.replace(policy_settings or PolicySettings(), fleet=self.fleet_settings,
                                          quarantine=self.q_settings)
        if knobs.placement:
            self.policy = dataclasses.replace(self.policy, placement=PLACEMENT)
        self.settings = Settings(policy=self.policy, restart=RestartSettings(strategy=knobs.strategy),
                                 kubernetes=KubernetesSettings(pod_name="", namespace=NS, node_name="",
                                                               workload=WORKLOAD, request_timeout=TIMEOUT_S))
        self.cluster = Cluster(self, faults=self._fault, evicted=self._evicted,
                               pdb_max_unavailable=fleet.unavailable_slots(self.fleet_settings, knobs.replicas)
                               if knobs.pdb else None)
        self.operator = LeaseLedger(SimApi(self.cluster, "operator", self.clock), NS, LEASE, WORKLOAD, "operator",
                                    TIMEOUT_S, wall_clock=self.clock, sleep=lambda s: None)
        self.metrics = WatchdogMetrics(lambda: views.snapshot(self.settings, History(started_at=self.now), self.now))
        self.desired = knobs.replicas
        self.template = "t1"
        self.rs: dict[str, int] = {"t1": knobs.replicas}  # each template's ReplicaSet's replicas
        self.pods: dict[str, Pod] = {}
        self.sidecars: dict[str, Sidecar] = {}
        self.removals: list[Removal] = []
        self.steps = 0
        self.sidecar_steps = 0  # sidecar moves taken (each a step of a sidecar's loop)
        self.budget_blocks = 0  # restarts the budget blocked (a sick node's restart loop bounded)
        self.names = 0
        self.api_errors = 0
        self.lost_answers = 0
        self.races = 0
        self.drains = 0  # pods removed by someone else (a node drain)
        self.leases_lost = 0  # the Lease deleted (an operator's cleanup, an etcd restore)
        self.leases_lost_at: list[float] = []
        self.neighbour_leases_lost_at: list[float] = []
        # The request mix's ground truth: real bodies, fingerprinted as every server does.
        self.key = workload_key(MODEL)
        self._prints: dict[str, Prints] = {}
        # Its client's own choices (a generator of its own: the world's moves stay as they were seeded).
        self.client = random.Random(seed + 1)
        killer = input_fingerprint(self.key, {"prompt": KILLER_PROMPT})  # its input: the same every try
        assert killer is not None
        self.killer: str = killer
        self.killer_prints: set[str] = {self.killer}  # every fingerprint a try of it had
        self.decoys = tuple({"prompt": f"decoy {i}", "max_tokens": 8} for i in range(knobs.decoys))
        self.popular_body = {"prompt": "the popular question", "max_tokens": 8}
        self.popular = fingerprint(self.key, self.popular_body)
        # Ground truth: when it was refused, by which pod.
        self.popular_refused: list[tuple[float, str]] = []
        self.i6_checked = 0  # the refusals I6 has judged (each once, right after the move it happened in)
        # Ground truth: when it was answered, by which pod.
        self.popular_answers: list[tuple[float, str]] = []
        self.tries = 0
        self.killer_refused = 0  # tries refused (ground truth: what the servers answered)
        self.killer_failures = 0  # failures the killer caused
        # F: the killer's failures in the Lease's records when it came in force there (each time, lifts
        # between).
        self.killer_f: list[int] = []
        self._killer_in_force = False
        self._observed: tuple[str | None, float, int] | None = None
        self._records: tuple[str | None, quarantine.Records] = (None, quarantine.Records())
        self.answered_at: dict[str, float] = {}  # fingerprint -> last success anywhere
        self.lifted: dict[str, float] = {}  # an operator's lifts
        self.crashes: list[tuple[str, str]] = []  # ground truth: each (pod, process) the killer crashed, in order
        self.crashed_at: dict[tuple[str, str], float] = {}
        self.lifted_after: dict[str, int] = {}  # a lifted fingerprint: how many crashes came before its lift
        self.trace: list[str] = []
        self.sick: set[str] = set()  # nodes whose servers hang once they served
        self.bad_cards: set[str] = set()  # nodes whose GPU the kubelet reports Unhealthy (and sick)
        self.node_writes_checked = 0  # the node writes I9 has judged
        self.neighbours: dict[str, Neighbour] = {}
        for _ in range(knobs.replicas):
            pod = self._create(growth=False, ready_now=True)
            pod.first_served_at = self.now
            pod.server.screen.quarantine.replace([])  # its sidecar's first list, before the run
        if knobs.neighbour:  # the other workload's pods, one on each of our first two nodes
            for pod in list(self.pods.values())[:2]:
                self._neighbour(pod.node)
        self.canaries()  # the pods there before the run served: their sidecars saw it
        for name in list(self.sidecars):
            self.sidecar_step(name)  # and told their ledger so

    def __del__(self) -> None:
        for car in self.sidecars.values():  # a run ends with its sidecars' tasks, never run, ended too
            for spawned in car.spawned:
                spawned.close()

    # -- the loop the sidecars' coroutines run on ---------------------------------------------------

    def run(self, coro: Coroutine[Any, Any, Any]) -> Any:
        """A coroutine of the sidecars' edge, to its end, and every task it spawned to theirs (a write
        beside a restart, an Event reported beside the loop): a move leaves nothing in flight."""
        if LOOP.is_running():  # a removal while a sidecar's step runs (its eviction): beside that step
            LOOP.create_task(coro)
            return None
        result = LOOP.run_until_complete(coro)
        while pending := asyncio.all_tasks(LOOP):
            LOOP.run_until_complete(asyncio.gather(*pending, return_exceptions=True))
        return result

    # -- the cluster -------------------------------------------------------------------------------

    def _create(self, growth: bool, replaces: str | None = None, ready_now: bool = False,
                template: str | None = None, node: str | None = None) -> Pod:
        self.names += 1
        name = f"p{self.names}"
        server = new_server(f"{name}-1", self.now, self.clock)
        load = 0.0 if ready_now else float(self.random.randint(int(LOAD_S[0]), int(LOAD_S[1])))
        pod = Pod(name, template or self.template, node or f"n{self.names}", self.now, self.now + load, server,
                  replaces=replaces, growth=growth, probe_phase=self.names)
        self.cluster.add_node(pod.node, [dict(OPERATOR_TAINT)])
        self.pods[name] = pod
        self.sidecars[name] = self._sidecar(pod)
        if ready_now:  # a workload running already: its pods Ready
            pod.ready_seen, pod.containers_ready = True, dict.fromkeys(PROBE_FAILURES, True)
        return pod

    def _sidecar(self, pod: Pod) -> Sidecar:
        """Its sidecar as `watchdog.runtime.wiring` builds one, on the simulated API and clocks."""
        skew = self.random.uniform(-self.knobs.skew_s, self.knobs.skew_s) if self.knobs.skew_s else 0.0
        settings = dataclasses.replace(self.settings, kubernetes=dataclasses.replace(
            self.settings.kubernetes, pod_name=pod.name, node_name=pod.node))
        car = Sidecar(pod.name, History(started_at=self.now, epoch=self.now, pod=pod.name, node=pod.node,
                                        strategy=self.knobs.strategy, budget_from_events=True), settings, skew)
        car.world = self

        def local() -> float:
            return self.now + car.skew  # its node's clock (a test may set it off later, as a node's may step)

        # As `gpu-watchdog run` wires it: one client, and the API server's clock it learns (`KubeApi.now`)
        # is what the workload's records are stamped by.
        api = SimApi(self.cluster, pod.name, local)
        wall = api.now
        ledger = LeaseLedger(api, NS, LEASE, WORKLOAD, pod.name, TIMEOUT_S, wall_clock=wall, sleep=lambda s: None)
        evictor = KubeRestarter(PodActions(api, pod.name, NS, TIMEOUT_S, wall_clock=wall), settings.restart,
                                sleep=_nothing, workload=WORKLOAD, node=pod.node, wall_clock=wall)
        # As `build_restarter` wires it, under `container` the verdict stamped by the node's clock (the probe's).
        restarter = ContainerRestarter(self.verdict_file(pod.name), evictor, wall_clock=local) \
            if self.knobs.strategy == "container" else evictor
        control = SimControl(self, pod.name)
        events = NodeReporter(api, NS, pod.node, TIMEOUT_S, node_condition=False, node_event=False)
        history = lambda: car.history  # noqa: E731 - the fold as it stands at each read
        # The loop's own object, as `gpu-watchdog run` makes it: its evaluation and its effects' bookkeeping
        # (`Watchdog.evaluate`), on this sidecar's history, clock and executor; a restart it starts is
        # stepped by the world's moves (`Stepwise`).
        wd = car.watchdog = Watchdog(settings, restarter, pod_gpus=lambda: None, wall_clock=local,
                                     restart_events=events, workload=WORKLOAD, ledger=ledger, cluster_clock=wall,
                                     metrics=self.metrics)
        wd.history, wd.clock = car.history, self.clock
        wd.decided = car.decided  # type: ignore[method-assign]
        ex = car.executor = Executor(
            settings=settings, restarter=restarter, metrics=self.metrics, clock=self.clock, wall_clock=wall,
            control=control, history=history, fold=car.fold,  # type: ignore[arg-type]
            restart_events=events, workload=WORKLOAD, ledger=ledger)
        wd._run = Stepwise(car, ex)  # type: ignore[assignment]
        car.fold(PodGpus((gpu_of(pod.node),)))  # the kubelet's answer: the node's one GPU

        if self.knobs.placement:
            car.keep_out = KeepOut(settings=settings, placer=Placer(api, NS, pod.name, pod.node, WORKLOAD, TIMEOUT_S),
                                   ledger=ledger, metrics=self.metrics, wall_clock=wall, workload=WORKLOAD,
                                   history=history, fold=car.fold, clock=self.clock)

        car.sampling = Sampling(
            settings=settings, samplers=Samplers(nvml=None, canary=CanarySampler(control, self.clock, CANARY_S),  # type: ignore[arg-type]
                                                 control=control, allocator=None, server_metrics=None,  # type: ignore[arg-type]
                                                 device_health=None),
            executor=ex, restarter=restarter, metrics=self.metrics, episodes=Episodes(self.metrics), history=history,
            fold=car.fold, evaluate=_nothing, spawn=car.spawned.append, clock=self.clock, wall_clock=local,  # type: ignore[arg-type]
            read_token=lambda: None, token=None, server_metrics_url=None)
        car.restarts = Restarts(
            settings=settings, executor=ex, metrics=self.metrics, fold=car.fold, record_decision=wd.record_decision,
            clock=self.clock, history=history, read_budget=wd.read_budget, keep_out=car.keep_out,
            worker_control=lambda k: control if k == 0 else None,  # type: ignore[arg-type, return-value]
            spawn=_spawn, restarted=lambda ended: None, escalate=_nothing,
            sleep=_nothing)
        return car

    def _neighbour(self, node: str) -> None:
        name = f"{NEIGHBOUR}-{len(self.neighbours) + 1}"
        self.cluster.others[name] = (node, NEIGHBOUR)
        settings = dataclasses.replace(self.settings, kubernetes=dataclasses.replace(
            self.settings.kubernetes, pod_name=name, node_name=node, workload=NEIGHBOUR))
        history = History(started_at=self.now, epoch=self.now, pod=name, node=node)
        api = SimApi(self.cluster, name, self.clock)
        ledger = LeaseLedger(api, NS, lease_name(NEIGHBOUR), NEIGHBOUR, name, TIMEOUT_S, wall_clock=api.now,
                             sleep=lambda s: None)
        self.neighbours[name] = Neighbour(name, node, KeepOut(
            settings=settings, placer=Placer(api, NS, name, node, NEIGHBOUR, TIMEOUT_S), ledger=ledger,
            metrics=self.metrics, wall_clock=api.now, workload=NEIGHBOUR, history=lambda: history,
            fold=lambda o: _folded(history, o, settings), clock=self.clock))

    def owner(self, caller: str) -> str | None:
        """The workload whose placement a caller's writes are (its `<owner>` in a node taint's value)."""
        workload = WORKLOAD if caller in self.pods else NEIGHBOUR if caller in self.neighbours else None
        return None if workload is None else self.owner_of(workload)

    @staticmethod
    def owner_of(workload: str) -> str:
        """As the docs define it: sha256 of `namespace/workload`, its first 8 hex digits."""
        return hashlib.sha256(f"{NS}/{workload}".encode()).hexdigest()[:8]

    def placed_at(self, node: str, owner: str, until: int) -> float:
        """When the API server first held this entry on the node (its log of node writes)."""
        return next((w.at for w in self.cluster.node_writes
                     if w.node == node and any(taint_entries(t).get(owner) == until for t in w.after)), self.now)

    def scope(self, caller: str) -> int:
        """The nodes the caller's workload runs on now (what its keep-out's bound is a share of)."""
        if caller in self.neighbours:
            return len({n.node for n in self.neighbours.values()})
        return len({p.node for p in self.alive()})

    def clock(self) -> float:
        return self.now

    def verdict_file(self, pod: str) -> str:
        return os.path.join(VERDICTS.name, f"{self.serial}-{pod}")

    def _liveness(self, pod: Pod) -> None:
        """The inference container's liveness probe under `container`: two failures in a row, and the
        kubelet kills it; the server starts again in place (its model loading anew)."""
        car = self.sidecars.get(pod.name)
        if car is None or round(self.now) % LIVENESS_PERIOD_S != pod.probe_phase % LIVENESS_PERIOD_S:
            return
        try:
            with open(self.verdict_file(pod.name), encoding="ascii") as fh:
                at = int(fh.read().split()[0])
        except (OSError, ValueError, IndexError):
            at = None
        node_now = self.now + car.skew
        started = pod.server.started_at + car.skew
        failing = at is not None and at > int(started) + 2 and node_now - at < VERDICT_TTL_S
        pod.liveness_failures = pod.liveness_failures + 1 if failing else 0
        if pod.liveness_failures < LIVENESS_FAILURES:
            return
        pod.liveness_failures = 0
        self._went_out(pod, "restarted in place", by_us=True)
        pod.out_in_place = True
        # Its new process (made at the sidecar's next step past this, as after a crash) loads the model first.
        pod.server.down_until = self.now + float(self.random.randint(int(LOAD_S[0]), int(LOAD_S[1])))
        self.trace.append(f"{self.now:.0f} container of {pod.name} restarted in place")

    def _went_out(self, pod: Pod, reason: str, by_us: bool) -> None:
        """Ground truth as a pod leaves, or its server is restarted in place: what I1 judges."""
        others = [p for p in self.alive() if p is not pod]
        out = len({p.replaces for p in others if p.replaces is not None and p.first_served_at is None}) + sum(
            1 for p in others if p.out_in_place)
        self.removals.append(Removal(pod.name, pod.node, self.now, reason, by_us, self.desired,
                                     sum(1 for p in others if p.serves(self.now)),
                                     out + int(by_us), self.cluster.version))

    def metrics_capped(self) -> int:
        """Restarts whose taint the bound refused, as the sidecars counted them (a benchmark's figure)."""
        value = self.metrics.registry.get_sample_value("gpu_watchdog_placement_actions_total", {"action": "capped"})
        return int(value or 0)

    def prints(self, body: dict[str, object]) -> Prints:
        """`Screen.prints` of a body, as every server computes it (one key for the workload), once per
        body: the simulation sends the same few bodies thousands of times."""
        text = json.dumps(body, sort_keys=True)
        found = self._prints.get(text)
        if found is None:
            found = self._prints[text] = (fingerprint(self.key, body), input_fingerprint(self.key, body))
        return found

    def alive(self) -> list[Pod]:
        return [p for p in self.pods.values() if p.alive]

    def _controller(self) -> None:
        """The Deployment and its ReplicaSets, RollingUpdate with `Knobs.surge` (maxSurge) and
        `Knobs.rollout_unavailable` (maxUnavailable): each template's ReplicaSet keeps its count of pods
        (a removed one is replaced at once, of its own template); a rollout grows the new template's
        while all pods stay within the replicas wanted plus the surge, and shrinks the old ones while
        the Ready pods stay at the replicas wanted less maxUnavailable, unready ones first; on a
        scale-down, unready pods go first."""
        old = [t for t, n in self.rs.items() if t != self.template and n > 0]
        if not old:
            self._set_rs(self.template, self.desired, growth=True)
            return
        k = self.knobs
        new = self.rs.get(self.template, 0)
        room = self.desired + k.surge - sum(self.rs.values())
        if room > 0 and new < self.desired:
            self._set_rs(self.template, min(self.desired, new + room), growth=True)
        # As the Deployment controller scales old ReplicaSets down: at most all pods less the minimum
        # available less the new ones not available, unready pods first, a Ready one only while the
        # Ready pods stay at the minimum.
        floor = self.desired - k.rollout_unavailable
        alive = self.alive()
        budget = len(alive) - floor - sum(1 for p in alive if p.template == self.template and not self.ready(p))
        for t in old:
            while self.rs[t] > 0 and budget > 0:
                mine = sorted((p for p in self.alive() if p.template == t),
                              key=lambda p: (self.ready(p), -p.created_at))
                if mine and self.ready(mine[0]) and sum(1 for p in self.alive() if self.ready(p)) - 1 < floor:
                    break
                self._set_rs(t, self.rs[t] - 1, growth=True)
                budget -= 1

    def _set_rs(self, template: str, count: int, growth: bool) -> None:
        self.rs[template] = count
        mine = [p for p in self.alive() if p.template == template]
        for _ in range(count - len(mine)):
            self._create(growth=growth, template=template)
        if len(mine) > count:
            for victim in sorted(mine, key=lambda p: (self.ready(p), -p.created_at))[:len(mine) - count]:
                self._remove(victim, "scaled down", by_us=False)

    def _evicted(self, name: str, caller: str) -> None:
        """The API server accepted an eviction (or deletion) of this pod: it goes now."""
        self._remove(self.pods[name], "evicted", by_us=caller == name)
        self.trace.append(f"{self.now:.0f} evict {name} by {caller}")

    def _remove(self, pod: Pod, reason: str, by_us: bool) -> None:
        car = self.sidecars.pop(pod.name, None)
        if car is not None:
            # A stopping sidecar says what its server answered (`run_until_signal`: `Executor.leaving`).
            self.run(car.executor.leaving())
            for spawned in car.spawned:  # its tasks end with its process
                spawned.close()
        self._went_out(pod, reason, by_us)
        pod.removed_at = self.now
        if len([p for p in self.alive() if p.template == pod.template]) < self.rs.get(pod.template, 0):
            # Where the pod's GPU frees, its replacement goes: a restart loop stays on one node.
            # (unless the node is tainted: the scheduler places it on another).
            node = pod.node if by_us and not self.keeps_out(pod.node) else None
            self._create(growth=False, replaces=pod.name if by_us else None, template=pod.template, node=node)

    def keeps_out(self, node: str) -> bool:
        """The scheduler's view: a taint on the node that a pod without tolerations may not be placed under."""
        return any(t.get("effect") in ("NoSchedule", "NoExecute")
                   for t in self.cluster.nodes[node]["spec"].get("taints") or [])

    def answers(self, pod: Pod) -> dict[str, bool]:
        """What each container's readiness probe answers now: the sidecar's `/readyz` (`views.ready`),
        the server admitting."""
        car = self.sidecars.get(pod.name)
        return {"watchdog": pod.alive and car is not None and views.ready(car.settings, car.history, self.now)[0],
                "inference": pod.alive and pod.server.admits(self.now)}

    def ready(self, pod: Pod) -> bool:
        """The pod's Ready condition as the API server holds it: set by the kubelet's probes."""
        return pod.alive and pod.ready_seen

    def _probe(self) -> None:
        """The kubelet probes each pod whose period comes round this second: a container is Ready
        after one success, unready after its failureThreshold in a row; the pod, while all are."""
        failures, period = self.knobs.probes or (None, PROBE_PERIOD_S)
        for pod in self.alive():
            if self.knobs.strategy == "container":
                self._liveness(pod)
            if round(self.now) % period != pod.probe_phase % period:
                continue
            for container, ok in self.answers(pod).items():
                pod.probe_failures[container] = 0 if ok else pod.probe_failures[container] + 1
                if ok or pod.probe_failures[container] >= (failures or PROBE_FAILURES[container]):
                    pod.containers_ready[container] = ok
            pod.ready_seen = all(pod.containers_ready.values())

    def drain(self, pod: Pod) -> None:
        """Someone else removes a pod (a node drain): its ReplicaSet makes a stand-in elsewhere."""
        self._remove(pod, "drained", by_us=False)
        self.drains += 1
        self.trace.append(f"{self.now:.0f} drain {pod.name}")

    def lease_lost(self) -> None:
        """An operator's cleanup or an etcd restore: the Lease is deleted, and everything it recorded."""
        if self.cluster.leases.pop(LEASE, None) is not None:
            self.leases_lost += 1
            self.leases_lost_at.append(self.now)
        if self.cluster.leases.pop(lease_name(NEIGHBOUR), None) is not None:
            self.neighbour_leases_lost_at.append(self.now)
        # The operator's lifts were records of that Lease: gone with it (I8 holds for recorded lifts).
        self.lifted_after.clear()
        self.trace.append(f"{self.now:.0f} lease lost")
        self._observe_killer()

    def clock_steps(self, pod: Pod, seconds: float) -> None:
        """Its node's clock steps to `seconds` off the world's (NTP gone, then back, or a VM resumed)."""
        car = self.sidecars.get(pod.name)
        if car is not None:
            car.skew = seconds
            self.trace.append(f"{self.now:.0f} clock of {pod.node} {seconds:+.0f}s")

    def scale(self, replicas: int) -> None:
        self.desired = replicas
        self._controller()
        self.trace.append(f"{self.now:.0f} scale {replicas}")

    def rollout(self) -> None:
        self.template = f"t{int(self.template[1:]) + 1}"
        self.trace.append(f"{self.now:.0f} rollout {self.template}")

    def _fault(self, caller: str, method: str, path: str) -> str | None:
        """What befalls a sidecar's request (an operator's always gets through)."""
        if caller == "operator":
            return None
        k, r = self.knobs, self.random.random()
        if r < k.api_error_rate:
            self.api_errors += 1
            return "refused"
        if method != "GET" and r < k.api_error_rate + k.lost_rate:
            self.lost_answers += 1
            return "lost"
        if method == "PUT" and "/leases/" in path and r < k.api_error_rate + k.lost_rate + k.race_rate:
            self.races += 1
            return "raced"
        return None

    # -- the Lease as the API server holds it (ground truth) ------------------------------------------

    def _lease_annotation(self, key: str) -> tuple[str | None, str | None]:
        lease = self.cluster.leases.get(LEASE)
        if lease is None:
            return None, None
        meta = lease["metadata"]
        return meta["resourceVersion"], (meta.get("annotations") or {}).get(key)

    def ledger(self) -> fleet.Ledger:
        return fleet.parse(self._lease_annotation(fleet.LEDGER_ANNOTATION)[1])

    def records(self) -> quarantine.Records:
        version, text = self._lease_annotation(quarantine.ANNOTATION)
        if version is None or version != self._records[0]:
            self._records = (version, quarantine.parse(text))
        return self._records[1]

    def restart_events(self) -> list[dict[str, Any]]:
        """Every restart Event the API server ever held (expired ones too), with its server time `_at`."""
        return [e for e in self.cluster.posted if (e.get("regarding") or {}).get("kind") == "Pod"
                and e.get("type") == "Warning"]

    # -- faults and requests -----------------------------------------------------------------------

    def hang(self, pod: Pod) -> None:
        if pod.serves(self.now):
            pod.server.hung_since = self.now
            self.trace.append(f"{self.now:.0f} hang {pod.name}")

    def sicken(self, node: str) -> None:
        """A node whose GPU wedges every server on it once it has served: a pod restarted there is
        replaced there and hangs again, a restart loop the lineage's budget must bound (I5)."""
        self.sick.add(node)
        self.trace.append(f"{self.now:.0f} sick {node}")

    def cards_fail(self, pods: list[Pod]) -> None:
        """These pods' cards go bad at once (a driver rollout gone wrong, a rack's power): the kubelet
        reports each Unhealthy and its server hangs, on that node, until the node is left alone."""
        for pod in pods:
            self.bad_cards.add(pod.node)
            self.sick.add(pod.node)
            self.hang(pod)
            self._card_report(pod)
        self.trace.append(f"{self.now:.0f} cards fail on {', '.join(p.node for p in pods)}")

    def _card_report(self, pod: Pod) -> None:
        car = self.sidecars.get(pod.name)
        if car is not None and pod.node in self.bad_cards:
            car.fold(card_failed(gpu_of(pod.node), self.now))

    def neighbours_card_fails(self, which: int) -> None:
        """A card of the other workload's, on one of our nodes, goes bad: its sidecar keeps it out before
        its own restart (which is that workload's, outside this world)."""
        if not self.neighbours:
            return
        n = list(self.neighbours.values())[which % len(self.neighbours)]
        gpu = f"GPU-{n.pod}"
        decision = Decision("restart", CONTEXT_LOSS, {"evidence": "device_health", "uuid": gpu,
                                                      "resource_id": gpu, "resource": "nvidia.com/gpu"})
        self.run(n.keep_out.before_pod_rung(decision, (gpu,), ()))
        self.trace.append(f"{self.now:.0f} neighbour's card fails on {n.node}")

    def popular_traffic(self, only: Pod | None = None) -> None:
        """The popular request answered by every replica that takes requests and does not refuse it
        (`only`: sent once, to that replica)."""
        for pod in [only] if only is not None else self.alive():
            if not (pod.serves(self.now) and pod.server.admits(self.now)):
                continue
            if pod.server.refuses(self.prints(self.popular_body)):
                self.popular_refused.append((self.now, pod.name))
                continue
            pod.server.run([self.prints(self.popular_body)], ok=True)
            self.answered_at[self.popular] = self.now
            self.popular_answers.append((self.now, pod.name))

    def killer_try(self) -> None:
        """The killer's client: the killer (its sampler or spelling new each try), its decoys in flight
        beside it, the popular request, a fresh one-off after it, in one step of one replica that takes
        requests; the step poisons that replica's context unless the killer is refused. Its sidecar
        reads what was in flight from the poisoned server (`Executor.record_failure`, as its restart's
        evidence step does) before the process leaves and is started again in place."""
        serving = [p for p in self.alive() if p.serves(self.now) and p.server.admits(self.now)]
        if not serving:
            return
        pod = self.random.choice(serving)
        prints = self.prints(killer_body(self.client))
        assert prints[0] is not None and prints[1] == self.killer
        self.killer_prints.add(prints[0])
        if pod.server.refuses(prints):
            self.killer_refused += 1
            return
        self.tries += 1
        one_off = {"prompt": f"one-off {self.tries}", "max_tokens": 8}
        server = pod.server
        ran = server.run([prints, *(self.prints(d) for d in self.decoys), self.prints(self.popular_body),
                          self.prints(one_off)], ok=False)
        server.screen.book.failed(ran)
        self.killer_failures += 1
        self.crashes.append((pod.name, server.process))
        self.crashed_at[(pod.name, server.process)] = self.now
        self.trace.append(f"{self.now:.0f} killer crashes {pod.name} ({self.killer_failures})")
        car = self.sidecars[pod.name]
        self.run(car.executor.record_failure(Decision("restart", CONTEXT_LOSS, instance_id=server.process)))
        server.down_until = self.now + RESTART_IN_PLACE_S
        self._observe_killer()

    def lift_killer(self) -> None:
        """An operator lifts what refuses the killer (`gpu-watchdog quarantine lift FP`, each entry)."""
        lifted: list[str] = []
        for q in quarantine.standing(self.records(), self.now):
            if q.fingerprint not in self.killer_prints:
                continue

            def lift(records: quarantine.Records, now: float, fp: str = q.fingerprint
                     ) -> tuple[quarantine.Records, bool]:
                return quarantine.lift_records(records, fp, now)

            if self.operator.update_records(lift):
                lifted.append(q.fingerprint)
        if lifted:
            for fp in {*lifted, self.killer}:
                self.lifted[fp] = self.now
                self.lifted_after[fp] = len(self.crashes)
            self.trace.append(f"{self.now:.0f} lift {', '.join(lifted)}")
        self._observe_killer()

    def forgetting(self, at: float) -> bool:
        """Within a window after the Lease was lost at `at`: the successes it held, gone with it, may
        have cleared any suspect, and the records quarantine nothing new meanwhile (`quarantine.lost`)."""
        return any(lost <= at < lost + self.q_settings.window + STEP_S for lost in self.leases_lost_at)

    def _observe_killer(self) -> None:
        """F, when the killer comes in force in the Lease's records: its failures recorded there then.
        Once per version of the Lease and second: nothing else changes what it finds."""
        seen = (self._lease_annotation(quarantine.ANNOTATION)[0], self.now, len(self.lifted_after))
        if seen == self._observed:
            return
        self._observed = seen
        records = self.records()
        in_force = bool(self.killer_prints & {q.fingerprint for q in quarantine.active(records, self.now)})
        if in_force and not self._killer_in_force:
            self.killer_f.append(len(self.killer_failures_recorded(records)))
        self._killer_in_force = in_force

    def killer_failures_recorded(self, records: quarantine.Records) -> set[tuple[str, str]]:
        """The (pod, process) of each recorded failure the killer was in flight at, of the crashes after
        its last lift (in the world's order: the records' stamps are the sidecars' clocks)."""
        since = set(self.crashes[self.lifted_after.get(self.killer, 0):])
        return {(f.pod, f.process) for f in records.failures
                if (f.pod, f.process) in since and self.killer_prints & {*f.inflight, *f.inputs}}

    # -- the sidecars ------------------------------------------------------------------------------

    def sidecar_step(self, name: str) -> None:
        """One sidecar does its next thing, as its loop's tasks would: its restart's next step, its
        ledger's bookkeeping after a canary served, its quarantine's sync, its budget's read, or an
        evaluation of the policy on what it folded."""
        car = self.sidecars.get(name)
        pod = self.pods[name]
        if car is None or not pod.alive:
            return
        self.sidecar_steps += 1
        server = pod.server
        if server.down_until is not None and self.now >= server.down_until:
            # The kubelet starts the container again: a new process, which awaits its sidecar's list.
            pod.starts += 1
            pod.server = new_server(f"{name}-{pod.starts}", self.now, self.clock)
        step = self._next(car)
        if step is not None:
            self.run(step)
            self._observe_killer()

    def _next(self, car: Sidecar) -> Coroutine[Any, Any, None] | None:
        """The sidecar's next move as its loop's tasks would make it, None where it has nothing to do."""
        h = car.history
        if car.proc is not None:
            return self._restart_step(car)
        if car.spawned:
            return car.spawned.pop(0)  # what `Sampling.canary` spawned (the ledger told a canary served)
        if car.keep_out is not None and self.now - car.reconciled_at >= LIFT_PASS_S:
            car.reconciled_at = self.now  # `run_until_signal`'s periodic placement pass
            return car.keep_out.reconcile()
        if self.now - car.synced_at >= SYNC_S:
            car.synced_at = self.now
            return car.executor.sync_quarantine()
        read_at = h.workload_read_at
        if read_at is None or self.now - read_at >= BUDGET_READ_S:
            return car.watchdog.read_budget()  # as the loop reads the Events again every BUDGET_READ_S
        return self._evaluate(car)

    async def _evaluate(self, car: Sidecar) -> None:
        """`Watchdog.evaluate` on what this sidecar folded; a restart it starts takes its first step at once,
        as `Restarts.run` does."""
        await car.watchdog.evaluate()
        await asyncio.sleep(0)  # the restart it spawned begins (`Stepwise.run`)
        if car.proc is not None:  # begun now: `_next` evaluates only while none is under way
            await self._restart_step(car)

    @staticmethod
    async def _restart_step(car: Sidecar) -> None:
        assert car.proc is not None
        car.proc = await car.restarts.step(car.proc)

    def canaries(self) -> None:
        """Each sidecar's canary, taken and folded by its `Sampling.canary` (the loop evaluates at its own
        step, `_next`)."""
        for pod in self.alive():
            car = self.sidecars.get(pod.name)
            if car is None:
                continue
            self.run(car.sampling.canary())
            last = car.history.canaries[-1] if car.history.canaries else None
            if last is not None and last.at == self.now and last.served and not car.history.restart_in_progress:
                car.blocked = False  # no restart wanted: nothing held back any more

    # -- time --------------------------------------------------------------------------------------

    def settle(self, rounds: int = 600) -> None:
        """No new faults; time passes and every sidecar acts until no replica that served is hung
        (each restart waits its turn for a slot: a replacement loading, a scale-up's pods serving
        first) and no taint of ours is left before its expiry and a pass of the sidecars' reconcile
        after it (I9 is judged on what is left then), 30 s at least and `rounds` at most."""
        for n in range(rounds):
            # Past the first 30 s (every sidecar has synced a few times), until none is left hung but
            # those the budget blocks (for the rest of its window).
            if n >= 30 and not any(p.server.hung_since is not None and self.seen_serving(p)
                                   and not (self.sidecars[p.name].blocked
                                            and self.sidecars[p.name].history.workload_restarts is not None)
                                   for p in self.alive()) \
                    and all(until + LIFT_BOUND_S < self.now for _, _, until in self.our_entries()):
                break  # the rest is held by a budget it read, for the rest of its window
            self.tick()
            self.popular_traffic()
            for _ in range(3):
                for name in list(self.sidecars):
                    self.sidecar_step(name)

    def our_entries(self) -> list[tuple[str, str, int]]:
        """Every `<owner>-<expiry>` entry of a gpu-watchdog taint on a node now: (node, owner, expiry)."""
        return [(name, owner, until) for name, node in self.cluster.nodes.items()
                for t in node["spec"].get("taints") or [] if t.get("key") == NODE_TAINT_KEY
                for owner, until in taint_entries(t).items()]

    def seen_serving(self, pod: Pod) -> bool:
        """Its sidecar saw it serve (one that never did is still starting: `policy.startup_timeout`)."""
        car = self.sidecars.get(pod.name)
        return car is not None and car.history.served_at is not None

    def tick(self) -> None:
        """A second passes: the controllers act, and the popular request is answered by every replica
        that serves and does not refuse it (it is popular: others send it all the time)."""
        self.now += STEP_S
        self.steps += 1
        self._probe()
        self._controller()
        if self.knobs.popular_every_tick:
            self.popular_traffic()
        for pod in self.alive():
            if pod.first_served_at is None and pod.serves(self.now):
                pod.first_served_at = self.now
            if pod.out_in_place and pod.serves(self.now):
                pod.out_in_place = False
            if pod.node in self.sick and self.seen_serving(pod):
                self.hang(pod)
            self._card_report(pod)
        self._observe_killer()  # an entry decided comes in force by the clock alone (`confirm`)
        for n in self.neighbours.values():
            if self.now - n.reconciled_at >= LIFT_PASS_S:
                n.reconciled_at = self.now
                self.run(n.keep_out.reconcile())
        self.canaries()
