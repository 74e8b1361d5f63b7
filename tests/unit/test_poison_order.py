"""A poisoned context tells a request that was running the fatal error, however its sequences (or
items) are spread between the batch and the queue; only a request that never started anywhere is
told `context_lost`, the 503 that the front and a gateway retry on the next engine.

A request of several sequences (OpenAI's `n`, `best_of`, a list of prompts) is one engine sequence
each, combined as the HTTP layer combines them (`asyncio.gather`: the first failure answers)."""

from __future__ import annotations

import asyncio
import json
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import requests
import torch

from gpu_watchdog.inference import model as model_mod
from gpu_watchdog.inference import poison
from gpu_watchdog.inference.engine import Engine
from gpu_watchdog.inference.engine_api import GenRequest, GenResult
from gpu_watchdog.inference.errors import ContextLost, FatalCudaError
from gpu_watchdog.inference.faults import FaultInjector
from gpu_watchdog.inference.guard import Guard
from gpu_watchdog.inference.handlers.causal_lm import CausalLM
from gpu_watchdog.inference.http_errors import error_response
from gpu_watchdog.inference.sequence import Seq
from tests.helpers import start_server


@pytest.fixture(autouse=True)
def termination_log(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    path = tmp_path / "termination-log"
    monkeypatch.setenv("GPU_WATCHDOG_TERMINATION_LOG", str(path))
    monkeypatch.setattr(poison, "TERMINATION_LOG", str(path))
    return path


@pytest.fixture(scope="module")
def lm() -> model_mod.LoadedModel:
    return model_mod.load(None, torch.device("cpu"))


def http_kind(exc: BaseException) -> tuple[int, str]:
    """The status and error type the HTTP layer answers a request that failed with `exc`."""
    response = error_response(exc, 1)
    assert response.text is not None
    return response.status, json.loads(response.text)["error"]["type"]


async def until(check: Callable[[], bool], what: str, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        if time.monotonic() > deadline:
            raise AssertionError(f"not within {timeout}s: {what}")
        await asyncio.sleep(0.005)


async def request(engine: Engine, prompts: list[GenRequest]) -> list[GenResult]:
    """One HTTP request's sequences, submitted and combined as `http_public` does."""
    return list(await asyncio.gather(*(asyncio.ensure_future(engine.submit(r, 30.0)) for r in prompts)))


def test_a_running_request_with_a_queued_sibling_is_told_the_fatal_error(lm: model_mod.LoadedModel) -> None:
    faults = FaultInjector()
    engine = Engine(CausalLM(lm), guard=Guard(faults=faults), max_rows=1)  # one row: the sibling waits
    codec = lm.codec
    running, proceed = threading.Event(), threading.Event()

    def first_token(_: str) -> None:  # the loop thread stops here until the scene is set
        running.set()
        proceed.wait(30)

    async def scenario() -> list[list[GenResult] | BaseException]:
        killer = asyncio.ensure_future(request(engine, [
            GenRequest(codec.encode("the request whose kernel kills the context"), 200, on_text=first_token),
            GenRequest(codec.encode("its second choice, still queued"), 200)]))
        await asyncio.to_thread(running.wait, 30)
        bystander = asyncio.ensure_future(request(engine, [GenRequest(codec.encode("someone else"), 5),
                                                           GenRequest(codec.encode("and again"), 5)]))
        await until(lambda: engine.queued == 3, "the sibling and the bystander's two sequences queued")
        assert engine.inflight == 1
        faults.inject("context_loss", {})  # the running row's next kernel fails
        proceed.set()
        return list(await asyncio.gather(killer, bystander, return_exceptions=True))

    try:
        killer, bystander = asyncio.run(scenario())
    finally:
        proceed.set()
        engine.stop()
    assert isinstance(killer, FatalCudaError), repr(killer)
    assert http_kind(killer) == (500, "fatal_cuda")
    # Entirely queued: never started anywhere, another engine may take it.
    assert isinstance(bystander, ContextLost), repr(bystander)
    assert http_kind(bystander) == (503, "context_lost")


def test_a_request_whose_first_sequence_fails_its_prefill_is_not_retriable(lm: model_mod.LoadedModel) -> None:
    """The query of death: the culprit's own prefill poisons the context while its sibling waits."""
    faults = FaultInjector()
    faults.inject("context_loss", {"when_prompt_contains": "KILLER"})
    engine = Engine(CausalLM(lm), guard=Guard(faults=faults), max_rows=1)
    codec = lm.codec
    decode = engine._decode
    culprit = [engine._sequence(GenRequest(codec.encode("KILLER"), 8)) for _ in range(2)]
    bystander = [engine._sequence(GenRequest(codec.encode(p), 8)) for p in ("x", "y")]
    for seq in culprit:
        seq.marks = frozenset({"context_loss"})  # as `serve`'s screen marks the request

    async def combined(seqs: list[Seq]) -> list[GenResult]:
        return list(await asyncio.gather(*(asyncio.wrap_future(s.future) for s in seqs)))

    async def scenario() -> list[list[GenResult] | BaseException]:
        with decode._cond:  # all queued before the loop thread looks: only the first is let in
            for seq in (*culprit, *bystander):
                decode.enqueue(seq)
        return list(await asyncio.gather(combined(culprit), combined(bystander), return_exceptions=True))

    try:
        outcome, innocent = asyncio.run(scenario())
    finally:
        engine.stop()
    assert culprit[0].admitted and not culprit[1].admitted
    assert isinstance(outcome, FatalCudaError), repr(outcome)
    assert isinstance(innocent, ContextLost), repr(innocent)


class Items:
    """A request-level handler whose forward pass with a KILLER item poisons the context (once let go)."""

    capabilities = frozenset({"predict"})

    def __init__(self) -> None:
        self.entered, self.release = threading.Event(), threading.Event()

    def load(self, model: str | None, device: torch.device) -> None:
        pass

    def sample(self) -> Any:
        return "sample"

    def decode(self, body: dict[str, Any]) -> list[Any]:
        return list(body["items"])

    def predict(self, items: list[Any]) -> list[Any]:
        if "KILLER" in items:
            self.entered.set()
            self.release.wait(30)
            raise FatalCudaError("an illegal memory access was encountered (test)")
        return [f"out:{i}" for i in items]

    def encode(self, output: Any) -> Any:
        return output


def test_an_item_request_with_one_item_run_and_one_queued_is_told_the_fatal_error() -> None:
    handler = Items()
    engine = Engine(handler, max_rows=1)  # one item a pass: the request's second item waits

    async def scenario() -> list[list[Any] | BaseException]:
        killer = asyncio.ensure_future(engine.predict(["KILLER", "its second item"], 30.0))
        await asyncio.to_thread(handler.entered.wait, 30)
        bystander = asyncio.ensure_future(engine.predict(["a", "b"], 30.0))
        await until(lambda: engine.queued == 3, "the second item and the bystander's two queued")
        handler.release.set()
        return list(await asyncio.gather(killer, bystander, return_exceptions=True))

    try:
        killer, bystander = asyncio.run(scenario())
    finally:
        handler.release.set()
        engine.stop()
    assert isinstance(killer, FatalCudaError), repr(killer)
    assert isinstance(bystander, ContextLost), repr(bystander)


@pytest.fixture
def serve(tmp_path: Path) -> Iterator[Any]:
    srv = start_server(tmp_path, "--fault-injection", "--max-batch-size", "1")
    try:
        yield srv
    finally:
        srv.proc.stop()


def test_through_http_a_killer_with_n_2_answers_500_not_a_retriable_503(serve: Any) -> None:
    """The stream's first choice runs (one row), its second waits; the context is lost under it."""
    body: dict[str, Any] = {"prompt": "long", "max_tokens": 400, "n": 2, "stream": True}
    with requests.post(serve.url + "/v1/completions", json=body, stream=True, timeout=60) as r:
        assert r.status_code == 200
        events: list[str] = []
        for raw in r.iter_lines(decode_unicode=True):
            line = raw if isinstance(raw, str) else raw.decode()
            if line.startswith("data: "):
                events.append(line[6:])
                if len(events) == 3:
                    serve.fault("context_loss")
    last = json.loads(events[-1])
    assert last["error"]["type"] == "FatalCudaError", last
    assert all(json.loads(e).get("choices", [{}])[0].get("index", 0) == 0 for e in events[:-1])
