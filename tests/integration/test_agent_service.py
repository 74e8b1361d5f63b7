"""The FastAPI example with the in-process agent, watched by `gpu-watchdog run`: real processes on loopback."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import requests

from tests.helpers import ROOT, Proc, free_port, metric, spawn, spawn_python, wait_for, wait_http

TOKEN = "agent-e2e-token"

CONFIG = """
target:
  control_url: http://127.0.0.1:{control_port}
  token_file: null
  metrics_url: http://127.0.0.1:{port}/metrics
  progress_metric: gpu_inference_requests_total{{route="/predict",code="200"}}
sampling: {{nvml_interval: 1s, torch_interval: 300ms, server_interval: 500ms}}
canary: {{interval: 300ms, timeout: 1s}}
policy:
  memory_pressure: {{cooldown: 1s}}
  fragmentation: {{ratio: 0.3, window: 10m, empty_cache_attempts: 2}}
  hang: {{consecutive_timeouts: 3}}
  admission: {{oom_threshold: 2, window: 60s, recover_after: 10m}}
restart: {{strategy: none}}
server: {{host: 127.0.0.1, port: {watchdog_port}}}
"""


class Service:
    def __init__(self, app: Proc, watchdog: Proc, port: int, control_port: int, watchdog_port: int) -> None:
        self.app = app
        self.watchdog = watchdog
        self.api = f"http://127.0.0.1:{port}"
        self.control = f"http://127.0.0.1:{control_port}"
        self.wd = f"http://127.0.0.1:{watchdog_port}"

    def ctl(self, method: str, path: str, body: Any = None) -> requests.Response:
        return requests.request(method, self.control + path, json=body,
                                headers={"Authorization": f"Bearer {TOKEN}"}, timeout=10)

    def fault(self, kind: str, **params: Any) -> None:
        r = self.ctl("POST", "/control/fault", {"kind": kind, **params})
        assert r.status_code == 200, r.text

    def memory(self) -> dict[str, Any]:
        r = self.ctl("GET", "/control/memory")
        assert r.status_code == 200, r.text
        data: dict[str, Any] = r.json()
        return data

    def predict(self, text: str = "hello", timeout: float = 30) -> requests.Response:
        return requests.post(self.api + "/predict", json={"inputs": text, "max_new_tokens": 2}, timeout=timeout)

    def wd_metric(self, name: str, **labels: str) -> float:
        return metric(self.wd + "/metrics", name, labels) or 0.0


@pytest.fixture(scope="module")
def service(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Service]:
    tmp = tmp_path_factory.mktemp("agent")
    port, control_port, watchdog_port = free_port(), free_port(), free_port()
    env = {"GPU_WATCHDOG_TOKEN": TOKEN}
    app = spawn_python([str(ROOT / "examples/fastapi_service/app.py"), "--port", str(port),
                        "--control-port", str(control_port), "--fault-injection"], tmp / "app.log", env=env)
    config = tmp / "watchdog.yaml"
    config.write_text(CONFIG.format(port=port, control_port=control_port, watchdog_port=watchdog_port))
    watchdog: Proc | None = None
    try:
        wait_http(f"http://127.0.0.1:{port}/healthz", app, timeout=120)
        watchdog = spawn(["run", "--config", str(config)], tmp / "watchdog.log", env=env)
        s = Service(app, watchdog, port, control_port, watchdog_port)
        wait_http(s.wd + "/readyz", watchdog, timeout=60)
        yield s
    finally:
        if watchdog is not None:
            watchdog.stop()
        app.stop()


def test_repeated_ooms_are_flushed_then_admission_is_lowered(service: Service) -> None:
    # First in the module: an OOM seen within the cooldown of another flush is not flushed again.
    assert service.memory()["admission"]["limit"] == 4
    assert service.predict().status_code == 200
    assert service.wd_metric("gpu_watchdog_canary_success") == 1.0
    for _ in range(5):  # the canary takes an injected OOM now and then: it runs through the same gate
        service.fault("oom", count=1)
        r = service.predict()
        if r.status_code == 503:
            break
    assert r.status_code == 503 and r.headers.get("Retry-After") and r.json()["error"]["type"] == "out_of_memory"
    wait_for(lambda: service.wd_metric("gpu_watchdog_empty_cache_total", reason="oom") >= 1, 20,
             "an empty_cache for the OOM")
    for _ in range(6):
        service.fault("oom", count=2)
        assert {service.predict().status_code for _ in range(2)} <= {200, 503}
        try:
            wait_for(lambda: service.memory()["admission"]["limit"] < 4, 3, "a lower limit")
            break
        except AssertionError:
            continue
    assert service.memory()["admission"]["limit"] < 4
    assert service.wd_metric("gpu_watchdog_admission_changes_total", direction="down") >= 1
    assert service.memory()["ooms_caught"] >= 3
    # The sidecar scrapes /metrics all along: a scrape is not a request (it would pass for progress).
    assert metric(service.api + "/metrics", "gpu_inference_requests_total", {"route": "/metrics"}) is None
    assert service.predict().status_code == 200  # lowered, not broken


def test_the_sidecar_reads_the_allocator_figures(service: Service) -> None:
    status = requests.get(service.wd + "/status", timeout=10).json()
    assert "healthy" in str(status)
    # The allocator figures come through: an injected fragmentation shows in the sidecar's gauge,
    # and the sidecar's empty_cache (through the agent) cures it.
    service.fault("fragmentation", ratio=0.6)
    wait_for(lambda: service.wd_metric("gpu_watchdog_empty_cache_total", reason="fragmentation_drift") >= 1, 20,
             "an empty_cache for fragmentation drift")
    memory = wait_for(lambda: (m := service.memory())["faults"]["fragmentation"] is None and m, 10,
                      "the flush to cure the injected fragmentation")
    assert memory["empty_cache_count"] >= 1 and memory["injected"] is False


def test_an_injected_hang_is_decided_hang(service: Service) -> None:
    wait_for(lambda: service.wd_metric("gpu_watchdog_canary_success") == 1.0, 10, "a healthy canary")
    stuck: list[int] = []
    injected = time.monotonic()
    service.fault("hang")
    # A request inside the model hangs too; it is released by `clear`.
    threading.Thread(target=lambda: stuck.append(service.predict(timeout=60).status_code), daemon=True).start()
    wait_for(lambda: service.wd_metric("gpu_watchdog_decisions_total", action="restart", reason="hang") >= 1, 30,
             "a hang decision")
    print(f"hang decided {time.monotonic() - injected:.2f}s after injection (canary 300ms/1s, 3 timeouts)")
    service.fault("clear")
    wait_for(lambda: stuck == [200], 30, "the stuck request to finish after clear")


def test_a_sticky_cuda_error_poisons_and_exits_3(service: Service, tmp_path: Path) -> None:
    service.fault("context_loss")
    r = service.predict()
    assert r.status_code == 500 and r.json()["error"]["type"] == "fatal_cuda"
    code = service.app.proc.wait(timeout=30)
    assert code == 3, service.app.log()[-2000:]
    wait_for(lambda: service.wd_metric("gpu_watchdog_decisions_total", action="restart",
                                       reason="context_loss") >= 1, 10, "a context_loss decision")
