"""What the watchdog sees of a server handed the largest prompts: a control API that answers within the
sidecar's timeouts under a flood of them, and their prefill counted as progress
(`gpu_inference_prompt_tokens_total`, which the sidecar adds to the generated tokens)."""

from __future__ import annotations

import asyncio
import threading
import uuid
from collections.abc import Iterator
from typing import Any

import pytest
import requests

from gpu_watchdog.benchmarks.control_under_flood import CANARY_TIMEOUT_S, MEMORY_TIMEOUT_S, flood, largest_body, probe
from gpu_watchdog.benchmarks.make_model import make
from tests.helpers import Server, metric, start_server

PREFILL_BUDGET = 64  # tokens one step prefills: a longer prompt goes a chunk per step
FLOOD_S = 6.0
CLIENTS = 4


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    # A Hugging Face tokenizer (byte-level: one token per UTF-8 byte): a 1 MiB prompt is seconds of
    # tokenizing, which on the event loop kept the control API from answering in time.
    tmp = tmp_path_factory.mktemp("large-prompts")
    model_dir = make(tmp / "tiny", hidden=64, layers=2, heads=2, vocab=300, context=1024, seed=1)
    srv = start_server(tmp, "--model", str(model_dir), "--max-prefill-tokens", str(PREFILL_BUDGET),
                       env={"HF_HUB_OFFLINE": "1"})
    yield srv
    srv.proc.stop()


def _served(url: str, prompt: str) -> tuple[dict[str, Any], float]:
    """The usage of one completion of `prompt`, and how far the prompt-token counter moved for it."""
    before = metric(url + "/metrics", "gpu_inference_prompt_tokens_total")
    r = requests.post(url + "/v1/completions", json={"prompt": prompt, "max_tokens": 2}, timeout=60)
    assert r.status_code == 200, r.text
    after = metric(url + "/metrics", "gpu_inference_prompt_tokens_total")
    assert before is not None and after is not None
    usage: dict[str, Any] = r.json()["usage"]
    return usage, after - before


def test_a_served_prompt_advances_the_prompt_token_counter_by_its_token_count(server: Server) -> None:
    # Each prompt starts with text no earlier prompt had, so the prefix cache holds none of it.
    short = f"{uuid.uuid4().hex} counts in one pass"
    usage, moved = _served(server.url, short)
    assert usage["prompt_tokens"] < PREFILL_BUDGET and usage["prompt_tokens_details"]["cached_tokens"] == 0
    assert moved == usage["prompt_tokens"]

    long = f"{uuid.uuid4().hex} is prefilled a chunk per step. " * 12
    usage, moved = _served(server.url, long)
    assert usage["prompt_tokens"] > 4 * PREFILL_BUDGET and usage["prompt_tokens_details"]["cached_tokens"] == 0
    assert moved == usage["prompt_tokens"]

    # Asked again, its beginning comes from the prefix cache: only what prefill computed counts.
    usage, moved = _served(server.url, long)
    cached = usage["prompt_tokens_details"]["cached_tokens"]
    assert cached > 0 and moved == usage["prompt_tokens"] - cached
    generated = metric(server.url + "/metrics", "gpu_inference_generated_tokens_total")
    assert generated is not None and generated > 0  # the two counters stay apart


def test_tokenize_and_detokenize_of_a_large_body_round_trip_and_name_a_bad_token(server: Server) -> None:
    text = f"{uuid.uuid4().hex} größer als ein Kilobyte. " * 2000
    r = requests.post(server.url + "/tokenize", json={"prompt": text, "return_token_strs": True}, timeout=60)
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["count"] == len(body["tokens"]) == len(body["token_strs"]) == len(text.encode())
    back = requests.post(server.url + "/detokenize", json={"tokens": body["tokens"]}, timeout=60)
    assert back.status_code == 200 and back.json()["prompt"] == text
    bad = [*body["tokens"][:3000], 99999, *body["tokens"][3000:]]
    r = requests.post(server.url + "/detokenize", json={"tokens": bad}, timeout=60)
    assert r.status_code == 400 and r.json()["error"]["param"] == "tokens[3000]", r.text


def test_the_control_api_answers_within_the_sidecars_timeouts_under_a_flood_of_maximum_size_prompts(
        server: Server) -> None:
    # Bodies this large are checked and tokenized off the event loop: a bad one is still a 4xx naming the field.
    big_bad = {"prompt": "x" * 4096, "max_tokens": 1, "temperature": "hot"}
    r = requests.post(server.url + "/v1/completions", json=big_bad, timeout=30)
    assert r.status_code == 400 and r.json()["error"]["param"] == "temperature", r.text
    r = requests.post(server.url + "/v1/chat/completions", timeout=30,
                      json={"messages": [{"role": "user", "content": "y" * 4096}], "max_tokens": 1})
    assert r.status_code == 413 and r.json()["error"]["param"] == "prompt", r.text

    body = largest_body()  # refused with 413, but only once its prompt was counted
    answers: dict[str, int] = {}
    flooding = threading.Thread(
        target=lambda: answers.update(asyncio.run(flood(server.url, body, CLIENTS, FLOOD_S))), daemon=True)
    flooding.start()
    memory, canary = asyncio.run(probe(server, FLOOD_S - 1.0))
    flooding.join(60)
    assert set(answers) == {"413"} and answers["413"] >= 2, answers  # the flood was answered, as refused
    assert memory.failures == 0 and canary.failures == 0, (memory.summary(), canary.summary())
    assert len(memory.latencies) >= 4 and len(canary.latencies) >= 2
    assert max(memory.latencies) < MEMORY_TIMEOUT_S and max(canary.latencies) < CANARY_TIMEOUT_S
