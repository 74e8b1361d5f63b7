"""The server's half of the query of death, on real processes: fingerprints in flight and at a
failure, a fault that fires for one request's prompt, the quarantine list refused with 422 (serve
and the agent alike)."""

from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import Any

import requests

from tests.helpers import ROOT, Server, json_lines, metric, start_app, start_server, wait_for

COMPLETIONS = "/v1/completions"


def post(srv: Server, body: dict[str, Any], path: str = COMPLETIONS, timeout: float = 60) -> requests.Response:
    return requests.post(srv.url + path, json=body, timeout=timeout)


def logged_fingerprint(srv: Server, nth_request: int = -1) -> str:
    """The fingerprint the access log line gives a request (an operator finds the client by it)."""
    lines = [e for e in json_lines(srv.proc.log()) if e.get("event") == "request" and e.get("fingerprint")]
    fp = lines[nth_request]["fingerprint"]
    assert isinstance(fp, str) and len(fp) == 16
    return fp


def test_a_fault_for_one_prompt_kills_only_that_request_and_what_was_in_flight_is_kept(tmp_path: Path) -> None:
    termination_log = tmp_path / "termination-log"
    srv = start_server(tmp_path, "--fault-injection", env={"GPU_WATCHDOG_TERMINATION_LOG": str(termination_log)})
    try:
        srv.fault("context_loss", when_prompt_contains="KILLER")
        ok = post(srv, {"prompt": "an ordinary question", "max_tokens": 3})
        assert ok.status_code == 200, ok.text
        innocent = logged_fingerprint(srv)
        # Every time, until cleared: the unmarked request above ran after the fault was armed.
        bad = post(srv, {"prompt": "please run the KILLER shape", "max_tokens": 3})
        assert bad.status_code == 500 and bad.json()["error"]["type"] == "fatal_cuda"
        culprit = wait_for(lambda: logged_fingerprint(srv) if logged_fingerprint(srv) != innocent else None, 10,
                           "the failed request's log line")
        assert srv.memory()["poisoned"] is True
        report = srv.ctl("GET", "/control/requests").json()
        assert report["at_failure"]["inflight"] == [culprit] and report["at_failure"]["newest"] == culprit
        assert innocent in report["completed"] and culprit not in report["completed"]
        assert srv.proc.proc.wait(timeout=20) == 3
        text = termination_log.read_text()
        assert "illegal memory access" in text and f"inflight: {culprit}" in text
    finally:
        srv.proc.stop()


def test_a_quarantined_request_is_refused_with_422_and_nothing_else_is(tmp_path: Path) -> None:
    srv = start_server(tmp_path)
    try:
        body = {"prompt": "the same question", "max_tokens": 4}
        assert post(srv, body).status_code == 200
        fp = logged_fingerprint(srv)
        bad = srv.ctl("POST", "/control/quarantine", {"fingerprint": "not hex", "until": 1})
        assert bad.status_code == 400 and bad.json()["error"]["param"] == "fingerprint"
        bad = srv.ctl("PUT", "/control/quarantine", {"entries": [{"fingerprint": fp}]})
        assert bad.status_code == 400 and bad.json()["error"]["param"] == "entries[0].until"
        until = time.time() + 600
        r = srv.ctl("POST", "/control/quarantine", {"fingerprint": fp, "until": until, "failures": 2,
                                                    "pods": ["llm-a", "llm-b"]})
        assert r.status_code == 200 and [e["fingerprint"] for e in r.json()["entries"]] == [fp]

        refused = post(srv, body)
        assert refused.status_code == 422
        error = refused.json()["error"]
        assert error["code"] == "request_quarantined" and error["fingerprint"] == fp
        assert "in flight at 2 failures of this service and is refused until" in error["message"]
        # Knobs that change only which tokens are drawn are the same computation: refused too.
        assert post(srv, {**body, "temperature": 0.7, "user": "someone else"}).status_code == 422
        # Anything that changes the work is another request.
        assert post(srv, {**body, "max_tokens": 5}).status_code == 200
        assert post(srv, {"prompt": "another question", "max_tokens": 4}).status_code == 200
        assert metric(srv.url + "/metrics", "gpu_inference_quarantined_total") == 2.0
        refusals = [e for e in json_lines(srv.proc.log()) if e.get("event") == "request_quarantined"]
        assert len(refusals) == 2 and refusals[0]["fingerprint"] == fp

        lifted = srv.ctl("DELETE", f"/control/quarantine?fingerprint={fp}").json()
        assert lifted["lifted"] is True and lifted["entries"] == []
        assert post(srv, body).status_code == 200
        # The sidecar's sync replaces the whole list.
        r = srv.ctl("PUT", "/control/quarantine", {"entries": [{"fingerprint": fp, "until": until}]})
        assert r.status_code == 200 and post(srv, body).status_code == 422
        assert srv.ctl("PUT", "/control/quarantine", {"entries": []}).status_code == 200
        assert post(srv, body).status_code == 200
    finally:
        srv.proc.stop()


def test_the_agent_fingerprints_refuses_and_reports_what_hangs(tmp_path: Path) -> None:
    token = "qod-agent-token"
    app = start_app(ROOT / "examples/fastapi_service/app.py", tmp_path, token, "--fault-injection")
    try:
        app.fault("hang", when_prompt_contains="WEDGE")
        assert requests.post(app.url + "/predict", json={"inputs": "fine", "max_new_tokens": 2},
                             timeout=30).status_code == 200
        hung: list[requests.Response] = []
        worker = threading.Thread(target=lambda: hung.append(requests.post(
            app.url + "/predict", json={"inputs": "a WEDGE input", "max_new_tokens": 2}, timeout=60)))
        worker.start()
        report = wait_for(lambda: (r := app.ctl("GET", "/control/requests").json())["inflight"] and r, 10,
                          "the hung request in flight")
        [stuck] = report["inflight"]
        assert report["newest"] == stuck and report["at_failure"] is None and len(report["completed"]) == 1
        # Other requests still run beside the hung one.
        assert requests.post(app.url + "/predict", json={"inputs": "fine too", "max_new_tokens": 2},
                             timeout=30).status_code == 200
        r = app.ctl("POST", "/control/quarantine", {"fingerprint": stuck, "until": time.time() + 60})
        assert r.status_code == 200
        refused = requests.post(app.url + "/predict", json={"inputs": "a WEDGE input", "max_new_tokens": 2},
                                timeout=30)
        assert refused.status_code == 422 and refused.json()["error"]["code"] == "request_quarantined"
        assert metric(app.url + "/metrics", "gpu_inference_quarantined_total") == 1.0
        app.fault("clear")
        worker.join(timeout=30)
        assert hung and hung[0].status_code == 200
        assert app.ctl("GET", "/control/requests").json()["inflight"] == []
    finally:
        app.proc.stop()
