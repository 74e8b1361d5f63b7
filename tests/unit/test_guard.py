"""The guard that `serve`'s engine and the agent share: a sticky error seen by a decode loop and one
raised inside an app's admitted call are recorded the same way, once (the metric, the termination
log with what was in flight, the owner told), the canary answers it without running, and the exit
waits for the watchdog's read only as long as its bound."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from gpu_watchdog.inference import model as model_mod
from gpu_watchdog.inference import poison
from gpu_watchdog.inference.engine import Engine
from gpu_watchdog.inference.engine_api import GenRequest
from gpu_watchdog.inference.errors import Draining, FatalCudaError, InferenceOOM
from gpu_watchdog.inference.faults import FaultInjector
from gpu_watchdog.inference.guard import Guard
from gpu_watchdog.inference.handlers.causal_lm import CausalLM
from gpu_watchdog.inference.screen import Entry, QuarantinedRequest, RequestAccount


@pytest.fixture
def termination_log(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    path = tmp_path / "termination-log"
    monkeypatch.setenv("GPU_WATCHDOG_TERMINATION_LOG", str(path))
    monkeypatch.setattr(poison, "TERMINATION_LOG", str(path))
    return path


def _through_the_engine(guard: Guard) -> None:
    engine = Engine(CausalLM(model_mod.load(None, torch.device("cpu"))), guard=guard)
    try:
        with pytest.raises(FatalCudaError):
            engine.generate([GenRequest(engine.lm.codec.encode("hello"), 4)])
        assert engine.poison_reason == guard.poison_reason
    finally:
        engine.stop()


def _through_admit(guard: Guard) -> None:
    with pytest.raises(FatalCudaError), guard.admit(1.0, 1.0, 8):
        pass


@pytest.mark.parametrize("way", [_through_the_engine, _through_admit], ids=["serve's engine", "the agent's admit"])
def test_a_sticky_error_is_recorded_once_the_same_way_by_either_path(
        way: Callable[[Guard], None], termination_log: Path) -> None:
    faults = FaultInjector()
    guard = Guard(faults=faults)
    told: list[str | None] = []
    guard.on_poisoned = lambda: told.append(guard.poison_reason)
    faults.inject("context_loss", {})
    way(guard)
    assert guard.poisoned and told == [guard.poison_reason]
    assert guard.metrics.registry.get_sample_value("gpu_inference_fatal_errors_total") == 1.0
    assert termination_log.read_text().startswith("gpu-watchdog inference: CUDA context poisoned: ")
    guard.poison("a second one")  # recorded once: the first reason stands, the owner is not told again
    assert told == [guard.poison_reason] and guard.poison_reason != "a second one"
    result = asyncio.run(guard.canary(1.0, lambda: pytest.fail("a poisoned process runs no canary")))
    assert (result.ok, result.error_class, result.error) == (False, "fatal_cuda", guard.poison_reason)


def test_an_oom_inside_admit_is_counted_the_cache_emptied_and_a_503_raised() -> None:
    guard = Guard()
    with pytest.raises(InferenceOOM), guard.admit(1.0, 1.0, 8):
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
    assert (guard.oom_count, guard.empty_cache_count, guard.poisoned) == (1, 1, False)
    assert guard.gate.stats().holders == 0  # the slot went back


def test_the_exit_waits_for_the_watchdogs_read_and_never_past_its_bound(termination_log: Path) -> None:
    async def lingered(report: bool) -> tuple[int, bool]:
        guard = Guard()
        guard.poison("an illegal memory access was encountered")
        if report:
            asyncio.get_running_loop().call_later(0.05, guard.poison_reported.set)
        code = await guard.linger(30.0 if report else 0.1)
        return code, guard.poison_reported.is_set()

    assert asyncio.run(lingered(report=True)) == (poison.EXIT_POISONED, True)
    assert asyncio.run(lingered(report=False)) == (poison.EXIT_POISONED, False)


def test_a_request_is_checked_against_the_quarantine_only_once_the_list_is_in_force() -> None:
    """A new process waiting for its sidecar's list refuses a request before checking it against
    the empty list: checked then, and admitted once the list came, a killer the list names ran."""
    now = [100.0]
    guard = Guard(clock=lambda: now[0])
    guard.quarantine_wait = 60.0
    guard.serving()
    killer = {"prompt": "the killer's prompt", "max_tokens": 4}
    fp, input_fp = guard.screen.prints(killer)
    with pytest.raises(Draining, match="quarantine list"):
        guard.screen.screened(RequestAccount(), fp, input_fp)
    assert input_fp is not None
    guard.screen.quarantine.replace([Entry(input_fp, until=time.time() + 600)])
    with pytest.raises(QuarantinedRequest):
        guard.screen.screened(RequestAccount(), fp, input_fp)
    guard.screen.screened(RequestAccount(), *guard.screen.prints({"prompt": "an innocent", "max_tokens": 4}))
    guard.check_admitting()
