"""`gpu-watchdog run` with strategy evict against a Kubernetes API emulator: the whole chain for real."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import aiohttp
import yaml

from tests.helpers import Proc, free_port, json_lines, rss_bytes, spawn, start_server
from tests.integration.kmock_api import NS, kubeconfig, serve_events

POD = "model-7f9c"


async def until(predicate: Any, timeout: float, what: str) -> None:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while loop.time() < deadline:
        if await predicate() if asyncio.iscoroutinefunction(predicate) else predicate():
            return
        await asyncio.sleep(0.1)  # yields to the emulator, which serves from this loop
    raise AssertionError(f"timed out waiting for {what}")


def our_pod(kmock: Any) -> None:
    """Our pod, of the Deployment "llm" (its ReplicaSet's name and the pod's template-hash label say so)."""
    kmock.objects["v1/pods", NS, POD] = {
        "apiVersion": "v1", "kind": "Pod", "spec": {"containers": [{"name": "inference", "image": "x"}]},
        "metadata": {"name": POD, "namespace": NS, "labels": {"pod-template-hash": "5c9d7b6f4"},
                     "ownerReferences": [{"apiVersion": "apps/v1", "kind": "ReplicaSet", "name": "llm-5c9d7b6f4",
                                          "uid": "u", "controller": True}]}}
    serve_events(kmock)


def real(req: Any) -> bool:
    return "dryRun" not in req.params


def run_watchdog(kmock: Any, tmp_path: Path, server: Any, **config: Any) -> tuple[Proc, str]:
    """`gpu-watchdog run` on `server`, evicting through the emulator; its process and its base URL."""
    kc = tmp_path / "kubeconfig"
    kubeconfig(kc, str(kmock.url).rstrip("/"))
    token_file = tmp_path / "token"
    token_file.write_text(server.token + "\n")
    wport = free_port()
    path = tmp_path / "watchdog.yaml"
    path.write_text(yaml.safe_dump({
        "target": {"control_url": server.control, "token_file": str(token_file)},
        "sampling": {"torch_interval": "300ms"},
        "canary": {"interval": "300ms", "timeout": "1s"},
        "kubernetes": {"pod_name": "${POD_NAME}", "namespace": "${POD_NAMESPACE}", "kubeconfig": str(kc)},
        "server": {"host": "127.0.0.1", "port": wport},
        # This emulator creates a Lease but cannot replace one: the quarantine's records would take
        # the Lease's create and leave the fleet's slot a replace it refuses. Both are tested
        # together on the emulator that has resourceVersion semantics (tests/fleet).
        "policy": {"quarantine": {"enabled": False}},
        **config,
    }))
    env = {"POD_NAME": POD, "POD_NAMESPACE": NS, "GPU_WATCHDOG_TOKEN": ""}
    return spawn(["run", "--config", str(path)], tmp_path / "watchdog.log", env=env), f"http://127.0.0.1:{wport}"


async def status_of(http: aiohttp.ClientSession, url: str) -> int:
    try:
        async with http.get(url) as r:
            return r.status
    except aiohttp.ClientError:
        return 0


async def test_context_loss_evicts_exactly_our_pod_and_records_an_event(kmock: Any, tmp_path: Path) -> None:
    our_pod(kmock)
    eviction = kmock[f"post /api/v1/namespaces/{NS}/pods/{POD}/eviction"] << 201 << {"kind": "Status"}
    server = await asyncio.to_thread(start_server, tmp_path, "--fault-injection")
    watchdog, base = run_watchdog(kmock, tmp_path, server,
                                  restart={"strategy": "evict", "drain_timeout": "2s", "retry_initial": "100ms"})
    try:
        async with aiohttp.ClientSession() as http:
            async def ready() -> bool:
                return await status_of(http, base + "/readyz") == 200

            await until(ready, 60, "watchdog ready")
            await asyncio.sleep(3)  # a few rounds of every loop, the API's client in use
            print(f"sidecar RSS, Kubernetes API configured: {rss_bytes(watchdog.proc.pid) / 2**20:.1f} MiB")
            async with http.post(server.control + "/control/fault", json={"kind": "context_loss"},
                                 headers=server.auth()) as r:
                assert r.status == 200
            await until(lambda: any(real(req) for req in eviction), 30, "eviction request")
            await until(lambda: any(getattr(k[0], "plural", None) == "events" for k in kmock.objects), 10, "event")
            # The pod is going away: the watchdog stays unready so the Service stops routing to it.
            assert not await ready()
        # Asked first (a dry run the disruption budget answers), then evicted, once.
        assert [real(req) for req in eviction] == [False, True]
        for req in eviction:
            assert req.url.path == f"/api/v1/namespaces/{NS}/pods/{POD}/eviction"
            assert req.data["metadata"] == {"name": POD, "namespace": NS}
        [event] = [dict(getattr(kmock.objects[k], "raw", None) or kmock.objects[k]) for k in kmock.objects
                   if getattr(k[0], "plural", None) == "events"]
        assert event["reason"] == "ContextLoss" and event["regarding"]["name"] == POD
        assert "illegal memory access" in event["note"]
        # The budget's key came from the API: the pod's name alone ("model-…") says nothing of "llm".
        assert event["metadata"]["annotations"]["gpu-watchdog.io/workload"] == "llm"
        # Only our pod was ever touched (read at start for its owner, then evicted).
        pod_requests = [req for req in kmock if "/pods" in str(req.url)]
        assert pod_requests and all(f"/pods/{POD}" in str(req.url) for req in pod_requests)
    finally:
        watchdog.stop()
        server.proc.stop()
    decisions = [e for e in json_lines(watchdog.log()) if e.get("event") == "decision"]
    assert decisions and decisions[0]["reason"] == "context_loss" and decisions[0]["strategy"] == "evict"


async def test_a_refused_eviction_lifts_the_drain_and_the_server_serves_on(kmock: Any, tmp_path: Path) -> None:
    """A `max_age` restart of a healthy server: the disruption budget allows the dry run, then refuses
    every eviction (another replica went first). The drain made for it must not outlive the refusal."""
    our_pod(kmock)
    url = f"post /api/v1/namespaces/{NS}/pods/{POD}/eviction"
    kmock[url][lambda req: not real(req)] << 201 << {"kind": "Status", "status": "Success"}
    refused = kmock[url][real] << 429 << {"kind": "Status", "code": 429, "message": "would violate the budget"}
    server = await asyncio.to_thread(start_server, tmp_path)
    watchdog, base = run_watchdog(
        kmock, tmp_path, server, policy={"max_age": "4s", "max_age_jitter": 0.0},
        restart={"strategy": "evict", "drain_timeout": "2s", "retry_initial": "300ms", "retry_max": "300ms",
                 "max_attempts": 4})
    seen: list[tuple[float, int, int]] = []  # (time, server /readyz, watchdog /readyz)
    try:
        async with aiohttp.ClientSession() as http:
            loop = asyncio.get_running_loop()
            started = loop.time()

            async def after_failure() -> bool:
                nonlocal reported_at
                seen.append((loop.time() - started, await status_of(http, server.url + "/readyz"),
                             await status_of(http, base + "/readyz")))
                try:
                    async with http.get(base + "/status") as r:
                        status = await r.json()
                except aiohttp.ClientError:
                    return False  # not listening yet
                if status["restart_failed"] and reported_at is None:
                    reported_at = seen[-1][0]
                return reported_at is not None and seen[-1][1:] == (200, 200)

            reported_at: float | None = None
            await until(after_failure, 60, "the failed restart reported, both ready again")
            assert reported_at is not None
            async with http.post(server.url + "/v1/completions", json={"prompt": "hi", "max_tokens": 2}) as r:
                assert r.status == 200  # serving, not a zombie
        assert len(refused) == 4
        # Ready again within the drain timeout of the report, not at the server's own deadline (122 s).
        assert seen[-1][0] - reported_at < 2.0
        assert kmock.objects["v1/pods", NS, POD] is not None  # still there, and serving
    finally:
        watchdog.stop()
        server.proc.stop()
    lines = json_lines(watchdog.log())
    # Drained right before each eviction the dry run allowed, and lifted after each refusal.
    drains = [e["event"] for e in json_lines(server.proc.log()) if e.get("event") in ("drain_started", "drain_lifted")]
    assert drains == ["drain_started", "drain_lifted"] * 4
    assert [e["by"] for e in json_lines(server.proc.log()) if e.get("event") == "drain_lifted"] == ["control"] * 4
    assert len([e for e in lines if e.get("event") == "drain_lifted"]) == 4
    [finished] = [e for e in lines if e.get("event") == "restart_finished"][:1]
    assert finished["done"] is False and "429" in finished["detail"]
