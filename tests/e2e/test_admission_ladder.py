"""The remedy ladder's first rung end to end: `up --fault-injection` on a simulated card that holds
4 sequences, a server started with 16 slots, 16 retrying clients. The watchdog lowers the limit
through the control API until OOMs become rare, never restarts, and climbs back after `clear`."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest
import requests

from tests.helpers import Proc, free_port, json_lines, metric, spawn, wait_http

CONFIG = """
sampling: {nvml_interval: 1s, torch_interval: 300ms, server_interval: 1s}
canary: {interval: 1s, timeout: 5s}
policy:
  memory_pressure: {cooldown: 1s}
  admission: {oom_threshold: 2, window: 10s, recover_after: 3s, max_wait: 12s}
restart: {strategy: evict, drain_timeout: 5s}
"""


class Clients:
    """Retrying clients: every request is sent until it gets its 200, waiting as Retry-After says."""

    def __init__(self, api: str, n: int) -> None:
        self.api, self.n = api, n
        self.stop = threading.Event()
        self.lock = threading.Lock()
        self.log: list[tuple[float, int]] = []  # (when, status) of every answer
        self.completed = self.lost = 0
        self.threads = [threading.Thread(target=self.run, daemon=True) for _ in range(n)]

    def run(self) -> None:
        with requests.Session() as s:
            while not self.stop.is_set():
                deadline = time.monotonic() + 120
                while True:
                    try:
                        r = s.post(self.api + "/v1/completions", json={"prompt": "ladder", "max_tokens": 8},
                                   timeout=60)
                        status = r.status_code
                    except requests.RequestException:
                        status = 0
                    with self.lock:
                        self.log.append((time.monotonic(), status))
                    if status == 200:
                        with self.lock:
                            self.completed += 1
                        break
                    if time.monotonic() > deadline:
                        with self.lock:
                            self.lost += 1
                        break
                    time.sleep(0.2)

    def __enter__(self) -> Clients:
        for t in self.threads:
            t.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop.set()
        for t in self.threads:
            t.join(timeout=130)

    def rates(self, start: float, end: float) -> dict[str, float]:
        with self.lock:
            window = [s for at, s in self.log if start <= at < end]
        seconds = max(1e-9, end - start)
        return {"answers": len(window), "ok_per_s": sum(s == 200 for s in window) / seconds,
                "rate_503": sum(s == 503 for s in window) / max(1, len(window))}


class Up:
    def __init__(self, tmp: Any, flags: list[str]) -> None:
        config = tmp / f"ladder-{flags[-1]}.yaml"
        config.write_text(CONFIG)
        port, control, self.wport = free_port(), free_port(), free_port()
        self.api, self.control = f"http://127.0.0.1:{port}", f"http://127.0.0.1:{control}"
        self.watchdog = f"http://127.0.0.1:{self.wport}"
        self.token = f"ladder-{port}"
        self.proc: Proc = spawn(["up", "--fault-injection", "--device", "cpu", "--host", "127.0.0.1", "--port",
                                 str(port), "--control-port", str(control), "--watchdog-port", str(self.wport),
                                 "--config", str(config), "--max-batch-size", "16", *flags],
                                tmp / f"up-{port}.log", env={"GPU_WATCHDOG_TOKEN": self.token})
        wait_http(self.watchdog + "/readyz", self.proc, timeout=120)

    def fault(self, kind: str, **params: object) -> None:
        r = requests.post(self.control + "/control/fault", json={"kind": kind, **params},
                          headers={"Authorization": f"Bearer {self.token}"}, timeout=10)
        assert r.status_code == 200, r.text

    def admission(self) -> dict[str, Any]:
        data: dict[str, Any] = requests.get(self.watchdog + "/status", timeout=10).json()["admission"]
        return data

    def ooms(self) -> float:
        return metric(self.api + "/metrics", "gpu_inference_ooms_total") or 0.0


def throughput_by_hand(tmp: Any, seconds: float) -> dict[str, float]:
    """The same server started with the right limit (4) by hand, on the same simulated card."""
    stack = Up(tmp, ["--max-concurrency", "4"])
    try:
        stack.fault("memory_cap", sequences=4)
        with Clients(stack.api, 16) as clients:
            start = time.monotonic()
            time.sleep(seconds)
            return clients.rates(start + 2, time.monotonic())
    finally:
        stack.proc.stop()


@pytest.fixture
def up(tmp_path: Any) -> Iterator[Up]:
    stack = Up(tmp_path, ["--max-concurrency", "16"])
    try:
        yield stack
    finally:
        stack.proc.stop()


@pytest.mark.timeout(400)
def test_the_limit_settles_on_the_card_and_climbs_back_after_clear(up: Up, tmp_path: Any) -> None:
    assert up.admission()["limit"] == 16 and up.admission()["ceiling"] == 16
    ooms_start = up.ooms()
    up.fault("memory_cap", sequences=4)
    t0 = time.monotonic()
    with Clients(up.api, 16) as clients:
        settled_at = None
        while time.monotonic() - t0 < 15:
            if up.admission()["limit"] <= 4:
                settled_at = time.monotonic()
                break
            time.sleep(0.2)
        assert settled_at is not None, f"never settled: {up.admission()}"
        ooms_settled = up.ooms()
        ooms_before = ooms_settled - ooms_start
        limits = []
        while time.monotonic() - settled_at < 20:  # settled: only the spaced probes may still meet the cap
            limits.append(up.admission()["limit"])
            time.sleep(0.5)
        ooms_after = up.ooms() - ooms_settled
        limit = limits[-1]
        before = clients.rates(t0, settled_at)
        after = clients.rates(settled_at + 2, time.monotonic())
    assert clients.lost == 0 and clients.completed > 0
    # Settled on the card: probes go one step above a limit that held, and 5 never holds on a card
    # of 4 sequences (with the canary's own slot, even 4 sometimes meets the cap).
    assert 2 <= sorted(limits)[len(limits) // 2] <= 4 and max(limits) <= 5, limits
    # Every grow is one step (a probe); a probe that meets OOMs goes back to the limit it came from.
    changes = [(e["action"], e["detail"]["from"], e["detail"]["to"]) for e in json_lines(up.proc.log())
               if e.get("event") == "decision" and e.get("action") in ("shrink_admission", "grow_admission")]
    for (kind, frm, to), after_it in zip(changes, [*changes[1:], ("", 0, 0)], strict=True):
        if kind == "grow_admission":
            assert to == frm + 1, changes
            if after_it[0] == "shrink_admission":
                assert after_it[1:] == (to, frm), changes
    restarts = [metric(up.watchdog + "/metrics", "gpu_watchdog_restarts_total", {"reason": r}) for r in
                ("context_loss", "hang", "fragmentation_drift", "unservable")]
    assert restarts == [0.0, 0.0, 0.0, 0.0]
    downs = metric(up.watchdog + "/metrics", "gpu_watchdog_admission_changes_total", {"direction": "down"}) or 0
    assert downs >= 2  # 16 -> 8 -> 4 (or lower)
    # OOMs become rare: a few per failed probe, probes at least recover_after (3 s) apart.
    assert ooms_after <= 7 * 3, (ooms_after, changes)
    # The engine absorbs most OOMs itself (shrink and retry), so clients see few 503s even before the
    # limit settles; what settling changes is how often the card runs out of memory at all.
    oom_rate_before = ooms_before / max(0.1, settled_at - t0)
    assert ooms_after / 20.0 < oom_rate_before / 3, (ooms_before, ooms_after, settled_at - t0)
    assert after["rate_503"] < 0.05, (before, after)
    print(f"\nsettled in {settled_at - t0:.1f} s; limits over the next 20 s: {sorted(set(limits))}; before:"
          f" {before}; after: {after}; OOMs: {ooms_before:g} in the {settled_at - t0:.1f} s before settling,"
          f" {ooms_after:g} in the 20 s after")

    up.fault("clear")
    t1 = time.monotonic()
    while up.admission()["limit"] < 16 and time.monotonic() - t1 < 120:
        time.sleep(0.5)
    a = up.admission()
    assert a["limit"] == 16 and a["ceiling"] == 16, a
    ups = metric(up.watchdog + "/metrics", "gpu_watchdog_admission_changes_total", {"direction": "up"}) or 0
    assert ups >= 16 - limit  # one slot per step
    print(f"back to 16 in {time.monotonic() - t1:.1f} s ({ups:g} steps up in all)")
    up.proc.stop()
    by_hand = throughput_by_hand(tmp_path, 20.0)
    print(f"by hand at 4: {by_hand}; settled by the watchdog: {after}")
