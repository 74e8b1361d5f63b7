"""The dashboard's queries parse (promtool), and the fleet's panels and alerts ask for series the
sidecar really exposes, with the labels it puts on them (its own /metrics text, parsed)."""

from __future__ import annotations

import json
import re
import subprocess
from pathlib import Path
from typing import Any

import yaml
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from gpu_watchdog.watchdog.core import names
from gpu_watchdog.watchdog.core.fleet import Breaker, FleetView
from gpu_watchdog.watchdog.core.views import Snapshot
from gpu_watchdog.watchdog.edge.metrics import WatchdogMetrics
from tests.helpers import ROOT
from tests.tooling import require

DASH = ROOT / "dashboards"
# Labels Prometheus adds to every scraped series (the pod's, through the ServiceMonitor).
TARGET_LABELS = {"namespace", "pod", "job", "instance", "service", "container", "endpoint"}


def dashboard() -> dict[str, Any]:
    data: dict[str, Any] = json.loads((DASH / "gpu-watchdog.json").read_text())
    return data


def panel_queries() -> list[tuple[str, str]]:
    return [(p["title"], t["expr"]) for p in dashboard()["panels"] if p["type"] != "row" for t in p["targets"]]


def concrete(expr: str) -> str:
    """Grafana's variables as it substitutes them for 'All'."""
    return re.sub(r"\$(namespace|pod|gpu)\b", ".*", expr.replace("$__rate_interval", "1m"))


def test_every_panel_query_parses(tmp_path: Path) -> None:
    rules = {"groups": [{"name": "panels", "rules": [
        {"record": f"panel:query_{i}", "expr": concrete(expr)} for i, (_, expr) in enumerate(panel_queries())]}]}
    path = tmp_path / "panels.yaml"
    path.write_text(yaml.safe_dump(rules))
    out = subprocess.run([require("promtool"), "check", "rules", str(path)], capture_output=True, text=True,
                         timeout=60)
    assert out.returncode == 0, out.stdout + out.stderr


def exposed_fleet_series() -> dict[str, set[str]]:
    """What a sidecar whose workload's breaker is open and whose restart waits serves on /metrics:
    each sample's name and its labels."""
    breaker = Breaker(reason="context_loss", opened_at=1.0, held_at=2.0, replicas=4, restarted=("a", "b", "c"),
                      opened_by="c")
    view = FleetView(lease="demo-gpu-watchdog-fleet", replicas=4, max_unavailable=1, restarting=("a",),
                     breaker=breaker, held=names.FLEET_BREAKER_OPEN)
    snapshot = Snapshot(fleet=view, workload="demo-gpu-watchdog", states=frozenset({names.FLEET_BREAKER_OPEN}))
    metrics = WatchdogMetrics(lambda: snapshot)
    text = generate_latest(metrics.registry).decode()
    out: dict[str, set[str]] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            out.setdefault(sample.name, set()).update(sample.labels)
    return out


def fleet_queries() -> list[tuple[str, str]]:
    rules = yaml.safe_load((DASH / "alerts.yaml").read_text())["groups"][0]["rules"]
    queries = [(title, expr) for title, expr in panel_queries() if "fleet" in expr]
    queries += [(r["alert"], r["expr"]) for r in rules if "fleet" in r["expr"]]
    return queries


def test_the_fleet_panels_and_alerts_ask_for_what_the_sidecar_exposes() -> None:
    exposed = exposed_fleet_series()
    queries = fleet_queries()
    assert {"Fleet restart slots in use vs max", "Fleet breaker", "Restarts held by the fleet",
            "GPUWatchdogFleetBreakerOpen", "GPUWatchdogFleetRestartWaiting",
            "GPUWatchdogFleetLedgerUnknown"} <= {title for title, _ in queries}
    for title, expr in queries:
        used = set(re.findall(r"\b(gpu_watchdog_\w+)", expr))
        assert used, (title, expr)
        for name in used:
            assert name in exposed, f"{title}: {name} is not a series the sidecar exposes"
        grouped = {label.strip() for group in re.findall(r"\bby \(([^)]*)\)", expr) for label in group.split(",")}
        own = set.intersection(*(exposed[name] for name in used))
        assert grouped <= own | TARGET_LABELS, (title, grouped - own - TARGET_LABELS)


def test_the_fleet_states_asked_for_are_the_sidecars() -> None:
    """A state name misspelt in an alert matches nothing, so the alert can never fire."""
    asked = {state for _, expr in fleet_queries() for state in re.findall(r'state="(fleet_\w+)"', expr)}
    assert asked == {names.FLEET_UNAVAILABLE_LIMIT, names.FLEET_LEDGER_UNKNOWN}
    assert asked <= set(names.STATES)
    [pattern] = {m for _, expr in panel_queries() for m in re.findall(r'state=~"(fleet_[^"]*)"', expr)}
    assert {s for s in names.STATES if re.fullmatch(pattern, s)} == set(names.FLEET_HOLDS)


def test_the_quarantine_panel_and_alert_ask_for_what_the_sidecar_and_the_server_expose() -> None:
    from gpu_watchdog.inference.metrics import InferenceMetrics

    watchdog = WatchdogMetrics(lambda: Snapshot())
    watchdog.quarantined.labels(workload="llm").set(1)
    server = InferenceMetrics()
    server.quarantined.inc()
    exposed = exposed_series(watchdog.registry, server.registry)
    rules = yaml.safe_load((DASH / "alerts.yaml").read_text())["groups"][0]["rules"]
    queries = [(title, expr) for title, expr in panel_queries() if "quarantined" in expr]
    queries += [(r["alert"], r["expr"]) for r in rules if "quarantined" in r["expr"]]
    assert {"Requests quarantined (query of death)", "GPUWatchdogRequestQuarantined"} <= {t for t, _ in queries}
    assert_ask_for_exposed(queries, re.compile(r"\b(gpu_(?:watchdog|inference)_\w+)"), exposed)


def exposed_series(*registries: Any) -> dict[str, set[str]]:
    """Every sample name the registries expose, with the labels it carries."""
    exposed: dict[str, set[str]] = {}
    for registry in registries:
        for family in text_string_to_metric_families(generate_latest(registry).decode()):
            for sample in family.samples:
                exposed.setdefault(sample.name, set()).update(sample.labels)
    return exposed


def assert_ask_for_exposed(queries: list[tuple[str, str]], series: re.Pattern[str],
                           exposed: dict[str, set[str]]) -> None:
    """Each query's series (those `series` matches) is exposed, and grouped only by labels it has."""
    for title, expr in queries:
        for name in set(series.findall(expr)):
            assert name in exposed, f"{title}: {name} is not a series the sidecar or the server exposes"
            grouped = {label.strip() for group in re.findall(r"\bby \(([^)]*)\)", expr) for label in group.split(",")}
            assert grouped <= exposed[name] | TARGET_LABELS, (title, grouped - exposed[name] - TARGET_LABELS)


def test_the_worker_panels_and_alert_ask_for_what_serve_s_workers_expose() -> None:
    from gpu_watchdog.inference.front import WorkerMetrics
    from gpu_watchdog.inference.workers import Worker, WorkerPlan

    metrics = WorkerMetrics()
    w = Worker(WorkerPlan(1, "1", 8002, "/tmp/w1.sock"))
    metrics.update(w)
    metrics.exited(w, "context_lost")
    from gpu_watchdog.watchdog.core.samples import CanarySample, TorchSample

    row = (1, TorchSample(at=1, reachable=True, uuid="GPU-b"), CanarySample(at=1, ok=True, latency_s=0.1,
                                                                            error_class=None))
    sidecar = WatchdogMetrics(lambda: Snapshot(workers=(row,)))
    exposed = exposed_series(metrics.registry, sidecar.registry)
    rules = yaml.safe_load((DASH / "alerts.yaml").read_text())["groups"][0]["rules"]
    worker_series = re.compile(r"\b(gpu_(?:inference|watchdog)_worker_\w+)")
    queries = [(title, expr) for title, expr in panel_queries() if worker_series.search(expr)]
    queries += [(r["alert"], r["expr"]) for r in rules if worker_series.search(r["expr"])]
    assert {"Inference workers ready", "Worker restarts (by its server, the pod kept serving)",
            "Workers as the watchdog sees them (control API up, last canary)",
            "GPUInferenceWorkerRestarting"} <= {t for t, _ in queries}
    assert_ask_for_exposed(queries, worker_series, exposed)
