"""Restarts at fleet scale, in a simulated cluster: 8 pods of one Deployment, each a real model
server and a real `gpu-watchdog run` sidecar, against an API emulator with real `resourceVersion`
semantics, the harness acting as the ReplicaSet (a deleted pod is replaced) and the kubelet.

Each scenario prints one line of figures (restarts carried out and held, times), read with `-s`.
"""

from __future__ import annotations

import asyncio
import json
import threading
import time
from pathlib import Path
from typing import Any

from kubernetes import client

from gpu_watchdog.watchdog.core import fleet
from gpu_watchdog.watchdog.core.fleet import GRANTED, UNAVAILABLE_LIMIT
from gpu_watchdog.watchdog.core.names import FLEET_BREAKER_OPEN, FLEET_UNAVAILABLE_LIMIT, HANG, RUNG_POD
from gpu_watchdog.watchdog.edge.config import FleetSettings
from gpu_watchdog.watchdog.edge.effects.fleet import LeaseLedger
from tests.fleet.harness import Fleet
from tests.fleet.readouts import figures, held_lines
from tests.integration.kmock_api import events as all_events

REPLICAS = 8


async def test_independent_faults_on_more_replicas_than_a_fixed_budget_are_all_restarted(
        kmock: Any, tmp_path: Path) -> None:
    """Four hangs on four replicas one after another, each replacement serving before the next fault:
    a fixed budget of 3 blocked the fourth; the fleet's allowance (8) restarts all four."""
    async with Fleet(kmock, tmp_path, replicas=REPLICAS) as f:
        started = time.monotonic()
        for n in range(1, 5):
            victim = next(p for p in f.pods() if p.replaces is None and p.ready)
            await f.hang(victim)
            await f.wait_until(lambda n=n: len(f.deletions()) == n, 30, f"restart {n}")  # type: ignore[misc]
            await f.wait_until(lambda: f.restarting() == 0, 60, f"replacement {n} serving")
        blocked = held_lines(f, "restart_blocked")
        assert [m.pod for m in f.deletions()] == [p.replaces for p in f.replacements()]
        assert blocked == [], blocked
        assert f.max_restarting() == 1
        status = await f.status(f.replacements()[-1])
        assert status["restart_budget"]["replicas"] == REPLICAS and status["restart_budget"]["allowance"] == REPLICAS
        figures("independent", restarts=len(f.deletions()), blocked=len(blocked), seconds=round(time.monotonic()
                                                                                            - started, 1))


async def test_every_replica_failing_at_once_restarts_at_most_max_unavailable_then_the_breaker_opens(
        kmock: Any, tmp_path: Path) -> None:
    """A bad rollout: every replica hangs at once and every replacement, once it has served, hangs
    the same way. Never more than 2 of 8 (25 %) restart at once; the breaker opens at the first
    replacement that comes back failing, and then nothing restarts any more."""
    async with Fleet(kmock, tmp_path, replicas=REPLICAS, replacement_hang_after=1) as f:
        t0 = time.monotonic()
        await f.hang_all()

        def opened() -> list[str]:
            return held_lines(f, "fleet_breaker_opened")

        await f.wait_until(opened, 90, "the breaker to open")
        opened_s = time.monotonic() - t0
        restarts_at_open = len(f.deletions())
        # Every sidecar still alive comes to hold its restart on the breaker.
        await f.wait_until(lambda: all(any(line.get("event") in (FLEET_BREAKER_OPEN, "fleet_breaker_opened")
                                           for line in p.log()) for p in f.pods()), 60,
                           "every sidecar to see the breaker")
        # A restart whose slot was granted before the breaker opened may still be carried out (at most
        # one per slot); after that, nothing restarts any more.
        settled = len(f.deletions())
        await asyncio.sleep(4.0)
        assert len(f.deletions()) == settled <= restarts_at_open + 2
        assert f.max_restarting() <= 2, f.restarting_series()
        assert settled <= REPLICAS
        statuses = [await f.status(p) for p in f.pods()]
        assert all(FLEET_BREAKER_OPEN in s["states"] for s in statuses)
        breaker = statuses[0]["fleet"]["breaker"]
        assert breaker["reason"] == HANG and len(breaker["restarted"]) > REPLICAS / 2
        # The one that opened it wrote the Warning Event on the Deployment.
        events = [e for e in all_events(kmock) if e.get("reason") == "FleetBreakerOpen"]
        assert len(events) == 1 and events[0]["regarding"]["kind"] == "Deployment"
        assert events[0]["regarding"]["name"] == "llm"
        held = held_lines(f, FLEET_UNAVAILABLE_LIMIT)
        figures("all_at_once", restarts=settled, restarts_when_it_opened=restarts_at_open,
                max_restarting_at_once=f.max_restarting(),
                held_for_a_slot=len(held), breaker_open_after_s=round(opened_s, 1),
                held_by_breaker=sum(1 for s in statuses if s["fleet"]["held"] == FLEET_BREAKER_OPEN))


async def test_two_sidecars_failing_in_the_same_instant_take_the_last_slot_once(kmock: Any, tmp_path: Path) -> None:
    """max_unavailable 1 and two replicas hung at the same moment: one restarts, the other holds
    (`fleet_unavailable_limit`) and takes the slot once the first replica's replacement serves."""
    config = {"policy": {"fleet": {"max_unavailable": 1}}}
    async with Fleet(kmock, tmp_path, replicas=4, sidecar_config=config) as f:
        a, b = f.pods()[:2]
        await asyncio.gather(f.hang(a), f.hang(b))
        await f.wait_until(lambda: len(f.deletions()) == 2, 60, "both restarted, one after the other")
        await f.wait_until(lambda: f.restarting() == 0, 60, "both replacements serving")
        assert f.max_restarting() == 1, f.restarting_series()
        first, second = f.deletions()
        assert held_lines(f, FLEET_UNAVAILABLE_LIMIT) == [second.pod]
        replacement = next(p for p in f.replacements() if p.replaces == first.pod)
        assert replacement.ready_at is not None and second.at >= replacement.ready_at
        figures("same_instant", restarts=2, held=1,
                lease_conflicts=len([w for w in kmock.writes_to("leases") if w.code == 409]))


async def test_two_writers_that_read_the_same_version_never_both_take_the_last_slot(kmock: Any) -> None:
    """The ledger's compare-and-swap, forced: both sidecars read the Lease before either writes."""
    cfg = client.Configuration()
    cfg.host = str(kmock.url).rstrip("/")
    api = client.ApiClient(cfg)
    s = FleetSettings(max_unavailable="1")
    both_read = threading.Barrier(2)
    outcomes: dict[str, list[str]] = {"a": [], "b": []}

    def decide(pod: str) -> Any:
        first = True

        def step(ledger: fleet.Ledger, now: float) -> tuple[fleet.Ledger, str]:
            nonlocal first
            if first:
                first = False
                both_read.wait(timeout=10)
            new, verdict = fleet.take(s, ledger, 8, pod, HANG, RUNG_POD, now)
            outcomes[pod].append(verdict.outcome)
            return new, verdict.outcome

        return step

    ledgers = {pod: LeaseLedger(api, "serving", "gpu-watchdog-llm", "llm", pod, 5.0) for pod in ("a", "b")}

    results = await asyncio.gather(*(asyncio.to_thread(ledgers[p].update, decide(p)) for p in ("a", "b")))
    final = dict(zip(("a", "b"), results, strict=True))
    assert sorted(final.values()) == sorted([GRANTED, UNAVAILABLE_LIMIT])
    # Exactly one write refused for its stale version: the loser's first.
    assert [w.code for w in kmock.writes_to("leases") if not w.ok] == [409]
    loser = next(p for p, v in final.items() if v == UNAVAILABLE_LIMIT)
    # The loser decided twice: once on the version both read (granted, refused with 409), once more.
    assert outcomes[loser] == [GRANTED, UNAVAILABLE_LIMIT]
    stored = await asyncio.to_thread(ledgers["a"].read)
    assert [sl.pod for sl in stored.slots] == [next(p for p, v in final.items() if v == GRANTED)]


async def test_an_operator_reads_the_ledger_and_resets_the_breaker_with_the_cli(kmock: Any, tmp_path: Path) -> None:
    """`gpu-watchdog fleet status` and `reset-breaker`, run as in the watchdog container (its config,
    its pod's name), against a ledger whose breaker is open."""
    from tests.fleet import cluster as k8s
    from tests.fleet.harness import write_kubeconfig
    from tests.helpers import spawn

    deploy = kmock.add(k8s.deployment("llm", "serving", 8))
    rs = kmock.add(k8s.replica_set(deploy, "5c9d7b6f4x"))
    kmock.add(k8s.pod_of(rs, "llm-5c9d7b6f4x-abcde", "node-0", ready=True))
    kubeconfig = tmp_path / "kubeconfig"
    write_kubeconfig(kubeconfig, str(kmock.url).rstrip("/"), "serving")
    opened = fleet.Breaker(HANG, time.time() - 30, time.time() - 5, 8, tuple(f"p{i}" for i in range(6)), "p0-g1")
    ledger = fleet.Ledger(slots=(fleet.Slot("p7", HANG, RUNG_POD, time.time() - 10),), breaker=opened)
    cfg = client.Configuration()
    cfg.host = str(kmock.url).rstrip("/")
    writer = LeaseLedger(client.ApiClient(cfg), "serving", "gpu-watchdog-llm", "llm", "p0", 5.0)
    await asyncio.to_thread(writer.update, lambda _led, _now: (ledger, None))
    config = tmp_path / "watchdog.yaml"
    config.write_text(json.dumps({
        "target": {"openai_url": "http://127.0.0.1:9", "metrics_url": None},
        "restart": {"strategy": "delete"},
        "kubernetes": {"pod_name": "${POD_NAME}", "namespace": "${POD_NAMESPACE}", "kubeconfig": str(kubeconfig)}}))
    env = {"POD_NAME": "llm-5c9d7b6f4x-abcde", "POD_NAMESPACE": "serving"}

    async def cli(*args: str) -> tuple[int, str]:
        proc = spawn(["fleet", *args, "--config", str(config)], tmp_path / f"fleet-{args[0]}.log", env=env)
        while proc.proc.poll() is None:  # the emulator answers from this loop: keep it turning
            await asyncio.sleep(0.05)
        return proc.proc.returncode, proc.log()

    code, out = await cli("status")
    assert code == 0, out
    shown = json.loads(out[out.index("{\n"):])
    assert shown["workload"] == "llm" and shown["replicas"] == 8 and shown["max_unavailable"] == 2
    assert shown["breaker"]["reason"] == HANG and [s["pod"] for s in shown["restarting"]] == ["p7"]
    code, out = await cli("reset-breaker")
    assert code == 0 and "reset" in out and "open for hang" in out, out
    after = await asyncio.to_thread(writer.read)
    assert fleet.breaker_open(after) is None and [s.pod for s in after.slots] == ["p7"]  # nothing else touched
    code, out = await cli("status")
    assert code == 0 and json.loads(out[out.index("{\n"):])["breaker"] is None


async def test_a_scale_up_during_a_restart_never_puts_two_replicas_down(kmock: Any, tmp_path: Path) -> None:
    """`max_unavailable: 1` over 4 replicas. A hangs and is replaced by a pod that takes 10 s to
    start; meanwhile the Deployment is scaled to 5 and the new pod serves at once. That pod is
    growth, not A's replacement: B, hanging next, waits for A's replacement to serve before its own
    restart (before, the new pod gave A's slot back and B went down beside A: two of five out)."""
    config = {"policy": {"fleet": {"max_unavailable": "1"}}}
    async with Fleet(kmock, tmp_path, replicas=4, sidecar_config=config, replacement_delay=10.0) as f:
        a, b = f.pods()[0], f.pods()[1]
        await f.hang(a)
        await f.wait_until(lambda: len(f.deletions()) == 1, 30, "A restarted")
        grown = await f.scale(5)
        assert len(grown) == 1
        await f.wait_until(lambda: grown[0].ready_at is not None, 30, "the scale-up's pod serving")
        replacement = next(p for p in f.pods() if p.replaces == a.name)
        assert replacement.ready_at is None  # still starting: A is still out
        await f.hang(b)
        await f.wait_until(lambda: b.name in held_lines(f, FLEET_UNAVAILABLE_LIMIT), 30, "B held for want of a slot")
        assert len(f.deletions()) == 1
        await f.wait_until(lambda: len(f.deletions()) == 2, 60, "B restarted once A's replacement serves")
        b_out = f.deletions()[1].at
        assert replacement.ready_at is not None and replacement.ready_at <= b_out
        assert [m.pod for m in f.deletions()] == [a.name, b.name]
        assert f.max_restarting() == 1, f.restarting_series()
        figures("scale_up_during_restart", restarts=len(f.deletions()), held_s=round(b_out - grown[0].ready_at, 1))
