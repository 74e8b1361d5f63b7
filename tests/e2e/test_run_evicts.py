"""`gpu-watchdog run` with strategy evict against a Kubernetes API emulator: the whole chain for real."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import aiohttp
import yaml

from tests.helpers import free_port, json_lines, spawn, start_server
from tests.integration.test_kubernetes import serve_events

NS, POD = "serving", "model-7f9c"


def kubeconfig(path: Path, url: str) -> None:
    path.write_text(yaml.safe_dump({
        "apiVersion": "v1", "kind": "Config", "current-context": "kmock",
        "clusters": [{"name": "kmock", "cluster": {"server": url}}],
        "users": [{"name": "kmock", "user": {"token": "not-a-real-token"}}],
        "contexts": [{"name": "kmock", "context": {"cluster": "kmock", "user": "kmock", "namespace": NS}}],
    }))


async def until(predicate: Any, timeout: float, what: str) -> None:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while loop.time() < deadline:
        if await predicate() if asyncio.iscoroutinefunction(predicate) else predicate():
            return
        await asyncio.sleep(0.1)  # yields to the emulator, which serves from this loop
    raise AssertionError(f"timed out waiting for {what}")


async def test_context_loss_evicts_exactly_our_pod_and_records_an_event(kmock: Any, tmp_path: Path) -> None:
    kmock.objects["v1/pods", NS, POD] = {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": POD, "namespace": NS},
                                         "spec": {"containers": [{"name": "inference", "image": "x"}]}}
    serve_events(kmock)
    eviction = kmock[f"post /api/v1/namespaces/{NS}/pods/{POD}/eviction"] << 201 << {"kind": "Status"}
    server = await asyncio.to_thread(start_server, tmp_path, "--fault-injection")
    kc = tmp_path / "kubeconfig"
    kubeconfig(kc, str(kmock.url).rstrip("/"))
    token_file = tmp_path / "token"
    token_file.write_text(server.token + "\n")
    wport = free_port()
    config = tmp_path / "watchdog.yaml"
    config.write_text(yaml.safe_dump({
        "target": {"control_url": server.control, "token_file": str(token_file)},
        "sampling": {"torch_interval": "300ms"},
        "canary": {"interval": "300ms", "timeout": "1s"},
        "restart": {"strategy": "evict", "drain_timeout": "2s", "retry_initial": "100ms"},
        "kubernetes": {"pod_name": "${POD_NAME}", "namespace": "${POD_NAMESPACE}", "kubeconfig": str(kc)},
        "server": {"host": "127.0.0.1", "port": wport},
    }))
    env = {"POD_NAME": POD, "POD_NAMESPACE": NS, "GPU_WATCHDOG_TOKEN": ""}
    watchdog = spawn(["run", "--config", str(config)], tmp_path / "watchdog.log", env=env)
    base = f"http://127.0.0.1:{wport}"
    try:
        async with aiohttp.ClientSession() as http:
            async def ready() -> bool:
                try:
                    async with http.get(base + "/readyz") as r:
                        return r.status == 200
                except aiohttp.ClientError:
                    return False

            await until(ready, 60, "watchdog ready")
            async with http.post(server.control + "/control/fault", json={"kind": "context_loss"},
                                 headers=server.auth()) as r:
                assert r.status == 200
            await until(lambda: len(eviction) >= 1, 30, "eviction request")
            await until(lambda: any(getattr(k[0], "plural", None) == "events" for k in kmock.objects), 10, "event")
            # The pod is going away: the watchdog stays unready so the Service stops routing to it.
            assert not await ready()
        assert len(eviction) == 1
        assert eviction[0].url.path == f"/api/v1/namespaces/{NS}/pods/{POD}/eviction"
        assert eviction[0].data["metadata"] == {"name": POD, "namespace": NS}
        [event] = [dict(getattr(kmock.objects[k], "raw", None) or kmock.objects[k]) for k in kmock.objects
                   if getattr(k[0], "plural", None) == "events"]
        assert event["reason"] == "ContextLoss" and event["regarding"]["name"] == POD
        assert "illegal memory access" in event["note"]
        # Only our pod was ever touched.
        pod_requests = [req for req in kmock if "/pods" in str(req.url)]
        assert pod_requests and all(f"/pods/{POD}" in str(req.url) for req in pod_requests)
    finally:
        watchdog.stop()
        server.proc.stop()
    decisions = [e for e in json_lines(watchdog.log()) if e.get("event") == "decision"]
    assert decisions and decisions[0]["reason"] == "context_loss" and decisions[0]["strategy"] == "evict"
