"""Security by default: the control API is loopback-only and token-gated, processes need no writable
working directory, and SIGTERM drains instead of dropping requests."""

from __future__ import annotations

import shutil
import signal
import socket
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import requests
import yaml

from tests.helpers import ROOT, Proc, free_port, json_lines, start_server, wait_for, wait_http


def test_control_api_listens_on_loopback_only(tmp_path: Path) -> None:
    srv = start_server(tmp_path, "--host", "0.0.0.0")
    try:
        # Another local address: the public API answers there, the control API does not.
        assert requests.get(f"http://127.0.0.2:{srv.port}/healthz", timeout=5).status_code == 200
        with socket.socket() as s:
            s.settimeout(3)
            assert s.connect_ex(("127.0.0.2", srv.control_port)) != 0
        assert srv.ctl("GET", "/control/memory").status_code == 200
    finally:
        srv.proc.stop()


def _unshare_available() -> bool:
    if shutil.which("unshare") is None:
        return False
    probe = subprocess.run(["unshare", "-m", "true"], capture_output=True, timeout=10)
    return probe.returncode == 0


@pytest.mark.skipif(not _unshare_available(), reason="needs a mount namespace (unshare -m) to make a read-only mount")
def test_both_processes_run_with_read_only_working_directory_and_code(tmp_path: Path) -> None:
    ro = tmp_path / "ro"
    ro.mkdir()
    port, control, wport = free_port(), free_port(), free_port()
    token = "read-only-token"
    config = ro / "watchdog.yaml"
    config.write_text(yaml.safe_dump({
        "target": {"control_url": f"http://127.0.0.1:{control}", "token_file": None},
        "canary": {"interval": "500ms", "timeout": "2s"}, "sampling": {"torch_interval": "500ms"},
        "restart": {"strategy": "none"}, "server": {"host": "127.0.0.1", "port": wport},
    }))
    writable_tmp = tmp_path / "tmp"
    writable_tmp.mkdir()
    # A private mount namespace: the working directory, HOME and the project itself become read-only
    # (as with readOnlyRootFilesystem); only TMPDIR stays writable, like the chart's /tmp emptyDir.
    script = (
        f"mount --bind {ro} {ro} && mount -o remount,bind,ro {ro} && "
        f"mount --bind {ROOT} {ROOT} && mount -o remount,bind,ro {ROOT} && cd {ro} && "
        f"({sys.executable} -m gpu_watchdog serve --device cpu --host 127.0.0.1 --port {port} --control-port {control}"
        f" > {tmp_path}/serve.log 2>&1 &) && "
        f"exec {sys.executable} -m gpu_watchdog run --config {config} > {tmp_path}/run.log 2>&1"
    )
    env = {"PATH": "/usr/bin:/bin:/usr/sbin:/sbin", "HOME": str(ro), "TMPDIR": str(writable_tmp),
           "GPU_WATCHDOG_TOKEN": token, "PYTHONDONTWRITEBYTECODE": "1", "HF_HUB_OFFLINE": "1"}
    proc = subprocess.Popen(["unshare", "-m", "--propagation", "private", "sh", "-c", script], env=env,
                            start_new_session=True)
    handle = Proc(proc, tmp_path / "run.log")
    try:
        wait_http(f"http://127.0.0.1:{wport}/readyz", handle, timeout=120)
        r = requests.post(f"http://127.0.0.1:{port}/v1/completions", json={"prompt": "ro", "max_tokens": 4},
                          timeout=30)
        assert r.status_code == 200 and len(r.json()["choices"][0]["text"]) == 4
        assert requests.get(f"http://127.0.0.1:{wport}/status", timeout=5).json()["ready"] is True
        assert list(ro.iterdir()) == [config]  # nothing was written next to them
    finally:
        import os

        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(timeout=30)
    assert "Read-only file system" not in (tmp_path / "serve.log").read_text()


def test_sigterm_drains_in_flight_requests_before_exit(tmp_path: Path) -> None:
    srv = start_server(tmp_path, "--fault-injection", "--max-concurrency", "1")
    try:
        srv.fault("slow", delay_s=1.5)
        result: dict[str, requests.Response] = {}
        t = threading.Thread(target=lambda: result.setdefault("r", requests.post(
            srv.url + "/v1/completions", json={"prompt": "finish me", "max_tokens": 3}, timeout=30)))
        t.start()
        wait_for(lambda: srv.memory()["inflight"] == 1, 10, "request in flight")
        srv.proc.proc.send_signal(signal.SIGTERM)
        wait_for(lambda: requests.get(srv.url + "/readyz", timeout=2).status_code == 503, 5, "unready while draining")
        late = requests.post(srv.url + "/v1/completions", json={"prompt": "too late", "max_tokens": 3}, timeout=10)
        assert late.status_code == 503 and late.headers["Retry-After"]
        t.join(timeout=30)
        assert result["r"].status_code == 200
        assert len(result["r"].json()["choices"][0]["text"]) == 3
        assert srv.proc.proc.wait(timeout=30) == 0
        events = [e["event"] for e in json_lines(srv.proc.log())]
        assert "shutdown_drain" in events and "shutdown" in events
    finally:
        srv.proc.stop()

