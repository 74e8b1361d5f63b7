"""A deterministic simulation of one workload: its Deployment and ReplicaSet controller, its pods
with their servers, its Lease with `resourceVersion` compare-and-swap, Events, a request mix and a
simulated clock; each pod's sidecar restarts through the real restart procedure
(`watchdog.core.procedure`: its evidence, the budget read from the Events, a slot, the act) and decides
with the real fleet, quarantine and budget rules (`watchdog.core.fleet`, `watchdog.core.quarantine`,
`watchdog.core.policy`): the same functions the sidecar folds its Lease and its history through.

The world is advanced by its scheduler (Hypothesis's stateful testing picks the steps and shrinks a
failing run to the shortest one). A sidecar's read and its write of the Lease are two steps, so other
sidecars' writes come in between and are lost races (409), decided again on what the winner wrote,
as the real `LeaseLedger.update` does. Every invariant is a function of the world (`invariants.py`).

The servers keep the real request record and screen (`inference.screen`: `RequestBook`, the
quarantine list, the fingerprints of real request bodies); the sidecars read a failure's evidence
from the record's report as they read `GET /control/requests` (`quarantine.failure_from`) and push
the list as `PUT /control/quarantine` takes it. The killer's client varies what does not matter to
the bug between tries (its sampler, its spelling), as a hostile client does.

What is simulated, not run: the canary's answer (each sidecar's canary, once a second, times out
on a hung server, is refused by one down or loading, and served otherwise), the drain, the kubelet,
the scheduler (a pod we restarted is replaced on its node: the lineage a restart loop is bounded
in). What is real: the fold of those canaries and of the budget's Events into each sidecar's
history (`state.reduce`), the decision to restart (`policy.decide`: the hang rule, the budget),
the order of a restart's steps, which restart takes a slot, when a slot goes back, when the breaker
opens, what counts as evidence, what is quarantined and when it clears.
"""

from __future__ import annotations

import dataclasses
import json
import random
from collections.abc import Callable
from dataclasses import dataclass, field

from gpu_watchdog.inference.fingerprint import fingerprint, input_fingerprint
from gpu_watchdog.inference.screen import (
    QuarantinedRequest,
    QuarantineList,
    RequestBook,
    Screen,
    parse_entry,
    workload_key,
)
from gpu_watchdog.watchdog.core import edges, fleet, policy, procedure, quarantine, state
from gpu_watchdog.watchdog.core.history import History
from gpu_watchdog.watchdog.core.names import CONTEXT_LOSS, FLEET_LEDGER_UNKNOWN, HANG, RUNG_POD
from gpu_watchdog.watchdog.core.procedure import Facts, Procedure, Step
from gpu_watchdog.watchdog.core.samples import CanarySample, PastRestart
from gpu_watchdog.watchdog.core.settings import FleetSettings, PolicySettings, QuarantineSettings
from gpu_watchdog.watchdog.core.timing import BUDGET_READ_S

STEP_S = 1.0  # the clock advances this much per tick
CANARY_S = 1.0  # each sidecar's canary runs once a tick; on a hung server it times out after this long
# A hang is decided by the real rule: its consecutive canary timeouts, one a tick.
DETECT_S = PolicySettings().hang.consecutive_timeouts * CANARY_S
LOAD_S = (2.0, 12.0)  # a new pod's model loads for this long before it serves (seeded, per pod)
RESTART_IN_PLACE_S = 2.0  # a crashed server is started again in its pod after this long
SYNC_S = 5.0  # each sidecar reads the quarantine and pushes it to its server this often
# A new server process waits this long at most for its sidecar's list before it serves without it
# (`serve --quarantine-wait`, as the chart starts it).
QUARANTINE_WAIT_S = 60.0
MODEL = "sim-model"  # every replica's: one fingerprint key for the workload
KILLER_PROMPT = "compute the shape that wedges the kernel"


Prints = tuple[str | None, str | None]  # a request's fingerprint and input fingerprint (`Screen.prints`)


@dataclass
class Server:
    """A pod's inference process: serving, hung, or down after a crash; its screen (the request
    record and the quarantine list) is the real one, on the world's clock."""

    process: str
    started_at: float
    screen: Screen
    hung_since: float | None = None
    down_until: float | None = None  # crashed: started again in place at this time

    def serving(self, now: float) -> bool:
        """Its model answers (the control canary too)."""
        return self.hung_since is None and self.down_until is None

    def admits(self, now: float) -> bool:
        """It takes clients' requests: serving, and its sidecar's quarantine list in force (or the
        wait for it over)."""
        return self.serving(now) and (self.screen.quarantine.received or now - self.started_at >= QUARANTINE_WAIT_S)

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


def new_server(process: str, now: float, clock: Callable[[], float]) -> Server:
    screen = Screen(process, MODEL)
    screen.book = RequestBook(process, clock)
    screen.quarantine = QuarantineList(clock)
    return Server(process, now, screen)


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
    served_once: bool = False  # its sidecar saw it serve (and told the ledger, `fleet.replaced`)
    removed_at: float | None = None
    replaces: str | None = None  # ground truth: the pod removed by us that this one stands in for
    growth: bool = False  # ground truth: created by a scale-up or a rollout's surge, not a replacement
    first_served_at: float | None = None  # ground truth: when it first could serve

    @property
    def alive(self) -> bool:
        return self.removed_at is None

    def serves(self, now: float) -> bool:
        return self.alive and now >= self.ready_at and self.server.serving(now)


@dataclass
class Lease:
    annotations: dict[str, str] = field(default_factory=dict)
    version: int = 1


@dataclass
class Pending:
    """A sidecar's read of the Lease, to be written back if no one wrote in between."""

    what: str  # "take" | "replaced" | "give_back" | "record" | "clear"
    version: int
    ledger: fleet.Ledger | None = None
    records: quarantine.Records | None = None
    verdict: fleet.Verdict | None = None
    reason: str = HANG
    failure: quarantine.Failure | None = None
    new_quarantine: list[quarantine.Quarantined] = field(default_factory=list)


@dataclass
class Sidecar:
    pod: str
    history: History  # what the budget is counted from: our pod, its node, the Events as read
    pending: Pending | None = None
    proc: Procedure | None = None  # the restart under way
    step: Step | None = None  # its step whose write waits for its commit
    slot: bool = False  # holds a slot (granted, the eviction not yet done)
    slot_at: float = 0.0
    held: str | None = None  # why its restart is held (a FLEET_HOLDS name)
    held_since: float | None = None
    event_written: bool = False  # its restart's Event (written once, before anything is done)
    blocked: bool = False  # its restart is blocked by the budget (said; read again every BUDGET_READ_S)
    synced_at: float = -1e9
    recorded: set[tuple[str, str]] = field(default_factory=set)  # (process, reason) recorded
    unrecorded: list[quarantine.Failure] = field(default_factory=list)  # a write the API refused


@dataclass
class Removal:
    pod: str
    at: float
    reason: str
    by_us: bool
    # Ground truth as the pod left: the desired replicas, the pods that serve once it is gone, and the
    # replicas out because of us with it (restarted, their stand-in not serving yet).
    desired: int = 0
    serving_after: int = 0
    out_after: int = 0


@dataclass
class Event:
    pod: str
    at: float
    reason: str
    node: str


@dataclass(frozen=True)
class Knobs:
    replicas: int = 4
    max_unavailable: str = "1"
    decoys: int = 0
    api_error_rate: float = 0.0
    popular_every_tick: bool = True  # False: the popular request only when a move sends it


class World:
    def __init__(self, knobs: Knobs, seed: int = 0) -> None:
        self.knobs = knobs
        self.random = random.Random(seed)
        self.now = 1000.0
        self.fleet_settings = FleetSettings(max_unavailable=knobs.max_unavailable)
        self.q_settings = QuarantineSettings()
        self.policy = dataclasses.replace(PolicySettings(), fleet=self.fleet_settings, quarantine=self.q_settings)
        self.lease = Lease()
        self._parsed: tuple[int, fleet.Ledger, quarantine.Records] | None = None
        self.desired = knobs.replicas
        self.template = "t1"
        self.rs: dict[str, int] = {"t1": knobs.replicas}  # each template's ReplicaSet's replicas
        self.pods: dict[str, Pod] = {}
        self.sidecars: dict[str, Sidecar] = {}
        self.removals: list[Removal] = []
        self.events: list[Event] = []
        self.steps = 0
        self.sidecar_steps = 0  # sidecar moves taken (each a step of a sidecar's loop)
        self.budget_blocks = 0  # restarts the budget blocked (a sick node's restart loop bounded)
        self.names = 0
        self.lost_races = 0
        self.api_errors = 0
        self.drains = 0  # pods removed by someone else (a node drain)
        self.leases_lost = 0  # the Lease's annotations lost (an operator's cleanup, an etcd restore)
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
        self.popular_refused: list[tuple[float, str]] = []  # ground truth: (when, by which pod) it was refused
        self.popular_answers: list[float] = []  # ground truth: when it was answered (anywhere)
        self.tries = 0
        self.killer_refused = 0  # tries refused (ground truth: what the servers answered)
        self.killer_failures = 0  # failures the killer caused
        # F: the killer's failures in the records when it was quarantined (each time, lifts between).
        self.killer_f: list[int] = []
        self.answered_at: dict[str, float] = {}  # fingerprint -> last success anywhere
        self.lifted: dict[str, float] = {}  # an operator's lifts
        self.crashes: list[tuple[str, str]] = []  # ground truth: each (pod, process) the killer crashed, in order
        self.lifted_after: dict[str, int] = {}  # a lifted fingerprint: how many crashes came before its lift
        self.trace: list[str] = []
        self.sick: set[str] = set()  # nodes whose servers hang once they served
        for _ in range(knobs.replicas):
            pod = self._create(growth=False, ready_now=True)
            pod.served_once, pod.first_served_at = True, self.now
            pod.server.screen.quarantine.replace([])  # its sidecar's first list, before the run
        self.canaries()  # the pods there before the run served: their sidecars saw it

    # -- the cluster -------------------------------------------------------------------------------

    def _create(self, growth: bool, replaces: str | None = None, ready_now: bool = False,
                template: str | None = None, node: str | None = None) -> Pod:
        self.names += 1
        name = f"p{self.names}"
        server = new_server(f"{name}-1", self.now, self.clock)
        load = 0.0 if ready_now else float(self.random.randint(int(LOAD_S[0]), int(LOAD_S[1])))
        pod = Pod(name, template or self.template, node or f"n{self.names}", self.now, self.now + load, server,
                  replaces=replaces, growth=growth)
        self.pods[name] = pod
        self.sidecars[name] = Sidecar(name, History(started_at=self.now, epoch=self.now, pod=name, node=pod.node,
                                                    strategy="evict", budget_from_events=True))
        return pod

    def clock(self) -> float:
        return self.now

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
        """The Deployment and its ReplicaSets: each template's ReplicaSet keeps its count of pods (a
        removed one is replaced at once, of its own template); a rollout moves one replica at a time
        to the new template, surge 1: a new pod first, an old one removed once every new pod serves;
        on a scale-down, pods not serving go first."""
        old = [t for t, n in self.rs.items() if t != self.template and n > 0]
        total = sum(self.rs.values())
        if old:
            if total <= self.desired:
                self._set_rs(self.template, self.rs.get(self.template, 0) + 1, growth=True)
            elif all(p.serves(self.now) for p in self.alive() if p.template == self.template):
                self._set_rs(old[0], self.rs[old[0]] - 1, growth=True)
        else:
            self._set_rs(self.template, self.desired, growth=True)

    def _set_rs(self, template: str, count: int, growth: bool) -> None:
        self.rs[template] = count
        mine = [p for p in self.alive() if p.template == template]
        for _ in range(count - len(mine)):
            self._create(growth=growth, template=template)
        if len(mine) > count:
            for victim in sorted(mine, key=lambda p: (p.serves(self.now), -p.created_at))[:len(mine) - count]:
                self._remove(victim, "scaled down", by_us=False)

    def _remove(self, pod: Pod, reason: str, by_us: bool) -> None:
        car = self.sidecars.get(pod.name)
        if car is not None:
            self._leaving(car, pod)
        pod.removed_at = self.now
        out = len({p.replaces for p in self.alive() if p.replaces is not None and p.first_served_at is None})
        self.removals.append(Removal(pod.name, self.now, reason, by_us, self.desired,
                                     sum(1 for p in self.alive() if p.serves(self.now)), out + int(by_us)))
        self.sidecars.pop(pod.name, None)
        if len([p for p in self.alive() if p.template == pod.template]) < self.rs.get(pod.template, 0):
            # Where the pod's GPU frees, its replacement goes: a restart loop stays on one node.
            self._create(growth=False, replaces=pod.name if by_us else None, template=pod.template,
                         node=pod.node if by_us else None)

    def ready(self, pod: Pod) -> bool:
        """The pod's Ready condition: what its sidecar's readiness (`policy.serviceable`, the real
        rule behind `/readyz`) says of its history, as the kubelet probes it."""
        car = self.sidecars.get(pod.name)
        return pod.alive and car is not None and policy.serviceable(car.history, self.policy, self.now) \
            and pod.server.admits(self.now)

    def census(self) -> fleet.Census:
        """What a LIST of the workload's pods and a GET of its Deployment answer now."""
        return fleet.Census(self.desired, tuple(fleet.PodSeen(p.name, self.ready(p)) for p in self.alive()))

    def drain(self, pod: Pod) -> None:
        """Someone else removes a pod (a node drain): its ReplicaSet makes a stand-in elsewhere."""
        self._remove(pod, "drained", by_us=False)
        self.drains += 1
        self.trace.append(f"{self.now:.0f} drain {pod.name}")

    def lease_lost(self) -> None:
        """An operator's cleanup or an etcd restore: the Lease's annotations are gone."""
        self.lease = Lease(version=self.lease.version + 1)
        self.leases_lost += 1
        # The operator's lifts were records of that Lease: gone with it (I8 holds for recorded lifts).
        self.lifted_after.clear()
        self.trace.append(f"{self.now:.0f} lease lost")

    def scale(self, replicas: int) -> None:
        self.desired = replicas
        self._controller()
        self.trace.append(f"{self.now:.0f} scale {replicas}")

    def rollout(self) -> None:
        self.template = f"t{int(self.template[1:]) + 1}"
        self.trace.append(f"{self.now:.0f} rollout {self.template}")

    # -- the Lease, compare-and-swap ---------------------------------------------------------------

    def _read(self) -> tuple[int, fleet.Ledger, quarantine.Records]:
        """What a GET returns: parsed from the stored text, as the sidecar parses it (once per version)."""
        if self._parsed is None or self._parsed[0] != self.lease.version:
            self._parsed = (self.lease.version, fleet.parse(self.lease.annotations.get(fleet.LEDGER_ANNOTATION)),
                            quarantine.parse(self.lease.annotations.get(quarantine.ANNOTATION)))
        return self._parsed

    def _write(self, version: int, ledger: fleet.Ledger | None = None,
               records: quarantine.Records | None = None) -> str:
        """"ok", "conflict" (409: someone wrote since `version`), or "error" (the API refused)."""
        if self.random.random() < self.knobs.api_error_rate:
            self.api_errors += 1
            return "error"
        if version != self.lease.version:
            self.lost_races += 1
            return "conflict"
        same = (ledger is None or fleet.dump(ledger) == self.lease.annotations.get(fleet.LEDGER_ANNOTATION,
                                                                                    fleet.dump(fleet.Ledger())))
        same = same and (records is None or quarantine.dump(records) == self.lease.annotations.get(
            quarantine.ANNOTATION, quarantine.dump(quarantine.Records())))
        if same:
            return "ok"  # nothing changed: nothing written (as LeaseLedger.update)
        if ledger is not None:
            self.lease.annotations[fleet.LEDGER_ANNOTATION] = fleet.dump(ledger)
        if records is not None:
            self.lease.annotations[quarantine.ANNOTATION] = quarantine.dump(records)
        self.lease.version += 1
        return "ok"

    def ledger(self) -> fleet.Ledger:
        return self._read()[1]

    def records(self) -> quarantine.Records:
        return self._read()[2]

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

    def popular_traffic(self) -> None:
        """The popular request answered by every replica that takes requests and does not refuse it."""
        for pod in self.alive():
            if not (pod.serves(self.now) and pod.server.admits(self.now)):
                continue
            if pod.server.refuses(self.prints(self.popular_body)):
                self.popular_refused.append((self.now, pod.name))
                continue
            pod.server.run([self.prints(self.popular_body)], ok=True)
            self.answered_at[self.popular] = self.now
            if not self.popular_answers or self.popular_answers[-1] != self.now:
                self.popular_answers.append(self.now)

    def killer_try(self) -> None:
        """The killer's client: the killer (its sampler or spelling new each try), its decoys in flight
        beside it, the popular request, a fresh one-off after it, in one step of one replica that takes
        requests; the step crashes that replica's server unless the killer is refused."""
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
        server.down_until = self.now + RESTART_IN_PLACE_S
        self.killer_failures += 1
        self.crashes.append((pod.name, server.process))
        # What the sidecar reads from `GET /control/requests` and records.
        failure = quarantine.failure_from(server.screen.book.report(), pod.name, CONTEXT_LOSS, self.now)
        self.trace.append(f"{self.now:.0f} killer crashes {pod.name} ({self.killer_failures})")
        self._begin_record(self.sidecars[pod.name], failure)

    def lift_killer(self) -> None:
        """An operator lifts what refuses the killer (`gpu-watchdog quarantine lift FP`, each entry)."""
        version, _, records = self._read()
        new, lifted = records, []
        for q in quarantine.active(records, self.now):
            if q.fingerprint in self.killer_prints:
                new, was = quarantine.lift_records(new, q.fingerprint, self.now)
                if was:
                    lifted.append(q.fingerprint)
        if lifted and self._write(version, records=new) == "ok":
            for fp in {*lifted, self.killer}:
                self.lifted[fp] = self.now
                self.lifted_after[fp] = len(self.crashes)
            self.trace.append(f"{self.now:.0f} lift {', '.join(lifted)}")

    # -- the sidecars ------------------------------------------------------------------------------

    def _begin_record(self, car: Sidecar, failure: quarantine.Failure) -> None:
        if (failure.process, failure.reason) in car.recorded:
            return
        version, _, records = self._read()
        new, quarantined = quarantine.record(self.q_settings, records, failure, self.now)
        car.pending = Pending("record", version, records=new, failure=failure, new_quarantine=quarantined)

    def sidecar_step(self, name: str) -> None:
        """One sidecar does its next thing: write what it decided (if nothing was written since it
        read), else look at its target and decide."""
        car = self.sidecars.get(name)
        pod = self.pods[name]
        if car is None or not pod.alive:
            return
        self.sidecar_steps += 1
        if car.pending is not None:
            self._commit(car, pod)
            return
        if car.unrecorded:
            self._begin_record(car, car.unrecorded.pop(0))
            return
        server = pod.server
        if server.down_until is not None and self.now >= server.down_until:
            pod.starts += 1
            pod.server = new_server(f"{name}-{pod.starts}", self.now, self.clock)  # awaits its sidecar's list
            car.synced_at = -1e9  # which pushes it at its next sync
        if pod.serves(self.now):
            car.blocked = False  # no restart wanted: nothing held back any more
            if not pod.served_once:
                version, ledger, _ = self._read()
                new, _slot = fleet.replaced(ledger, name, pod.created_at, template=pod.template,
                                            replicas=self.desired)
                car.pending = Pending("replaced", version, ledger=new)
                return
            if car.held is not None:
                version, ledger, _ = self._read()
                car.pending = Pending("give_back", version, ledger=fleet.leave_waiting(ledger, name))
                return
        if self.now - car.synced_at >= SYNC_S:
            self._sync(car, pod)
            return
        if car.proc is not None:
            self._restart_step(car, pod)
            return
        read_at = car.history.workload_read_at
        if read_at is None or self.now - read_at >= BUDGET_READ_S:
            self._read_budget(car)  # as the loop reads the Events again every BUDGET_READ_S
            return
        # The loop's evaluation: the real policy on what this sidecar folded.
        restart = next((d for d in policy.decide(self.policy, car.history, self.now, True) if d.action == "restart"),
                       None)
        if restart is None or not pod.served_once:
            return
        if not restart.allowed:  # blocked by the budget: said once, decided again after the next read
            if not car.blocked:
                self.budget_blocks += 1
            car.blocked = True
            return
        # `restart.strategy: evict` replaces the pod, whatever rung the policy names.
        decision = dataclasses.replace(restart, rung=RUNG_POD)
        car.proc = procedure.begin(self.policy, car.history, 0, decision, self.now, from_events=True,
                                   asked_again=car.held is not None)
        self._restart_step(car, pod)

    def canaries(self) -> None:
        """Each sidecar's canary, folded into its history as `Sampling.canary` folds it."""
        for pod in self.alive():
            car = self.sidecars.get(pod.name)
            if car is None:
                continue
            server = pod.server
            if pod.serves(self.now):
                sample = CanarySample(self.now, True, 0.05, None, instance_id=server.process)
            elif server.hung_since is not None:
                sample = CanarySample(self.now, False, CANARY_S, "timeout", "canary timed out",
                                      instance_id=server.process)
            else:  # down after a crash, or still loading its model
                sample = CanarySample(self.now, False, 0.0, "unreachable", "connection refused",
                                      instance_id=server.process)
            state.reduce(car.history, sample)

    def _restart_step(self, car: Sidecar, pod: Pod) -> None:
        """The next step of its restart, through the real procedure."""
        assert car.proc is not None
        step = procedure.next_step(self.policy, car.history, car.proc,
                                   Facts(self.now, "evict", slot_held=car.slot, slot_taken_at=car.slot_at))
        assert step is not None
        server = pod.server
        if step.kind == procedure.STACKS:  # a hung process's stacks, as `Executor.take_stacks` folds them
            st = edges.Stacks(0, server.process, HANG, self.now, "control", stuck="engine.py:1 in forward (MainThread)")
            state.reduce(car.history, edges.StacksTaken(st))
            car.proc = procedure.advance(car.proc, step, stacks=edges.stacks_detail(st))
        elif step.kind == procedure.EVIDENCE:
            server.screen.book.stalled()
            failure = quarantine.failure_from(server.screen.book.report(), pod.name, HANG, self.now)
            self._begin_record(car, failure)  # written beside the restart: committed at its next step
            car.proc = procedure.advance(car.proc, step, inflight=failure.inflight)
        elif step.kind == procedure.READ_BUDGET:
            self._read_budget(car)
            car.proc = procedure.advance(car.proc, step)
        elif step.kind == procedure.BLOCKED:
            if not car.blocked:
                self.budget_blocks += 1
            car.blocked, car.proc = True, None
        elif step.kind == procedure.TAKE_SLOT:
            version, ledger, _ = self._read()
            new, verdict = fleet.take(self.fleet_settings, ledger, self.desired, pod.name, HANG, RUNG_POD, self.now,
                                      template=pod.template, marks=True, census=self.census())
            car.pending, car.step = Pending("take", version, ledger=new, verdict=verdict), step
        elif step.kind == procedure.HELD:
            if car.held is None:
                car.held_since = self.now
            car.held, car.proc = car.proc.held, None
        elif step.kind == procedure.SLOT_WAIT:
            pass  # asked again at its next step, as the procedure's performer sleeps until then
        elif step.kind == procedure.RECOUNT:  # as `Executor.recount`: the pods listed, the Lease read
            version, ledger, _ = self._read()
            verdict = fleet.recount(self.fleet_settings, ledger, self.census(), pod.name)
            held = None if verdict.granted else verdict.outcome
            if held is not None:  # the slot back, as `release_slot` (a write lost leaves it to lapse)
                self._write(version, ledger=fleet.give_back(ledger, pod.name, restarted=False))
                car.slot = False
            car.proc = procedure.advance(car.proc, step, held=held)
        elif step.kind == procedure.RESTART:
            self._evict(car, pod)
        else:
            raise AssertionError(f"a step the pod's restart never takes: {step.kind}")

    def _read_budget(self, car: Sidecar) -> None:
        """The workload's restart Events, as `Executor.read_budget` folds them (unreadable: None)."""
        restarts: tuple[PastRestart, ...] | None
        if self.random.random() < self.knobs.api_error_rate:
            self.api_errors += 1
            restarts = None
        else:
            restarts = tuple(PastRestart(e.at, e.pod, e.node) for e in self.events)
        state.reduce(car.history, state.WorkloadRestarts(self.now, self.now, restarts, self.desired))

    def _sync(self, car: Sidecar, pod: Pod) -> None:
        version, _, records = self._read()
        car.synced_at = self.now
        self._push(pod, records)
        answered = quarantine.answered_in(pod.server.screen.book.report())
        new, _removed = quarantine.clear(self.q_settings, records, answered, pod.name, self.now)
        if new != records:
            car.pending = Pending("clear", version, records=new)

    def _push(self, pod: Pod, records: quarantine.Records) -> None:
        """`PUT /control/quarantine`, as the server's control API parses it."""
        pod.server.screen.quarantine.replace([parse_entry(e) for e in quarantine.server_entries(records, self.now)])

    def killer_failures_recorded(self, records: quarantine.Records) -> set[tuple[str, str]]:
        """The (pod, process) of each recorded failure the killer was in flight at, after its last lift."""
        lifted = self.lifted.get(self.killer, -1e18)
        return {(f.pod, f.process) for f in records.failures
                if f.at > lifted and self.killer_prints & {*f.inflight, *f.inputs}}

    def _leaving(self, car: Sidecar, pod: Pod) -> None:
        """A stopping sidecar clears what its server answered (`Executor.leaving`): one read and one
        write, lost to a race or an API error like any other."""
        version, _, records = self._read()
        answered = quarantine.answered_in(pod.server.screen.book.report())
        new, _removed = quarantine.clear(self.q_settings, records, answered, pod.name, self.now)
        if new != records:
            self._write(version, records=new)

    def _commit(self, car: Sidecar, pod: Pod) -> None:
        p = car.pending
        assert p is not None
        car.pending = None
        result = self._write(p.version, ledger=p.ledger, records=p.records)
        if result == "conflict" and p.what == "record":
            assert p.failure is not None
            self._begin_record(car, p.failure)  # decided again on what the winner wrote
            return
        if result == "error" and p.what == "take" and car.proc is not None and car.step is not None:
            car.proc = procedure.advance(car.proc, car.step, held=FLEET_LEDGER_UNKNOWN)  # as `take_slot`
            return
        if result != "ok":
            if p.what == "record":
                assert p.failure is not None
                car.unrecorded.append(p.failure)  # tried again at its next step
            return  # the others are decided again at its next step, on what the winner wrote
        if p.what == "record":
            assert p.failure is not None
            car.recorded.add((p.failure.process, p.failure.reason))
            killer = any(q.fingerprint in self.killer_prints for q in p.new_quarantine)
            if p.failure.reason == CONTEXT_LOSS or killer:
                self._push(pod, self.records())
            if killer:
                self.killer_f.append(len(self.killer_failures_recorded(self.records())))
        elif p.what == "replaced":
            pod.served_once = True
        elif p.what == "give_back":
            car.held, car.held_since, car.proc = None, None, None
        elif p.what == "take":
            assert p.verdict is not None and car.proc is not None and car.step is not None
            if p.verdict.granted:
                car.slot, car.slot_at, car.held, car.held_since, car.blocked = True, self.now, None, None, False
            car.proc = procedure.advance(car.proc, car.step, held=None if p.verdict.granted else p.verdict.outcome)

    def _evict(self, car: Sidecar, pod: Pod) -> None:
        """As `KubeRestarter.restart`: the Event first (refused: tried again at its next step), then the
        ledger told when the pod goes (`fleet.acted`; refused, the pod goes all the same and its
        marked slot lapses at `slot_timeout`), then the eviction."""
        if not car.event_written:
            if self.random.random() < self.knobs.api_error_rate:
                self.api_errors += 1
                return  # the Event refused: nothing done, tried again
            self.events.append(Event(pod.name, self.now, HANG, pod.node))
            car.event_written = True
        version, ledger, _ = self._read()
        self._write(version, ledger=fleet.acted(ledger, pod.name, self.now))
        self._remove(pod, HANG, by_us=True)
        self.trace.append(f"{self.now:.0f} evict {pod.name}")

    # -- time --------------------------------------------------------------------------------------

    def settle(self, rounds: int = 600) -> None:
        """No new faults; time passes and every sidecar acts until no replica that served is hung
        (each restart waits its turn for a slot: a replacement loading, a scale-up's pods serving
        first), 30 s at least and `rounds` at most."""
        for n in range(rounds):
            # Past the first 30 s (every sidecar has synced a few times), until none is left hung but
            # those the budget blocks (for the rest of its window).
            if n >= 30 and not any(p.server.hung_since is not None and p.served_once
                                   and not (self.sidecars[p.name].blocked
                                            and self.sidecars[p.name].history.workload_restarts is not None)
                                   for p in self.alive()):
                break  # the rest is held by a budget it read, for the rest of its window
            self.tick()
            self.popular_traffic()
            for _ in range(3):
                for name in list(self.sidecars):
                    self.sidecar_step(name)

    def tick(self) -> None:
        """A second passes: the controllers act, and the popular request is answered by every replica
        that serves and does not refuse it (it is popular: others send it all the time)."""
        self.now += STEP_S
        self.steps += 1
        self._controller()
        if self.knobs.popular_every_tick:
            self.popular_traffic()
        for pod in self.alive():
            if pod.first_served_at is None and pod.serves(self.now):
                pod.first_served_at = self.now
            if pod.node in self.sick and pod.served_once:
                self.hang(pod)
        self.canaries()
