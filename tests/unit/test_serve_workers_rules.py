"""`serve --workers N`'s pure parts: which worker a request goes to, how soon an exited one starts
again, which card and port each gets, and the merged `/metrics`."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from gpu_watchdog.inference.front import label_sample, merge_metrics
from gpu_watchdog.inference.poison import EXIT_TOLD, exit_code
from gpu_watchdog.inference.settings import ServeSettings, SettingsError
from gpu_watchdog.inference.workers import BACKOFF_MAX_S, Worker, WorkerPlan, backoff, pick, plan_workers


class Running:
    returncode = None


def worker(k: int, inflight: int = 0, limit: int = 2, ready: bool = True) -> Worker:
    w = Worker(WorkerPlan(k, None, 8001 + k, f"/tmp/w{k}.sock"), ready=ready, limit=limit, inflight=inflight)
    w.proc = Running()  # type: ignore[assignment]
    return w


def test_a_request_goes_to_the_least_loaded_ready_worker_with_room() -> None:
    ws = [worker(0, inflight=2), worker(1, inflight=1), worker(2, inflight=0, ready=False)]
    assert pick(ws, set()) is ws[1]
    assert pick(ws, {1}) is ws[0]  # full, but ready: its own gate queues it
    assert pick(ws, {0, 1}) is None  # not ready gets nothing
    ws[2].ready = True
    assert pick(ws, set()) is ws[2]


def test_a_worker_whose_process_is_gone_gets_nothing_whatever_it_last_said() -> None:
    ws = [worker(0), worker(1)]
    ws[0].proc = None
    assert pick(ws, set()) is ws[1]


def test_full_workers_share_by_how_full_they_are() -> None:
    ws = [worker(0, inflight=3, limit=2), worker(1, inflight=5, limit=4)]
    assert pick(ws, set()) is ws[1]  # 5/4 < 3/2


def test_backoff_doubles_from_one_second_and_stops_at_its_cap() -> None:
    assert backoff(0) == 0.0
    assert [backoff(n) for n in (1, 2, 3, 4)] == [1.0, 2.0, 4.0, 8.0]
    assert backoff(50) == BACKOFF_MAX_S


def test_each_worker_gets_its_card_and_the_next_control_port(tmp_path: Path) -> None:
    s = ServeSettings(workers=3, device="cuda", control_port=9001)
    plans = plan_workers(s, tmp_path, {"CUDA_VISIBLE_DEVICES": "GPU-a,GPU-b,GPU-c,GPU-d"}, has_gpu=True)
    assert [(p.gpu, p.control_port) for p in plans] == [("GPU-a", 9001), ("GPU-b", 9002), ("GPU-c", 9003)]
    env = plans[1].env({"CUDA_VISIBLE_DEVICES": "GPU-a,GPU-b", "GPU_WATCHDOG_INSTANCE_ID": "x", "HOME": "/h"})
    assert env["CUDA_VISIBLE_DEVICES"] == "GPU-b" and env["GPU_WATCHDOG_WORKER"] == "1"
    assert "GPU_WATCHDOG_INSTANCE_ID" not in env and env["HOME"] == "/h"
    argv = plans[2].argv(s)
    assert argv[argv.index("--control-port") + 1] == "9003"
    assert argv[argv.index("--unix-socket") + 1] == plans[2].socket
    assert "--workers" not in argv
    cpu = plan_workers(ServeSettings(workers=2, device="auto"), tmp_path, {}, has_gpu=False)
    assert [p.gpu for p in cpu] == [None, None]
    assert "CUDA_VISIBLE_DEVICES" not in cpu[0].env({})


@pytest.mark.parametrize(("settings", "env", "message"), [
    (ServeSettings(workers=3, device="cuda"), {"CUDA_VISIBLE_DEVICES": "0,1"}, "names 2 GPU(s)"),
    (ServeSettings(workers=2, port=8002, control_port=8001), {}, "--port 8002 is one of the workers' control"),
    (ServeSettings(workers=2, control_port=65535), {}, "past port 65535"),
    (ServeSettings(workers=2, control_port=0), {}, "needs a --control-port"),
])
def test_plans_that_cannot_work_are_refused_naming_the_flag(tmp_path: Path, settings: ServeSettings,
                                                            env: dict[str, str], message: str) -> None:
    with pytest.raises(SettingsError, match=re.escape(message)):
        plan_workers(settings, tmp_path, env, has_gpu=True)


def test_workers_and_a_unix_socket_are_one_process_s_or_the_others() -> None:
    with pytest.raises(SettingsError, match="--workers must be between 1 and 64"):
        ServeSettings(workers=0)
    with pytest.raises(SettingsError, match="--unix-socket"):
        ServeSettings(workers=2, unix_socket="/tmp/x.sock")


def test_label_sample_puts_the_worker_first_in_any_sample() -> None:
    assert label_sample('a_total{route="/x",code="200"} 3.0', "1") == 'a_total{worker="1",route="/x",code="200"} 3.0'
    assert label_sample("b 1.5", "0") == 'b{worker="0"} 1.5'
    assert label_sample("c{} 2", "2") == 'c{worker="2"} 2'
    assert label_sample('d{x="a b{c}"} 1 1700000000', "0") == 'd{worker="0",x="a b{c}"} 1 1700000000'


def _exposition(requests: float, inflight: float) -> str:
    r = CollectorRegistry()
    Counter("gpu_inference_requests", "Requests", ["route", "code"], registry=r).labels("/v1/completions", "200").inc(
        requests)
    Gauge("gpu_inference_inflight_requests", "In flight", registry=r).set(inflight)
    h = Histogram("gpu_inference_request_duration_seconds", "Latency", ["route"], buckets=(0.1, 1), registry=r)
    h.labels("/v1/completions").observe(0.5)
    return generate_latest(r).decode()


def test_merged_metrics_parse_as_one_exposition_with_every_worker_s_series() -> None:
    text = merge_metrics({"0": _exposition(3, 1), "1": _exposition(5, 2)})
    families = {f.name: f for f in text_string_to_metric_families(text)}
    assert text.count("# TYPE gpu_inference_requests_total counter") == 1
    reqs = {s.labels["worker"]: s.value for s in families["gpu_inference_requests"].samples
            if s.name == "gpu_inference_requests_total"}
    assert reqs == {"0": 3.0, "1": 5.0}
    inflight = {s.labels["worker"]: s.value for s in families["gpu_inference_inflight_requests"].samples}
    assert inflight == {"0": 1.0, "1": 2.0}
    buckets = [s for s in families["gpu_inference_request_duration_seconds"].samples if s.name.endswith("_bucket")]
    assert {(s.labels["worker"], s.labels["le"]) for s in buckets} == {
        (w, le) for w in "01" for le in ("0.1", "1.0", "+Inf")}


def test_merging_nothing_is_an_empty_exposition() -> None:
    assert merge_metrics({}) == ""


def test_a_gunicorn_worker_never_leaves_with_a_code_that_stops_gunicorn(monkeypatch: pytest.MonkeyPatch) -> None:
    import sys
    import types

    monkeypatch.delitem(sys.modules, "gunicorn", raising=False)
    assert [exit_code(c) for c in (3, 4, 75, 1)] == [3, 4, 75, 1]
    monkeypatch.setitem(sys.modules, "gunicorn", types.ModuleType("gunicorn"))
    assert [exit_code(c) for c in (3, 4, 75, 1)] == [EXIT_TOLD, EXIT_TOLD, 75, 1]


def test_the_watched_worker_s_progress_is_its_own_on_the_merged_page() -> None:
    from gpu_watchdog.watchdog.edge.samplers.server_metrics import parse

    r0, r1 = CollectorRegistry(), CollectorRegistry()
    for registry, tokens in ((r0, 5), (r1, 900)):
        Counter("gpu_inference_generated_tokens", "Tokens", registry=registry).inc(tokens)
        Gauge("gpu_inference_inflight_requests", "In flight", registry=registry).set(1)
    page = merge_metrics({"0": generate_latest(r0).decode(), "1": generate_latest(r1).decode()})
    assert parse(page, 0.0, worker="0").generated_tokens == 5
    assert parse(page, 0.0).generated_tokens == 905  # the whole server's, as for one worker


def test_the_sidecar_exposes_every_worker_labelled_with_its_index_and_gpu() -> None:
    from gpu_watchdog.watchdog.core.samples import CanarySample, TorchSample
    from gpu_watchdog.watchdog.core.views import Snapshot
    from gpu_watchdog.watchdog.edge.metrics import WatchdogMetrics

    ok = CanarySample(at=1, ok=True, latency_s=0.1, error_class=None)
    hung = CanarySample(at=1, ok=False, latency_s=5, error_class="timeout")
    rows = ((0, TorchSample(at=1, reachable=True, device="cuda", uuid="GPU-a", allocated_bytes=10,
                            reserved_bytes=20), ok),
            (1, TorchSample(at=1, reachable=True, device="cuda", uuid="GPU-b", allocated_bytes=30, reserved_bytes=40,
                            poisoned=True), hung),
            (2, TorchSample(at=1, reachable=False), None))
    text = generate_latest(WatchdogMetrics(lambda: Snapshot(workers=rows)).registry).decode()
    series = {(s.name, tuple(sorted(s.labels.items()))): s.value
              for f in text_string_to_metric_families(text) for s in f.samples if "worker" in s.labels}
    assert series[("gpu_watchdog_worker_up", (("uuid", "GPU-a"), ("worker", "0")))] == 1.0
    assert series[("gpu_watchdog_worker_up", (("uuid", "GPU-b"), ("worker", "1")))] == 0.0  # poisoned
    assert series[("gpu_watchdog_worker_up", (("uuid", ""), ("worker", "2")))] == 0.0  # unreachable
    assert series[("gpu_watchdog_worker_canary_success", (("worker", "1"),))] == 0.0
    assert series[("gpu_watchdog_worker_torch_reserved_bytes", (("uuid", "GPU-b"), ("worker", "1")))] == 40.0
    assert ("gpu_watchdog_worker_torch_allocated_bytes", (("uuid", ""), ("worker", "2"))) not in series
    alone = generate_latest(WatchdogMetrics(lambda: Snapshot()).registry).decode()
    assert "gpu_watchdog_worker_up" not in alone
