"""The target server's /metrics read into one sample: real exposition text from each server."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
from prometheus_client import generate_latest

from gpu_watchdog.watchdog.core.names import SERVER_KINDS
from gpu_watchdog.watchdog.edge.samplers.server_metrics import DIALECTS, parse

FIXTURES = Path(__file__).resolve().parent.parent / "fixtures"

# TGI's router exports through the `metrics` crate's Prometheus exporter: counters without
# `_total`, histograms with _sum/_count; names from router/src/infer and server.rs.
TGI_PAGE = """\
# TYPE tgi_request_count counter
tgi_request_count 41
# TYPE tgi_batch_inference_success counter
tgi_batch_inference_success{method="prefill"} 37
tgi_batch_inference_success{method="decode"} 5120
# TYPE tgi_batch_current_size gauge
tgi_batch_current_size 6
# TYPE tgi_queue_size gauge
tgi_queue_size 11
# TYPE tgi_request_generated_tokens summary
tgi_request_generated_tokens_sum 4096
tgi_request_generated_tokens_count 35
"""

# SGLang with --enable-metrics (python/sglang/srt/metrics/collector.py), labels as it sets them.
SGLANG_PAGE = """\
# HELP sglang:num_running_reqs The number of running requests.
# TYPE sglang:num_running_reqs gauge
sglang:num_running_reqs{engine_type="unified",model_name="m",pp_rank="0",tp_rank="0"} 12.0
# TYPE sglang:num_queue_reqs gauge
sglang:num_queue_reqs{engine_type="unified",model_name="m",pp_rank="0",tp_rank="0"} 3.0
# TYPE sglang:token_usage gauge
sglang:token_usage{engine_type="unified",model_name="m",pp_rank="0",tp_rank="0"} 0.41
# TYPE sglang:generation_tokens_total counter
sglang:generation_tokens_total{model_name="m"} 90210.0
# TYPE sglang:prompt_tokens_total counter
sglang:prompt_tokens_total{model_name="m"} 1234.0
# TYPE sglang:num_retracted_requests_total counter
sglang:num_retracted_requests_total{model_name="m"} 2.0
"""


def test_a_real_vllm_scrape_under_load() -> None:
    # Scraped from vLLM 0.32 (CPU build) with 4 sequence slots and 12 clients.
    s = parse((FIXTURES / "vllm-0.32-cpu-busy.metrics").read_text(), at=3.0)
    assert (s.reachable, s.server, s.at) == (True, "vllm", 3.0)
    assert (s.requests_running, s.requests_waiting) == (4.0, 8.0)
    assert s.generated_tokens == 670.0 and s.progress == 670.0 + 64.0  # generated + prompt tokens
    assert s.kv_cache_usage_ratio == pytest.approx(0.00782013685239491)
    assert s.preemptions == 0.0 and s.pending == 12.0


def test_older_vllm_kv_name_and_several_engines_add_up() -> None:
    page = "\n".join([
        'vllm:num_requests_running{engine="0",model_name="a"} 2',
        'vllm:num_requests_running{engine="1",model_name="a"} 3',
        'vllm:gpu_cache_usage_perc{engine="0",model_name="a"} 0.5',
        'vllm:generation_tokens_total{engine="0",model_name="a"} 10',
        'vllm:generation_tokens_total{engine="1",model_name="a"} 32', ""])
    s = parse(page, at=0)
    assert (s.requests_running, s.requests_waiting, s.generated_tokens) == (5.0, None, 42.0)
    assert s.kv_cache_usage_ratio == 0.5


def test_tgi_progress_is_its_forward_steps() -> None:
    s = parse(TGI_PAGE, at=1.0)
    assert (s.server, s.requests_running, s.requests_waiting) == ("tgi", 6.0, 11.0)
    assert s.generated_tokens == 4096.0  # counted when requests end
    assert s.progress == 37 + 5120  # moves at every prefill and decode step
    assert s.kv_cache_usage_ratio is None and s.preemptions is None


def test_sglang() -> None:
    s = parse(SGLANG_PAGE, at=1.0)
    assert (s.server, s.requests_running, s.requests_waiting) == ("sglang", 12.0, 3.0)
    assert (s.generated_tokens, s.progress) == (90210.0, 90210.0 + 1234.0)
    assert (s.kv_cache_usage_ratio, s.preemptions) == (0.41, 2.0)


def test_the_bundled_server_from_its_own_registry() -> None:
    from gpu_watchdog.inference.metrics import InferenceMetrics

    m = InferenceMetrics()
    m.inflight.set(3)
    m.queued.set(1)
    m.tokens.inc(17)
    s = parse(generate_latest(m.registry).decode(), at=2.0)
    assert (s.server, s.requests_running, s.requests_waiting, s.generated_tokens, s.progress) == (
        "bundled", 3.0, 1.0, 17.0, 17.0)
    # The steps it failed for non-finite logits: evidence of corruption for the sidecar.
    assert s.nonfinite == 0.0
    m.nonfinite.inc(2)
    assert parse(generate_latest(m.registry).decode(), at=3.0).nonfinite == 2.0


def test_a_page_with_none_of_our_names_is_unknown_not_an_error() -> None:
    s = parse("# TYPE process_cpu_seconds_total counter\nprocess_cpu_seconds_total 4.2\n", at=0)
    assert (s.reachable, s.server, s.progress, s.error) == (True, "unknown", None, None)


@pytest.mark.parametrize("page", [
    "<html><body>Not Found</body></html>",
    "vllm:num_requests_running{engine=\"0\" 3\n",
    "vllm:generation_tokens_total not-a-number\n",
    "\x00\x01\x02binary",
])
def test_garbage_is_reported_in_the_sample(page: str) -> None:
    s = parse(page, at=0)
    assert s.reachable is False and s.error is not None and s.error.startswith("bad_response: not Prometheus")


def test_every_dialect_is_a_known_server_kind() -> None:
    assert {d.server for d in DIALECTS} | {"unknown"} == set(SERVER_KINDS)


def _bundled_page(generated: int, prompt: int) -> str:
    from gpu_watchdog.inference.metrics import InferenceMetrics

    m = InferenceMetrics()
    m.inflight.set(1)
    m.tokens.inc(generated)
    m.prompt_tokens.inc(prompt)
    return generate_latest(m.registry).decode()


def _vllm_page(generated: int, prompt: int) -> str:
    return "\n".join([
        "# TYPE vllm:num_requests_running gauge", 'vllm:num_requests_running{engine="0",model_name="m"} 1',
        "# TYPE vllm:generation_tokens_total counter",
        f'vllm:generation_tokens_total{{engine="0",model_name="m"}} {generated}',
        "# TYPE vllm:prompt_tokens_total counter", f'vllm:prompt_tokens_total{{engine="0",model_name="m"}} {prompt}',
        ""])


@pytest.mark.parametrize("page", [_bundled_page, _vllm_page], ids=["bundled", "vllm"])
def test_progress_advances_when_only_prompt_tokens_do(page: Callable[[int, int], str]) -> None:
    # A long prompt being prefilled on an otherwise idle server: no token generated, still work done.
    before, after = parse(page(40, 1000), at=1.0), parse(page(40, 3048), at=6.0)
    assert before.generated_tokens == after.generated_tokens == 40.0
    assert before.progress is not None and after.progress is not None
    assert after.progress - before.progress == 2048.0


def test_sglang_progress_moves_with_its_schedulers_live_counter() -> None:
    # Its prompt and generation totals only grow as requests finish; the scheduler's counter grows as it runs.
    def page(realtime: float) -> str:
        return SGLANG_PAGE + "".join(
            f'sglang:realtime_tokens_total{{model_name="m",mode="{mode}"}} {realtime * share}\n'
            for mode, share in (("prefill_compute", 0.5), ("prefill_cache", 0.25), ("decode", 0.25)))

    before, after = parse(page(4000.0), at=1.0), parse(page(4512.0), at=6.0)
    assert before.generated_tokens == after.generated_tokens == 90210.0
    assert before.progress == 90210.0 + 1234.0 + 4000.0
    assert after.progress == 90210.0 + 1234.0 + 4512.0
