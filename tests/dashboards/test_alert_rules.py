"""Alert rules checked by promtool, routing checked by amtool."""

from __future__ import annotations

import subprocess

import yaml

from tests.helpers import ROOT
from tests.tooling import require

DASH = ROOT / "dashboards"


def rules() -> list[dict[str, object]]:
    data = yaml.safe_load((DASH / "alerts.yaml").read_text())
    return [r for g in data["groups"] for r in g["rules"]]


def test_promtool_check_rules() -> None:
    out = subprocess.run([require("promtool"), "check", "rules", str(DASH / "alerts.yaml")], capture_output=True,
                         text=True, timeout=60)
    assert out.returncode == 0, out.stdout + out.stderr
    assert f"SUCCESS: {len(rules())} rules found" in out.stdout + out.stderr


def test_promtool_unit_tests_pass() -> None:
    out = subprocess.run([require("promtool"), "test", "rules", "alerts_test.yaml"], cwd=DASH, capture_output=True,
                         text=True, timeout=60)
    assert out.returncode == 0, out.stdout + out.stderr


def test_every_alert_both_fires_and_stays_silent_in_the_unit_tests() -> None:
    tests = yaml.safe_load((DASH / "alerts_test.yaml").read_text())["tests"]
    fires, silent = set(), set()
    for t in tests:
        for case in t["alert_rule_test"]:
            (fires if case["exp_alerts"] else silent).add(case["alertname"])
    names = {r["alert"] for r in rules()}
    assert names == fires
    assert names == silent


def test_every_alert_has_severity_summary_and_runbook() -> None:
    runbook = (DASH / "RUNBOOK.md").read_text()
    for r in rules():
        labels, ann = r["labels"], r["annotations"]
        assert isinstance(labels, dict) and labels["severity"] in ("critical", "warning"), r["alert"]
        assert isinstance(ann, dict) and ann["summary"] and ann["runbook"].endswith(str(r["alert"]).lower())
        assert f"## {r['alert']}" in runbook


def route(*labels: str) -> str:
    out = subprocess.run([require("amtool"), "config", "routes", "test",
                          f"--config.file={DASH / 'alertmanager-example.yaml'}", *labels],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    return out.stdout.strip()


def test_alertmanager_example_pages_when_the_watchdog_can_no_longer_help_and_tickets_the_rest() -> None:
    out = subprocess.run([require("amtool"), "check-config", str(DASH / "alertmanager-example.yaml")],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stdout + out.stderr
    for r in rules():
        labels = {**r["labels"], "alertname": r["alert"]}  # type: ignore[dict-item]
        receiver = route(*(f"{k}={v}" for k, v in labels.items()))
        pages = ("GPUWatchdogContextLoss", "GPUWatchdogRestartBudgetExhausted", "GPUWatchdogFleetBreakerOpen")
        expected = "pager" if r["alert"] in pages else "ticket"
        assert receiver == expected, (r["alert"], receiver)
