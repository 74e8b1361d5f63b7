"""The admission gate from a coroutine, its queue bound, and the agent's OOM recording."""

from __future__ import annotations

import asyncio
import threading

import pytest
import torch

from gpu_watchdog.inference.admission import AdmissionGate
from gpu_watchdog.inference.agent import Agent, AgentSettings
from gpu_watchdog.inference.errors import AdmissionTimeout, InferenceOOM, QueueFull


async def test_async_waiter_does_not_block_the_loop_and_gets_in_on_release() -> None:
    gate = AdmissionGate(1)
    held = gate.acquire(1, timeout=1)
    assert held is not None
    waiter = asyncio.create_task(gate.acquire_async(1, timeout=5))
    ticks = 0
    for _ in range(5):
        await asyncio.sleep(0.01)
        ticks += 1
    assert ticks == 5 and not waiter.done() and gate.stats().waiting == 1
    # Released from another thread, as a worker would.
    threading.Thread(target=gate.release, args=(held,)).start()
    grant = await asyncio.wait_for(waiter, 2)
    assert grant is not None and gate.stats().holders == 1


async def test_async_waiter_times_out_and_cancellation_takes_nothing() -> None:
    gate = AdmissionGate(1)
    held = gate.acquire(1, timeout=1)
    assert held is not None
    assert await gate.acquire_async(1, timeout=0.05) is None
    waiter = asyncio.create_task(gate.acquire_async(1, timeout=5))
    await asyncio.sleep(0.02)
    waiter.cancel()
    with pytest.raises(asyncio.CancelledError):
        await waiter
    assert gate.stats().waiting == 0
    gate.release(held)
    assert gate.stats().in_use == 0
    assert gate.try_acquire(1) is not None  # nobody phantom ahead in the queue


async def test_threads_and_coroutines_share_one_fifo_queue() -> None:
    gate = AdmissionGate(1)
    held = gate.acquire(1, timeout=1)
    assert held is not None
    order: list[str] = []

    def thread_waiter() -> None:
        g = gate.acquire(1, timeout=5)
        assert g is not None
        order.append("thread")
        gate.release(g)

    t = threading.Thread(target=thread_waiter)
    t.start()
    while gate.stats().waiting < 1:
        await asyncio.sleep(0.005)

    async def coro_waiter() -> None:
        g = await gate.acquire_async(1, timeout=5)
        assert g is not None
        order.append("coroutine")
        gate.release(g)

    task = asyncio.create_task(coro_waiter())
    while gate.stats().waiting < 2:
        await asyncio.sleep(0.005)
    gate.release(held)
    await asyncio.wait_for(task, 5)
    await asyncio.to_thread(t.join, 5)
    assert order == ["thread", "coroutine"]


async def test_queue_bound_refuses_at_once() -> None:
    gate = AdmissionGate(1)
    held = gate.acquire(1, timeout=1)
    assert held is not None
    first = asyncio.create_task(gate.acquire_async(1, timeout=5, max_waiting=1))
    await asyncio.sleep(0.02)
    with pytest.raises(QueueFull):
        await gate.acquire_async(1, timeout=5, max_waiting=1)
    with pytest.raises(QueueFull):
        gate.acquire(1, timeout=5, max_waiting=1)
    gate.release(held)
    assert await first is not None


def test_agent_turns_an_oom_into_a_503_and_empties_the_cache() -> None:
    agent = Agent(AgentSettings(limit=1, queue_timeout=0.05, device="cpu"))
    with pytest.raises(InferenceOOM), agent.admit():
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 1 GiB")
    report = agent.memory_report()
    assert (report["ooms_caught"], report["empty_cache_count"], report["inflight"]) == (1, 1, 0)
    with pytest.raises(ValueError), agent.admit():  # an app's own error passes through untouched
        raise ValueError("bad input")
    assert agent.memory_report()["ooms_caught"] == 1


def test_agent_queue_timeout_and_limit_change() -> None:
    agent = Agent(AgentSettings(limit=1, queue_timeout=0.05, device="cpu"))
    with agent.admit(), pytest.raises(AdmissionTimeout), agent.admit():
        pass
    agent.set_admission_limit(2)
    with agent.admit(), agent.admit():
        assert agent.memory_report()["admission"]["holders"] == 2


async def test_the_canary_runs_on_its_reserved_slot_while_the_gate_is_full() -> None:
    ran: list[int] = []
    agent = Agent(AgentSettings(limit=1, queue_timeout=0.05, device="cpu"), canary=lambda: ran.append(1))
    with agent.admit():  # the app's one slot is taken
        result = await agent.canary(2.0)
    assert result.ok and ran == [1]
    assert (await Agent(AgentSettings(device="cpu")).canary(1.0)).error_class == "other"  # none registered


async def test_a_canary_that_runs_out_of_memory_says_oom() -> None:
    def oom() -> None:
        raise torch.OutOfMemoryError("CUDA out of memory")

    agent = Agent(AgentSettings(device="cpu"), canary=oom)
    result = await agent.canary(2.0)
    assert (result.ok, result.error_class) == (False, "oom") and agent.guard.oom_count == 1
