"""`gpu-watchdog up --handler embeddings --model DIR`: the watchdog watches an embedding model as it
watches the causal LM, with no change: ready, the canary on the handler's sample, a poisoned
process restarted and serving again."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import requests

from gpu_watchdog.benchmarks.make_encoder import make
from tests.e2e.up_stack import SHORT, Stack
from tests.helpers import free_port, json_lines, metric, spawn, wait_for, wait_http


def embeds(stack: Stack) -> bool:
    try:
        r = requests.post(stack.api + "/v1/embeddings", json={"input": ["are you there", "yes"]}, timeout=10)
    except requests.RequestException:
        return False
    return r.status_code == 200 and len(r.json()["data"]) == 2


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    tmp = tmp_path_factory.mktemp("up-handler")
    model = make(tmp / "encoder", "bert")
    config = tmp / "watchdog.yaml"
    config.write_text(SHORT)
    port, control_port, watchdog_port = free_port(), free_port(), free_port()
    proc = spawn(["up", "--handler", "embeddings", "--model", str(model), "--fault-injection", "--device", "cpu",
                  "--host", "127.0.0.1", "--port", str(port), "--control-port", str(control_port),
                  "--watchdog-port", str(watchdog_port), "--config", str(config)], tmp / "up.log",
                 env={"GPU_WATCHDOG_TOKEN": "e2e-handler-token"})
    s = Stack(proc, port, control_port, watchdog_port)
    s.token = "e2e-handler-token"
    try:
        wait_http(s.watchdog + "/readyz", proc, timeout=120)
        yield s
    finally:
        code = proc.stop(timeout=20)
        assert code == 0, proc.log()[-3000:]


def test_the_watchdog_comes_up_ready_next_to_an_embedding_model(stack: Stack) -> None:
    assert embeds(stack)
    wait_for(lambda: metric(stack.watchdog + "/metrics", "gpu_watchdog_canary_success") == 1.0, 15,
             "a successful canary on the handler's sample")
    r = requests.post(stack.api + "/v1/completions", json={"prompt": "hi"}, timeout=10)
    assert r.status_code == 404


def test_a_poisoned_handler_process_is_restarted_and_serves_again(stack: Stack) -> None:
    stack.fault("context_loss")
    wait_for(lambda: stack.restarts("context_loss") >= 1, 60, "restart for context_loss")
    wait_for(lambda: embeds(stack), 60, "embeddings served again")
    try:
        wait_for(stack.ready, 30, "watchdog ready again")
    except AssertionError as exc:
        status = requests.get(stack.watchdog + "/status", timeout=5).text
        raise AssertionError(f"{exc}; the watchdog's /status: {status[:3000]}") from None
    assert any(e.get("event") == "fatal_cuda_error" for e in json_lines(stack.proc.log()))
