"""How many torch threads a forward pass gets on CPU: the cores it can use without starving the event loop.

On CPU the event loop that parses requests and streams tokens shares the cores with torch. A
prefill is arithmetic-bound and streams nothing while it runs: every core shortens it (a batch of
32 prompts of 256 tokens on 2 cores: 409 against 775 ms on one). A decode step is bound by
reading weights, keys and values, which a second thread barely speeds up and often slows (the
threads meet at every one of its small operations; in process, one thread against two: the small
model 2.0 / 2.1 ms at 4 rows, 4.2 / 4.8 at 16, 8.8 / 8.8 at 32; an 85 M-parameter one 25.6 / 25.0
at 4, 51.5 / 47.1 at 16, 107 / 131 at 32), while the core it takes is the one the event loop
needs to stream that step's tokens (served at 16 clients, 256 in / 128 out: 1,828 against 1,557
output tokens/s). So decode steps, and short prefills, leave one core to the event loop. An
explicit OMP_NUM_THREADS wins over all of it.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass

import torch

# Below this, a prefill's operations are too short to share between threads.
PARALLEL_PREFILL_TOKENS = 64


@dataclass(frozen=True)
class CpuThreads:
    compute: int  # prefills: every core
    stream: int  # decode steps and short prefills: one core left to the event loop

    def for_pass(self, tokens: int, prefill: bool) -> int:
        """`tokens`: rows x new tokens per row."""
        return self.compute if prefill and tokens >= PARALLEL_PREFILL_TOKENS else self.stream


def plan(device: torch.device, cores: int | None = None, env: Mapping[str, str] = os.environ) -> CpuThreads | None:
    """The threads for passes on `device`; None off CPU. `cores`: torch's own count unless given."""
    if device.type != "cpu":
        return None
    cores = torch.get_num_threads() if cores is None else cores
    if "OMP_NUM_THREADS" in env:
        return CpuThreads(cores, cores)
    return CpuThreads(cores, max(1, cores - 1))


class ThreadSetter:
    """Sets torch's thread count before each pass, only when it changes (the call is cheap, ~0.1 us)."""

    def __init__(self, threads: CpuThreads | None) -> None:
        self.threads = threads
        self._current = torch.get_num_threads()

    def before(self, tokens: int, prefill: bool) -> None:
        if self.threads is None:
            return
        n = self.threads.for_pass(tokens, prefill)
        if n != self._current:
            torch.set_num_threads(n)
            self._current = n
