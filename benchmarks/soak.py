"""Chaos soak: steady client load on `gpu-watchdog up --fault-injection` while faults land at random moments.

Usage: python -m gpu_watchdog.benchmarks.soak [--duration 600] [--clients 6] [--seed 1]

What it proves (and prints): every request ends in a correct completion for *its* prompt (none lost,
none duplicated, none answered with another request's text); every restart carries the reason of
the fault that caused it and none happens without one; the restart budget holds; the model serves
again after each restart within a measured bound; a stream cut by a restart ends with an error
(an error event or a broken transfer), never silently.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import json
import os
import random
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import yaml

from gpu_watchdog.benchmarks._procs import ROOT, free_port
from gpu_watchdog.benchmarks.loadgen import backoff_delay

RESTART_FAULTS = {"context_loss": "context_loss", "hang": "hang"}
SOFT_FAULTS = ("oom", "fragmentation", "slow")
# Short prompts for plain requests; the last ones are long generations, used for streams, so that
# a restart has something to cut.
PROMPTS = [(f"soak prompt {k}: " + "abcdefghij"[: k % 10], 4 + k % 7) for k in range(40)]
PROMPTS += [(f"soak stream {k}", 120 + 10 * k) for k in range(8)]
STREAMED = range(40, len(PROMPTS))


@dataclass
class SoakSettings:
    duration_s: float = 60.0
    clients: int = 6
    seed: int = 1
    restart_faults: tuple[str, ...] = ("context_loss", "hang")
    soft_faults: int = 4
    stream_share: float = 0.25
    try_timeout_s: float = 10.0
    request_deadline_s: float = 120.0
    workdir: Path = field(default_factory=lambda: ROOT / "benchmarks" / "results" / "logs")


@dataclass
class SoakReport:
    sent: int = 0
    completed: int = 0
    retries: int = 0
    lost: int = 0
    wrong: int = 0
    duplicated: int = 0
    silent_truncations: int = 0
    stream_error_events: int = 0
    stream_transport_cuts: int = 0
    statuses: collections.Counter[str] = field(default_factory=collections.Counter)
    faults: list[tuple[float, str]] = field(default_factory=list)
    restarts: list[dict[str, Any]] = field(default_factory=list)
    serve_again_s: list[float] = field(default_factory=list)
    detect_s: list[float] = field(default_factory=list)
    budget: int = 0
    budget_remaining_end: float | None = None
    exit_code: int | None = None

    def restart_reasons(self) -> collections.Counter[str]:
        return collections.Counter(r["reason"] for r in self.restarts)

    def summary(self) -> str:
        longest = max(self.serve_again_s) if self.serve_again_s else None
        return "\n".join([
            "chaos soak summary",
            f"  requests sent {self.sent}, completed correctly {self.completed}, retries {self.retries}",
            f"  lost {self.lost}, wrong text {self.wrong}, duplicated {self.duplicated},"
            f" silently truncated streams {self.silent_truncations}",
            f"  streams cut: {self.stream_error_events} with an error event, {self.stream_transport_cuts} by a broken"
            f" transfer",
            f"  retried answers: {dict(self.statuses)}",
            f"  faults injected: {collections.Counter(k for _, k in self.faults)}",
            f"  restarts by reason: {dict(self.restart_reasons())} (budget {self.budget},"
            f" remaining at the end {self.budget_remaining_end})",
            f"  fault -> restart decision: {[round(x, 2) for x in self.detect_s]} s",
            f"  restart decision -> serving again: {[round(x, 2) for x in self.serve_again_s]} s"
            f" (longest {longest and round(longest, 2)} s)",
            f"  up exited with {self.exit_code}",
        ])


async def _complete(session: aiohttp.ClientSession, api: str, rid: str, k: int, stream: bool,
                    timeout: float) -> tuple[str, str | None]:
    """One try. Returns (outcome, text): ok | retry:<why> | silent_truncation | wrong_id."""
    prompt, max_tokens = PROMPTS[k]
    body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": stream}
    async with session.post(api + "/v1/completions", json=body, headers={"X-Request-Id": rid},
                            timeout=aiohttp.ClientTimeout(total=timeout)) as resp:
        if resp.status != 200:
            await resp.read()
            return f"retry:{resp.status}", resp.headers.get("Retry-After")
        if not stream:
            data = await resp.json()
            if data["id"] != f"cmpl-{rid}":
                return "wrong_id", None
            return "ok", data["choices"][0]["text"]
        parts: list[str] = []
        done = False
        async for raw in resp.content:
            line = raw.decode().strip()
            if not line.startswith("data: "):
                continue
            payload = line[6:]
            if payload == "[DONE]":
                done = True
                break
            event = json.loads(payload)
            if "error" in event:
                return "retry:stream_error_event", None
            if event["id"] != f"cmpl-{rid}":
                return "wrong_id", None
            parts.append(event["choices"][0]["text"])
        if not done:
            return "silent_truncation", None
        return "ok", "".join(parts)


async def _client(session: aiohttp.ClientSession, api: str, s: SoakSettings, rng: random.Random,
                  expected: dict[int, str], report: SoakReport, seen: collections.Counter[str], ids: Any,
                  stop_at: float) -> None:
    loop = asyncio.get_running_loop()
    while loop.time() < stop_at:
        n = next(ids)
        rid = f"soak-{n}"
        stream = rng.random() < s.stream_share
        k = rng.choice(STREAMED) if stream else rng.randrange(40)
        report.sent += 1
        deadline = loop.time() + s.request_deadline_s
        attempt = 0
        while True:
            retry_after = None
            try:
                outcome, text = await _complete(session, api, rid, k, stream, s.try_timeout_s)
            except (aiohttp.ClientPayloadError, aiohttp.ServerDisconnectedError) as exc:
                outcome, text = f"retry:{type(exc).__name__}", None
                if stream:
                    report.stream_transport_cuts += 1
            except (aiohttp.ClientError, TimeoutError) as exc:
                outcome, text = f"retry:{type(exc).__name__}", None
            if outcome == "ok":
                if text != expected[k]:
                    report.wrong += 1
                seen[rid] += 1
                report.completed += 1 if text == expected[k] else 0
                break
            if outcome == "silent_truncation":
                report.silent_truncations += 1
                outcome = "retry:silent_truncation"
            if outcome == "wrong_id":
                report.wrong += 1
                break
            if outcome == "retry:stream_error_event":
                report.stream_error_events += 1
            if outcome.startswith("retry:") and text is not None:
                retry_after = text
            report.statuses[outcome[6:]] += 1
            if loop.time() >= deadline:
                report.lost += 1
                break
            report.retries += 1
            await asyncio.sleep(min(backoff_delay(min(attempt, 5), 0.2, retry_after), 5.0))
            attempt += 1


async def _watch(session: aiohttp.ClientSession, url: str) -> dict[str, Any]:
    async with session.get(url + "/status", timeout=aiohttp.ClientTimeout(total=5)) as r:
        data: dict[str, Any] = await r.json()
        return data


async def _ready(session: aiohttp.ClientSession, url: str) -> bool:
    try:
        async with session.get(url + "/readyz", timeout=aiohttp.ClientTimeout(total=2)) as r:
            return r.status == 200
    except (aiohttp.ClientError, TimeoutError):
        return False


async def _serving(session: aiohttp.ClientSession, api: str) -> bool:
    try:
        async with session.post(api + "/v1/completions", json={"prompt": "probe", "max_tokens": 1},
                                timeout=aiohttp.ClientTimeout(total=5)) as r:
            return r.status == 200
    except (aiohttp.ClientError, TimeoutError):
        return False


async def _injector(session: aiohttp.ClientSession, s: SoakSettings, rng: random.Random, control: str, wd: str,
                    api: str, token: str, report: SoakReport, stop_at: float) -> None:
    loop = asyncio.get_running_loop()
    schedule = list(s.restart_faults) + [rng.choice(SOFT_FAULTS) for _ in range(s.soft_faults)]
    rng.shuffle(schedule)
    gap = max(2.0, (stop_at - loop.time()) / (len(schedule) + 1))
    headers = {"Authorization": f"Bearer {token}"}
    for kind in schedule:
        await asyncio.sleep(rng.uniform(0.5 * gap, gap))
        while not await _ready(session, wd):
            await asyncio.sleep(0.2)
        before = len((await _watch(session, wd))["restarts"])
        body: dict[str, Any] = {"kind": kind}
        if kind == "oom":
            body["count"] = 2
        elif kind == "slow":
            body["delay_s"] = 0.3
        async with session.post(control + "/control/fault", json=body, headers=headers) as r:
            assert r.status == 200, await r.text()
        t0 = loop.time()
        report.faults.append((t0, kind))
        if kind in RESTART_FAULTS:
            # The decision: the watchdog turns "restarting" (or has already finished one).
            while loop.time() - t0 < 90:
                status = await _watch(session, wd)
                if status["restart_in_progress"] or len(status["restarts"]) > before:
                    break
                await asyncio.sleep(0.05)
            t_restart = loop.time()
            report.detect_s.append(t_restart - t0)
            while not (await _ready(session, wd) and await _serving(session, api)):
                if loop.time() - t_restart > 120:
                    break
                await asyncio.sleep(0.05)
            report.serve_again_s.append(loop.time() - t_restart)
        elif kind == "slow":
            await asyncio.sleep(2.0)
            async with session.post(control + "/control/fault", json={"kind": "clear"}, headers=headers) as r:
                assert r.status == 200


def _config(budget: int) -> dict[str, Any]:
    return {
        "sampling": {"nvml_interval": "1s", "torch_interval": "300ms", "server_interval": "500ms"},
        "canary": {"interval": "500ms", "timeout": "3s"},
        "policy": {"memory_pressure": {"cooldown": "1s"},
                   "fragmentation": {"ratio": 0.3, "window": "10m", "empty_cache_attempts": 2},
                   "hang": {"consecutive_timeouts": 3},
                   "restart_budget": {"max_restarts": budget, "window": "1h"}},
        "restart": {"strategy": "local", "drain_timeout": "5s"},
    }


def _start_up(log_path: Path, cfg: Path, port: int, control_port: int, wport: int,
              token: str) -> tuple[subprocess.Popen[bytes], Any]:
    log = open(log_path, "wb")  # closed by run_soak
    up = subprocess.Popen([sys.executable, "-m", "gpu_watchdog", "up", "--fault-injection", "--device", "cpu", "--host",
                           "127.0.0.1", "--port", str(port), "--control-port", str(control_port), "--watchdog-port",
                           str(wport), "--config", str(cfg), "--queue-timeout", "5"], stdout=log,
                          stderr=subprocess.STDOUT, env={**os.environ, "GPU_WATCHDOG_TOKEN": token}, cwd=str(ROOT))
    return up, log


def _stop_up(up: subprocess.Popen[bytes]) -> int:
    up.send_signal(signal.SIGTERM)
    try:
        return up.wait(timeout=60)
    except subprocess.TimeoutExpired:
        up.kill()
        return up.wait()


async def run_soak(s: SoakSettings) -> SoakReport:
    rng = random.Random(s.seed)
    s.workdir.mkdir(parents=True, exist_ok=True)
    report = SoakReport(budget=len(s.restart_faults))
    cfg = s.workdir / f"soak-{os.getpid()}.yaml"
    cfg.write_text(yaml.safe_dump(_config(report.budget)))
    port, control_port, wport = free_port(), free_port(), free_port()
    token = f"soak-{port}"
    up, log = _start_up(s.workdir / f"soak-{os.getpid()}.log", cfg, port, control_port, wport, token)
    api, wd, control = f"http://127.0.0.1:{port}", f"http://127.0.0.1:{wport}", f"http://127.0.0.1:{control_port}"
    loop = asyncio.get_running_loop()
    try:
        async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as session:
            start = loop.time()
            while not await _ready(session, wd):
                if up.poll() is not None or loop.time() - start > 180:
                    raise RuntimeError(f"up did not become ready; see {log.name}")
                await asyncio.sleep(0.2)
            expected: dict[int, str] = {}
            for k, (prompt, max_tokens) in enumerate(PROMPTS):
                async with session.post(api + "/v1/completions", json={"prompt": prompt, "max_tokens": max_tokens,
                                                                        "temperature": 0}) as r:
                    expected[k] = (await r.json())["choices"][0]["text"]
            seen: collections.Counter[str] = collections.Counter()
            ids = iter(range(10**9))
            stop_at = loop.time() + s.duration_s
            clients = [_client(session, api, s, random.Random(s.seed * 1000 + i), expected, report, seen, ids,
                               stop_at) for i in range(s.clients)]
            await asyncio.gather(_injector(session, s, rng, control, wd, api, token, report, stop_at), *clients)
            report.duplicated = sum(1 for c in seen.values() if c > 1)
            status = await _watch(session, wd)
            report.restarts = status["restarts"]
            report.budget_remaining_end = status["restart_budget_remaining"]
    finally:
        report.exit_code = await asyncio.to_thread(_stop_up, up)
        log.close()
    return report


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--duration", type=float, default=600.0)
    p.add_argument("--clients", type=int, default=6)
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--soft-faults", type=int, default=12)
    a = p.parse_args()
    started = time.monotonic()
    report = asyncio.run(run_soak(SoakSettings(duration_s=a.duration, clients=a.clients, seed=a.seed,
                                               soft_faults=a.soft_faults)))
    print(report.summary())
    print(f"  wall time {time.monotonic() - started:.0f} s")
    out = ROOT / "benchmarks" / "results" / "soak.md"
    out.write_text("# Chaos soak\n\n```\n" + report.summary() + "\n```\n", encoding="utf-8")
    ok = report.lost == report.wrong == report.duplicated == report.silent_truncations == 0
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
