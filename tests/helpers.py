"""Test helpers: free ports, real processes on loopback (and their resident memory), waiting for readiness."""

from __future__ import annotations

import asyncio
import json
import os
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import requests

from gpu_watchdog.benchmarks._procs import Endpoints, free_port, stop_process

ROOT = Path(__file__).resolve().parent.parent


@dataclass
class Proc:
    proc: subprocess.Popen[bytes]
    log_path: Path
    extra: dict[str, Any] = field(default_factory=dict)

    def log(self) -> str:
        return self.log_path.read_text(encoding="utf-8", errors="replace") if self.log_path.exists() else ""

    def stop(self, timeout: float = 10.0) -> int | None:
        return stop_process(self.proc, timeout)


def spawn_python(argv: list[str], log_path: Path, env: dict[str, str] | None = None, cwd: Path | None = None) -> Proc:
    """`python ARGV...` in the repository, its output in `log_path`."""
    full_env = {**os.environ, **(env or {})}
    with open(log_path, "wb") as fh:
        proc = subprocess.Popen([sys.executable, *argv], stdout=fh, stderr=subprocess.STDOUT, env=full_env,
                                cwd=str(cwd or ROOT))
    return Proc(proc, log_path)


def spawn(args: list[str], log_path: Path, env: dict[str, str] | None = None, cwd: Path | None = None) -> Proc:
    """`gpu-watchdog ARGS...`."""
    return spawn_python(["-m", "gpu_watchdog", *args], log_path, env, cwd)


def wait_http(url: str, proc: Proc, timeout: float = 90.0, status: int = 200) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.proc.poll() is not None:
            code = proc.proc.returncode
            raise AssertionError(f"process exited with {code} before {url} was up:\n{proc.log()[-4000:]}")
        try:
            if requests.get(url, timeout=2).status_code == status:
                return
        except requests.RequestException:
            pass
        time.sleep(0.1)
    raise AssertionError(f"{url} not {status} within {timeout}s:\n{proc.log()[-4000:]}")


@dataclass
class Server(Endpoints):
    proc: Proc

    def auth(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.token}"}

    def ctl(self, method: str, path: str, body: Any = None, timeout: float = 30.0) -> requests.Response:
        return requests.request(method, self.control + path, json=body, headers=self.auth(), timeout=timeout)

    def memory(self) -> dict[str, Any]:
        r = self.ctl("GET", "/control/memory")
        assert r.status_code == 200, r.text
        data: dict[str, Any] = r.json()
        return data

    def fault(self, kind: str, **params: Any) -> None:
        r = self.ctl("POST", "/control/fault", {"kind": kind, **params})
        assert r.status_code == 200, r.text


def start_server(tmp_path: Path, *flags: str, env: dict[str, str] | None = None, name: str = "serve",
                 ports: tuple[int, int] | None = None, token: str | None = None) -> Server:
    """`serve` on free ports (or `ports` again: a container restarted in place), ready."""
    port, control_port = ports or (free_port(), free_port())
    token = token or f"test-token-{port}"
    proc = spawn(["serve", "--device", "cpu", "--host", "127.0.0.1", "--port", str(port),
                  "--control-port", str(control_port), *flags], tmp_path / f"{name}-{port}.log",
                 env={"GPU_WATCHDOG_TOKEN": token, **(env or {})})
    server = Server(port, control_port, token, proc)
    try:
        wait_http(server.url + "/readyz", proc)
    except BaseException:
        proc.stop()
        raise
    return server


def start_app(script: Path, tmp_path: Path, token: str, *flags: str, ready: str = "/healthz") -> Server:
    """A service of a user's kind (`script --port P --control-port C FLAGS...`), up and answering `ready`."""
    port, control_port = free_port(), free_port()
    proc = spawn_python([str(script), "--port", str(port), "--control-port", str(control_port), *flags],
                        tmp_path / f"{script.stem}-{port}.log", env={"GPU_WATCHDOG_TOKEN": token})
    try:
        wait_http(f"http://127.0.0.1:{port}{ready}", proc, timeout=120)
    except BaseException:
        proc.stop()
        raise
    return Server(port, control_port, token, proc)


def metric(url: str, name: str, labels: dict[str, str] | None = None) -> float | None:
    """The sum of the samples of `name` whose labels include `labels` (as PromQL's sum() over a
    selector), or None when there is none."""
    from prometheus_client.parser import text_string_to_metric_families

    text = requests.get(url, timeout=10).text
    values = [float(s.value) for family in text_string_to_metric_families(text) for s in family.samples
              if s.name == name and all(s.labels.get(k) == v for k, v in (labels or {}).items())]
    return sum(values) if values else None


def wait_for(predicate: Any, timeout: float, what: str, interval: float = 0.1) -> Any:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(interval)
    raise AssertionError(f"timed out after {timeout}s waiting for {what}")


async def async_wait(probe: Any, timeout: float, what: str) -> Any:
    """`wait_for` from inside the event loop, for a probe that is itself a coroutine."""
    deadline = asyncio.get_running_loop().time() + timeout
    while asyncio.get_running_loop().time() < deadline:
        found = await probe()
        if found:
            return found
        await asyncio.sleep(0.05)
    raise AssertionError(f"not within {timeout} s: {what}")


async def until(predicate: Any, timeout: float, what: str) -> None:
    """A plain predicate polled from the event loop, so what it reads (an in-process sidecar, the
    emulator) moves on between polls."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while not predicate():
        if loop.time() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        await asyncio.sleep(0.05)


def rss_bytes(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise AssertionError(f"no VmRSS for {pid}")


def json_lines(text: str) -> list[dict[str, Any]]:
    import json

    out = []
    for line in text.splitlines():
        if line.startswith("{"):
            try:
                out.append(json.loads(line))
            except ValueError:
                continue
    return out


def post_raw(srv: Server, path: str, body: Any, headers: dict[str, str] | None = None) -> socket.socket:
    """A POST written on a socket of its own, its answer not read: the test closes it to disconnect."""
    raw = json.dumps(body).encode()
    sock = socket.create_connection(("127.0.0.1", srv.port), timeout=10)
    extra = "".join(f"{k}: {v}\r\n" for k, v in (headers or {}).items())
    head = (f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n{extra}"
            f"Content-Length: {len(raw)}\r\n\r\n")
    sock.sendall(head.encode() + raw)
    return sock

