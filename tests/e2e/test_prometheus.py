"""A real Prometheus scrapes a running `gpu-watchdog up`; every dashboard and alert query runs against it."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import time
from collections.abc import Iterator
from typing import Any

import pytest
import requests
import yaml

from tests.helpers import ROOT, Proc, free_port, spawn, wait_for, wait_http
from tests.tooling import require

# Panels whose series exist on any running stack, GPU or not (the NVML and 5xx panels need a GPU or errors).
ALWAYS_PRESENT = {
    "Torch reserved vs allocated", "Fragmentation ratio", "Canary success", "Canary latency p50 / p99",
    "empty_cache by reason", "Restarts by reason (1h)", "Restart budget remaining", "Watchdog state",
    "Request rate by status", "Request latency p50 / p99", "In-flight and queued vs admission limit", "OOMs",
    "Batch size p50 / max", "Tokens per second", "Server requests running / waiting",
    "Server generated tokens per second", "Saturated / starting", "Admission limit (watchdog) and its changes",
}


def dashboard() -> dict[str, Any]:
    data: dict[str, Any] = json.loads((ROOT / "dashboards" / "gpu-watchdog.json").read_text())
    return data


def concrete(expr: str) -> str:
    """Grafana variables -> what Prometheus understands, as Grafana would substitute them for 'All'."""
    expr = expr.replace("$__rate_interval", "1m")
    return re.sub(r"\$(namespace|pod|gpu)\b", ".*", expr)


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    tmp = tmp_path_factory.mktemp("prom")
    config = tmp / "watchdog.yaml"
    config.write_text("canary: {interval: 500ms, timeout: 2s}\nsampling: {torch_interval: 500ms}\n")
    port, control_port, wport, pport = free_port(), free_port(), free_port(), free_port()
    up: Proc = spawn(["up", "--device", "cpu", "--host", "127.0.0.1", "--port", str(port),
                      "--control-port", str(control_port), "--watchdog-port", str(wport), "--config", str(config)],
                     tmp / "up.log")
    prom_cfg = tmp / "prometheus.yml"
    shutil.copy(ROOT / "dashboards" / "alerts.yaml", tmp / "alerts.yaml")
    prom_cfg.write_text(yaml.safe_dump({
        "global": {"scrape_interval": "1s", "evaluation_interval": "1s"},
        "rule_files": ["alerts.yaml"],
        "scrape_configs": [
            {"job_name": "inference", "static_configs": [{"targets": [f"127.0.0.1:{port}"]}]},
            {"job_name": "watchdog", "static_configs": [{"targets": [f"127.0.0.1:{wport}"]}]},
        ],
    }))
    prometheus = require("prometheus")
    prom_log = open(tmp / "prometheus.log", "wb")
    prom = subprocess.Popen([prometheus, f"--config.file={prom_cfg}", f"--storage.tsdb.path={tmp / 'tsdb'}",
                             f"--web.listen-address=127.0.0.1:{pport}"], stdout=prom_log, stderr=subprocess.STDOUT)
    try:
        wait_http(f"http://127.0.0.1:{wport}/readyz", up, timeout=120)
        api = f"http://127.0.0.1:{port}"
        for i in range(12):
            r = requests.post(api + "/v1/completions", json={"prompt": f"scrape me {i}", "max_tokens": 4}, timeout=30)
            assert r.status_code == 200
        prom_url = f"http://127.0.0.1:{pport}"
        wait_for(lambda: _targets_up(prom_url) == 2, 60, "both targets scraped")
        wait_for(lambda: _has_data(prom_url, "rate(gpu_inference_requests_total[1m])"), 60, "a rate over traffic")
        yield {"prometheus": prom_url, "api": api}
    finally:
        prom.terminate()
        prom.wait(timeout=20)
        prom_log.close()
        up.stop(timeout=20)


def _targets_up(prom: str) -> int:
    try:
        data = requests.get(prom + "/api/v1/targets", timeout=5).json()["data"]["activeTargets"]
    except (requests.RequestException, KeyError, ValueError):
        return 0
    return sum(1 for t in data if t["health"] == "up")


def query(prom: str, expr: str) -> dict[str, Any]:
    r = requests.get(prom + "/api/v1/query", params={"query": expr}, timeout=10)
    assert r.status_code == 200, f"{expr}: {r.text}"
    body: dict[str, Any] = r.json()
    assert body["status"] == "success"
    return body


def _has_data(prom: str, expr: str) -> bool:
    return bool(query(prom, expr)["data"]["result"])


def test_every_panel_query_parses_and_always_present_panels_have_data(stack: dict[str, Any]) -> None:
    panels = [p for p in dashboard()["panels"] if p["type"] != "row"]
    titles = {p["title"] for p in panels}
    assert ALWAYS_PRESENT <= titles

    def empty_panels() -> list[str]:
        empty = []
        for panel in panels:  # every query must parse, every time
            results = [query(stack["prometheus"], concrete(t["expr"]))["data"]["result"] for t in panel["targets"]]
            if panel["title"] in ALWAYS_PRESENT and not any(results):
                empty.append(panel["title"])
        return empty

    # rate()/increase() need two scrapes of each target inside their window; give them that time.
    deadline = time.monotonic() + 60
    missing = empty_panels()
    while missing and time.monotonic() < deadline:
        time.sleep(1)
        missing = empty_panels()
    assert missing == []


def test_dashboard_variables_query_real_series(stack: dict[str, Any]) -> None:
    for var in dashboard()["templating"]["list"]:
        if var["type"] != "query":
            continue
        m = re.fullmatch(r"label_values\((.+),\s*(\w+)\)", var["query"]["query"])
        assert m, var["query"]
        r = requests.get(stack["prometheus"] + "/api/v1/series", params={"match[]": concrete(m.group(1))}, timeout=10)
        assert r.status_code == 200 and r.json()["status"] == "success", r.text


def test_alert_rules_load_and_evaluate_in_prometheus(stack: dict[str, Any]) -> None:
    rules = yaml.safe_load((ROOT / "dashboards" / "alerts.yaml").read_text())["groups"][0]["rules"]
    for rule in rules:
        query(stack["prometheus"], rule["expr"])

    def evaluated() -> list[dict[str, Any]] | None:
        groups = requests.get(stack["prometheus"] + "/api/v1/rules", timeout=5).json()["data"]["groups"]
        loaded = [r for g in groups for r in g["rules"]]
        return loaded if loaded and all(r.get("lastEvaluation", "").startswith("2") for r in loaded) else None

    loaded = wait_for(evaluated, 30, "rules evaluated")
    assert {r["name"] for r in loaded} == {r["alert"] for r in rules}
    assert all(r["health"] == "ok" for r in loaded), loaded
    # A healthy stack pages nobody.
    firing = [r["name"] for r in loaded if r["state"] == "firing"]
    assert firing == []


def test_metric_names_match_the_contract(stack: dict[str, Any]) -> None:
    names = set(requests.get(stack["prometheus"] + "/api/v1/label/__name__/values", timeout=10).json()["data"])
    for name in ("gpu_watchdog_torch_reserved_bytes", "gpu_watchdog_canary_success",
                 "gpu_watchdog_canary_duration_seconds_bucket", "gpu_watchdog_restarts_total",
                 "gpu_watchdog_restart_budget_remaining", "gpu_watchdog_state", "gpu_watchdog_empty_cache_total",
                 "gpu_watchdog_sample_duration_seconds_bucket", "gpu_inference_requests_total",
                 "gpu_inference_request_duration_seconds_bucket", "gpu_inference_inflight_requests",
                 "gpu_inference_queued_requests", "gpu_inference_admission_limit", "gpu_inference_ooms_total",
                 "gpu_inference_batch_size_bucket", "gpu_inference_generated_tokens_total",
                 "gpu_inference_empty_cache_total", "gpu_inference_fatal_errors_total",
                 # The target's own signals (here the bundled server's /metrics) and the ladder.
                 "gpu_watchdog_server_requests_running", "gpu_watchdog_server_requests_waiting",
                 "gpu_watchdog_server_generated_tokens_total", "gpu_watchdog_admission_limit",
                 "gpu_watchdog_admission_changes_total"):
        assert name in names, name

