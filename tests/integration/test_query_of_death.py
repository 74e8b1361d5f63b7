"""The server's half of the query of death, on real processes: fingerprints in flight and at a
failure, a fault that fires for one request's prompt, the quarantine list refused with 422 (serve
and the agent alike)."""

from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import requests
import yaml

from gpu_watchdog.inference.fingerprint import fingerprint, input_fingerprint
from gpu_watchdog.inference.screen import KEY_ENV
from tests.helpers import (
    ROOT,
    Proc,
    Server,
    free_port,
    json_lines,
    metric,
    spawn,
    start_app,
    start_server,
    wait_for,
    wait_http,
)

COMPLETIONS = "/v1/completions"
CHAT = "/v1/chat/completions"


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
        # A read for what was answered (the sidecar's sync) does not let it go: it waits for the read
        # that takes the evidence (the restart's, which may come later on a loaded node).
        time.sleep(1.0)
        assert srv.proc.proc.poll() is None
        wrong = srv.ctl("GET", "/control/requests?evidence=maybe")
        assert wrong.status_code == 400 and wrong.json()["error"]["param"] == "evidence", wrong.text
        taken = srv.ctl("GET", "/control/requests?evidence=1").json()
        assert taken["at_failure"] == report["at_failure"]
        assert srv.proc.proc.wait(timeout=20) == 3
        assert not [e for e in json_lines(srv.proc.log()) if e.get("event") == "inflight_not_read"]
        text = termination_log.read_text()
        assert "illegal memory access" in text and f"inflight: {culprit}" in text
    finally:
        srv.proc.stop()


def test_an_input_is_refused_whatever_its_settings_and_a_failure_records_what_ran_beside_the_killer(
        tmp_path: Path) -> None:
    """The input fingerprint on a real server: a quarantined input refuses every setting and spelling
    of it (token ids, chat) and nothing else. Then the failure's record: two slots (the admission
    limit), both generating, the killer waiting for one with 40 fresh requests behind it; the step
    it joins loses the context, and the record is what ran in it (the newest 32 in flight were all
    the record kept, and the killer was never among them)."""
    key = "qod-integration-key"
    srv = start_server(tmp_path, "--fault-injection", "--max-concurrency", "2", env={KEY_ENV: key})
    killer = {"prompt": "run the KILLER shape", "max_tokens": 3}
    killer_input = input_fingerprint(key.encode(), killer)
    assert killer_input is not None
    try:
        until = time.time() + 600
        assert srv.ctl("POST", "/control/quarantine", {"fingerprint": killer_input, "until": until,
                                                       "failures": 3}).status_code == 200
        for body in ({**killer, "temperature": 0.7}, {**killer, "seed": 11, "max_tokens": 5},
                     {**killer, "stop": ["never matches"]}, {**killer, "presence_penalty": 1e-9},
                     {**killer, "n": 2}, {"prompt": list(b"run the KILLER shape"), "max_tokens": 3},
                     {"messages": [{"role": "user", "content": "run the KILLER shape"}], "max_tokens": 3}):
            refused = post(srv, body, CHAT if "messages" in body else COMPLETIONS)
            assert refused.status_code == 422, (body, refused.text)
            error = refused.json()["error"]
            assert error["code"] == "request_quarantined" and error["fingerprint"] == killer_input
            assert error["message"].startswith("this request's input") and "at 3 failures" in error["message"]
        ordinary = {"prompt": "an ordinary question", "max_tokens": 3}
        assert post(srv, ordinary).status_code == 200
        [line] = [e for e in json_lines(srv.proc.log()) if e.get("event") == "request" and e.get("status") == 200]
        assert line["fingerprint"] == fingerprint(key.encode(), ordinary)
        assert line["input_fingerprint"] == input_fingerprint(key.encode(), ordinary)
        assert srv.ctl("DELETE", f"/control/quarantine?fingerprint={killer_input}").json()["lifted"] is True

        srv.fault("slow", delay_s=0.01, when_prompt_contains="innocent story")  # long enough to queue behind
        srv.fault("context_loss", when_prompt_contains="KILLER")
        sent = {**killer, "temperature": 0.7}
        fresh = [{"prompt": f"fresh question {i}", "max_tokens": 3} for i in range(40)]
        stories = [{"prompt": f"an innocent story {n}", "max_tokens": m} for n, m in ((1, 150), (2, 500))]
        with ThreadPoolExecutor(len(fresh) + 4) as pool:
            running = [pool.submit(post, srv, body) for body in stories]
            wait_for(lambda: srv.memory()["inflight"] == 2, 30, "both slots taken")
            crash = pool.submit(post, srv, sent)
            wait_for(lambda: srv.memory()["queued"] == 1, 30, "the killer waiting for a slot")
            answers = [pool.submit(post, srv, body) for body in fresh]
            waiting = wait_for(lambda: (n := srv.ctl("GET", "/control/requests").json()["inflight_total"]) >= 43 and n,
                               30, "the 40 fresh requests in flight behind the killer")
            assert crash.result().status_code == 500
            report = srv.ctl("GET", "/control/requests").json()
            assert running[0].result().status_code == 200  # the short story ended, freeing a slot
            assert all(a.result().status_code in (500, 503) for a in answers)
        frozen = report["at_failure"]
        killer_fp = fingerprint(key.encode(), sent)
        assert waiting >= 43 and killer_fp in frozen["inflight"]
        assert frozen["inputs"][frozen["inflight"].index(killer_fp)] == killer_input
        # What ran in the step: the killer and what shared the other slot, never the requests waiting.
        assert frozen["inflight_total"] <= 2 and len(frozen["inflight"]) <= 2
        beside = set(frozen["inflight"]) - {killer_fp}
        assert beside <= {fingerprint(key.encode(), body) for body in (*stories, *fresh)}
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
        # The same computation spelt otherwise (fields at their defaults, another user): refused too.
        assert post(srv, {**body, "n": 1, "stop": None, "user": "someone else"}).status_code == 422
        # Anything that changes the work is another request: a longer answer, another sampler.
        assert post(srv, {**body, "max_tokens": 5}).status_code == 200
        assert post(srv, {**body, "temperature": 0.7}).status_code == 200
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


def serve_on(tmp_path: Path, port: int, control_port: int, token: str, name: str) -> Server:
    """The bundled server on the same ports again: the container restarted in place."""
    return start_server(tmp_path, "--fault-injection", name=name, ports=(port, control_port), token=token)


def test_a_failure_the_budget_blocks_the_restart_of_is_still_recorded_and_quarantines(tmp_path: Path) -> None:
    """The restart budget spent, a request that kills each new process of the container (restarted in
    place by the kubelet, not by the sidecar) is still recorded at every failure, and quarantined."""
    port, control_port, token = free_port(), free_port(), "qod-budget-token"
    verdict = tmp_path / "verdict" / "restart"
    verdict.parent.mkdir()
    wport = free_port()
    config = tmp_path / "watchdog.yaml"
    config.write_text(yaml.safe_dump({
        "target": {"control_url": f"http://127.0.0.1:{control_port}", "metrics_url": f"http://127.0.0.1:{port}/metrics"},
        "sampling": {"torch_interval": "300ms", "server_interval": "1s"},
        "canary": {"interval": "500ms", "timeout": "2s"},
        "policy": {"restart_budget": {"max_restarts": 1, "window": "1h"},
                   "quarantine": {"enabled": True, "failures": 2, "window": "1h", "ttl": "1h", "confirm": "2s"}},
        "restart": {"strategy": "container", "verdict_file": str(verdict)},
        "kubernetes": {"pod_name": "", "namespace": ""},
        "server": {"host": "127.0.0.1", "port": wport},
    }))
    wd_url = f"http://127.0.0.1:{wport}"
    servers: list[Server] = [serve_on(tmp_path, port, control_port, token, "serve-1")]
    wd: Proc = spawn(["run", "--config", str(config)], tmp_path / "watchdog.log", env={"GPU_WATCHDOG_TOKEN": token})

    def status() -> dict[str, Any]:
        doc: dict[str, Any] = requests.get(wd_url + "/status", timeout=5).json()
        return doc

    def recorded() -> list[dict[str, Any]]:
        return [e for e in json_lines(wd.log()) if e.get("event") == "failure_recorded"]

    def crash(srv: Server, marker: str) -> str:
        """A request whose prompt has `marker` loses the process's context; its fingerprint, once the
        process has left (as a poisoned server does)."""
        srv.fault("context_loss", when_prompt_contains=marker)
        bad = post(srv, {"prompt": f"please run the {marker} shape", "max_tokens": 3})
        assert bad.status_code == 500 and bad.json()["error"]["type"] == "fatal_cuda"
        assert srv.proc.proc.wait(timeout=30) == 3
        [fp] = {e["fingerprint"] for e in json_lines(srv.proc.log()) if e.get("event") == "request"
                and e.get("status") == 500}
        assert isinstance(fp, str)
        return fp

    try:
        wait_http(wd_url + "/readyz", wd, timeout=60)
        # The budget's one restart, spent on another request's failure: recorded, and restarted.
        first = servers[0]
        first_process = first.ctl("GET", "/control/requests").json()["instance_id"]
        other = crash(first, "FIRST")
        wait_for(verdict.exists, 30, "the restart's verdict")
        assert [r["reason"] for r in status()["restarts"]] == ["context_loss"]
        servers.append(serve_on(tmp_path, port, control_port, token, "serve-2"))
        wait_for(lambda: not verdict.exists(), 30, "the verdict cleared once the new container serves")
        assert status()["restart_budget_remaining"] == 0

        # Now the budget holds every restart back: the kubelet restarts the crashed container, the
        # same request kills it again, and each failure is recorded all the same.
        processes = []
        culprit = None
        for n in (2, 3):
            srv = servers[-1]
            processes.append(srv.ctl("GET", "/control/requests").json()["instance_id"])
            culprit = crash(srv, "KILLER")
            wait_for(lambda: any(e["process"] == processes[-1] for e in recorded()), 30,
                     f"the failure of process {n} recorded although its restart is blocked")
            if n == 2:
                assert status()["quarantine"]["entries"] == []  # one process: not enough
            servers.append(serve_on(tmp_path, port, control_port, token, f"serve-{n + 1}"))

        lines = recorded()
        assert [e["process"] for e in lines] == [first_process, *processes]  # once per failing process
        assert other in lines[0]["inflight"] and all(culprit in e["inflight"] for e in lines[1:])
        log = json_lines(wd.log())
        assert [e["reason"] for e in log if e.get("event") == "restart_blocked"] == ["context_loss"]
        doc = status()
        assert [q["fingerprint"] for q in doc["quarantine"]["entries"]] == [culprit]
        [entry] = doc["quarantine"]["entries"]
        assert entry["active"] and sorted(f["process"] for f in entry["failures"]) == sorted(processes)
        assert [e["fingerprint"] for e in log if e.get("event") == "request_quarantined"] == [culprit]
        # The next process is told before it serves it: refused, and nothing else is.
        last = servers[-1]
        wait_for(lambda: [e["fingerprint"] for e in last.ctl("GET", "/control/quarantine").json()["entries"]]
                 == [culprit], 30, "the quarantine pushed to the new process")
        assert post(last, {"prompt": "please run the KILLER shape", "max_tokens": 3}).status_code == 422
        assert post(last, {"prompt": "an ordinary question", "max_tokens": 3}).status_code == 200
        # Nothing restarted after the first: no verdict, one restart, the blocked ones said as such.
        doc = status()
        assert not verdict.exists() and [r["reason"] for r in doc["restarts"]] == ["context_loss"]
        assert any(d["outcome"] == "blocked_by_budget" and d["reason"] == "context_loss"
                   for d in doc["last_decisions"])
    finally:
        wd.stop()
        for srv in servers:
            srv.proc.stop()


def test_a_new_process_serves_only_once_its_quarantine_list_has_arrived(tmp_path: Path) -> None:
    """`--quarantine-wait`: loaded, the process stays unready and answers 503 + Retry-After until the
    sidecar's list arrives (an empty one too), and serves then with that list in force; its canary
    answers meanwhile, so the sidecar still sees the model serve."""
    port, control_port = free_port(), free_port()
    srv = Server(port, control_port, f"test-token-{port}",
                 spawn(["serve", "--device", "cpu", "--host", "127.0.0.1", "--port", str(port), "--control-port",
                        str(control_port), "--quarantine-wait", "600"], tmp_path / "serve.log",
                       env={"GPU_WATCHDOG_TOKEN": f"test-token-{port}"}))
    try:
        wait_http(srv.url + "/readyz", srv.proc, status=503)
        wait_for(lambda: requests.get(srv.url + "/readyz", timeout=5).json().get("reason") == "awaiting_quarantine",
                 90, "the model loaded, the list awaited")
        body = {"prompt": "a question the fleet quarantined", "max_tokens": 4}
        waiting = post(srv, body)
        assert waiting.status_code == 503 and waiting.headers["Retry-After"]
        assert "quarantine list" in waiting.json()["error"]["message"]
        listed = srv.ctl("GET", "/control/quarantine").json()
        assert listed["received"] is False and listed["entries"] == []
        assert srv.ctl("POST", "/control/canary", {"timeout": 30}).json()["ok"] is True
        assert srv.memory()["ready"] is False

        fp_entry = {"fingerprint": "0" * 16, "until": time.time() + 600}
        assert srv.ctl("PUT", "/control/quarantine", {"entries": [fp_entry]}).json()["received"] is True
        assert requests.get(srv.url + "/readyz", timeout=5).status_code == 200
        assert post(srv, body).status_code == 200
        fp = logged_fingerprint(srv)
        assert srv.ctl("PUT", "/control/quarantine",
                       {"entries": [{"fingerprint": fp, "until": time.time() + 600}]}).status_code == 200
        assert post(srv, body).status_code == 422
        assert [e["event"] for e in json_lines(srv.proc.log()) if e.get("event") == "quarantine_received"] \
            == ["quarantine_received"]
    finally:
        srv.proc.stop()


def test_a_process_whose_sidecar_never_sends_the_list_serves_after_the_wait(tmp_path: Path) -> None:
    srv = start_server(tmp_path, "--quarantine-wait", "1")
    try:
        assert post(srv, {"prompt": "hello", "max_tokens": 2}).status_code == 200
        assert srv.ctl("GET", "/control/quarantine").json()["received"] is False
        over = [e for e in json_lines(srv.proc.log()) if e.get("event") == "quarantine_wait_over"]
        assert len(over) == 1 and over[0]["waited_s"] == 1.0
    finally:
        srv.proc.stop()
