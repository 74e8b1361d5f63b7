"""Start and stop the project's own processes on loopback for the benchmark scenarios."""

from __future__ import annotations

import os
import platform
import random
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import requests

ROOT = Path(__file__).resolve().parent.parent


def _ephemeral_low() -> int:
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


_GIVEN: set[int] = set()


def free_port() -> int:
    """A loopback port nothing listens on, chosen below the kernel's ephemeral range: a port the
    kernel hands out (bind to 0) is the next one it gives an outgoing connection too, so a server
    told to listen there a moment later can find it taken by some client's socket."""
    return free_ports(1)


def free_ports(n: int) -> int:
    """The first of `n` consecutive free loopback ports (a server's workers' control ports)."""
    low = _ephemeral_low()
    for _ in range(500):
        base = random.randrange(10000, max(low - n, 10001))
        ports = range(base, base + n)
        if _GIVEN.intersection(ports):
            continue
        held: list[socket.socket] = []
        try:
            for port in ports:
                s = socket.socket()
                held.append(s)
                s.bind(("127.0.0.1", port))
        except OSError:
            continue
        finally:
            for s in held:
                s.close()
        _GIVEN.update(ports)
        return base
    raise RuntimeError(f"no {n} consecutive free loopback ports below {low}")


def stop_process(proc: subprocess.Popen[bytes], timeout: float) -> int | None:
    """SIGTERM, then SIGKILL after `timeout`; the exit code."""
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    return proc.returncode


@dataclass
class Running:
    proc: subprocess.Popen[bytes]
    log: Path

    def stop(self) -> None:
        stop_process(self.proc, 30.0)


def start(args: list[str], log: Path, env: dict[str, str] | None = None) -> Running:
    log.parent.mkdir(parents=True, exist_ok=True)
    fh = open(log, "wb")
    proc = subprocess.Popen([sys.executable, "-m", "gpu_watchdog", *args], stdout=fh, stderr=subprocess.STDOUT,
                            env={**os.environ, **(env or {})}, cwd=str(ROOT))
    return Running(proc, log)


def wait_ok(url: str, running: Running, timeout: float = 180.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if running.proc.poll() is not None:
            raise RuntimeError(f"process exited ({running.proc.returncode}); see {running.log}")
        try:
            if requests.get(url, timeout=2).status_code == 200:
                return
        except requests.RequestException:
            pass
        time.sleep(0.1)
    raise RuntimeError(f"{url} not ready after {timeout}s; see {running.log}")


@dataclass
class Endpoints:
    """Where one inference server listens, and its control token."""

    port: int
    control_port: int
    token: str

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def control(self) -> str:
        return f"http://127.0.0.1:{self.control_port}"


@dataclass
class Server(Endpoints):
    running: Running


def serve(flags: list[str], log: Path) -> Server:
    port, control = free_port(), free_port()
    token = f"bench-{port}"
    running = start(["serve", "--host", "127.0.0.1", "--port", str(port), "--control-port", str(control), *flags],
                    log, env={"GPU_WATCHDOG_TOKEN": token})
    wait_ok(f"http://127.0.0.1:{port}/readyz", running)
    return Server(port, control, token, running)


def machine() -> str:
    cpu = platform.processor() or platform.machine()
    vector = ""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
            elif line.startswith("flags") and not vector:
                # Which vector units the CPU has decides which of vLLM's CPU kernel builds runs.
                flags = set(line.split(":", 1)[1].split())
                vector = (", AVX-512 with bf16" if "avx512_bf16" in flags else ", AVX-512" if "avx512f" in flags
                          else ", AVX2, no AVX-512" if "avx2" in flags else "")
    except OSError:
        pass
    cpu += vector
    mem = ""
    try:
        kb = int(Path("/proc/meminfo").read_text().split()[1])
        mem = f", {kb / 2**20:.0f} GiB RAM"
    except (OSError, ValueError, IndexError):
        pass
    import torch

    gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "no GPU (CPU run)"
    return (f"{os.cpu_count()} CPU cores ({cpu}){mem}; {gpu}; Python {platform.python_version()},"
            f" torch {torch.__version__}")
