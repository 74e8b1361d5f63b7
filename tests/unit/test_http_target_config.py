"""`target.http` and `target.progress_metric`: bad config names the key; the named counter is read."""

from __future__ import annotations

from pathlib import Path

import pytest

from gpu_watchdog.watchdog.core.selector import Selector, parse
from gpu_watchdog.watchdog.edge.config import ConfigError, from_mapping, metrics_url
from gpu_watchdog.watchdog.edge.samplers.http_canary import lookup
from gpu_watchdog.watchdog.edge.samplers.server_metrics import progress_of


def errors(target: dict[str, object]) -> list[str]:
    with pytest.raises(ConfigError) as exc:
        from_mapping({"target": target, "restart": {"strategy": "none"}})
    return exc.value.errors


def test_a_full_http_target_loads(tmp_path: Path) -> None:
    body = tmp_path / "body.json"
    body.write_text('{"inputs": [{"name": "INPUT0", "shape": [1], "datatype": "FP32", "data": [0.0]}]}')
    s = from_mapping({"target": {"http": {"url": "http://127.0.0.1:8000/v2/models/m/infer", "body_file": str(body),
                                          "headers": {"X-Team": "ml"}, "expect_json": "outputs.0.data"},
                                 "metrics_url": "http://127.0.0.1:8002/metrics",
                                 "progress_metric": 'nv_inference_count{model="m"}'},
                      "restart": {"strategy": "none"}})
    assert s.target.http is not None and s.target.http.method == "POST" and s.target.http.expect_status == 200
    assert s.target.http.headers == {"X-Team": "ml"}
    # auto: the served URL's origin, as for openai_url
    auto = from_mapping({"target": {"http": {"url": "http://10.0.0.1:8080/predictions/m"}},
                         "restart": {"strategy": "none"}})
    assert metrics_url(auto.target) == "http://10.0.0.1:8080/metrics"


@pytest.mark.parametrize(("target", "key"), [
    ({"http": {}}, "target.http.url: required"),
    ({"http": {"url": "ftp://x"}}, "target.http.url: expected an http(s) URL"),
    ({"http": {"url": "http://a", "method": "DELETE"}}, "target.http.method"),
    ({"http": {"url": "http://a", "headers": ["a"]}}, "target.http.headers"),
    ({"http": {"url": "http://a", "body": {}, "body_file": "/etc/hostname"}}, "target.http.body_file: give body"),
    ({"http": {"url": "http://a", "body_file": "/no/such/file"}}, "target.http.body_file: no such file"),
    ({"http": {"url": "http://a", "expect_status": 42}}, "target.http.expect_status"),
    ({"http": {"url": "http://a", "expect_json": "a..b"}}, "target.http.expect_json"),
    ({"http": {"url": "http://a", "method": "GET", "body": {"x": 1}}}, "target.http.body: a GET"),
    ({"http": {"url": "http://a", "bdy": {}}}, "target.http.bdy: unknown key"),
    ({"http": {"url": "http://a"}, "openai_url": "http://b"}, "target.http: cannot be combined"),
    ({"progress_metric": "te request"}, "target.progress_metric"),
    ({"progress_metric": "x{a=b}"}, "target.progress_metric"),
])
def test_bad_http_config_names_the_key(target: dict[str, object], key: str) -> None:
    assert any(e.startswith(key) for e in errors(target)), errors(target)


def test_selector_parses_names_and_labels() -> None:
    assert parse("te_request_success") == Selector("te_request_success")
    s = parse('nv_inference_count{model="m", version="1"}')
    assert s.labels == (("model", "m"), ("version", "1")) and str(s) == 'nv_inference_count{model="m",version="1"}'
    assert s.matches("nv_inference_count", {"model": "m", "version": "1", "gpu": "0"})
    assert not s.matches("nv_inference_count", {"model": "other", "version": "1"})
    assert parse("ts_inference_requests").matches("ts_inference_requests_total", {})


def test_progress_is_the_named_series_summed() -> None:
    page = ("# HELP x y\n# TYPE te_request_success counter\n"
            'te_request_success{method="embed"} 10\nte_request_success{method="rerank"} 5\n'
            "te_request_failure 2\nsome_histogram_bucket{le=\"1\"} 3\n")
    assert progress_of(page, parse("te_request_success")) == 15
    assert progress_of(page, parse('te_request_success{method="embed"}')) == 10
    assert progress_of(page, parse("absent")) is None
    assert progress_of("garbage {{{ \n", parse("garbage")) is None


def test_key_paths_walk_objects_and_lists() -> None:
    data = {"outputs": [{"data": [1.0]}], "n": 0}
    assert lookup(data, "outputs.0.data.0") == 1.0
    assert lookup(data, "n") == 0
    assert lookup([[0.1]], "0.0") == 0.1
    from gpu_watchdog.watchdog.edge.samplers.http_canary import _MISSING

    assert lookup(data, "outputs.1") is _MISSING and lookup(data, "outputs.x") is _MISSING


@pytest.mark.parametrize("name", ["triton", "torchserve", "litserve", "tei", "fastapi_agent"])
def test_the_shipped_example_configs_load(name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    from gpu_watchdog.watchdog.edge.config import load
    from tests.helpers import ROOT

    monkeypatch.setenv("POD_NAME", "demo-0")
    monkeypatch.setenv("POD_NAMESPACE", "serving")
    s = load(str(ROOT / "examples" / "http_targets" / f"{name}.yaml"))
    assert s.target.http is not None or s.target.control_url
