"""restart.strategy container, in real processes: the verdict the inference container's liveness reads.

`gpu-watchdog serve` (CPU, fault injection) stands for the inference container and
`gpu-watchdog run` for the sidecar; the probe is the chart's own script, run with `sh` the way the
kubelet's exec probe runs it, against the serving process as the container's first process. The
kubelet's part, restarting a container whose liveness fails, is played by the test.
"""

from __future__ import annotations

import os
import signal
import subprocess
import time
from pathlib import Path
from typing import Any

import pytest
import requests
import yaml

from tests.helpers import ROOT, Proc, Server, free_port, spawn, wait_for, wait_http

pytestmark = pytest.mark.timeout(300)

PROBE = ROOT / "helm" / "gpu-watchdog" / "files" / "verdict-probe.sh"


def serve(tmp_path: Path, port: int, control_port: int, token: str, name: str) -> Server:
    proc = spawn(["serve", "--device", "cpu", "--host", "127.0.0.1", "--port", str(port), "--control-port",
                  str(control_port), "--fault-injection"], tmp_path / f"{name}.log",
                 env={"GPU_WATCHDOG_TOKEN": token})
    server = Server(port, control_port, token, proc)
    wait_http(server.url + "/readyz", proc)
    return server


def liveness(verdict: Path, container: Server) -> tuple[int, str]:
    """The chart's exec probe, with the serving process as the container's PID 1."""
    r = subprocess.run(["sh", "-c", PROBE.read_text()], capture_output=True, text=True, timeout=10,
                       env={**os.environ, "GPU_WATCHDOG_VERDICT_FILE": str(verdict),
                            "GPU_WATCHDOG_VERDICT_PID": str(container.proc.proc.pid)})
    return r.returncode, r.stdout


def sidecar(tmp_path: Path, target: Server, verdict: Path) -> tuple[Proc, str]:
    port = free_port()
    config: dict[str, Any] = {
        "target": {"control_url": target.control, "metrics_url": target.url + "/metrics"},
        "sampling": {"torch_interval": "1s", "server_interval": "1s"},
        "canary": {"interval": "1s", "timeout": "1s"},
        "policy": {"hang": {"consecutive_timeouts": 2}},
        "restart": {"strategy": "container", "verdict_file": str(verdict)},
        "kubernetes": {"pod_name": "", "namespace": ""},
        "server": {"host": "127.0.0.1", "port": port},
    }
    path = tmp_path / "watchdog.yaml"
    path.write_text(yaml.safe_dump(config))
    proc = spawn(["run", "--config", str(path)], tmp_path / "watchdog.log", env={"GPU_WATCHDOG_TOKEN": target.token})
    url = f"http://127.0.0.1:{port}"
    wait_http(url + "/readyz", proc, timeout=60)
    return proc, url


def test_a_hang_sets_the_verdict_a_restarted_container_clears_it_and_a_dead_sidecar_never_sets_it(
        tmp_path: Path) -> None:
    port, control_port, token = free_port(), free_port(), "container-rung-token"
    verdict = tmp_path / "verdict" / "restart"
    verdict.parent.mkdir()
    first = serve(tmp_path, port, control_port, token, "serve-1")
    wd, wd_url = sidecar(tmp_path, first, verdict)
    second: Server | None = None
    try:
        assert liveness(verdict, first)[0] == 0  # healthy: no verdict, the container lives
        first.fault("hang")
        wait_for(verdict.exists, 30, "the hang verdict")
        assert verdict.read_text().split()[1] == "hang"
        code, said = liveness(verdict, first)
        assert code == 1 and "hang" in said  # the kubelet would now restart the container in place
        status = requests.get(wd_url + "/status", timeout=5).json()
        [restart] = [d for d in status["last_decisions"] if d["action"] == "restart" and d["outcome"] == "done"]
        assert restart["reason"] == "hang"
        assert status["restarts"][-1]["rung"] == "container"
        # The kubelet's part: the container restarts in place, on the same ports.
        first.proc.proc.send_signal(signal.SIGKILL)
        first.proc.proc.wait()
        second = serve(tmp_path, port, control_port, token, "serve-2")
        # A verdict older than the new container never kills it, even before the sidecar clears it.
        assert liveness(verdict, second)[0] == 0
        wait_for(lambda: not verdict.exists(), 30, "the verdict cleared once the new container serves")
        wait_for(lambda: requests.get(wd_url + "/readyz", timeout=5).status_code == 200, 30, "ready again")
        restarts = requests.get(wd_url + "/metrics", timeout=5).text
        assert 'gpu_watchdog_restarts_total{reason="hang",rung="container"} 1.0' in restarts
        # A dead sidecar never sets it: the container is left alone, whatever happens to it.
        wd.proc.send_signal(signal.SIGKILL)
        wd.proc.wait()
        second.fault("hang")
        time.sleep(6.0)  # more than the two timeouts and the interval that decided it above
        assert not verdict.exists() and liveness(verdict, second)[0] == 0
    finally:
        wd.stop()
        first.proc.stop()
        if second is not None:
            second.proc.stop()
