"""`serve --workers N` as a real process tree on loopback: N CPU workers behind one port, each with
its own gate and control API; a poisoned worker exits and is started again while the others serve,
and the sidecar decides for the watched worker alone."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
import requests
import structlog

from gpu_watchdog.benchmarks._procs import free_port, free_ports
from gpu_watchdog.watchdog.core.names import RUNG_WORKER
from gpu_watchdog.watchdog.edge.effects.restart import ContainerRestarter
from gpu_watchdog.watchdog.runtime.app import Watchdog
from tests.helpers import async_wait, json_lines, spawn, wait_for
from tests.integration.sidecar_stand_ins import NoNvml
from tests.integration.workers import TOKEN, Tree, sidecar_settings, start_tree, worker_requests


@pytest.fixture
def three(tmp_path: Path) -> Iterator[Tree]:
    tree = start_tree(tmp_path, 3, "--max-concurrency", "2", "--fault-injection")
    yield tree
    tree.proc.stop(timeout=40)


def test_a_flood_of_32_clients_is_spread_and_never_more_than_its_limit_inside_any_worker(three: Tree) -> None:
    with ThreadPoolExecutor(32) as pool:
        codes = list(pool.map(lambda _: three.complete(), range(96)))
    assert codes == [200] * 96
    peaks = [three.memory(k)["admission"]["peak_holders"] for k in range(3)]
    assert all(1 <= p <= 2 for p in peaks), peaks  # each worker's own gate, each at most its limit
    served = worker_requests(three)
    assert set(served) == {"0", "1", "2"} and all(v > 0 for v in served.values()), served
    assert sum(served.values()) == 96
    pids = {three.memory(k)["pid"] for k in range(3)}
    assert len(pids) == 3 and three.proc.proc.pid not in pids


def test_a_poisoned_worker_exits_and_is_started_again_while_the_others_answer(three: Tree) -> None:
    before = {w["worker"]: w for w in three.workers_view()}
    codes: list[int] = []
    stop = threading.Event()

    def client() -> None:
        while not stop.is_set():
            codes.append(three.complete())

    clients = [threading.Thread(target=client) for _ in range(8)]
    for t in clients:
        t.start()
    try:
        time.sleep(1.0)
        r = three.ctl(1, "POST", "/control/fault", {"kind": "context_loss"})
        assert r.status_code == 200, r.text
        wait_for(lambda: [w for w in three.workers_view() if w["worker"] == 1 and w["generation"] == 2 and w["ready"]],
                 120, "worker 1 started again and ready")
        time.sleep(1.0)
    finally:
        stop.set()
        for t in clients:
            t.join()
    after = {w["worker"]: w for w in three.workers_view()}
    assert after[1]["last_exit"] == 3 and after[1]["pid"] != before[1]["pid"] and after[1]["restarts"] == 1
    assert [after[k]["pid"] for k in (0, 2)] == [before[k]["pid"] for k in (0, 2)]  # the others never stopped
    failed = [c for c in codes if c != 200]
    # Only what was in flight on worker 1 when its context was lost: at most its limit.
    assert len(failed) <= 2 and len(codes) > 50, (failed, len(codes))
    assert three.complete() == 200
    text = requests.get(three.url + "/metrics", timeout=10).text
    assert 'gpu_inference_worker_restarts_total{gpu="",reason="context_lost",worker="1"} 1.0' in text
    log = json_lines(three.proc.log())
    exits = [e for e in log if e.get("event") == "worker_exited"]
    assert [(e["worker"], e["code"], e["reason"]) for e in exits] == [(1, 3, "context_lost")]
    poisoned = [e for e in log if e.get("event") == "fatal_cuda_error"]
    assert poisoned and all(e["worker"] == "1" for e in poisoned)  # each line names its worker


def test_a_stream_through_the_front_is_cancelled_in_its_worker_when_the_client_leaves(three: Tree) -> None:
    body = {"prompt": "stream me", "max_tokens": 400, "stream": True, "ignore_eos": True}
    with requests.post(three.url + "/v1/completions", json=body, stream=True, timeout=30) as r:
        assert r.status_code == 200 and r.headers["Content-Type"].startswith("text/event-stream")
        lines = r.iter_lines()
        first = next(line for line in lines if line)
        assert first.startswith(b"data: {")
        busy = wait_for(lambda: [k for k in range(3) if three.memory(k)["inflight"] > 0], 10, "a busy worker")
    wait_for(lambda: all(three.memory(k)["inflight"] == 0 for k in busy), 20, "the stream cancelled in its worker")


def test_a_worker_told_to_exit_leaves_with_75_and_comes_back(three: Tree) -> None:
    r = three.ctl(2, "POST", "/control/exit", {"reason": "test"})
    assert r.status_code == 202 and r.json() == {"exiting": True, "code": 75}
    wait_for(lambda: [w for w in three.workers_view() if w["worker"] == 2 and w["generation"] == 2 and w["ready"]],
             120, "worker 2 started again")
    assert {w["worker"]: w["last_exit"] for w in three.workers_view()}[2] == 75
    bad = three.ctl(0, "POST", "/control/exit", {"reason": 7})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "reason"


def test_a_worker_that_cannot_start_stops_the_server_with_a_message(tmp_path: Path) -> None:
    port, control = free_port(), free_ports(2)
    proc = spawn(["serve", "--device", "cpu", "--port", str(port), "--control-port", str(control), "--workers", "2",
                  "--handler", "no_such_module_here:Handler"], tmp_path / "bad.log", env={"GPU_WATCHDOG_TOKEN": TOKEN})
    try:
        assert proc.proc.wait(timeout=120) == 2
    finally:
        proc.stop()
    failed = [e for e in json_lines(proc.log()) if e.get("event") == "worker_failed"]
    assert failed and "could not start" in failed[0]["error"]


def test_a_bad_workers_flag_is_a_usage_error(tmp_path: Path) -> None:
    proc = spawn(["serve", "--workers", "0"], tmp_path / "usage.log")
    assert proc.proc.wait(timeout=60) == 2
    assert "argument --workers: must be a positive integer" in proc.log()


async def test_the_sidecar_decides_for_the_watched_worker_and_its_server_restarts_only_that_one(
        tmp_path: Path) -> None:
    tree = await asyncio.to_thread(start_tree, tmp_path, 2, "--max-concurrency", "2", "--fault-injection")
    verdict = tmp_path / "verdict"
    settings = sidecar_settings(tree, verdict)
    wd = Watchdog(settings, ContainerRestarter(str(verdict)), nvml_backend=NoNvml(), token=TOKEN)  # type: ignore[arg-type]
    await wd.start(serve_http=False)
    try:
        with structlog.testing.capture_logs() as logs:
            await async_wait(lambda: _true(wd.history.served_at is not None), 60, "worker 0 served a canary")
            pid0 = tree.memory(0)["pid"]
            # Worker 1 poisoned: shown, never decided for (its server starts it again).
            await asyncio.to_thread(tree.ctl, 1, "POST", "/control/fault", {"kind": "context_loss"})
            await asyncio.to_thread(tree.complete)
            await asyncio.to_thread(tree.complete)
            await async_wait(lambda: _true(any(e["event"] == "worker_poisoned" for e in logs)), 30, "worker 1 poisoned")
            assert not [e for e in logs if e["event"] == "decision"]
            # Worker 0 hung: decided for worker 0, cured by that worker alone.
            await asyncio.to_thread(tree.ctl, 0, "POST", "/control/fault", {"kind": "hang"})
            await async_wait(lambda: _true(any(e["event"] == "restart_finished" for e in logs)), 60, "a restart")
            await async_wait(lambda: _true(_ready_again(tree, 0, pid0)), 120, "worker 0 started again")
            # Worker 1 (started again after its poisoning) hung: decided for worker 1 by its own canaries.
            await async_wait(lambda: _true(any(c.served for c in list(wd.history.worker_canaries.get(1, ()))[-3:])),
                             60, "worker 1 serving its canaries again")
            pid1 = tree.memory(1)["pid"]
            await asyncio.to_thread(tree.ctl, 1, "POST", "/control/fault", {"kind": "hang"})
            await async_wait(lambda: _true(_ready_again(tree, 1, pid1)), 120, "worker 1 started again")
        finished = [e for e in logs if e["event"] == "restart_finished"]
        assert [(e["reason"], e["rung"], e["done"], e.get("worker", 0)) for e in finished] == [
            ("hang", RUNG_WORKER, True, 0), ("hang", RUNG_WORKER, True, 1)]
        assert not verdict.exists()  # the container was never restarted
        view = {w["worker"]: w for w in tree.workers_view()}
        assert view[0]["last_exit"] == 75 and view[1]["last_exit"] == 75 and view[1]["restarts"] == 2
        assert await asyncio.to_thread(tree.complete) == 200
    finally:
        await wd.stop()
        await asyncio.to_thread(tree.proc.stop, 40)


async def _true(value: bool) -> bool:
    return value


def _ready_again(tree: Tree, k: int, old_pid: int) -> bool:
    try:
        return any(w["worker"] == k and w["ready"] and w["pid"] != old_pid for w in tree.workers_view())
    except requests.RequestException:
        return False


async def test_a_request_that_hangs_two_workers_is_refused_by_every_worker(tmp_path: Path) -> None:
    """The query of death inside one pod: a request that wedges whichever worker takes it hangs one,
    then (sent again) the other process; both failures recorded with it in flight, it is
    quarantined and the list reaches every worker, so the next copy is refused (422) wherever the
    front sends it, and every other request is served."""
    tree = await asyncio.to_thread(start_tree, tmp_path, 2, "--max-concurrency", "2", "--fault-injection")
    verdict = tmp_path / "verdict"
    settings = sidecar_settings(tree, verdict)
    wd = Watchdog(settings, ContainerRestarter(str(verdict)), nvml_backend=NoNvml(), token=TOKEN)  # type: ignore[arg-type]
    wedge = {"prompt": "a WEDGE shaped request", "max_tokens": 4}

    def arm(k: int) -> None:
        r = tree.ctl(k, "POST", "/control/fault", {"kind": "hang", "when_prompt_contains": "WEDGE"})
        assert r.status_code == 200, r.text

    def send(body: dict[str, Any]) -> requests.Response:
        return requests.post(tree.url + "/v1/completions", json=body, timeout=90)

    def pids() -> dict[int, int]:
        return {w["worker"]: w["pid"] for w in tree.workers_view()}

    await wd.start(serve_http=False)
    try:
        with structlog.testing.capture_logs() as logs:
            await async_wait(lambda: _true(wd.history.served_at is not None and any(
                c.served for c in wd.history.worker_canaries.get(1, ()))), 60, "both workers serving canaries")
            for k in (0, 1):
                await asyncio.to_thread(arm, k)
            answers: list[requests.Response] = []
            for n in (1, 2):
                before = await asyncio.to_thread(pids)
                sent = threading.Thread(target=lambda: answers.append(send(wedge)))
                sent.start()
                await async_wait(lambda n=n: _true(len([e for e in logs if e["event"] == "restart_finished"]) >= n),
                                 60, f"restart {n}")
                [k] = [e.get("worker", 0) for e in logs if e["event"] == "restart_finished"][n - 1:n]
                await async_wait(lambda k=k, before=before: _true(_ready_again(tree, k, before[k])), 120,
                                 f"worker {k} started again")
                await asyncio.to_thread(arm, k)  # the new process wedges on it too
                await asyncio.to_thread(sent.join, 60)
            restarted = [e.get("worker", 0) for e in logs if e["event"] == "restart_finished"]
            assert len(restarted) == 2  # two processes, whichever workers they were
            assert [a.status_code for a in answers] == [502, 502]  # each lost with its worker, never run twice
            [q] = [e for e in logs if e["event"] == "request_quarantined"]
            await async_wait(lambda: _true(all(
                [e["fingerprint"] for e in tree.ctl(k, "GET", "/control/quarantine").json()["entries"]]
                == [q["fingerprint"]] for k in (0, 1))), 45, "the quarantine in every worker")
        for _ in range(4):  # whichever worker takes it
            refused = await asyncio.to_thread(send, wedge)
            assert refused.status_code == 422 and refused.json()["error"]["code"] == "request_quarantined"
        assert await asyncio.to_thread(tree.complete) == 200
        assert not verdict.exists()
    finally:
        await wd.stop()
        await asyncio.to_thread(tree.proc.stop, 40)
