"""A service's workers as the tests reach them: `serve --workers N` started as a real process tree on
loopback, each worker's control API, and the sidecar settings that watch them all quickly. Shared by
the worker tests here, the SDK tests and the fleet's in-process workers, so all start and read a
tree the same way."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import requests
from prometheus_client.parser import text_string_to_metric_families

from gpu_watchdog.benchmarks._procs import free_port, free_ports
from gpu_watchdog.contract import MEMORY
from gpu_watchdog.watchdog.edge.config import Settings, from_mapping
from tests.fleet.harness import deep_merge
from tests.helpers import Proc, spawn, wait_for, wait_http

TOKEN = "workers-serve-token"
BODY = {"prompt": "hello workers", "max_tokens": 4}


def memory(port: int, token: str) -> dict[str, Any]:
    r = requests.get(f"http://127.0.0.1:{port}{MEMORY}", headers={"Authorization": f"Bearer {token}"}, timeout=5)
    assert r.status_code == 200, (port, r.status_code, r.text)
    return dict(r.json())


@dataclass
class Tree:
    port: int
    control: int
    workers: int
    proc: Proc

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def ctl(self, k: int, method: str, path: str, body: Any = None) -> requests.Response:
        return requests.request(method, f"http://127.0.0.1:{self.control + k}{path}", json=body,
                                headers={"Authorization": f"Bearer {TOKEN}"}, timeout=10)

    def memory(self, k: int) -> dict[str, Any]:
        r = self.ctl(k, "GET", MEMORY)
        assert r.status_code == 200, r.text
        return dict(r.json())

    def workers_view(self) -> list[dict[str, Any]]:
        return list(requests.get(self.url + "/healthz", timeout=5).json()["workers"])

    def complete(self) -> int:
        try:
            return requests.post(self.url + "/v1/completions", json=BODY, timeout=60).status_code
        except requests.RequestException:
            return -1


def start_tree(tmp_path: Path, workers: int, *flags: str) -> Tree:
    port, control = free_port(), free_ports(workers)
    proc = spawn(["serve", "--device", "cpu", "--host", "127.0.0.1", "--port", str(port), "--control-port",
                  str(control), "--workers", str(workers), *flags], tmp_path / f"workers-{port}.log",
                 env={"GPU_WATCHDOG_TOKEN": TOKEN})
    tree = Tree(port, control, workers, proc)
    try:
        wait_http(tree.url + "/readyz", proc, timeout=120)
        wait_for(lambda: all(w["ready"] for w in tree.workers_view()), 120, "every worker ready")
    except BaseException:
        proc.stop()
        raise
    return tree


def sidecar_settings(tree: Tree, verdict: Path, override: dict[str, Any] | None = None) -> Settings:
    """The sidecar watching every worker of `tree` quickly (canaries every 300 ms, a hang after two
    timeouts), restarting in place through `verdict`; `override` merged over it key by key."""
    return from_mapping(deep_merge({
        "target": {"control_url": f"http://127.0.0.1:{tree.control}", "token_file": None, "metrics_url": None,
                   "workers": tree.workers},
        "sampling": {"torch_interval": "200ms"}, "canary": {"interval": "300ms", "timeout": "1s"},
        "policy": {"hang": {"consecutive_timeouts": 2}},
        "restart": {"strategy": "container", "verdict_file": str(verdict)},
        "server": {"host": "127.0.0.1", "port": 0},
    }, override or {}))


def worker_requests(tree: Tree) -> dict[str, float]:
    text = requests.get(tree.url + "/metrics", timeout=10).text
    out: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name == "gpu_inference_requests_total" and s.labels.get("route") == "/v1/completions":
                out[s.labels["worker"]] = out.get(s.labels["worker"], 0.0) + s.value
    return out
