"""`gpu-watchdog up` as the end-to-end tests drive it: a sidecar config with short intervals, and the
stack's three addresses with the calls the tests make on them. Shared by the fault scenarios and the
handler scenario, so both drive the same stack the same way."""

from __future__ import annotations

import requests

from tests.helpers import Proc, metric

SHORT = """
sampling: {nvml_interval: 1s, torch_interval: 300ms}
canary: {interval: 300ms, timeout: 1s}
policy:
  memory_pressure: {cooldown: 1s}
  fragmentation: {ratio: 0.3, window: 10m, empty_cache_attempts: 2}
  hang: {consecutive_timeouts: 3}
  restart_budget: {max_restarts: 3, window: 1h}
restart: {strategy: evict, drain_timeout: 5s}
"""


class Stack:
    def __init__(self, proc: Proc, port: int, control_port: int, watchdog_port: int) -> None:
        self.proc = proc
        self.api = f"http://127.0.0.1:{port}"
        self.control = f"http://127.0.0.1:{control_port}"
        self.watchdog = f"http://127.0.0.1:{watchdog_port}"
        self.token = ""

    def fault(self, kind: str, **params: object) -> None:
        r = requests.post(self.control + "/control/fault", json={"kind": kind, **params},
                          headers={"Authorization": f"Bearer {self.token}"}, timeout=10)
        assert r.status_code == 200, r.text

    def restarts(self, reason: str) -> float:
        return metric(self.watchdog + "/metrics", "gpu_watchdog_restarts_total", {"reason": reason}) or 0.0

    def flushes(self, reason: str) -> float:
        return metric(self.watchdog + "/metrics", "gpu_watchdog_empty_cache_total", {"reason": reason}) or 0.0

    def serving(self) -> bool:
        try:
            r = requests.post(self.api + "/v1/completions", json={"prompt": "are you there", "max_tokens": 3},
                              timeout=10)
        except requests.RequestException:
            return False
        return r.status_code == 200 and len(r.json()["choices"][0]["text"]) == 3

    def ready(self) -> bool:
        try:
            return requests.get(self.watchdog + "/readyz", timeout=5).status_code == 200
        except requests.RequestException:
            return False
