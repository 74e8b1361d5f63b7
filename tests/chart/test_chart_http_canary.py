"""`inference.engine: external` with a server that is not OpenAI-compatible: the sidecar canaries `external.http`."""

from __future__ import annotations

from typing import Any

import pytest

from tests.chart.rendering import watchdog_config
from tests.chart.value_sets import EXTERNAL

TRITON: dict[str, Any] = {
    **EXTERNAL,
    "external": {**EXTERNAL["external"],
                 "http": {"url": "http://127.0.0.1:8080/v2/models/m/infer",
                          "body": {"inputs": [{"name": "INPUT0", "shape": [1], "datatype": "FP32", "data": [0.0]}]},
                          "expect_json": "outputs.0.data"},
                 "progressMetric": 'nv_inference_count{model="m"}'},
}


def test_external_http_canary_replaces_the_openai_one(monkeypatch: pytest.MonkeyPatch) -> None:
    target = watchdog_config(TRITON, monkeypatch).target
    assert target.openai_url is None and target.http is not None
    assert target.http.url == "http://127.0.0.1:8080/v2/models/m/infer" and target.http.expect_json == "outputs.0.data"
    assert target.progress_metric == 'nv_inference_count{model="m"}'
    assert target.metrics_url == "http://127.0.0.1:8080/metrics"


def test_external_without_http_keeps_the_openai_canary(monkeypatch: pytest.MonkeyPatch) -> None:
    target = watchdog_config(EXTERNAL, monkeypatch).target
    assert target.http is None and target.openai_url == "http://127.0.0.1:8080/v1"
