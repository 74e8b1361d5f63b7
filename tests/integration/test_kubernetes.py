"""The real `kubernetes` client against kmock's Kubernetes API emulator."""

from __future__ import annotations

from typing import Any

import pytest
from kubernetes import client

from gpu_watchdog.watchdog.core.policy import Decision
from gpu_watchdog.watchdog.edge.config import RestartSettings
from gpu_watchdog.watchdog.edge.effects.restart import NOT_RECORDED, KubeRestarter
from gpu_watchdog.watchdog.edge.kube.kube import PodActions, RefusedError
from tests.integration.kmock_api import NS, POD, events, pod
from tests.integration.sidecar_stand_ins import RecordingDrain


def dry(req: Any) -> bool:
    return req.params.get("dryRun") == "All"


def real(req: Any) -> bool:
    return "dryRun" not in req.params


BLOCKED = {"kind": "Status", "code": 429,
           "message": "Cannot evict pod as it would violate the pod's disruption budget."}
EVICTION = f"post /api/v1/namespaces/{NS}/pods/{POD}/eviction"


DECISION = Decision("restart", "context_loss", {"evidence": "canary", "error": "illegal memory access"}, drain=False)


def restarter(api: client.ApiClient, **changes: Any) -> tuple[KubeRestarter, list[float]]:
    slept: list[float] = []

    async def fake_sleep(s: float) -> None:  # records the backoff instead of waiting it out
        slept.append(s)

    settings = RestartSettings(**{"strategy": "evict", "retry_initial": 1.0, "retry_max": 8.0, "max_attempts": 6,
                                  **changes})
    return KubeRestarter(PodActions(api, POD, NS, 5.0), settings, sleep=fake_sleep), slept


async def test_eviction_url_body_and_event(kmock: Any, api: client.ApiClient) -> None:
    spy = kmock[EVICTION] << 201 << {"kind": "Status", "status": "Success"}
    r, slept = restarter(api, grace_period=20.0)
    drain = RecordingDrain()
    outcome = await r.restart(DECISION, drain)
    assert outcome.done and outcome.attempts == 1 and slept == []
    # Asked first (a dry run the disruption budget answers), then evicted for real.
    assert [dry(req) for req in spy] == [True, False]
    for req in spy:
        assert str(req.method).upper().endswith("POST")
        assert req.url.path == f"/api/v1/namespaces/{NS}/pods/{POD}/eviction"
        assert req.data["metadata"] == {"name": POD, "namespace": NS}
        assert req.data["deleteOptions"]["gracePeriodSeconds"] == 20
    assert drain.calls == ["begin"]
    [ev] = events(kmock)
    assert ev["reason"] == "ContextLoss" and ev["type"] == "Warning" and ev["action"] == "Evict"
    assert ev["regarding"]["name"] == POD and ev["regarding"]["kind"] == "Pod"
    assert "illegal memory access" in ev["note"]
    assert ev["reportingController"] == "gpu-watchdog.io/watchdog"


async def test_pdb_429_is_retried_with_backoff_then_succeeds(kmock: Any, api: client.ApiClient) -> None:
    refused = kmock[EVICTION][:3] << 429 << BLOCKED
    accepted = kmock[EVICTION] << 201 << {"kind": "Status", "status": "Success"}
    r, slept = restarter(api)
    drain = RecordingDrain()
    outcome = await r.restart(DECISION, drain)
    assert outcome.done and outcome.attempts == 4
    assert [dry(req) for req in refused] == [True] * 3 and [dry(req) for req in accepted] == [True, False]
    assert slept == [1.0, 2.0, 4.0]
    # Nothing drained while the budget said no; drained once it said yes, right before the eviction.
    assert drain.calls == ["lift:eviction_refused"] * 3 + ["begin"]
    [ev] = events(kmock)  # one Event, written once the eviction was allowed
    assert ev["reason"] == "ContextLoss"


async def test_a_refusal_after_the_dry_run_lifts_the_drain(kmock: Any, api: client.ApiClient) -> None:
    """The budget can change between the question and the eviction (another pod went first)."""
    kmock[EVICTION][dry] << 201 << {"kind": "Status", "status": "Success"}
    refused = kmock[EVICTION][real][:1] << 429 << BLOCKED
    accepted = kmock[EVICTION][real] << 201 << {"kind": "Status", "status": "Success"}
    r, slept = restarter(api)
    drain = RecordingDrain()
    outcome = await r.restart(DECISION, drain)
    assert outcome.done and outcome.attempts == 2 and slept == [1.0]
    assert len(refused) == 1 and len(accepted) == 1
    assert drain.calls == ["begin", "lift:eviction_refused", "begin"]
    assert len(events(kmock)) == 1  # the same restart: recorded once


async def test_no_event_no_restart(kmock: Any, api: client.ApiClient) -> None:
    """An Event the API refuses (an admission webhook, an events quota) while listing works: an
    unrecorded restart would be invisible to the next pod generation's budget, so none happens."""
    evictions = kmock[EVICTION] << 201 << {"kind": "Status", "status": "Success"}
    refused = kmock[f"post /apis/events.k8s.io/v1/namespaces/{NS}/events"] << 403 << {
        "kind": "Status", "code": 403, "message": "events is forbidden: exceeded quota"}
    r, slept = restarter(api)
    drain = RecordingDrain()
    outcome = await r.restart(DECISION, drain)
    assert outcome.done is False and outcome.not_recorded
    assert outcome.detail.startswith(NOT_RECORDED) and "403" in outcome.detail
    assert len(refused) == 3 and slept == [1.0, 2.0]  # three tries, then given up for now
    assert [dry(req) for req in evictions] == [True]  # asked, never evicted
    assert drain.calls == []  # and never drained
    assert kmock.objects["v1/pods", NS, POD] is not None


async def test_a_pdb_that_never_relents_never_leads_to_a_delete(kmock: Any, api: client.ApiClient) -> None:
    """A 429 is the budget saying "not now": going around it with a DELETE would break the fleet's PDB."""
    refused = kmock[EVICTION] << 429 << BLOCKED
    deletes = kmock[f"delete /api/v1/namespaces/{NS}/pods/{POD}"] << 200 << pod()
    r, slept = restarter(api, max_attempts=5)
    drain = RecordingDrain()
    outcome = await r.restart(DECISION, drain)
    assert outcome.done is False and outcome.attempts == 5 and "429" in outcome.detail
    assert slept == [1.0, 2.0, 4.0, 8.0]  # backing off between attempts, never around the budget
    assert len(refused) == 5 and all(dry(req) for req in refused) and len(deletes) == 0
    assert kmock.objects["v1/pods", NS, POD] is not None  # the pod is still there
    assert "begin" not in drain.calls  # never drained: it served all along
    assert events(kmock) == []  # nothing happened, so nothing is recorded against the budget


async def test_403_is_reported_not_raised(kmock: Any, api: client.ApiClient) -> None:
    spy = kmock[f"post /api/v1/namespaces/{NS}/pods/{POD}/eviction"] << 403 << {"kind": "Status", "code": 403,
                                                                             "message": "forbidden"}
    r, slept = restarter(api, max_attempts=3)
    outcome = await r.restart(DECISION, RecordingDrain())
    assert outcome.done is False
    assert "403" in outcome.detail and outcome.attempts == 3
    assert len(spy) == 3 and slept == [1.0, 2.0]


async def test_delete_strategy_deletes_our_pod(kmock: Any, api: client.ApiClient) -> None:
    ours = kmock[f"delete /api/v1/namespaces/{NS}/pods/{POD}"] << 200 << pod()
    theirs = kmock[f"delete /api/v1/namespaces/{NS}/pods/neighbour"] << 200 << pod("neighbour")
    r, _ = restarter(api, strategy="delete", grace_period=5.0)
    drain = RecordingDrain()
    outcome = await r.restart(Decision("restart", "hang", {"consecutive_timeouts": 3}, drain=False), drain)
    assert outcome.done and drain.calls == ["begin"]
    # Asked first (a dry run: RBAC and admission answer as they would), recorded, then deleted.
    # (The emulator knows no dryRun, so its store deleted at the question and answers the delete
    # itself: "already gone", done either way.)
    sent = [(str(req.method).rsplit(".", 1)[-1].upper(), req.params.get("dryRun")) for req in kmock
            if "/pods/" in str(req.url) or "/events" in str(req.url)]
    assert sent == [("DELETE", "All"), ("POST", None), ("DELETE", None)] and len(theirs) == 0
    assert ours[0].params.get("gracePeriodSeconds") == "5" and dry(ours[0])
    [ev] = events(kmock)
    assert ev["reason"] == "Hang" and ev["action"] == "Delete"


async def test_refuses_any_pod_but_its_own(kmock: Any, api: client.ApiClient,
                                          monkeypatch: pytest.MonkeyPatch) -> None:
    spy = kmock[f"post /api/v1/namespaces/{NS}/pods/neighbour/eviction"] << 201
    actions = PodActions(api, POD, NS, 5.0)
    with pytest.raises(RefusedError):
        actions.evict("neighbour", NS, None)
    with pytest.raises(RefusedError):
        actions.delete(POD, "other-namespace", None)
    assert len(spy) == 0
    monkeypatch.setenv("POD_NAME", "the-real-pod")
    with pytest.raises(RefusedError, match="not this pod"):
        PodActions(api, POD, NS, 5.0)
    with pytest.raises(RefusedError):
        PodActions(api, "", NS, 5.0)
