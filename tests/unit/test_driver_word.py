"""The driver's word first: NVIDIA's Xid catalog, NVML's recovery action and the pod's device health,
on traces (samples in, decisions out), and which decisions the Node hears of at once."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import pytest

from gpu_watchdog.watchdog.core import policy, xid_catalog
from gpu_watchdog.watchdog.core.escalation import driver_says
from gpu_watchdog.watchdog.core.history import History
from gpu_watchdog.watchdog.core.names import (
    CONTEXT_LOSS,
    FLEET_UNAVAILABLE_LIMIT,
    HANG,
    RUNG_CONTAINER,
    RUNG_POD,
    RUNG_WORKER,
)
from gpu_watchdog.watchdog.core.policy import Decision, decide
from gpu_watchdog.watchdog.core.samples import (
    RESTART_FAILED,
    RESTART_HELD,
    RESTART_REPORTED,
    CanarySample,
    DeviceHealth,
    DeviceHealthSample,
    GpuSample,
    TorchSample,
    WorkerCanaries,
    WorkerRestarted,
    WorkerSample,
    WorkersSample,
    XidEvent,
)
from gpu_watchdog.watchdog.core.state import RestartEnded, reduce
from gpu_watchdog.watchdog.core.timing import FLEET_RETRY_S, RESTART_RETRY_S
from gpu_watchdog.watchdog.edge.samplers.device_health import device_health
from tests.unit.histories import OTHER, UUID, history, settings, worker_canary


def gpu(at: float, recovery: int | None, uuid: str = UUID, lost: bool = False) -> GpuSample:
    return GpuSample(at=at, available=True, uuid=uuid, index=0, recovery_action=recovery, lost=lost)


def restart(ds: list[Decision]) -> Decision | None:
    restarts = [d for d in ds if d.action == "restart"]
    assert len(restarts) <= 1
    return restarts[0] if restarts else None


# -- the catalog -----------------------------------------------------------------------------------


def test_the_catalog_names_its_source_and_keeps_every_xid_we_knew() -> None:
    assert "NVIDIA Xid catalog, docs.nvidia.com/deploy/xid-errors" in " ".join((xid_catalog.__doc__ or "").split())
    before = {13, 31, 43, 45, 68, 48, 94, 46, 62, 64, 74, 79, 95, 109, 119, 120, 63, 92}
    common = {8, 13, 31, 43, 45, 48, 61, 62, 63, 64, 68, 69, 74, 79, 92, 94, 95, 109, 119, 120, 121, 140, 143, 154}
    assert before | common <= set(xid_catalog.CATALOG)
    assert all(x.bucket in xid_catalog.REMEDY for x in xid_catalog.CATALOG.values())


def test_the_catalogs_own_buckets_for_the_common_xids() -> None:
    """Spot checks against the catalog itself (not derived from the table under test)."""
    bucket = {code: x.bucket for code, x in xid_catalog.CATALOG.items()}
    assert [bucket[x] for x in (8, 13, 31, 68, 69, 94)] == ["RESTART_APP"] * 6
    assert [bucket[x] for x in (46, 62, 64, 95, 109, 119, 120, 140, 143)] == ["RESET_GPU"] * 9
    assert [bucket[x] for x in (43, 63, 92, 121)] == ["IGNORE"] * 4
    assert (bucket[79], bucket[48], bucket[45], bucket[74], bucket[61], bucket[154]) == (
        "RESTART_BM", "WORKFLOW_XID_48", "WORKFLOW_XID_45", "WORKFLOW_NVLINK_ERR", "CONTACT_SUPPORT", "XID_154")


def test_the_policys_sets_come_from_the_catalog() -> None:
    assert policy.XID_CRITICAL == policy.XID_APP_FAULT | policy.XID_ECC | policy.XID_HARDWARE
    assert not policy.XID_CRITICAL & policy.XID_WARN_ONLY
    assert policy.XID_CRITICAL | policy.XID_WARN_ONLY == set(xid_catalog.CATALOG)
    # The catalog says otherwise than the sets did: 43 is IGNORE, 45 follows another Xid.
    assert {43, 45, 63, 92} <= policy.XID_WARN_ONLY
    assert {13, 31, 68} <= policy.XID_APP_FAULT and {48, 94} <= policy.XID_ECC
    assert {46, 62, 64, 74, 79, 95, 109, 119, 120} <= policy.XID_HARDWARE


# What each bucket must do for us, written out here rather than read from the table under test:
# (restarts, rung, node_action).
EXPECTED = {
    "RESTART_APP": (True, RUNG_CONTAINER, None),
    "RESET_GPU": (True, RUNG_POD, "reset_gpu"),
    "WORKFLOW_XID_48": (True, RUNG_POD, "reset_gpu"),
    "WORKFLOW_NVLINK_ERR": (True, RUNG_POD, "reset_gpu"),
    "RESTART_BM": (True, RUNG_POD, "reboot"),
    "RESTART_VM": (True, RUNG_POD, "reboot"),
    "IGNORE": (False, None, None),
    "CONTACT_SUPPORT": (False, None, None),
    "CHECK_MECHANICALS": (False, None, None),
    "WORKFLOW_XID_45": (False, None, None),
    "WORKFLOW_NVLINK5_ERR": (False, None, None),
    "XID_154": (False, None, None),
}


@pytest.mark.parametrize("code", sorted(xid_catalog.CATALOG))
def test_every_xid_of_the_catalog_on_our_gpu(code: int) -> None:
    row = xid_catalog.CATALOG[code]
    restarts, rung, node_action = EXPECTED[row.bucket]
    h = history()
    h.xids.append(XidEvent(at=2, xid=code, uuid=UUID))
    d = restart(decide(settings(), h, 2.5))
    if not restarts:
        assert d is None, f"Xid {code} ({row.bucket}) must never restart"
        return
    assert d is not None and (d.reason, d.rung, d.drain) == (CONTEXT_LOSS, rung, False)
    assert d.detail["xid"] == code and d.detail["bucket"] == row.bucket and d.detail.get("node_action") == node_action
    assert d.detail["class"] == ("ecc" if code in (48, 94, 140) else "hardware" if node_action else "app_fault")


def test_an_xid_the_catalog_does_not_name_never_restarts() -> None:
    h = history()
    h.xids.append(XidEvent(at=2, xid=999, uuid=UUID))
    assert xid_catalog.remedy(999) is None and restart(decide(settings(), h, 2.5)) is None


def test_an_xid_that_needs_the_node_wins_over_an_earlier_one_a_new_process_cures() -> None:
    h = history()
    h.xids.extend([XidEvent(at=2, xid=13, uuid=UUID), XidEvent(at=3, xid=79, uuid=UUID)])
    d = restart(decide(settings(), h, 3.5))
    assert d is not None and (d.detail["xid"], d.detail["node_action"], d.rung) == (79, "reboot", RUNG_POD)


def test_another_pods_gpu_never_restarts_whatever_the_catalog_says() -> None:
    h = history(gpus_visible=8, pod_gpus=(UUID,))
    h.xids.append(XidEvent(at=2, xid=79, uuid=OTHER))
    assert restart(decide(settings(), h, 2.5)) is None


# -- NVML's recovery action ---------------------------------------------------------------------------

NAMES = {1: ("GPU_RESET", "reset_gpu"), 2: ("NODE_REBOOT", "reboot"), 3: ("DRAIN_P2P", "drain_p2p"),
         4: ("DRAIN_AND_RESET", "reset_gpu"), 5: ("RECOVER_IMEX_DOMAIN", "recover_imex_domain"),
         6: ("BUS_RESET", "reset_gpu"), 7: ("SYSTEM_REBOOT", "reboot"),
         9: ("UNKNOWN_9", "recovery_action_9")}  # a value newer than the table


@pytest.mark.parametrize("value", sorted(NAMES))
def test_every_recovery_action_but_none_restarts_the_pod_and_names_what_the_node_needs(value: int) -> None:
    h = history(gpus=(gpu(2, value),), gpus_visible=1)
    d = restart(decide(settings(), h, 2.5))
    name, node_action = NAMES[value]
    assert d is not None and (d.reason, d.rung, d.drain) == (CONTEXT_LOSS, RUNG_POD, False)
    assert {k: d.detail[k] for k in ("evidence", "recovery_action", "node_action", "uuid")} == {
        "evidence": "recovery_action", "recovery_action": name, "node_action": node_action, "uuid": UUID}


@pytest.mark.parametrize("value", [0, None])
def test_no_action_or_no_field_is_nothing(value: int | None) -> None:
    h = history(gpus=(gpu(2, value),), gpus_visible=1)
    assert decide(settings(), h, 2.5) == []


def test_the_recovery_action_is_weighed_before_the_canary() -> None:
    h = history(gpus=(gpu(2, 1),), gpus_visible=1)
    h.canaries.append(CanarySample(at=2, ok=False, latency_s=0.1, error_class="fatal_cuda", error="illegal address",
                                   instance_id="i1"))
    d = restart(decide(settings(), h, 2.5))
    assert d is not None and (d.detail["evidence"], d.rung) == ("recovery_action", RUNG_POD)


def test_a_lost_gpu_that_says_what_it_needs_is_reported_as_that() -> None:
    h = history(gpus=(gpu(2, 2, lost=True),), gpus_visible=1)
    d = restart(decide(settings(), h, 2.5))
    assert d is not None and (d.detail["evidence"], d.detail["node_action"]) == ("recovery_action", "reboot")


def test_a_reading_from_before_the_last_restart_says_nothing_of_the_new_process() -> None:
    h = history(gpus=(gpu(2, 1),), gpus_visible=1)
    reduce(h, RestartEnded(at=3, reason=CONTEXT_LOSS, done=True, keep_unready=False))
    assert restart(decide(settings(), h, 3.5)) is None
    h.gpus = (gpu(4, 1),)  # the card still needs its reset: the next reading says so again
    assert restart(decide(settings(), h, 4.5)) is not None


# -- device health in the pod's status --------------------------------------------------------------


def health(at: float, *states: str) -> DeviceHealthSample:
    return DeviceHealthSample(at=at, read=True, devices=tuple(
        DeviceHealth("inference", "nvidia.com/gpu", f"GPU-{i}", s) for i, s in enumerate(states)))


def test_an_unhealthy_gpu_in_the_pods_status_restarts_the_pod() -> None:
    h = history()
    reduce(h, health(2, "Healthy", "Unhealthy"))
    d = restart(decide(settings(), h, 2.5))
    assert d is not None and (d.reason, d.rung) == (CONTEXT_LOSS, RUNG_POD)
    assert {k: d.detail[k] for k in ("evidence", "resource_id", "container", "uuid")} == {
        "evidence": "device_health", "resource_id": "GPU-1", "container": "inference", "uuid": "GPU-1"}
    assert "node_action" not in d.detail  # the device plugin is the node's own: it knows already


@pytest.mark.parametrize("states", [(), ("Healthy",), ("Unknown",)])
def test_healthy_unknown_or_absent_device_health_is_nothing(states: tuple[str, ...]) -> None:
    h = history()
    reduce(h, health(2, *states))
    assert decide(settings(), h, 2.5) == []


def test_an_unreadable_status_keeps_the_last_reading_and_an_old_one_is_ignored() -> None:
    h = history()
    reduce(h, health(2, "Healthy"))
    reduce(h, DeviceHealthSample(at=3, read=False, error="403: forbidden"))
    assert h.device_health is not None and h.device_health.at == 2
    reduce(h, health(4, "Unhealthy"))
    reduce(h, RestartEnded(at=5, reason=CONTEXT_LOSS, done=True, keep_unready=False))
    assert decide(settings(), h, 5.5) == []


def test_the_pods_status_is_read_from_its_json() -> None:
    def status(name: str, resources: list[dict[str, Any]] | None) -> dict[str, Any]:
        out: dict[str, Any] = {"name": name, "image": "img", "imageID": "sha", "ready": True, "restartCount": 0}
        if resources is not None:
            out["allocatedResourcesStatus"] = resources
        return out

    pod = {
        "apiVersion": "v1", "kind": "Pod", "metadata": {"name": "model-0"},
        "spec": {"containers": [{"name": "inference", "image": "img"}, {"name": "watchdog", "image": "img"}]},
        "status": {"containerStatuses": [
            status("inference", [
                {"name": "nvidia.com/gpu", "resources": [{"resourceID": "GPU-1111::2", "health": "Unhealthy",
                                                          "message": "Xid 79"}]},
                {"name": "example.com/nic", "resources": [{"resourceID": "nic0", "health": "Unhealthy"}]}]),
            status("watchdog", None)]}}
    sample = device_health(pod, at=7.0)
    assert sample.read and sample.at == 7.0
    assert [(d.container, d.resource, d.resource_id, d.health, d.message, d.uuid) for d in sample.devices] == [
        ("inference", "nvidia.com/gpu", "GPU-1111::2", "Unhealthy", "Xid 79", "GPU-1111")]
    bare = {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "model-0"},
            "spec": {"containers": [{"name": "inference", "image": "img"}]}}
    assert device_health(bare, at=1.0).devices == ()


# -- which decisions the Node hears of at once --------------------------------------------------------


def test_the_driver_saying_reset_or_reboot_is_a_suspect_at_once() -> None:
    h = history(gpus=(gpu(2, 1),), gpus_visible=1)
    d = restart(decide(settings(), h, 2.5))
    assert d is not None
    s = driver_says(d.reason, d.detail)
    assert s is not None and (s.uuid, s.driver_says, s.node_action, s.restarts) == (UUID, "GPU_RESET", "reset_gpu", ())
    h = history()
    h.xids.append(XidEvent(at=2, xid=79, uuid=None))  # an event that names no GPU: the pod's only one
    d = restart(decide(settings(), h, 2.5))
    assert d is not None
    s = driver_says(d.reason, d.detail)
    assert s is not None and (s.uuid, s.driver_says, s.node_action, s.xids) == (UUID, "RESTART_BM", "reboot", [79])


def test_what_a_new_process_cures_waits_for_restarts_that_do_not() -> None:
    h = history()
    h.xids.append(XidEvent(at=2, xid=13, uuid=UUID))
    d = restart(decide(settings(), h, 2.5))
    assert d is not None and driver_says(d.reason, d.detail) is None
    h = history()
    reduce(h, health(2, "Unhealthy"))
    d = restart(decide(settings(), h, 2.5))
    assert d is not None and driver_says(d.reason, d.detail) is None
    assert driver_says(HANG, {"node_action": "reset_gpu"}) is None  # only context loss carries the driver's word


def test_with_no_gpu_named_the_node_still_hears_of_it() -> None:
    s = driver_says(CONTEXT_LOSS, {"evidence": "xid", "xid": 79, "bucket": "RESTART_BM", "node_action": "reboot",
                                   "uuid": None, "gpus": ["GPU-1", "GPU-2"]})
    assert s is not None and s.uuid == "unknown" and s.driver_says == "RESTART_BM"


def test_settings_other_than_the_defaults_change_nothing_of_the_rung() -> None:
    """The driver's word sends the pod at once, whatever the in-place ladder allows."""
    s = replace(settings(), in_place=replace(settings().in_place, max_restarts=10))
    h = history(gpus=(gpu(2, 4),), gpus_visible=1)
    d = restart(decide(s, h, 2.5))
    assert d is not None and d.rung == RUNG_POD


# -- the worker rung (target.workers > 1) ---------------------------------------------------------


def poisoned(h: History, at: float) -> History:
    h.canaries.append(CanarySample(at=at, ok=False, latency_s=0.01, error_class="fatal_cuda",
                                   error="CUDA error: an illegal memory access", instance_id="i1"))
    return h


def test_one_worker_of_several_poisoned_is_that_worker_s_to_cure_not_the_container_s() -> None:
    d = restart(decide(settings(), poisoned(history(worker_count=2), 2), 2))
    assert d is not None and (d.reason, d.rung) == (CONTEXT_LOSS, RUNG_WORKER)
    alone = restart(decide(settings(), poisoned(history(), 2), 2))
    assert alone is not None and alone.rung == RUNG_CONTAINER


def test_a_hung_worker_of_several_is_that_worker_s_and_a_stall_of_the_server_the_container_s() -> None:
    h = history(worker_count=3)
    for k in range(3):
        h.canaries.append(CanarySample(at=10 + 5 * k, ok=False, latency_s=5, error_class="timeout", instance_id="i1"))
    d = restart(decide(settings(), h, 30))
    assert d is not None and (d.reason, d.rung) == (HANG, RUNG_WORKER)
    stall = policy.rung_for(settings(), h, Decision("restart", HANG, {"evidence": "stall"}), 30)
    assert stall == RUNG_CONTAINER


def test_a_gpu_level_fault_of_a_worker_goes_where_it_would_for_one() -> None:
    h = history(worker_count=2)
    lost = policy.rung_for(settings(), h, Decision("restart", CONTEXT_LOSS, {"evidence": "gpu_lost"}), 5)
    xid = policy.rung_for(settings(), h, Decision("restart", CONTEXT_LOSS, {"evidence": "xid", "xid": 13}), 5)
    assert (lost, xid) == (RUNG_POD, RUNG_CONTAINER)


def test_worker_restarts_that_do_not_cure_climb_to_the_container() -> None:
    s = settings()
    h = history(worker_count=2)
    for k in range(s.in_place.max_restarts):
        h = reduce(h, RestartEnded(at=10.0 + k, reason=CONTEXT_LOSS, done=True, keep_unready=False,
                                   rung=RUNG_WORKER))
    d = restart(decide(s, poisoned(h, 20), 20))
    assert d is not None and d.rung == RUNG_CONTAINER


def test_another_worker_whose_own_canaries_time_out_after_it_served_is_that_worker_s_hang() -> None:
    s = settings()
    h = history(worker_count=3)
    h = reduce(h, WorkerCanaries(5, ((1, worker_canary(5, True)), (2, worker_canary(5, True)))))
    for t in (10, 15, 20):
        h = reduce(h, WorkerCanaries(t, ((1, worker_canary(t, False)), (2, worker_canary(t, t != 15)))))
    [d] = policy.other_workers(s, h, 20)
    assert (d.reason, d.rung, d.detail["worker"], d.instance_id, d.allowed) == (HANG, RUNG_WORKER, 1, "w1", True)
    assert restart(decide(s, h, 20)) is None  # the watched worker serves: nothing for the pod


def test_a_worker_that_never_served_is_loading_and_one_restarted_starts_again_from_nothing() -> None:
    s = settings()
    h = history(worker_count=2)
    for t in (10, 15, 20):
        h = reduce(h, WorkerCanaries(t, ((1, worker_canary(t, False)),)))
    assert policy.other_workers(s, h, 20) == []
    h = reduce(h, WorkerCanaries(25, ((1, worker_canary(25, True)),)))
    for t in (30, 35, 40):
        h = reduce(h, WorkerCanaries(t, ((1, worker_canary(t, False)),)))
    assert len(policy.other_workers(s, h, 40)) == 1
    h = reduce(h, WorkerRestarted(41, 1, HANG, "w1"))
    assert policy.other_workers(s, h, 41) == [] and h.restarts_within(41, 3600)[-1].rung == RUNG_WORKER


def test_worker_restarts_spend_the_budget_like_any_other() -> None:
    s = settings()
    h = history(worker_count=2)
    for k in range(s.restart_budget.max_restarts):
        h = reduce(h, WorkerRestarted(1.0 + k, 1, HANG, f"w{k}"))
    h = reduce(h, WorkerCanaries(50, ((1, worker_canary(50, True)),)))
    for t in (55, 60, 65):
        h = reduce(h, WorkerCanaries(t, ((1, worker_canary(t, False)),)))
    [d] = policy.other_workers(s, h, 65)
    assert not d.allowed and d.blocked_by == "restart_budget"


def hung_worker(h: History, start: float) -> History:
    """Worker 1 served at `start`, then its canaries time out three times, 5 s apart."""
    h = reduce(h, WorkerCanaries(start, ((1, worker_canary(start, True)),)))
    for t in (start + 5, start + 10, start + 15):
        h = reduce(h, WorkerCanaries(t, ((1, worker_canary(t, False)),)))
    return h


def test_a_worker_restart_not_carried_out_is_held_back_in_that_worker_s_own_episode() -> None:
    s = settings()
    h = hung_worker(history(worker_count=2), 5)
    # Failed: not asked again at the next canary, but after the backoff, which doubles.
    h = reduce(h, WorkerRestarted(20, 1, HANG, "w1", RESTART_FAILED))
    assert policy.other_workers(s, h, 21) == [] and len(policy.other_workers(s, h, 20 + RESTART_RETRY_S)) == 1
    h = reduce(h, WorkerRestarted(20 + RESTART_RETRY_S, 1, HANG, "w1", RESTART_FAILED))
    assert policy.other_workers(s, h, 21 + 1.5 * RESTART_RETRY_S) == []
    assert len(policy.other_workers(s, h, 20 + 3 * RESTART_RETRY_S)) == 1
    # Failures of another worker's restart hold back neither the budget nor the watched target.
    assert h.restarts_within(100, 3600) == [] and policy.budget_remaining(s, h, 100) == s.restart_budget.max_restarts
    assert not policy._held_back(h, HANG, 21)
    # Still hung whatever holds it back: the fleet's hold is not over while this worker wants a restart.
    assert [d.detail["worker"] for d in policy.hung_workers(s, h)] == [1]
    assert policy.worker_restart_wanted(s, h, 21)


def test_a_worker_restart_held_by_the_fleet_is_asked_again_after_the_hold_and_one_reported_once() -> None:
    s = settings()
    h = hung_worker(history(worker_count=2), 5)
    h = reduce(h, WorkerRestarted(20, 1, HANG, "w1", RESTART_HELD, FLEET_UNAVAILABLE_LIMIT))
    assert policy.other_workers(s, h, 21) == []
    assert len(policy.other_workers(s, h, 20 + FLEET_RETRY_S[FLEET_UNAVAILABLE_LIMIT])) == 1
    # Strategy none: said once, not again until that worker serves again.
    h = reduce(h, WorkerRestarted(30, 1, HANG, "w1", RESTART_REPORTED))
    assert policy.other_workers(s, h, 500) == []
    assert not policy.worker_restart_wanted(s, h, 500)  # a fleet hold does not wait on it
    h = hung_worker(h, 600)
    assert len(policy.other_workers(s, h, 615)) == 1


def test_a_hung_worker_s_restart_names_the_process_that_served_not_a_timed_out_canary() -> None:
    s = settings()
    h = history(worker_count=2)
    h = reduce(h, WorkerCanaries(5, ((1, worker_canary(5, True, "w1-first")),)))
    for t in (10, 15, 20):
        h = reduce(h, WorkerCanaries(t, ((1, CanarySample(at=t, ok=False, latency_s=5.0, error_class="timeout")),)))
    [d] = policy.other_workers(s, h, 20)
    assert d.instance_id == "w1-first"


def test_a_worker_s_restart_names_the_gpu_it_said_it_runs_on() -> None:
    s = settings()
    h = hung_worker(history(worker_count=2), 5)
    memory = TorchSample(at=4, reachable=True, device="cuda", uuid=OTHER, instance_id="w1")
    h = reduce(h, WorkersSample(4, (WorkerSample(1, "http://127.0.0.1:1", memory),)))
    [d] = policy.other_workers(s, h, 20)
    assert d.detail["gpus"] == [OTHER]
