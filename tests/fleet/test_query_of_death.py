"""The query of death, end to end: two pods of one Deployment, each the bundled server on the built-in
model (fault injection on) and a real `gpu-watchdog run` sidecar, against the API emulator. One
request kills every engine it reaches (`context_loss` when its prompt contains a marker); a client
sends it to one pod and retries it on the other; the sidecars record what was in flight at each
failure in the workload's Lease and quarantine it, and both replicas refuse it with 422 while other
clients' requests go on being served.

Prints one line of figures (read with `-s`): the time from the second failure to the refusal on
every replica, and the requests lost at each failure.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp

from gpu_watchdog.inference.fingerprint import fingerprint, input_fingerprint
from gpu_watchdog.watchdog.core.names import CONTEXT_LOSS
from tests.fleet.harness import Fleet, FleetPod
from tests.helpers import ROOT, json_lines
from tests.integration.kmock_api import events as all_events

MARK = "QOD-7f3a"
MARKED = {"prompt": f"compute the {MARK} shape", "max_tokens": 6}
INNOCENT = {"prompt": "a long and entirely innocent story", "max_tokens": 400}
SERVE_ARGS = ("--quarantine-wait", "60")  # as the chart starts the bundled server beside a quarantine
CONFIG = {
    "canary": {"interval": "300ms", "timeout": "2s"},
    "sampling": {"torch_interval": "300ms"},
    # The wait for the replicas' word (`confirm`) shortened: the tests wait it out in real time.
    "policy": {"quarantine": {"enabled": True, "failures": 2, "window": "1h", "ttl": "1h", "confirm": "2s"}},
}


@dataclass(frozen=True)
class Answer:
    sent: float
    answered: float
    pod: str
    status: int


def request_lines(pod: FleetPod) -> list[dict[str, Any]]:
    return [e for e in json_lines(pod.model_log_text()) if e.get("event") == "request"]


async def listed(fleet: Fleet, pod: FleetPod) -> list[str]:
    """The fingerprints a pod's server refuses, where it serves ([] while it is down, starting or poisoned,
    or its readiness probe has not passed yet: a replacement's sidecar pushes the list before its model
    has loaded, and a request sent then is told to come back later)."""
    if not pod.ready:
        return []
    try:
        memory = await fleet.control(pod, "GET", "/control/memory")
        if memory["poisoned"] or not memory["ready"]:
            return []
        return [e["fingerprint"] for e in (await fleet.control(pod, "GET", "/control/quarantine"))["entries"]]
    except Exception:
        return []


async def all_lifted(fleet: Fleet) -> bool:
    for pod in fleet.pods():
        try:
            if (await fleet.control(pod, "GET", "/control/quarantine"))["entries"]:
                return False
        except AssertionError:
            return False
    return True


async def test_a_request_that_kills_two_replicas_is_refused_by_both_and_nothing_else_is(
        kmock: Any, tmp_path: Path) -> None:
    async with Fleet(kmock, tmp_path, replicas=2, sidecar_config=CONFIG, model="serve", ready_timeout=120,
                     serve_faults=[{"kind": "context_loss", "when_prompt_contains": MARK}]) as fleet:
        first = fleet.pods()
        await fleet.wait_until(lambda: all((p.name, 1) in fleet.serve_ready for p in first), 60, "faults armed")
        answers: list[Answer] = []
        retried = 0
        stop = asyncio.Event()

        async def other_clients(k: int) -> None:
            """Unmarked requests, each new, to a Ready pod (as a Service routes); one that never ran (a
            503 with Retry-After, a refused connection) is retried on a Ready pod, as a gateway does,
            while both replicas are down too."""
            nonlocal retried
            i = 0
            while not stop.is_set():
                ready = [p for p in fleet.pods() if p.ready]
                if not ready:
                    await asyncio.sleep(0.05)
                    continue
                pod = ready[(i + k) % len(ready)]
                sent = fleet.clock()
                body = {"prompt": f"client {k} question {i}", "max_tokens": 4}
                status, _ = await fleet.complete(pod, body, 30)
                tries = 0
                while status in (0, 503) and tries < 120:
                    retried, tries = retried + 1, tries + 1
                    await asyncio.sleep(0.25)
                    others = [p for p in fleet.pods() if p.ready and p is not pod] or [p for p in fleet.pods()
                                                                                       if p.ready]
                    if others:
                        status, _ = await fleet.complete(others[0], body, 30)
                answers.append(Answer(sent, fleet.clock(), pod.name, status))
                i += 1
                await asyncio.sleep(0.02)

        clients = [asyncio.create_task(other_clients(k)) for k in range(3)]
        try:
            await asyncio.sleep(1.5)
            pod1, pod2 = first
            # The bystander: an innocent long generation in flight on pod 1 when the marked request lands.
            bystander = asyncio.create_task(fleet.complete(pod1, INNOCENT))
            await asyncio.sleep(0.3)
            status, body = await fleet.complete(pod1, MARKED)
            crash1 = fleet.clock()
            assert status == 500 and body["error"]["type"] == "fatal_cuda", body
            status, _ = await bystander
            assert status == 500  # in flight at the crash: it gets its error
            # Its client retries it on the other replica, where it completes.
            status, _ = await fleet.complete(pod2, INNOCENT)
            assert status == 200
            # A gateway retries the marked request on the other replica at once: it kills that one too.
            status, body = await fleet.complete(pod2, MARKED)
            crash2 = fleet.clock()
            assert status == 500 and body["error"]["type"] == "fatal_cuda", body

            async def refused_everywhere() -> list[str] | None:
                pods = fleet.pods()
                lists = [await listed(fleet, p) for p in pods]
                return lists[0] if len(pods) == 2 and all(x and x == lists[0] for x in lists) else None

            [culprit] = await fleet.wait_until(refused_everywhere, 90, "the marked request quarantined at both pods",
                                               interval=0.1)
            refused_at = fleet.clock()
            removed_before = len(fleet.deletions())
            exits_before = sum(p.model_exits for p in fleet.all_pods.values())

            for _ in range(3):
                for pod in fleet.pods():
                    status, body = await fleet.complete(pod, MARKED)
                    assert status == 422, (pod.name, status, body)
                    error = body["error"]
                    assert error["code"] == "request_quarantined" and error["fingerprint"] == culprit
                    assert "in flight at 2 failures of this service and is refused until" in error["message"]
                    # The bystander is served everywhere.
                    assert (await fleet.complete(pod, INNOCENT))[0] == 200
            await asyncio.sleep(3)
        finally:
            stop.set()
            await asyncio.gather(*clients)

        # No further exit or restart once it is refused.
        assert len(fleet.deletions()) == removed_before
        assert sum(p.model_exits for p in fleet.all_pods.values()) == exits_before

        # The evidence: the culprit was in flight at both failures, on two pods; the bystander only at one.
        # A first pod whose server restarted in place keeps its log, so the later refusals may follow the
        # failure there: the evidence is what came before them.
        for p in first:
            statuses = [e["status"] for e in request_lines(p) if e.get("fingerprint") == culprit]
            refused = statuses.index(422) if 422 in statuses else len(statuses)
            assert statuses[:refused] == [500] and set(statuses[refused:]) <= {422}, (p.name, statuses)
        innocent_fp = {e["fingerprint"] for p in first for e in request_lines(p)
                       if e.get("status") == 500 and e["fingerprint"] != culprit}
        for pod in fleet.pods():
            status_doc = await fleet.status(pod)
            entries = status_doc["quarantine"]["entries"]
            assert [q["fingerprint"] for q in entries] == [culprit]
            assert sorted(entries[0]["pods"]) == sorted([pod1.name, pod2.name])
            assert {f["reason"] for f in entries[0]["failures"]} == {CONTEXT_LOSS}
            assert not innocent_fp & {q["fingerprint"] for q in entries}
        recorded = [line for p in first for line in p.log() if line.get("event") == "failure_recorded"]
        assert len(recorded) == 2 and all(culprit in line["inflight"] for line in recorded)
        assert any(innocent_fp & set(line["inflight"]) for line in recorded)  # the bystander was there, once
        quarantined = [line for p in fleet.all_pods.values() for line in p.log()
                       if line.get("event") == "request_quarantined"]
        assert len(quarantined) == 1 and quarantined[0]["fingerprint"] == culprit
        events = [e for e in all_events(kmock) if e.get("reason") == "RequestQuarantined"]
        assert len(events) == 1 and culprit in events[0]["note"]
        restart_events = [e for e in all_events(kmock)
                          if (e.get("metadata", {}).get("annotations") or {}).get("gpu-watchdog.io/inflight")]
        assert all(culprit in e["metadata"]["annotations"]["gpu-watchdog.io/inflight"] for e in restart_events)

        # An operator lists it and lifts it with the sidecar's own rights; every replica serves it again.
        pod = fleet.pods()[0]

        async def cli(*args: str) -> tuple[int, str, str]:
            env = {**os.environ, "POD_NAME": pod.name, "POD_NAMESPACE": fleet.namespace, "NODE_NAME": pod.node,
                   "GPU_WATCHDOG_TOKEN": pod.token}
            proc = await asyncio.create_subprocess_exec(
                sys.executable, "-m", "gpu_watchdog", "quarantine", *args, "--config", str(pod.config_path), env=env,
                cwd=ROOT, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
            out, err = await proc.communicate()
            assert proc.returncode is not None
            return proc.returncode, out.decode(), err.decode()

        code, out, err = await cli("list")
        assert code == 0, err
        shown = json.loads(out)
        assert [q["fingerprint"] for q in shown["quarantined"]] == [culprit] and shown["workload"] == "llm"
        code, _, err = await cli("lift")
        assert code == 2 and "needs a FINGERPRINT" in err
        code, out, err = await cli("lift", culprit)
        assert code == 0 and "lifted" in out, err
        await fleet.wait_until(lambda: all_lifted(fleet), 20, "the lift pushed to both servers")
        assert [e for e in all_events(kmock) if e.get("reason") == "QuarantineLifted"]
        code, _, err = await cli("lift", culprit)
        assert code == 1 and "not quarantined" in err

        # Other clients: served throughout; lost only what was in flight at a crash, on the crashed pod.
        crashed = {pod1.name: crash1, pod2.name: crash2}
        lost = [a for a in answers if a.status != 200]
        for a in lost:
            assert a.status == 500 and a.pod in crashed and a.sent <= crashed[a.pod] <= a.answered + 0.5, a
        served_after = [a for a in answers if a.status == 200 and a.sent > refused_at]
        assert len(served_after) >= 5
        print("\nquery of death: " + json.dumps({
            "second_failure_to_refused_everywhere_s": round(refused_at - crash2, 2),
            "lost_at_failure_1": sum(1 for a in lost if a.pod == pod1.name),
            "lost_at_failure_2": sum(1 for a in lost if a.pod == pod2.name),
            "other_requests": len(answers), "other_served": len(answers) - len(lost), "other_retried": retried,
            "restarts": len(fleet.deletions()), "model_exits": exits_before}, sort_keys=True))


async def test_a_killer_that_varies_its_settings_is_refused_by_its_input_and_the_innocent_beside_it_never(
        kmock: Any, tmp_path: Path) -> None:
    """The killer sent each time with another temperature, seed or top_p (a new fingerprint each try),
    and an innocent long generation retried by its own client onto the next replica, in flight beside
    it at both of the first failures. By fingerprint alone the innocent stood alone at two failures and
    was refused, the killer never; by input, the two tie at two failures, the third (the innocent not
    there) takes the killer's input, and every replica refuses it under any setting while the innocent
    is served everywhere."""
    async with Fleet(kmock, tmp_path, replicas=2, sidecar_config=CONFIG, model="serve", ready_timeout=120,
                     serve_faults=[{"kind": "context_loss", "when_prompt_contains": MARK}],
                     serve_args=SERVE_ARGS) as fleet:
        first = fleet.pods()
        await fleet.wait_until(lambda: all((p.name, 1) in fleet.serve_ready for p in first), 60, "faults armed")
        key = f"key-of-{fleet.deployment}".encode()  # the workload's fingerprint key (the harness's Secret)
        killer_input = input_fingerprint(key, MARKED)
        innocent_fp = fingerprint(key, INNOCENT)
        tries = [{**MARKED, "temperature": 0.7}, {**MARKED, "seed": 5}, {**MARKED, "top_p": 0.9}]
        assert len({fingerprint(key, t) for t in tries}) == 3 and input_fingerprint(key, tries[0]) == killer_input

        async def beside(pod: FleetPod, killer: dict[str, Any]) -> None:
            """The innocent generating on `pod` when the killer lands there: both in the failing step."""
            innocent = asyncio.create_task(fleet.complete(pod, INNOCENT))
            await asyncio.sleep(0.3)
            status, body = await fleet.complete(pod, killer)
            assert status == 500 and body["error"]["type"] == "fatal_cuda", body
            assert (await innocent)[0] == 500

        def recorded() -> list[dict[str, Any]]:
            return [line for p in fleet.all_pods.values() for line in p.log()
                    if line.get("event") == "failure_recorded"]

        pod1, pod2 = first
        await beside(pod1, tries[0])
        await beside(pod2, tries[1])  # its client retried the innocent here; a gateway, the killer
        await fleet.wait_until(lambda: len(recorded()) == 2, 30, "both failures recorded")
        assert all(innocent_fp in line["inflight"] for line in recorded())
        await asyncio.sleep(2)  # a quarantine would be decided with the second record, and pushed within 5 s
        for pod in fleet.pods():
            assert await listed(fleet, pod) == []

        async def crash_once_more() -> bool:
            """The killer with a third setting, alone, on a replica that serves again."""
            for pod in [p for p in fleet.pods() if p.ready]:
                status, body = await fleet.complete(pod, tries[2])
                assert status != 422, body  # nothing is refused yet
                if status == 500:
                    return True
            return False

        await fleet.wait_until(crash_once_more, 90, "a third failure, on a replica serving again", interval=0.5)

        async def refused_everywhere() -> bool:
            """Both replicas refuse it and neither sidecar still has a restart to carry out (the
            replica of the third failure may be replaced even after its process came back in place)."""
            pods = fleet.pods()
            if len(pods) != 2 or not all([await listed(fleet, p) == [killer_input] for p in pods]):
                return False
            try:
                return not any([(await fleet.status(p))["restart_in_progress"] for p in pods])
            except aiohttp.ClientError:
                return False

        await fleet.wait_until(refused_everywhere, 90, "the killer's input quarantined at both pods", interval=0.2)
        for pod in fleet.pods():
            for body in ({**MARKED, "temperature": 1.3}, {**MARKED, "seed": 99, "max_tokens": 5},
                         {"prompt": list(f"compute the {MARK} shape".encode()), "max_tokens": 6}):
                status, answer = await fleet.complete(pod, body)
                assert status == 422, (pod.name, body, answer)
                error = answer["error"]
                assert error["code"] == "request_quarantined" and error["fingerprint"] == killer_input
                assert error["message"].startswith("this request's input")
            assert (await fleet.complete(pod, INNOCENT))[0] == 200  # the innocent is served everywhere
            entries = (await fleet.status(pod))["quarantine"]["entries"]
            assert [(q["fingerprint"], q["input"]) for q in entries] == [(killer_input, True)]
            assert len(entries[0]["failures"]) == 3
        assert len(recorded()) == 3

        # A new process of a replica (its container restarted in place) serves nothing before the list
        # is in force there, however late its sidecar is: here it is stopped until the model has loaded.
        pod = fleet.pods()[0]
        assert pod.model is not None and pod.sidecar is not None
        starts = pod.model_starts
        pod.sidecar.proc.send_signal(signal.SIGSTOP)
        try:
            pod.model.proc.kill()
            await fleet.wait_until(lambda: pod.model_starts > starts, 30, "the process started again in its pod")
            await fleet.wait_until(lambda: sum(e.get("event") == "ready" for e in json_lines(pod.model_log_text()))
                                   == pod.model_starts, 120, "the new process's model loaded")
            status, answer = await fleet.complete(pod, {**MARKED, "temperature": 0.4}, 10)
            assert status == 503 and "quarantine list" in answer["error"]["message"], (status, answer)
        finally:
            pod.sidecar.proc.send_signal(signal.SIGCONT)
        seen: list[int] = []

        async def refused_by_the_new_process() -> bool:
            status, answer = await fleet.complete(pod, {**MARKED, "temperature": 0.4}, 10)
            if not seen or seen[-1] != status:
                seen.append(status)
            assert status in (503, 422), (seen, answer)
            return status == 422

        await fleet.wait_until(refused_by_the_new_process, 60, "the new process refusing the killer", interval=0.02)
        assert pod.model_starts == starts + 1  # it never crashed it
        received = [e for e in json_lines(pod.model_log_text()) if e.get("event") == "quarantine_received"]
        assert len(received) == pod.model_starts  # each process, its list once
        quarantined = [line["fingerprint"] for p in fleet.all_pods.values() for line in p.log()
                       if line.get("event") == "request_quarantined" and "workload" in line]
        assert quarantined == [killer_input] and innocent_fp not in quarantined
