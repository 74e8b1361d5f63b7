"""Answers checked, on real processes: the bundled server answers a correctness probe on its control
canary, a corrupted card's answers deviate from its healthy ones, non-finite logits are never answered
with 200 (counted), and a sidecar with no fleet to agree a reference with acts on nothing and says so."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import requests
import yaml

from gpu_watchdog.watchdog.core import correctness
from gpu_watchdog.watchdog.core.settings import CorrectnessSettings
from tests.helpers import Server, free_port, json_lines, metric, spawn, start_server, wait_for, wait_http

SETTINGS = CorrectnessSettings(enabled=True)
PROMPT = correctness.PROMPTS[0]


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    srv = start_server(tmp_path_factory.mktemp("answers"), "--fault-injection")
    yield srv
    srv.proc.stop()


def ask(srv: Server, probe: dict[str, Any]) -> requests.Response:
    return srv.ctl("POST", "/control/canary", {"timeout": 10, "probe": probe})


def answer_of(srv: Server, prompt: str = PROMPT) -> correctness.Answer:
    r = ask(srv, {"prompt": prompt, "max_tokens": 3, "top_logprobs": 2})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["ok"], body
    return correctness.from_control(correctness.probe_id(prompt), body["answer"])


def test_the_control_canary_answers_a_probe_with_tokens_and_log_probabilities(server: Server) -> None:
    a, b = answer_of(server), answer_of(server)
    assert len(a.steps) == 3 and all(s.logprob is not None and s.margin is not None and s.margin >= 0
                                     for s in a.steps)
    assert correctness.compare(SETTINGS, a, b).result == correctness.MATCH
    # The plain canary is unchanged: no answer in it.
    plain = server.ctl("POST", "/control/canary", {"timeout": 10}).json()
    assert plain["ok"] and "answer" not in plain


@pytest.mark.parametrize(("probe", "field"), [
    ({"prompt": ""}, "probe.prompt"), ({"prompt": "x", "max_tokens": 99}, "probe.max_tokens"),
    ({"prompt": "x", "top_logprobs": 0}, "probe.top_logprobs"), ({"prompt": "x", "tokens": 3}, "probe.tokens"),
    ("x", "probe")])
def test_a_bad_probe_is_a_400_naming_its_field(server: Server, probe: Any, field: str) -> None:
    r = ask(server, probe)
    assert r.status_code == 400, r.text
    assert field in r.text


def test_a_corrupted_card_answers_what_the_healthy_one_did_not(server: Server) -> None:
    healthy = {p: answer_of(server, p) for p in correctness.PROMPTS}
    server.fault("corrupt", mode="perturb", amount=50.0)
    # `clear` leaves it: a bad memory row is not cleared by asking.
    server.fault("clear")
    assert server.memory()["faults"]["corrupt"] == {"mode": "perturb", "amount": 50.0}
    # The probes the fleet would ask: those whose first token leads by the margin.
    asked = [p for p in correctness.PROMPTS if (healthy[p].steps[0].margin or 0) >= SETTINGS.margin]
    assert asked
    results = [correctness.compare(SETTINGS, healthy[p], answer_of(server, p)).result for p in asked]
    assert all(r in correctness.DEVIATIONS for r in results), results
    # ... and the client is none the wiser: still 200 (what the probes are for).
    r = requests.post(server.url + "/v1/completions", json={"prompt": PROMPT, "max_tokens": 3}, timeout=30)
    assert r.status_code == 200


def test_non_finite_logits_fail_the_request_never_200_and_are_counted(server: Server) -> None:
    before = metric(server.url + "/metrics", "gpu_inference_nonfinite_total") or 0.0
    server.fault("corrupt", mode="nonfinite")
    r = requests.post(server.url + "/v1/completions", json={"prompt": "anything", "max_tokens": 4}, timeout=30)
    assert r.status_code == 500 and r.json()["error"]["type"] == "nonfinite", r.text
    with requests.post(server.url + "/v1/completions", json={"prompt": "stream", "max_tokens": 4, "stream": True},
                       stream=True, timeout=30) as s:
        text = s.text
    assert '"text"' not in text and "error" in text, text
    canary = ask(server, {"prompt": PROMPT}).json()
    assert not canary["ok"] and canary["nonfinite"] is True and "answer" not in canary
    assert (metric(server.url + "/metrics", "gpu_inference_nonfinite_total") or 0.0) >= before + 3
    # Not a lost context: the process goes on (the probes judge the card).
    assert not server.memory()["poisoned"]


def test_a_sidecar_with_no_fleet_to_agree_with_acts_on_nothing_and_says_so(tmp_path: Path) -> None:
    srv = start_server(tmp_path, "--fault-injection", name="alone")
    wport = free_port()
    config = tmp_path / "watchdog.yaml"
    config.write_text(yaml.safe_dump({
        "target": {"control_url": srv.control, "metrics_url": None},
        "canary": {"interval": "300ms", "timeout": "3s"}, "sampling": {"torch_interval": "1s"},
        "policy": {"correctness": {"enabled": True, "every": 1, "prompts": list(correctness.PROMPTS[:2])}},
        "restart": {"strategy": "none"}, "kubernetes": {"pod_name": "", "namespace": ""},
        "server": {"host": "127.0.0.1", "port": wport}}))
    wd = spawn(["run", "--config", str(config)], tmp_path / "watchdog.log", env={"GPU_WATCHDOG_TOKEN": srv.token})
    url = f"http://127.0.0.1:{wport}"
    try:
        wait_http(url + "/readyz", wd, timeout=60)
        srv.fault("corrupt", mode="perturb", amount=8.0)  # wrong from its first answer
        wait_for(lambda: (metric(url + "/metrics", "gpu_watchdog_correctness_probes_total",
                                 {"result": "no_reference"}) or 0) >= 4, 60, "four probes without a reference")
        status = requests.get(url + "/status", timeout=5).json()
        ref = status["correctness"]["reference"]
        assert ref["agreed"] is False and "2 needed" in ref["why"], ref
        assert metric(url + "/metrics", "gpu_watchdog_correctness_reference_agreed") == 0
        assert not [d for d in status["last_decisions"] if d["action"] == "restart"]
        said = [e for e in json_lines(wd.log()) if e.get("event") == "correctness_no_reference"]
        assert len(said) == 1 and said[0]["action"] == "nothing compared, nothing acted on"
    finally:
        wd.stop()
        srv.proc.stop()
