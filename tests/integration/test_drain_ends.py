"""A drain always ends: by its deadline, kept by the server itself, or at once by `DELETE /control/drain`.

`gpu-watchdog serve` and the FastAPI example with the agent, as real processes on loopback. The
shutdown's drain (SIGTERM) is the one no deadline or lift ends.
"""

from __future__ import annotations

import re
import signal
import threading
import time
from collections.abc import Iterator
from typing import Any

import aiohttp
import pytest
import requests

from gpu_watchdog import contract
from gpu_watchdog.watchdog.edge.control_client import ControlClient
from gpu_watchdog.watchdog.edge.samplers.canary import CanarySampler
from tests.helpers import ROOT, Server, json_lines, start_app, start_server, wait_for

DEADLINE = 1.5
MARGIN = 1.5  # scheduling on a shared 2-core machine


def complete(srv: Server) -> requests.Response:
    return requests.post(srv.url + "/v1/completions", json={"prompt": "hi", "max_tokens": 2}, timeout=30)


def readyz(srv: Server) -> int:
    return requests.get(srv.url + "/readyz", timeout=5).status_code


def lifts(log: str) -> list[str]:
    """Who lifted each drain, from `serve`'s JSON log lines or the example app's console ones."""
    by_json = [e["by"] for e in json_lines(log) if e.get("event") == "drain_lifted"]
    return by_json or re.findall(r"\bdrain_lifted\b.*?\bby=(\w+)", log)


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    srv = start_server(tmp_path_factory.mktemp("drain"), "--fault-injection", "--max-concurrency", "2")
    yield srv
    srv.proc.stop()


def test_a_drain_lifts_itself_at_its_deadline(server: Server) -> None:
    r = server.ctl("POST", "/control/drain", {"timeout": 1, "deadline": DEADLINE})
    began = time.monotonic()
    assert r.status_code == 200 and r.json()["drained"] is True and r.json()["draining"] is True, r.text
    assert readyz(server) == 503
    refused = complete(server)
    assert refused.status_code == 503 and refused.json()["error"]["type"] == "draining"
    canary = server.ctl("POST", "/control/canary", {"timeout": 5}).json()
    assert canary["ok"] is True and canary["draining"] is True  # the model serves; the server refuses traffic
    memory = server.memory()
    assert memory["draining"] is True and memory["ready"] is False
    assert 0 < memory["drain_deadline_left_s"] <= DEADLINE
    wait_for(lambda: readyz(server) == 200, DEADLINE + MARGIN, "the drain to lift by itself")
    lifted_after = time.monotonic() - began
    assert lifted_after >= DEADLINE - 0.6, lifted_after  # not before its time (counted from the answer)
    assert complete(server).status_code == 200
    memory = server.memory()
    assert memory["draining"] is False and memory["drain_deadline_left_s"] is None
    assert server.ctl("POST", "/control/canary", {"timeout": 5}).json()["draining"] is False
    wait_for(lambda: "deadline" in lifts(server.proc.log()), 5, "a drain_lifted log line by the deadline")


def test_delete_lifts_a_drain_at_once_and_is_idempotent(server: Server) -> None:
    assert server.ctl("POST", "/control/drain", {"timeout": 0}).status_code == 200  # the default deadline, 300 s
    assert readyz(server) == 503
    assert 290 < server.memory()["drain_deadline_left_s"] <= 300
    r = server.ctl("DELETE", "/control/drain")
    assert r.status_code == 200 and r.json()["draining"] is False and r.json()["lifted"] is True, r.text
    assert readyz(server) == 200
    answered = complete(server)
    assert answered.status_code == 200 and len(answered.json()["choices"][0]["text"]) == 2
    again = server.ctl("DELETE", "/control/drain")
    assert again.status_code == 200 and again.json()["draining"] is False and again.json()["lifted"] is False
    assert "control" in lifts(server.proc.log())


@pytest.mark.parametrize("deadline", [0, -1, 3601, "10", True, None])
def test_a_bad_deadline_is_a_400_naming_it(server: Server, deadline: Any) -> None:
    r = server.ctl("POST", "/control/drain", {"timeout": 0, "deadline": deadline})
    assert r.status_code == 400 and r.json()["error"]["param"] == "deadline", r.text
    assert readyz(server) == 200  # nothing drained


async def test_the_sidecars_client_drains_lifts_and_sees_the_flag_in_its_canary(server: Server) -> None:
    async with aiohttp.ClientSession() as session:
        client = ControlClient(server.control, server.token, session)
        canary = CanarySampler(client, time.monotonic, timeout=5.0)
        drained = await client.drain(0.5, deadline=60)
        assert drained["draining"] is True and 50 < drained["deadline_left_s"] <= 60
        sample = await canary.sample()
        assert sample.ok and sample.draining
        lifted = await client.undrain()
        assert lifted["draining"] is False and lifted["lifted"] is True
        assert (await client.undrain())["lifted"] is False
        assert not (await canary.sample()).draining
        await client.drain(0.5)  # no deadline sent: the server's default
        assert 290 < (await client.memory())["drain_deadline_left_s"] <= contract.DRAIN_DEADLINE_DEFAULT_S
        await client.undrain()
    assert readyz(server) == 200


def test_the_shutdown_drain_outlives_an_earlier_deadline(server: Server) -> None:
    # Last of the server's tests: it ends the process.
    srv = server
    srv.fault("slow", delay_s=1.0)
    result: dict[str, requests.Response] = {}
    t = threading.Thread(target=lambda: result.setdefault("r", complete(srv)))
    t.start()
    wait_for(lambda: srv.memory()["inflight"] == 1 or "r" in result, 10, "a request in flight")
    assert "r" not in result, result["r"].text
    assert srv.ctl("POST", "/control/drain", {"timeout": 0, "deadline": 0.3}).status_code == 200
    lifted_before = lifts(srv.proc.log())
    srv.proc.proc.send_signal(signal.SIGTERM)
    time.sleep(0.8)  # past the control drain's deadline, the request still running
    assert srv.proc.proc.poll() is None
    assert readyz(srv) == 503
    assert complete(srv).status_code == 503
    refused = srv.ctl("DELETE", "/control/drain")
    assert refused.status_code == 409 and refused.json()["draining"] is True, refused.text
    t.join(timeout=30)
    assert result["r"].status_code == 200
    assert srv.proc.proc.wait(timeout=30) == 0
    assert lifts(srv.proc.log()) == lifted_before
    assert any(e.get("event") == "drain_deadline_passed" for e in json_lines(srv.proc.log()))


# -- the agent (examples/fastapi_service/app.py) ---------------------------------------------

TOKEN = "drain-agent-token"


def predict(app: Server) -> requests.Response:
    return requests.post(app.url + "/predict", json={"inputs": "hello", "max_new_tokens": 2}, timeout=30)


@pytest.fixture(scope="module")
def agent_app(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    app = start_app(ROOT / "examples/fastapi_service/app.py", tmp_path_factory.mktemp("drain-agent"), TOKEN)
    try:
        yield app
    finally:
        app.proc.stop()


def test_the_agents_drain_lifts_itself_at_its_deadline(agent_app: Server) -> None:
    assert predict(agent_app).status_code == 200
    r = agent_app.ctl("POST", "/control/drain", {"timeout": 1, "deadline": DEADLINE})
    assert r.status_code == 200 and r.json()["draining"] is True, r.text
    refused = predict(agent_app)
    assert refused.status_code == 503 and refused.json()["error"]["type"] == "draining"
    canary = agent_app.ctl("POST", "/control/canary", {"timeout": 5}).json()
    assert canary["ok"] is True and canary["draining"] is True
    memory = agent_app.memory()
    assert memory["ready"] is False and 0 < memory["drain_deadline_left_s"] <= DEADLINE
    wait_for(lambda: agent_app.memory()["ready"], DEADLINE + MARGIN, "the agent's drain to lift by itself")
    assert predict(agent_app).status_code == 200
    assert agent_app.ctl("POST", "/control/canary", {"timeout": 5}).json()["draining"] is False
    wait_for(lambda: "deadline" in lifts(agent_app.proc.log()), 5, "a drain_lifted log line by the deadline")


def test_the_agents_drain_lifted_by_delete(agent_app: Server) -> None:
    assert agent_app.ctl("POST", "/control/drain", {"timeout": 0}).status_code == 200
    assert predict(agent_app).status_code == 503
    r = agent_app.ctl("DELETE", "/control/drain")
    assert r.status_code == 200 and r.json()["draining"] is False and r.json()["lifted"] is True, r.text
    assert predict(agent_app).status_code == 200
    assert agent_app.memory()["draining"] is False
