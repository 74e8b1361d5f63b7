"""The restart budget holds across pod generations: counted from the restart Events in the namespace.

Every restart replaces the pod, and a new pod's sidecar starts with an empty memory. The real
`kubernetes` client against kmock: each generation is a new Watchdog with a new pod name, watching
a real HTTP server that hangs after it has served once, and evicting its own pod through the real
restarter, which writes the Event the next generation reads back.
"""

from __future__ import annotations

import asyncio
import datetime as dt
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import pytest
from aiohttp import web
from kubernetes import client

from gpu_watchdog.watchdog.core.names import BUDGET_EXHAUSTED, HANG
from gpu_watchdog.watchdog.core.policy import Decision
from gpu_watchdog.watchdog.edge.config import from_mapping, workload_of
from gpu_watchdog.watchdog.edge.effects.node import NodeReporter
from gpu_watchdog.watchdog.edge.effects.restart import KubeRestarter, annotations_for, event_reason, note_for
from gpu_watchdog.watchdog.edge.kube.kube import CONTROLLER, PodActions, workload_from_pod
from gpu_watchdog.watchdog.runtime.app import Watchdog
from gpu_watchdog.watchdog.runtime.wiring import resolve_workload
from tests.integration.kmock_api import NS, events, kubeconfig, pod
from tests.integration.loopback import serve_everything
from tests.integration.sidecar_stand_ins import NoNvml

EVENTS = f"get /apis/events.k8s.io/v1/namespaces/{NS}/events"
# Pods of the Deployment "model", as its ReplicaSets name them: three generations and the fourth.
GENERATIONS = ["model-5d8f9c7b4-x2k9p", "model-5d8f9c7b4-q7w3n", "model-6b7c8d9f5-m4t8z", "model-6b7c8d9f5-h2j6v"]


@asynccontextmanager
async def hanging_server() -> AsyncIterator[str]:
    """An OpenAI-style server that answers its first completion and then never again."""
    served = {"n": 0}
    release = asyncio.Event()

    async def handler(request: web.Request) -> web.Response:
        if request.path.endswith("/models"):
            return web.json_response({"data": [{"id": "m"}]})
        served["n"] += 1
        if served["n"] > 1:
            await release.wait()
        return web.json_response({"choices": [{"text": "x"}]})

    async with serve_everything(handler) as url:
        try:
            yield url
        finally:
            release.set()


def generation(api: client.ApiClient, kmock: Any, pod_name: str, url: str, request_timeout: float = 5.0,
               max_restarts: int = 3, workload: str | None = None) -> Watchdog:
    if ("v1/pods", NS, pod_name) not in kmock.objects:
        kmock.objects["v1/pods", NS, pod_name] = pod(pod_name)
    settings = from_mapping({
        "target": {"openai_url": url, "metrics_url": None},
        # The first answer must come within the timeout even on a loaded machine; the hang never comes.
        "canary": {"interval": "200ms", "timeout": "1s"},
        "policy": {"hang": {"consecutive_timeouts": 2},
                   "restart_budget": {"max_restarts": max_restarts, "window": "1h"}},
        "restart": {"strategy": "evict", "max_attempts": 1},
        "kubernetes": {"pod_name": pod_name, "namespace": NS, "node_name": "", "request_timeout": request_timeout},
        "server": {"host": "127.0.0.1", "port": 0},
    })
    workload = workload or workload_of(settings)
    restarter = KubeRestarter(PodActions(api, pod_name, NS, request_timeout), settings.restart, workload=workload)
    reader = NodeReporter(api, NS, "", request_timeout, False)
    return Watchdog(settings, restarter, nvml_backend=NoNvml(), restart_events=reader,  # type: ignore[arg-type]
                    workload=workload)


async def live(wd: Watchdog, until_decided: float = 30.0) -> tuple[dict[str, Any], dict[str, Any]]:
    """Run one generation until it decided a restart (carried out or blocked); its first status and its last."""
    await wd.start(serve_http=False)
    try:
        first = wd.status()
        loop = asyncio.get_running_loop()
        deadline = loop.time() + until_decided
        while loop.time() < deadline:
            if any(d.outcome in ("done", "failed", "not_recorded", "blocked_by_budget") for d in wd.history.decisions):
                break
            await asyncio.sleep(0.05)
        await asyncio.sleep(0.2)  # let a started eviction finish
        return first, wd.status()
    finally:
        await wd.stop()


def other_workload_restart(api: client.ApiClient, pod_name: str) -> None:
    d = Decision("restart", HANG, {"evidence": "canary"})
    PodActions(api, pod_name, NS, 5).record_event(pod_name, NS, event_reason(HANG), note_for(d), "Evict",
                                                    annotations=annotations_for(d, "embedder"))


async def test_the_budget_holds_across_pod_generations(kmock: Any, api: client.ApiClient) -> None:
    for name in ("embedder-7f9d6c5b8-a1b2c", "embedder-7f9d6c5b8-d3e4f", "embedder-7f9d6c5b8-g5h6j"):
        await asyncio.to_thread(other_workload_restart, api, name)  # another workload's: not ours to count
    evictions = []
    for n, pod_name in enumerate(GENERATIONS):
        spy = kmock[f"post /api/v1/namespaces/{NS}/pods/{pod_name}/eviction"] << 201 << {
            "kind": "Status", "status": "Success"}
        async with hanging_server() as url:
            first, last = await live(generation(api, kmock, pod_name, url))
        evictions.append(sum(1 for req in spy if "dryRun" not in req.params))
        assert first["restart_budget"]["scope"] == "workload" and first["restart_budget"]["workload"] == "model"
        # A new sidecar knows at once what its predecessors did.
        assert first["restart_budget_remaining"] == 3 - n if n < 3 else first["restart_budget_remaining"] == 0
        if n < 3:
            assert [d["outcome"] for d in last["last_decisions"] if d["action"] == "restart"] == ["started", "done"]
        else:
            assert [d["outcome"] for d in last["last_decisions"]] == ["blocked_by_budget"]
            assert BUDGET_EXHAUSTED in last["states"] and last["restart_budget_remaining"] == 0
    assert evictions == [1, 1, 1, 0]  # the fourth generation reports and does not act
    ours = [e for e in events(kmock) if e["metadata"].get("annotations", {}).get("gpu-watchdog.io/workload")
            == "model"]
    assert sorted(e["regarding"]["name"] for e in ours) == sorted(GENERATIONS[:3])
    assert all(e["metadata"]["annotations"]["gpu-watchdog.io/reason"] == HANG for e in ours)


async def unreadable_events(kmock: Any, api: client.ApiClient, request_timeout: float = 5.0) -> dict[str, Any]:
    pod_name = GENERATIONS[0]
    spy = kmock[f"post /api/v1/namespaces/{NS}/pods/{pod_name}/eviction"] << 201 << {"kind": "Status"}
    async with hanging_server() as url:
        _, last = await live(generation(api, kmock, pod_name, url, request_timeout=request_timeout))
    assert len(spy) == 0, "a budget that cannot be read is spent: no restart"
    [d] = [d for d in last["last_decisions"] if d["action"] == "restart"]
    assert d["outcome"] == "blocked_by_budget" and d["reason"] == HANG
    assert last["restart_budget_remaining"] == 0 and BUDGET_EXHAUSTED in last["states"]
    assert last["restart_budget"]["read_error"]
    return last


async def test_events_that_cannot_be_listed_spend_the_budget(kmock: Any, api: client.ApiClient) -> None:
    kmock[EVENTS] << 503 << {"kind": "Status", "code": 503, "message": "etcd leader changed"}
    last = await unreadable_events(kmock, api)
    assert last["restart_budget"]["read_error"].startswith("503")


async def test_a_slow_events_list_spends_the_budget(kmock: Any, api: client.ApiClient) -> None:
    async def slow() -> dict[str, Any]:
        await asyncio.sleep(3)
        return {"kind": "EventList", "apiVersion": "events.k8s.io/v1", "metadata": {}, "items": []}

    kmock[EVENTS] << slow
    await unreadable_events(kmock, api, request_timeout=0.5)


async def test_a_partial_events_list_spends_the_budget(kmock: Any, api: client.ApiClient) -> None:
    """The first page comes, the next one fails: a partial count must not pass for the whole."""
    kmock[EVENTS][lambda req: req.params.get("continue") == "page-2"] << 500 << {"kind": "Status", "code": 500}
    kmock[EVENTS] << 200 << {"kind": "EventList", "apiVersion": "events.k8s.io/v1",
                             "metadata": {"continue": "page-2"}, "items": []}
    last = await unreadable_events(kmock, api)
    assert last["restart_budget"]["read_error"].startswith("500")


@pytest.mark.parametrize(("pod_name", "workload"), [
    ("model-5d8f9c7b4-x2k9p", "model"), ("llm-server-0", "llm-server-0"), ("a-b-c-7f9d6c5b8-a1b2c", "a-b-c")])
def test_the_workload_of_a_pod(pod_name: str, workload: str) -> None:
    settings = from_mapping({"kubernetes": {"pod_name": pod_name, "namespace": NS}})
    assert workload_of(settings) == workload
    named = from_mapping({"kubernetes": {"pod_name": pod_name, "namespace": NS, "workload": "release-x"}})
    assert workload_of(named) == "release-x"


def restart_event(api: client.ApiClient, pod_name: str, workload: str) -> None:
    d = Decision("restart", HANG, {"evidence": "canary"})
    PodActions(api, pod_name, NS, 5).record_event(pod_name, NS, event_reason(HANG), note_for(d), "Evict",
                                                  annotations=annotations_for(d, workload))


async def test_an_event_the_api_refuses_means_no_restart(kmock: Any, api: client.ApiClient) -> None:
    """Listing works, creating is refused (an admission webhook, an events quota): no record, no restart."""
    pod_name = GENERATIONS[0]
    evictions = kmock[f"post /api/v1/namespaces/{NS}/pods/{pod_name}/eviction"] << 201 << {"kind": "Status"}
    refused = kmock[f"post /apis/events.k8s.io/v1/namespaces/{NS}/events"] << 403 << {
        "kind": "Status", "code": 403, "message": "admission webhook denied the request"}
    async with hanging_server() as url:
        _, last = await live(generation(api, kmock, pod_name, url))
    assert len(refused) == 3
    assert [req.params.get("dryRun") for req in evictions] == ["All"], "asked, never evicted"
    [d] = [d for d in last["last_decisions"] if d["outcome"] != "started"]
    assert d["outcome"] == "not_recorded" and d["reason"] == HANG
    assert "restart_not_recorded" in last["states"] and "403" in last["restart_not_recorded"]
    assert last["restarts"] == [] and last["restart_budget_remaining"] == 3  # not counted as done


async def test_a_future_dated_restart_event_does_not_count(kmock: Any, api: client.ApiClient) -> None:
    """Anyone who may create Events can date one a day ahead: it would spend the budget for a day."""
    now = dt.datetime.now(dt.UTC)
    for n, ahead in enumerate((dt.timedelta(days=1), dt.timedelta(seconds=10))):
        kmock.objects["events.k8s.io/v1/events", NS, f"forged-{n}"] = {
            "apiVersion": "events.k8s.io/v1", "kind": "Event", "metadata": {
                "name": f"forged-{n}", "namespace": NS,
                "annotations": {"gpu-watchdog.io/workload": "model", "gpu-watchdog.io/reason": HANG}},
            "eventTime": (now + ahead).isoformat().replace("+00:00", "Z"), "reportingController": CONTROLLER,
            "reportingInstance": "x", "action": "Evict", "reason": "Hang",
            "regarding": {"kind": "Pod", "name": "model-5d8f9c7b4-zzzzz", "namespace": NS}}
    wd = generation(api, kmock, GENERATIONS[0], "http://127.0.0.1:9")
    await wd.start(serve_http=False)
    try:
        # Within the clock skew allowed (10 s ahead) it counts; a day ahead it does not.
        assert wd.status()["restart_budget_remaining"] == 2
    finally:
        await wd.stop()


async def test_a_pod_shares_its_deployments_budget_through_its_owner(kmock: Any, api: client.ApiClient,
                                                                   tmp_path: Path,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """A pod whose name says nothing (a custom controller's, a renamed one) but whose controller is a
    ReplicaSet of the Deployment "model": it counts the restarts of that Deployment's other pods."""
    pod_name = "gpu-serving-worker"
    kmock.objects["v1/pods", NS, pod_name] = {
        **pod(pod_name), "metadata": {
            "name": pod_name, "namespace": NS, "labels": {"pod-template-hash": "5d8f9c7b4"},
            "ownerReferences": [{"apiVersion": "apps/v1", "kind": "ReplicaSet", "name": "model-5d8f9c7b4",
                                 "uid": "1", "controller": True}]}}
    for name in GENERATIONS[:2]:
        await asyncio.to_thread(restart_event, api, name, "model")
    kc = tmp_path / "kubeconfig"
    kubeconfig(kc, str(kmock.url).rstrip("/"))
    settings = from_mapping({"kubernetes": {"pod_name": pod_name, "namespace": NS, "kubeconfig": str(kc),
                                            "workload": ""}, "restart": {"strategy": "evict"}})
    assert workload_of(settings) == pod_name  # the name alone would give it a budget of its own
    assert await asyncio.to_thread(resolve_workload, settings) == "model"
    wd = generation(api, kmock, pod_name, "http://127.0.0.1:9", workload="model")
    await wd.start(serve_http=False)
    try:
        assert wd.status()["restart_budget_remaining"] == 1
    finally:
        await wd.stop()
    # And where the pod cannot be read, the name is the fallback.
    monkeypatch.setattr("gpu_watchdog.watchdog.runtime.wiring.WORKLOAD_TRIES", 1)
    del kmock.objects["v1/pods", NS, pod_name]
    assert await asyncio.to_thread(resolve_workload, settings) == pod_name


@pytest.mark.parametrize(("owners", "labels", "workload"), [
    ([("ReplicaSet", "model-5d8f9c7b4")], {"pod-template-hash": "5d8f9c7b4"}, "model"),
    ([("ReplicaSet", "standalone")], {}, "standalone"),
    ([("StatefulSet", "llm")], {}, "llm"),
    ([("Job", "eval-run")], {}, "eval-run"),
    ([], {}, "bare-pod")])
def test_the_workload_from_a_pods_controller(owners: list[tuple[str, str]], labels: dict[str, str],
                                             workload: str) -> None:
    assert workload_from_pod("bare-pod", labels, owners) == workload
