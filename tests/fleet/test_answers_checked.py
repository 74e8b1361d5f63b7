"""Answers checked across a fleet, end to end: three pods of one Deployment (real sidecars, real model
servers answering with log-probabilities) against the API emulator. One card computes wrong from its
first answer: the other two agree the reference in the workload's Lease, the sick card never becomes it,
its pod is restarted within the stated number of probes, and its replacement on the same card answers
wrong again: the Node hears that the card computes wrong, and with `policy.placement` on the card is
kept out of the next placement. The other replicas are untouched; two cards that disagree agree on
nothing, and nothing is restarted.

Prints one line of figures (read with `-s`)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from gpu_watchdog.watchdog.core import correctness, placement
from gpu_watchdog.watchdog.core.names import CORRUPT
from tests.fleet.cluster import Cluster
from tests.fleet.harness import Fleet, deep_merge
from tests.fleet.scheduler import Scheduler
from tests.integration.kmock_api import events as all_events

pytestmark = pytest.mark.timeout(180)

CONSECUTIVE = 2
CONFIG = {"policy": {"correctness": {"enabled": True, "every": 1, "consecutive": CONSECUTIVE,
                                     "prompts": ["alpha beta gamma", "delta epsilon"]}}}


def decisions(lines: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [e for e in lines if e.get("event") == "decision" and e.get("reason") == CORRUPT]


async def test_a_card_that_computes_wrong_is_restarted_then_reported_and_never_the_reference(
        kmock: Any, tmp_path: Path) -> None:
    async with Fleet(kmock, tmp_path, replicas=3, sidecar_config=CONFIG, replacement_node="same",
                     corrupt_nodes=frozenset({"node-0"})) as fleet:
        first = fleet.pods()
        [sick] = [p for p in first if p.node == "node-0"]
        healthy = [p for p in first if p is not sick]
        await fleet.wait_until(lambda: len(fleet.deletions()) >= 2, 90, "the sick card's pod restarted twice")
        reports = await fleet.wait_until(
            lambda: [e for e in all_events(kmock) if e.get("reason") == "GPUSuspect"
                     and (e.get("regarding") or {}).get("name") == "node-0"], 30, "the Node told")
        # Only the sick card's pods went; the healthy replicas were never restarted.
        gone = [m.pod for m in fleet.deletions()]
        [replacement, *_] = fleet.replacements()
        assert gone[:2] == [sick.name, replacement.name], gone
        assert replacement.node == "node-0"
        assert all(p.alive for p in healthy)
        assert not [d for p in healthy for d in decisions(p.log())]

        # The reference is the healthy cards' agreement; the sick card voted and lost.
        lease = kmock.lease(fleet.namespace, f"gpu-watchdog-{fleet.deployment}")
        records = correctness.parse(lease["metadata"]["annotations"][correctness.ANNOTATION])
        [entry] = records.entries
        assert entry.reference is not None and entry.reference.cards == ("node-1", "node-2")
        assert "node-0" in {s.card for s in entry.submissions}
        assert entry.key.startswith("m|")

        # Detected within the stated number of probes: the first decision on the deviations that made it.
        [first_decision] = decisions(sick.log())
        detail = first_decision["detail"]
        assert detail["consecutive"] == CONSECUTIVE and "after_restart" not in detail
        assert first_decision["detail"]["differed"]["got"] == " #"
        deviations = [e for e in sick.log() if e.get("event") == "correctness_deviation"]
        assert len(deviations) == CONSECUTIVE
        # Its replacement on the same card: wrong again, the pod's rung, and the card reported.
        [again] = decisions(replacement.log())
        assert again["detail"]["after_restart"] >= 1
        [suspect] = [e for e in replacement.log() if e.get("event") == "gpu_suspect"]
        assert suspect["trigger"] == "answers"
        note = reports[0].get("note") or ""
        assert "reference again after a restart" in note, note
        # The healthy sidecars compared their probes and found them matching.
        for p in healthy:
            status = await fleet.status(p)
            assert status["correctness"]["reference"]["agreed"] is True
            assert status["correctness"]["deviations_in_a_row"] == 0
        print(json.dumps({"scenario": "answers_checked", "replicas": 3,
                          "probes_to_first_restart": len(deviations),
                          "restarts": len(fleet.deletions()), "node_reports": len(reports)}))


async def test_two_cards_that_disagree_agree_on_nothing_and_nothing_is_restarted(kmock: Any, tmp_path: Path) -> None:
    """One card wrong from boot, one right: no majority, so no reference, so no restart, and both say so."""
    async with Fleet(kmock, tmp_path, replicas=2, sidecar_config=CONFIG, corrupt_nodes=frozenset({"node-0"})) as fleet:
        pods = fleet.pods()

        async def unagreed() -> bool:
            for p in pods:
                ref = (await fleet.status(p))["correctness"]["reference"] or {}
                if ref.get("agreed") is not False or ref.get("why") != "1 card(s) answered alike, 2 needed":
                    return False
            return True

        await fleet.wait_until(unagreed, 60, "both sidecars saying there is no agreed reference")
        # Long enough for many probes: every canary interval, each one not compared.
        await fleet.wait_until(lambda: sum(1 for p in pods for e in p.log()
                                           if e.get("event") == "correctness_voted") >= 2, 30, "both voted")
        for p in pods:
            status = await fleet.status(p)
            assert status["correctness"]["deviations_in_a_row"] == 0
            assert all(x["result"] == correctness.NO_REFERENCE for x in status["correctness"]["last"])
        assert fleet.deletions() == [] and all(p.alive for p in pods)
        assert not [d for p in pods for d in decisions(p.log())]


async def test_a_card_wrong_again_after_a_restart_is_kept_out_and_the_next_pod_lands_elsewhere(
        kmock: Cluster, tmp_path: Path) -> None:
    """With `policy.placement` on, the card the second restart blames is tainted before its pod goes, and
    the replacement is placed on another card, where it answers right."""
    scheduler = Scheduler(kmock, {"node-a": 1, "node-b": 1, "node-c": 1, "node-d": 1}, mode="dra")
    config = deep_merge(CONFIG, {"restart": {"strategy": "evict"}, "policy": {"placement": {"strategy": "device"}}})
    async with Fleet(kmock, tmp_path, replicas=3, sidecar_config=config, scheduler=scheduler,
                     corrupt_nodes=frozenset({"node-a"})) as fleet:
        [sick] = [p for p in fleet.pods() if p.node == "node-a"]
        await fleet.wait_until(lambda: any(p.node == "node-d" and p.ready for p in fleet.pods()), 120,
                               "a replacement on the free card, serving")
        [rule] = kmock.stored("devicetaintrules")
        assert rule["spec"]["deviceSelector"]["pool"] == "node-a"
        assert "again after a restart" in rule["metadata"]["annotations"][placement.EVIDENCE_ANNOTATION]
        on_a = [p for p in fleet.all_pods.values() if p.node == "node-a"]
        assert on_a[0] is sick and len(on_a) == 2  # the sick card's pod, and its replacement there, once
        assert all(not p.alive for p in on_a)
        # Only node-a's pods were restarted: the replicas on the good cards were never touched.
        assert {fleet.pod(m.pod).node for m in fleet.deletions()} == {"node-a"}


async def test_the_bundled_server_corrupted_in_memory_is_restarted_and_its_replacement_answers_right(
        kmock: Any, tmp_path: Path) -> None:
    """Two bundled servers on the built-in model agree the reference through their control canaries;
    one is then corrupted in memory (the `corrupt` fault: until its process exits). Its probes deviate,
    it is restarted, and the new process, on a fresh card, answers as the reference says."""
    config = deep_merge(CONFIG, {"policy": {"correctness": {"prompts": list(correctness.PROMPTS)}}})
    async with Fleet(kmock, tmp_path, replicas=2, sidecar_config=config, model="serve", ready_timeout=120) as fleet:
        sick, healthy = fleet.pods()

        async def agreed(p: Any) -> bool:
            ref = (await fleet.status(p))["correctness"]["reference"] or {}
            return ref.get("agreed") is True

        await fleet.wait_until(lambda: agreed(sick), 90, "the two replicas agreeing a reference")
        # Each vote under the key of the device the server reports, never before it was read: a
        # reference agreed under an unknown device is voted again once it is known, and a card that
        # went wrong in between leaves two cards that disagree and no reference at all.
        votes = [e for p in (sick, healthy) for e in p.log() if e.get("event") == "correctness_voted"]
        assert votes and all(e["key"].split("|")[1] == "cpu" for e in votes), votes
        await fleet.control(sick, "POST", "/control/fault", {"kind": "corrupt", "mode": "perturb", "amount": 50.0})
        await fleet.wait_until(lambda: fleet.deletions(), 60, "the corrupted replica restarted")
        assert [m.pod for m in fleet.deletions()] == [sick.name]
        [decision] = decisions(sick.log())
        assert all(d in correctness.DEVIATIONS for d in decision["detail"]["deviations"])
        [replacement] = fleet.replacements()
        await fleet.wait_until(lambda: replacement.ready, 90, "the replacement serving")
        await fleet.wait_until(lambda: any(e.get("event") == "correctness_voted" for e in replacement.log()), 30,
                               "the replacement's vote")
        assert not decisions(replacement.log()) and not decisions(healthy.log())
        assert healthy.alive and len(fleet.deletions()) == 1

        async def matched() -> bool:
            last = (await fleet.status(replacement))["correctness"]["last"]
            return bool(last) and all(x["result"] == correctness.MATCH for x in last)

        await fleet.wait_until(matched, 30, "the replacement's answers matching the reference")
