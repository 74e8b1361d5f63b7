"""Calls handed from another thread to the event loop: all of them, in order, in few wake-ups."""

from __future__ import annotations

import asyncio
import threading

from gpu_watchdog.inference.mailbox import Mailbox


def test_every_call_arrives_in_order_and_before_anything_the_thread_schedules_after_it() -> None:
    async def scenario() -> tuple[list[object], int, int]:
        loop = asyncio.get_running_loop()
        wakeups = 0
        schedule = loop.call_soon_threadsafe

        def counted(*args: object) -> object:
            nonlocal wakeups
            wakeups += 1
            return schedule(*args)  # type: ignore[arg-type]

        loop.call_soon_threadsafe = counted  # type: ignore[method-assign]
        box = Mailbox(loop)
        got: list[object] = []
        done = loop.create_future()

        def producer() -> None:
            for step in range(50):
                for row in range(8):  # a step's tokens, one per row
                    box.post(got.append, (step, row))
            # As a future resolved after its last piece: it must come after all of them.
            schedule(lambda: done.set_result(len(got)))

        thread = threading.Thread(target=producer)
        thread.start()
        seen_at_done = await done
        thread.join()
        return got, seen_at_done, wakeups

    got, seen_at_done, wakeups = asyncio.run(scenario())
    assert got == [(step, row) for step in range(50) for row in range(8)]
    assert seen_at_done == 400
    assert wakeups <= 50  # at most one per step, not one per call
