"""The watchdog next to a real vLLM (its CPU build): busy is not hung, a stopped engine is.

Scenarios, each against a real `vllm.entrypoints.openai.api_server` serving a tiny generated model:
- saturation: few sequence slots, many clients; counts the watchdog's restart decisions (must be
  0) and the share of time its `/readyz` answered 200;
- engine stopped: the API process stays up (its `/health` stays 200) while its engine process is
  frozen with SIGSTOP; the time until the watchdog decides `hang`, with short settings and at
  the defaults.

Usage: python -m gpu_watchdog.benchmarks.peer_vllm [--vllm-python PATH] [--defaults]
Writes benchmarks/results/peer_vllm.md. The tests run the same scenarios with short settings.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import tempfile
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import requests
import yaml

from gpu_watchdog.benchmarks._procs import ROOT, Running, free_port, machine, start, stop_process

SERVED_NAME = "tiny"


def vllm_python() -> Path | None:
    """The vLLM venv's interpreter: $GPU_WATCHDOG_VLLM_PYTHON, else `make vllm`'s .venv-vllm."""
    configured = os.environ.get("GPU_WATCHDOG_VLLM_PYTHON")
    path = Path(configured) if configured else ROOT / ".venv-vllm" / "bin" / "python"
    return path if path.exists() else None


def make_tiny_model(directory: Path) -> Path:
    from gpu_watchdog.benchmarks.make_model import make

    if not (directory / "config.json").exists():
        make(directory, hidden=256, layers=4, heads=4, vocab=2048, context=1024, seed=0)
    return directory


@dataclass
class Vllm:
    proc: subprocess.Popen[bytes]
    port: int
    log: Path

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def engine_pids(self) -> list[int]:
        """Every process below the API server: the engine core and its worker."""
        found: list[int] = []
        frontier = [self.proc.pid]
        while frontier:
            parent = frontier.pop()
            for entry in Path("/proc").iterdir():
                if not entry.name.isdigit():
                    continue
                try:
                    ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
                except (OSError, IndexError, ValueError):
                    continue
                if ppid == parent:
                    found.append(int(entry.name))
                    frontier.append(int(entry.name))
        return found

    def stop(self) -> None:
        for pid in self.engine_pids():
            try:
                os.kill(pid, signal.SIGCONT)
            except ProcessLookupError:
                pass
        stop_process(self.proc, 30.0)


def start_vllm(python: Path, model: Path, workdir: Path, max_num_seqs: int | None, timeout: float = 300.0,
               eager: bool = True) -> Vllm:
    """vLLM on loopback; `max_num_seqs=None, eager=False` is vLLM at its defaults (compiled graphs)."""
    port = free_port()
    workdir.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "VLLM_NO_USAGE_STATS": "1", "VLLM_CPU_KVCACHE_SPACE": "1",
           "VLLM_CACHE_ROOT": str(workdir / "cache"), "TORCHINDUCTOR_CACHE_DIR": str(workdir / "inductor"),
           "TMPDIR": str(workdir)}
    log = workdir / f"vllm-{port}.log"
    fh = open(log, "wb")
    proc = subprocess.Popen(
        [str(python), "-m", "vllm.entrypoints.openai.api_server", "--model", str(model), "--served-model-name",
         SERVED_NAME, "--dtype", "float32", "--max-model-len", "512",
         *([] if max_num_seqs is None else ["--max-num-seqs", str(max_num_seqs)]),
         *(["--enforce-eager"] if eager else []), "--host", "127.0.0.1", "--port", str(port)],
        stdout=fh, stderr=subprocess.STDOUT, env=env, cwd=str(workdir))
    server = Vllm(proc, port, log)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"vLLM exited ({proc.returncode}):\n{log.read_text(errors='replace')[-3000:]}")
        try:
            if requests.get(server.url + "/v1/models", timeout=2).status_code == 200:
                return server
        except requests.RequestException:
            pass
        time.sleep(0.5)
    server.stop()
    raise RuntimeError(f"vLLM not up within {timeout}s; see {log}")


def watchdog_config(openai_url: str, short: bool = True, **target: Any) -> dict[str, Any]:
    config: dict[str, Any] = {
        "target": {"openai_url": openai_url, **target},
        "restart": {"strategy": "none"},  # report only: the decisions are what is measured
        "server": {"host": "127.0.0.1", "port": free_port()},
    }
    if short:
        config["sampling"] = {"server_interval": "1s"}
        config["canary"] = {"interval": "2s", "timeout": "1s"}
    return config


@contextmanager
def watchdog(config: dict[str, Any], workdir: Path, ready_timeout: float = 60.0) -> Iterator[tuple[Running, str]]:
    workdir.mkdir(parents=True, exist_ok=True)
    port = config["server"]["port"]
    path = workdir / f"watchdog-{port}.yaml"
    path.write_text(yaml.safe_dump(config))
    running = start(["run", "--config", str(path)], workdir / f"watchdog-{port}.log")
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + ready_timeout
        while time.monotonic() < deadline:
            if running.proc.poll() is not None:
                raise RuntimeError(f"watchdog exited: {running.log.read_text(errors='replace')[-3000:]}")
            try:
                if requests.get(url + "/readyz", timeout=2).status_code == 200:
                    break
            except requests.RequestException:
                pass
            time.sleep(0.1)
        else:
            raise RuntimeError(f"watchdog not ready within {ready_timeout:g}s:"
                               f" {running.log.read_text(errors='replace')[-3000:]}")
        yield running, url
    finally:
        running.stop()


def decisions(log: Path, action: str = "restart") -> list[dict[str, Any]]:
    """The watchdog's decision log lines for `action`."""
    out = []
    for line in log.read_text(errors="replace").splitlines():
        if line.startswith("{"):
            try:
                entry = json.loads(line)
            except ValueError:
                continue
            if entry.get("event") == "decision" and entry.get("action") == action:
                out.append(entry)
    return out


@dataclass
class Flood:
    """Many clients sending completions in a loop until stopped."""

    url: str
    clients: int
    max_tokens: int
    sent: int = 0
    ok: int = 0
    tokens: int = 0
    _stop: threading.Event = field(default_factory=threading.Event)
    _threads: list[threading.Thread] = field(default_factory=list)
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def _client(self) -> None:
        with requests.Session() as session:
            while not self._stop.is_set():
                body: dict[str, Any] = {"model": SERVED_NAME, "prompt": "the quick brown fox",
                                        "max_tokens": self.max_tokens, "temperature": 0, "ignore_eos": True}
                try:
                    r = session.post(self.url + "/v1/completions", json=body, timeout=120)
                    good = r.status_code == 200
                    n = r.json()["usage"]["completion_tokens"] if good else 0
                except (requests.RequestException, ValueError, KeyError):
                    good, n = False, 0
                with self._lock:
                    self.sent += 1
                    self.ok += good
                    self.tokens += n

    def __enter__(self) -> Flood:
        self._threads = [threading.Thread(target=self._client, daemon=True) for _ in range(self.clients)]
        for t in self._threads:
            t.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        for t in self._threads:
            t.join(timeout=130)


def saturation(server: Vllm, workdir: Path, clients: int, seconds: float, short: bool = True) -> dict[str, Any]:
    """Flood the server while the watchdog watches; its restart decisions and readiness."""
    config = watchdog_config(server.url + "/v1", short=short)
    with watchdog(config, workdir) as (wd, url):
        polls = ready = 0
        saturated_seen = False
        probe_s: list[float] = []
        with Flood(server.url, clients, max_tokens=64) as flood:
            deadline = time.monotonic() + seconds
            while time.monotonic() < deadline:
                try:
                    polls += 1
                    sent = time.monotonic()
                    ready += requests.get(url + "/readyz", timeout=2).status_code == 200
                    probe_s.append(time.monotonic() - sent)
                    states = requests.get(url + "/status", timeout=2).json()["states"]
                    saturated_seen = saturated_seen or "saturated" in states
                except requests.RequestException:
                    pass
                time.sleep(0.2)
            status = requests.get(url + "/status", timeout=5).json()
        metrics = requests.get(url + "/metrics", timeout=5).text
    timeouts = sum(float(line.split()[-1]) for line in metrics.splitlines()
                   if line.startswith('gpu_watchdog_canary_failures_total{error_class="timeout"}'))
    return {"clients": clients, "seconds": seconds, "requests_ok": flood.ok, "requests_sent": flood.sent,
            "generated_tokens_per_s": round(flood.tokens / seconds, 1), "restart_decisions": len(decisions(wd.log)),
            "ready_share": round(ready / max(1, polls), 4), "canary_timeouts": timeouts,
            "saturated_seen": saturated_seen, "status_states": status["states"],
            "progress_unknown_seen": bool(_counter(metrics, "gpu_watchdog_progress_unknown_episodes_total")),
            "loop_lag": status.get("event_loop_lag_s"),
            "readyz_p99_s": round(sorted(probe_s)[int(0.99 * (len(probe_s) - 1))], 4) if probe_s else None}


def _counter(metrics: str, name: str) -> float:
    return sum(float(line.split()[-1]) for line in metrics.splitlines() if line.startswith(name + " "))


def engine_stop(server: Vllm, workdir: Path, short: bool = True, busy: bool = False) -> dict[str, Any]:
    """Freeze the engine (the API stays up) and time the watchdog's `hang` decision."""
    config = watchdog_config(server.url + "/v1", short=short)
    pids = server.engine_pids()
    with watchdog(config, workdir) as (wd, _url):
        time.sleep(3.0)  # let it see the server serve and read its metrics
        flood = Flood(server.url, 4, max_tokens=256) if busy else None
        if flood is not None:
            flood.__enter__()
            time.sleep(2.0)
        health = requests.get(server.url + "/health", timeout=5).status_code
        stopped_at = time.time()
        for pid in pids:
            os.kill(pid, signal.SIGSTOP)
        try:
            limit = 30.0 if short else 240.0
            deadline = time.monotonic() + limit
            found: list[dict[str, Any]] = []
            while time.monotonic() < deadline and not found:
                time.sleep(0.2)
                found = decisions(wd.log)
            health_stopped = requests.get(server.url + "/health", timeout=5).status_code
        finally:
            for pid in pids:
                os.kill(pid, signal.SIGCONT)
            if flood is not None:
                flood._stop.set()
    if not found:
        return {"decided": False, "health_before": health, "health_while_stopped": health_stopped}
    from datetime import datetime

    decided_at = datetime.fromisoformat(found[0]["timestamp"].replace("Z", "+00:00")).timestamp()
    canary = config.get("canary", {"interval": "30s", "timeout": "10s"})
    return {"decided": True, "reason": found[0]["reason"], "seconds": round(decided_at - stopped_at, 2),
            "detail": found[0]["detail"], "busy": busy, "health_before": health,
            "health_while_stopped": health_stopped, "canary": canary}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--vllm-python", type=Path, default=None)
    p.add_argument("--defaults", action="store_true", help="also time the engine stop at the default settings")
    p.add_argument("--clients", type=int, default=96)
    p.add_argument("--seconds", type=float, default=40.0)
    p.add_argument("--runs", type=int, default=5, help="saturation runs in a row")
    a = p.parse_args()
    python = a.vllm_python or vllm_python()
    if python is None:
        raise SystemExit("no vLLM venv: run `make vllm` or pass --vllm-python")
    with tempfile.TemporaryDirectory(prefix="peer-vllm-") as tmp:
        work = Path(tmp)
        model = make_tiny_model(work / "model")
        server = start_vllm(python, model, work / "vllm", max_num_seqs=8)
        try:
            sats = [saturation(server, work / "wd", a.clients, a.seconds) for _ in range(a.runs)]
            idle = engine_stop(server, work / "wd")
            busy = engine_stop(server, work / "wd", busy=True)
            default = engine_stop(server, work / "wd", short=False) if a.defaults else None
        finally:
            server.stop()
    lines = [
        "# The watchdog next to a real vLLM", "",
        f"Machine: {machine()}. vLLM CPU build, tiny generated model, `--max-num-seqs 8`.", "",
        "## Saturation (busy is not hung)", "",
        f"{a.clients} clients for {a.seconds:g} s, canary every 2 s with a 1 s timeout, 3 timeouts make a hang,"
        " server metrics every 1 s; each run a fresh watchdog:", "",
        "| run | restart decisions | /readyz 200 share | /readyz p99 | loop lag p99 | canary timeouts |"
        " saturated / progress unknown seen | requests ok | tokens/s |",
        "|---|---|---|---|---|---|---|---|---|",
        *[f"| {i + 1} | {sat['restart_decisions']} | {sat['ready_share']:.1%} | {sat['readyz_p99_s']} s |"
          f" {(sat['loop_lag'] or {}).get('p99_s')} s | {sat['canary_timeouts']:g} |"
          f" {sat['saturated_seen']} / {sat['progress_unknown_seen']} | {sat['requests_ok']}/{sat['requests_sent']} |"
          f" {sat['generated_tokens_per_s']} |" for i, sat in enumerate(sats)],
        "", "## Engine stopped (API alive, `/health` 200)", "",
        "| case | canary interval / timeout | decision | seconds from SIGSTOP | /health while stopped |",
        "|---|---|---|---|---|",
    ]
    for name, r in (("idle, short settings", idle), ("busy, short settings", busy), ("idle, defaults", default)):
        if r is None:
            continue
        c = r.get("canary", {})
        lines.append(f"| {name} | {c.get('interval')} / {c.get('timeout')} | {r.get('reason', 'none')} |"
                     f" {r.get('seconds', '-')} | {r['health_while_stopped']} |")
    out = ROOT / "benchmarks" / "results" / "peer_vllm.md"
    out.write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
