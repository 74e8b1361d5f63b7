"""A worker's restart is a restart of the workload's like any other: a hung worker of a real
`serve --workers 2` is restarted by its sidecar only once its Event is written (read back by every
pod's budget, naming the worker's GPU) and a slot of the workload's ledger is taken, given back once
that worker serves again; with no slot free, or with the Events refused, it is not told to exit.

The real Watchdog, container restarter, Lease ledger and `kubernetes` client against the emulator.
"""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import structlog
from kubernetes import client

from gpu_watchdog.watchdog.core import fleet
from gpu_watchdog.watchdog.core.names import FLEET_UNAVAILABLE_LIMIT, HANG, RUNG_POD, RUNG_WORKER
from gpu_watchdog.watchdog.edge.effects.fleet import LeaseLedger
from gpu_watchdog.watchdog.edge.effects.node import NodeReporter
from gpu_watchdog.watchdog.edge.effects.restart import NOT_RECORDED, WORKER_ACTION, ContainerRestarter, KubeRestarter
from gpu_watchdog.watchdog.edge.kube.kube import PodActions
from gpu_watchdog.watchdog.runtime.app import Watchdog
from tests.fleet.clients import NS
from tests.fleet.workload import LEASE, after_creation, cluster_of, stored_ledger
from tests.helpers import until
from tests.integration.kmock_api import events
from tests.integration.sidecar_stand_ins import NoNvml
from tests.integration.workers import TOKEN, Tree, sidecar_settings, start_tree


@asynccontextmanager
async def watched(kmock: Any, tmp_path: Path) -> AsyncIterator[tuple[Tree, Watchdog, str, client.ApiClient]]:
    """Two CPU workers behind one port, the sidecar of pod `pods[0]` watching both."""
    api, pods = cluster_of(kmock, 2)
    await after_creation()
    pod = pods[0]
    tree = await asyncio.to_thread(start_tree, tmp_path, 2, "--max-concurrency", "2", "--fault-injection")
    verdict = tmp_path / "verdict"
    settings = sidecar_settings(tree, verdict, {
        "policy": {"fleet": {"max_unavailable": 1}}, "restart": {"retry_initial": "100ms"},
        "kubernetes": {"pod_name": pod, "namespace": NS, "node_name": "", "request_timeout": 5},
    })
    evict = dataclasses.replace(settings.restart, strategy="evict")
    restarter = ContainerRestarter(str(verdict), KubeRestarter(PodActions(api, pod, NS, 5.0), evict, workload="llm"))
    wd = Watchdog(settings, restarter, nvml_backend=NoNvml(), token=TOKEN,  # type: ignore[arg-type]
                  restart_events=NodeReporter(api, NS, "", 5.0, False), workload="llm",
                  ledger=LeaseLedger(api, NS, LEASE, "llm", pod, 5.0))
    await wd.start(serve_http=False)
    try:
        await until(lambda: any(c.served for c in wd.history.worker_canaries.get(1, ())), 60,
                    "worker 1 serving its canaries")
        yield tree, wd, pod, api
        assert not verdict.exists()  # never the container
    finally:
        await wd.stop()
        await asyncio.to_thread(tree.proc.stop, 40)


def pid_of(tree: Tree, k: int) -> int:
    """Worker k's process as its server says (a hung worker's own control API may not answer)."""
    return int(next(w["pid"] for w in tree.workers_view() if w["worker"] == k))


def ready_again(tree: Tree, k: int, old_pid: int) -> bool:
    try:
        return any(w["worker"] == k and w["ready"] and w["pid"] != old_pid for w in tree.workers_view())
    except OSError:
        return False


async def test_a_hung_worker_s_restart_is_recorded_takes_a_slot_and_gives_it_back_once_it_serves(
        kmock: Any, tmp_path: Path) -> None:
    async with watched(kmock, tmp_path) as (tree, wd, pod, _api):
        pid1 = await asyncio.to_thread(pid_of, tree, 1)
        with structlog.testing.capture_logs() as logs:
            await asyncio.to_thread(tree.ctl, 1, "POST", "/control/fault", {"kind": "hang"})
            await until(lambda: ready_again(tree, 1, pid1), 120, "worker 1 started again")
            # The slot goes back once worker 1's new process serves a canary, not when it was told.
            await until(lambda: not wd.executor.fleet.slot_held, 30, "the slot given back")
        names = [e["event"] for e in logs]
        told, back = names.index("restart_finished"), names.index("fleet_slot_given_back")
        assert told < back and logs[back]["why"] == "worker_1_serves" and logs[back]["restarted"] is True
        # Its canaries were forgotten at the restart: a served one since is the new process's.
        assert any(c.served for c in wd.history.worker_canaries[1])
        ledger = stored_ledger(kmock)
        assert ledger.slots == () and [(r.pod, r.reason) for r in ledger.restarts] == [(pod, HANG)]
        taken = [fleet.parse(((w.body or {}).get("metadata", {}).get("annotations") or {}).get(fleet.LEDGER_ANNOTATION))
                 for w in kmock.writes_to("leases") if w.ok]
        assert {(s.pod, s.rung) for led in taken for s in led.slots} == {(pod, RUNG_WORKER)}
        # Its Event: what every pod's budget reads back, and the worker's own note.
        [event] = [e for e in events(kmock) if e.get("action") == WORKER_ACTION]
        assert event["reason"] == "WorkerRestartHang" and event["regarding"]["name"] == pod
        assert "worker 1 of its server" in event["note"]
        records = await asyncio.to_thread(wd.restart_events.restart_records)  # type: ignore[union-attr]
        assert [(r.pod, r.reason, r.workload) for r in records] == [(pod, HANG, "llm")]
        assert wd.metrics.registry.get_sample_value("gpu_watchdog_restarts_total",
                                                    {"reason": HANG, "rung": RUNG_WORKER}) == 1.0
        assert await asyncio.to_thread(tree.complete) == 200


async def test_a_hung_worker_waits_for_a_slot_and_is_not_told_to_exit_while_its_event_is_refused(
        kmock: Any, tmp_path: Path) -> None:
    async with watched(kmock, tmp_path) as (tree, wd, pod, api):
        # The other replica's slot: a pod the cluster lists (a slot of a pod gone holds nobody).
        other = "llm-5c9d7b6f4x-ccccc"
        assert kmock.read("pods", NS, other) is not None
        api_writer = LeaseLedger(api, NS, LEASE, "llm", other, 5.0)
        await asyncio.to_thread(api_writer.update, lambda _l, now: (fleet.Ledger(slots=(
            fleet.Slot(other, HANG, RUNG_POD, now),)), None))
        pid1 = await asyncio.to_thread(pid_of, tree, 1)
        with structlog.testing.capture_logs() as logs:
            await asyncio.to_thread(tree.ctl, 1, "POST", "/control/fault", {"kind": "hang"})
            await until(lambda: wd.executor.fleet.held == FLEET_UNAVAILABLE_LIMIT, 30, "the restart held")
            await asyncio.sleep(3.0)  # asked again after each hold: still no slot
            assert [w.pod for w in stored_ledger(kmock).waiting] == [pod]
            held = [d for d in wd.history.decisions if d.outcome == FLEET_UNAVAILABLE_LIMIT]
            assert len(held) == 1 and held[0].detail["worker"] == 1
            # The Events refused, then the slot frees: taken, the Event refused, nothing told, the slot back.
            refused = kmock[f"post /apis/events.k8s.io/v1/namespaces/{NS}/events"] << 403 << {
                "kind": "Status", "code": 403, "message": "events is forbidden: exceeded quota"}
            await asyncio.to_thread(api_writer.update, lambda led, now: (fleet.give_back(led, other, True), None))
            await until(lambda: any(d.outcome == "not_recorded" for d in wd.history.decisions), 30,
                        "the restart not recorded")
            await until(lambda: any(e["event"] == "fleet_slot_given_back" for e in logs), 10, "the slot given back")
        assert [e["restarted"] for e in logs if e["event"] == "fleet_slot_given_back"] == [False]
        assert not wd.executor.fleet.slot_held
        assert len(refused) == 3  # three tries, then nothing done
        assert stored_ledger(kmock).slots == () and stored_ledger(kmock).restarts == ()
        assert wd.executor.not_recorded_now() is not None and NOT_RECORDED in wd.executor.not_recorded_now()
        assert not [e for e in logs if e["event"] == "restart_finished"]
        assert await asyncio.to_thread(pid_of, tree, 1) == pid1  # still the hung process: never told
