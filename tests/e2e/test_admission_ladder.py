"""The remedy ladder's first rung end to end: `up --fault-injection` on a simulated card that holds
4 sequences, a server started with 16 slots and batch 16, 16 retrying clients. The watchdog lowers
the limit through the control API until OOMs become rare, never restarts, and climbs back after
`clear`.

On that card the canary's reserved row makes 4 a limit that fails only when a canary coincides
with a full batch, and 3 the highest that always holds: the ladder must settle between them, its
probes of 4 ever further apart. The property is checked twice in a row on one stack, the ladder
having forgotten the first run.
"""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import requests

from gpu_watchdog.watchdog.core.names import RESTART_REASONS
from tests.helpers import Proc, free_port, json_lines, metric, spawn, wait_http

CONFIG = """
sampling: {nvml_interval: 1s, torch_interval: 300ms, server_interval: 1s}
canary: {interval: 1s, timeout: 5s}
policy:
  memory_pressure: {cooldown: 1s}
  admission: {window: 30s, recover_after: 3s, max_wait: 40s}
restart: {strategy: evict, drain_timeout: 5s}
"""
FLOOD_S = 45.0
TAIL_S = 30.0  # the stretch at the end of the flood where OOMs must have become rare
BACK_S = 120.0


class Clients:
    """Retrying clients: every request is sent until it gets its 200, waiting as Retry-After says."""

    def __init__(self, api: str, n: int) -> None:
        self.api, self.n = api, n
        self.stop = threading.Event()
        self.lock = threading.Lock()
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


class Up:
    def __init__(self, tmp: Path) -> None:
        config = tmp / "ladder.yaml"
        config.write_text(CONFIG)
        port, control, wport = free_port(), free_port(), free_port()
        self.api, self.control = f"http://127.0.0.1:{port}", f"http://127.0.0.1:{control}"
        self.watchdog = f"http://127.0.0.1:{wport}"
        self.token = f"ladder-{port}"
        self.proc: Proc = spawn(["up", "--fault-injection", "--device", "cpu", "--host", "127.0.0.1", "--port",
                                 str(port), "--control-port", str(control), "--watchdog-port", str(wport),
                                 "--config", str(config), "--max-batch-size", "16", "--max-concurrency", "16"],
                                tmp / f"up-{port}.log", env={"GPU_WATCHDOG_TOKEN": self.token})
        wait_http(self.watchdog + "/readyz", self.proc, timeout=120)

    def fault(self, kind: str, **params: Any) -> None:
        r = requests.post(self.control + "/control/fault", json={"kind": kind, **params},
                          headers={"Authorization": f"Bearer {self.token}"}, timeout=10)
        assert r.status_code == 200, r.text

    def admission(self) -> dict[str, Any]:
        data: dict[str, Any] = requests.get(self.watchdog + "/status", timeout=10).json()["admission"]
        return data

    def ooms(self) -> float:
        return metric(self.api + "/metrics", "gpu_inference_ooms_total") or 0.0

    def changes(self) -> list[tuple[str, int, int]]:
        """The ladder's changes so far, from the watchdog's decision log: (action, from, to)."""
        return [(e["action"], e["detail"]["from"], e["detail"]["to"]) for e in json_lines(self.proc.log())
                if e.get("event") == "decision" and e.get("action") in ("shrink_admission", "grow_admission")]


class OomSeconds:
    """Which seconds of a stretch saw the server's OOM counter rise (polled every 0.2 s)."""

    def __init__(self, up: Up, t0: float) -> None:
        self.up, self.t0 = up, t0
        self.seconds: set[int] = set()
        self.total = 0.0
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self.run, daemon=True)

    def run(self) -> None:
        last = self.up.ooms()
        while not self.stop.wait(0.2):
            now = self.up.ooms()
            if now > last:
                self.seconds.add(math.floor(time.monotonic() - self.t0))
                self.total += now - last
            last = now

    def __enter__(self) -> OomSeconds:
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop.set()
        self.thread.join(timeout=10)


@pytest.fixture(scope="module")
def up(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Up]:
    """One stack for both runs (one start instead of two): back at 16, in full use and quiet
    for its longest remembered wait, the ladder forgets the run before, as a fresh one would."""
    stack = Up(tmp_path_factory.mktemp("ladder"))
    try:
        yield stack
    finally:
        stack.proc.stop()


def forgotten(up: Up, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        a = up.admission()
        if (a["limit"], a["ceiling"], a["base"], a["failed"]) == (16, 16, 16, []):
            return True
        time.sleep(0.5)
    return False


@pytest.mark.timeout(400)
@pytest.mark.parametrize("run", [1, 2])
def test_the_limit_settles_on_the_card_and_climbs_back_after_clear(up: Up, run: int) -> None:
    # The run before (if any) ended back at 16: in full use (more clients than slots, so that all 16
    # are taken at every sample) and quiet there for its longest remembered wait (max_wait at most),
    # the ladder forgets it.
    with Clients(up.api, 24):
        assert forgotten(up, 90), up.admission()
    earlier = len(up.changes())
    up.fault("memory_cap", sequences=4)
    t0 = time.monotonic()
    with Clients(up.api, 16) as clients, OomSeconds(up, t0) as ooms:
        limits: list[int] = []
        while time.monotonic() - t0 < FLOOD_S:
            limits.append(up.admission()["limit"])
            time.sleep(0.5)
        limit = up.admission()["limit"]
        tail = sorted(s for s in ooms.seconds if FLOOD_S - TAIL_S <= s < FLOOD_S)
        flood_ooms = ooms.total

        up.fault("clear")
        t1 = time.monotonic()
        # The ladder grows only while its limit is in full use. Sixteen clients barely fill 15
        # slots (a client between two requests leaves one free at a sample, more often the faster
        # the server answers), so demand is raised above the ceiling, as while forgetting.
        with Clients(up.api, 8):
            while up.admission()["limit"] < 16 and time.monotonic() - t1 < BACK_S:
                time.sleep(0.5)
            back = time.monotonic() - t1
            a = up.admission()
    changes = up.changes()[earlier:]
    print(f"\nrun {run}: OOMs in {len(tail)} of the last {TAIL_S:g} s of the flood ({flood_ooms:g} OOMs in"
          f" {FLOOD_S:g} s); limit after {FLOOD_S:g} s: {limit} (over the flood: {sorted(set(limits))}); back to 16"
          f" {back:.1f} s after the clear; changes: {changes}")

    assert 2 <= limit <= 4, (limit, changes)
    assert len(tail) <= 4, (tail, changes)
    assert a["limit"] == 16 and a["ceiling"] == 16, (a, changes)
    assert back <= BACK_S
    # No restart, and every request was answered in the end.
    restarts = [metric(up.watchdog + "/metrics", "gpu_watchdog_restarts_total", {"reason": r}) or 0.0
                for r in RESTART_REASONS]
    assert restarts == [0.0] * len(RESTART_REASONS)
    assert clients.lost == 0 and clients.completed > 0
    # Every grow is one step (a probe); a probe that meets an OOM goes back to the limit it came from.
    for (kind, frm, to), after in zip(changes, [*changes[1:], ("", 0, 0)], strict=True):
        if kind == "grow_admission":
            assert to == frm + 1, changes
            if after[0] == "shrink_admission":
                assert after[1:] == (to, frm), changes
