"""How many torch threads a forward pass gets on CPU: the cores it can use without starving the event loop.

On CPU the event loop that parses requests and streams tokens shares the cores with torch. A
prefill is arithmetic-bound and streams nothing while it runs: every core shortens it (a batch of
32 prompts of 256 tokens on 2 cores: 409 against 775 ms on one). So is a decode step of many rows,
bound by reading their keys and values, which a second core reads alongside (32 rows: 8.2 against
10.4 ms; served, its attention took a third of the step on one core). A decode step of a few rows
is a string of small operations, each of which a second thread makes slower (the threads meet at
every operation: 4 rows, 3.8 against 2.8 ms): those leave one core to the event loop. An explicit
OMP_NUM_THREADS wins over all of it.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass

import torch

# Below these, a pass's operations are too short to share between threads.
PARALLEL_PREFILL_TOKENS = 64
PARALLEL_DECODE_ROWS = 16


@dataclass(frozen=True)
class CpuThreads:
    compute: int  # prefills and decode steps of many rows: every core
    stream: int  # small passes: one core left to the event loop

    def for_pass(self, tokens: int, prefill: bool) -> int:
        """`tokens`: rows x new tokens per row (a decode step: its rows)."""
        big = tokens >= (PARALLEL_PREFILL_TOKENS if prefill else PARALLEL_DECODE_ROWS)
        return self.compute if big else self.stream


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
