"""Errors are told apart by type, never by text: the OOM rule, the sticky-error rule and its device probe."""

from __future__ import annotations

import threading
import time

import pytest
import torch

from gpu_watchdog.inference.agent import Agent, AgentSettings
from gpu_watchdog.inference.errors import (
    AdmissionTimeout,
    FatalCudaError,
    InferenceOOM,
    classify,
    cuda_context_alive,
    is_fatal_cuda,
    is_oom,
    sticky_candidate,
)
from gpu_watchdog.inference.faults import FaultInjector

ILLEGAL = "CUDA error: an illegal memory access was encountered"
OOM_TEXT = "CUDA out of memory. Tried to allocate 2.00 GiB"


class LookupFailed(RuntimeError):
    """An application's own exception class."""


def hostile() -> list[BaseException]:
    """Exceptions whose message says CUDA trouble but whose type is an application's."""
    return [KeyError(f"no such name: {ILLEGAL}"), ValueError(OOM_TEXT), LookupFailed(ILLEGAL),
            LookupFailed(OOM_TEXT), RuntimeError(f"while loading the model: {ILLEGAL}"),
            RuntimeError(OOM_TEXT), Exception(f"{ILLEGAL}; {OOM_TEXT}"), TypeError("cuda error: illegal")]


def never(reason: str = "") -> bool:
    raise AssertionError(f"the device was probed for an error that cannot be sticky {reason}")


@pytest.mark.parametrize("exc", hostile(), ids=lambda e: type(e).__name__)
def test_text_alone_makes_neither_an_oom_nor_a_sticky_error(exc: BaseException) -> None:
    assert not is_oom(exc)
    assert not sticky_candidate(exc)
    assert not is_fatal_cuda(exc, probe=never)
    assert classify(exc, probe=never) == "other"


def test_oom_is_torchs_type_or_ours() -> None:
    assert is_oom(torch.OutOfMemoryError(OOM_TEXT)) and is_oom(InferenceOOM("no"))
    assert is_oom(torch.OutOfMemoryError("whatever it says"))
    assert classify(torch.OutOfMemoryError("x"), probe=never) == "oom"
    # An OOM is never sticky, even in torch's CUDA-check words.
    assert not is_fatal_cuda(torch.OutOfMemoryError("CUDA error: out of memory"), probe=lambda: False)


@pytest.mark.parametrize("exc", [
    torch.AcceleratorError("CUDA error: an illegal memory access was encountered"),
    torch.AcceleratorError("anything: the type is torch's"),
    RuntimeError(ILLEGAL + "\nCUDA kernel errors might be asynchronously reported at some other API call"),
    RuntimeError("CUDA error: device-side assert triggered"),
    RuntimeError("CUDA driver error: unspecified launch failure"),
    RuntimeError("CUDA error: CUBLAS_STATUS_EXECUTION_FAILED when calling `cublasSgemm( handle, opa, opb, ...)`"),
], ids=lambda e: str(e)[:40])
def test_torchs_own_cuda_errors_are_sticky_when_the_device_confirms(exc: BaseException) -> None:
    assert sticky_candidate(exc)
    assert is_fatal_cuda(exc, probe=lambda: False) and classify(exc, probe=lambda: False) == "fatal_cuda"
    # The device still runs work (or CUDA never started here): not a poisoned context.
    assert not is_fatal_cuda(exc, probe=lambda: True) and classify(exc, probe=lambda: True) == "other"


def test_our_own_types_need_no_probe() -> None:
    assert is_fatal_cuda(FatalCudaError("poisoned"), probe=never)
    assert classify(AdmissionTimeout("late"), probe=never) == "timeout"
    assert classify(TimeoutError(), probe=never) == "timeout"


def test_on_a_machine_that_never_started_cuda_nothing_is_sticky() -> None:
    assert not torch.cuda.is_initialized()
    assert cuda_context_alive()
    assert not is_fatal_cuda(RuntimeError(ILLEGAL))
    assert not is_fatal_cuda(torch.AcceleratorError(ILLEGAL))


def test_the_probe_asks_the_device_only_where_cuda_started() -> None:
    touched: list[int] = []

    def touch() -> None:
        touched.append(1)

    assert cuda_context_alive(initialized=lambda: False, touch=touch) and touched == []
    assert cuda_context_alive(initialized=lambda: True, touch=touch) and touched == [1]

    def poisoned() -> None:
        raise torch.AcceleratorError(ILLEGAL)

    assert not cuda_context_alive(initialized=lambda: True, touch=poisoned)

    def full() -> None:
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 MiB")

    # Out of memory while probing still proves the context alive.
    assert cuda_context_alive(initialized=lambda: True, touch=full)


def test_a_probe_that_gets_no_answer_in_time_is_not_taken_for_a_poisoned_context() -> None:
    """A busy card can keep a new stream waiting: no answer is no proof, and exiting cannot be taken
    back (a device that really stopped is the canary's and the hang rule's to find)."""
    release = threading.Event()

    def hung() -> None:
        release.wait()

    start = time.monotonic()
    try:
        assert cuda_context_alive(initialized=lambda: True, touch=hung, timeout_s=0.2)
    finally:
        release.set()
    assert time.monotonic() - start < 2.0


def test_injected_faults_raise_the_engines_own_types() -> None:
    faults = FaultInjector()
    faults.inject("oom", {"count": 1})
    with pytest.raises(torch.OutOfMemoryError) as oom:
        faults.before_forward()
    assert is_oom(oom.value)
    faults.inject("context_loss", {})
    for step in (faults.before_forward, faults.during_forward):
        with pytest.raises(FatalCudaError) as fatal:
            step()
        assert is_fatal_cuda(fatal.value, probe=never) and "illegal memory access" in str(fatal.value)


def quiet_agent() -> Agent:
    agent = Agent(AgentSettings(limit=2, queue_timeout=0.5, device="cpu"))

    def exit_() -> None:
        raise AssertionError(f"the agent would exit: {agent.guard.poison_reason}")

    agent._exit = exit_  # type: ignore[method-assign]
    return agent


@pytest.mark.parametrize("exc", hostile(), ids=lambda e: type(e).__name__)
def test_an_apps_exception_leaves_admit_and_guard_as_it_was_raised(exc: BaseException) -> None:
    agent = quiet_agent()
    with pytest.raises(type(exc)) as inside, agent.admit():
        raise exc
    assert inside.value is exc and type(inside.value) is type(exc)
    with pytest.raises(type(exc)) as guarded, agent.guard():
        raise exc
    assert guarded.value is exc
    report = agent.memory_report()
    assert (report["ooms_caught"], report["poisoned"], report["inflight"]) == (0, False, 0)
    counted = agent.metrics.registry.get_sample_value
    assert counted("gpu_inference_ooms_total") == 0 and counted("gpu_inference_fatal_errors_total") == 0


async def test_an_async_admit_lets_an_apps_exception_through_too() -> None:
    agent = quiet_agent()
    err = KeyError(f"no such name: {ILLEGAL}")
    with pytest.raises(KeyError) as inside:
        async with agent.admit():
            raise err
    assert inside.value is err and not agent.poisoned and agent.guard.oom_count == 0


async def test_a_canary_failing_with_hostile_text_is_other() -> None:
    def canary() -> None:
        raise LookupFailed(ILLEGAL)

    agent = quiet_agent()
    agent.register_canary(canary)
    result = await agent.canary(2.0)
    assert (result.ok, result.error_class, agent.poisoned) == (False, "other", False)
