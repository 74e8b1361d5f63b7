"""The sidecar's own memory: `gpu-watchdog run` watching a real server stays within 64 MiB resident,
in local mode (no Kubernetes API, strategy none) and with a Kubernetes API configured and in use
(evict, the fleet's Lease, the quarantine); it imports what a mode needs when it needs it (protobuf only
where the config asks for the kubelet) and never the official Kubernetes client, whose typed models
alone would take more than the budget (watchdog/edge/kube/kube_api.py)."""

from __future__ import annotations

import asyncio
import json
import time
from pathlib import Path
from typing import Any

import aiohttp
import pytest
import yaml

from tests.fleet import cluster as k8s
from tests.fleet.cluster import Cluster
from tests.fleet.harness import write_kubeconfig
from tests.helpers import free_port, json_lines, rss_bytes, spawn, start_server, wait_http

LOCAL_MODE_LIMIT = 64 * 2**20
KUBERNETES_MODE_LIMIT = 64 * 2**20
# The official client's stack: none of it may be imported by the sidecar.
KUBERNETES_CLIENT = ("kubernetes", "pydantic", "pydantic_core", "oauthlib", "requests_oauthlib", "websocket",
                     "requests")


def mapped_packages(pid: int) -> set[str]:
    """The site-packages whose native libraries the process has loaded."""
    maps = Path(f"/proc/{pid}/maps").read_text().splitlines()
    return {line.split()[-1].split("site-packages/")[1].split("/")[0] for line in maps
            if "site-packages/" in line and ".so" in line}


def write_config(tmp_path: Path, server: Any, token_file: Path, port: int, mode: dict[str, Any]) -> Path:
    """The sidecar's config for both modes: the same target and loops, `mode` its restart and API."""
    config = tmp_path / "watchdog.yaml"
    config.write_text(yaml.safe_dump({
        "target": {"control_url": server.control, "openai_url": server.url, "token_file": str(token_file)},
        "sampling": {"torch_interval": "200ms"},
        "canary": {"interval": "300ms", "timeout": "2s"},
        "server": {"host": "127.0.0.1", "port": port},
        **mode,
    }))
    return config


def test_local_mode_stays_within_64_mib(tmp_path: Path) -> None:
    server = start_server(tmp_path)
    token_file = tmp_path / "token"
    token_file.write_text(server.token + "\n")
    wport = free_port()
    config = write_config(tmp_path, server, token_file, wport, {"restart": {"strategy": "none"}})
    watchdog = spawn(["run", "--config", str(config)], tmp_path / "watchdog.log", env={"GPU_WATCHDOG_TOKEN": ""})
    try:
        wait_http(f"http://127.0.0.1:{wport}/readyz", watchdog)
        time.sleep(5)  # canaries, allocator samples, scrapes: every loop has run many times
        samples = []
        for _ in range(5):
            samples.append(rss_bytes(watchdog.proc.pid))
            time.sleep(0.5)
        native = mapped_packages(watchdog.proc.pid)
    finally:
        watchdog.stop()
        server.proc.stop()
    print(f"sidecar RSS, local mode: {max(samples) / 2**20:.1f} MiB (samples {[s >> 20 for s in samples]} MiB)")
    assert max(samples) <= LOCAL_MODE_LIMIT, [s >> 20 for s in samples]
    # Nothing of the Kubernetes client's stack or of protobuf was needed, so none of it is loaded.
    assert not native & {"google", "pydantic_core", "rpds", "charset_normalizer", "grpc"}, native


def imported_packages(log: str) -> set[str]:
    """The top-level packages a process started with PYTHONPROFILEIMPORTTIME=1 imported (its stderr)."""
    out = set()
    for line in log.splitlines():
        if line.startswith("import time:") and "|" in line:
            name = line.rsplit("|", 1)[1].strip()
            if name and not name.startswith("imported package"):
                out.add(name.split(".")[0])
    return out


@pytest.mark.kmock(cls=Cluster)
async def test_kubernetes_mode_stays_within_64_mib(kmock: Any, tmp_path: Path) -> None:
    """Our pod of the Deployment "llm" in the emulator (a real API server's semantics), restart strategy
    evict, the fleet ledger and the quarantine on as the chart sets them: the sidecar reads its pod, its
    workload's restart Events and its Lease, then idles."""
    ns, deploy_name, template_hash = "serving", "llm", "5c9d7b6f4x"
    deploy = kmock.add(k8s.deployment(deploy_name, ns, 1))
    rs = kmock.add(k8s.replica_set(deploy, template_hash))
    pod_name = f"{rs['metadata']['name']}-b2c4d"
    kmock.add(k8s.pod_of(rs, pod_name, "node-0", ready=True, wall=kmock.wall))
    kubeconfig = tmp_path / "kubeconfig"
    write_kubeconfig(kubeconfig, str(kmock.url).rstrip("/"), ns)
    server = await asyncio.to_thread(start_server, tmp_path)
    token_file = tmp_path / "token"
    token_file.write_text(server.token + "\n")
    wport = free_port()
    config = write_config(tmp_path, server, token_file, wport, {
        "restart": {"strategy": "evict"},
        "policy": {"fleet": {"enabled": True}, "quarantine": {"enabled": True}},
        "kubernetes": {"pod_name": "${POD_NAME}", "namespace": "${POD_NAMESPACE}", "node_name": "${NODE_NAME}",
                       "kubeconfig": str(kubeconfig)},
    })
    env = {"POD_NAME": pod_name, "POD_NAMESPACE": ns, "NODE_NAME": "node-0", "GPU_WATCHDOG_TOKEN": "",
           "GPU_WATCHDOG_WORKLOAD": "", "PYTHONPROFILEIMPORTTIME": "1"}
    watchdog = spawn(["run", "--config", str(config)], tmp_path / "watchdog.log", env=env)
    base = f"http://127.0.0.1:{wport}"

    def asked(part: str) -> bool:
        return any(str(req.method).upper().endswith("GET") and part in req.url.path for req in kmock)

    try:
        await asyncio.to_thread(wait_http, f"{base}/readyz", watchdog)
        loop = asyncio.get_running_loop()
        deadline = loop.time() + 30
        # The emulator serves from this loop: every wait yields to it.
        while not (asked(f"/pods/{pod_name}") and asked("/events") and asked("/leases/")):
            assert loop.time() < deadline, [f"{req.method} {req.url.path}" for req in kmock]
            await asyncio.sleep(0.1)
        await asyncio.sleep(6)  # every loop many times, the quarantine's Lease read (5 s) again
        samples = []
        for _ in range(5):
            samples.append(rss_bytes(watchdog.proc.pid))
            await asyncio.sleep(0.5)
        native = mapped_packages(watchdog.proc.pid)
        async with aiohttp.ClientSession() as http, http.get(f"{base}/status") as r:
            status = await r.json()
    finally:
        await asyncio.to_thread(watchdog.stop)
        await asyncio.to_thread(server.proc.stop)
    print(f"sidecar RSS, Kubernetes API configured: {max(samples) / 2**20:.1f} MiB"
          f" (samples {[s >> 20 for s in samples]} MiB)")
    log = watchdog.log()
    # It talked to the API: its workload from its pod's owner, the budget from the workload's Events.
    assert any(e.get("event") == "workload" and e.get("workload") == deploy_name
               and e.get("source") == "ownerReferences" for e in json_lines(log)), log[-3000:]
    budget = status["restart_budget"]
    assert (budget["scope"], budget["workload"], budget["read_error"]) == ("workload", deploy_name, None), \
        json.dumps(budget)
    assert max(samples) <= KUBERNETES_MODE_LIMIT, [s >> 20 for s in samples]
    assert not native & {"google", "pydantic_core", "rpds", "charset_normalizer", "grpc"}, native
    imported = imported_packages(log)
    assert "urllib3" in imported and not imported & set(KUBERNETES_CLIENT), sorted(imported & set(KUBERNETES_CLIENT))
