"""What the generation loop and the request-level batch loop share: one thread that owns the model.

Every forward pass runs on that thread (CUDA streams and allocator state stay on one thread); other
threads only queue work and read figures under the condition.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass

from gpu_watchdog.inference.faults import FaultInjector


@dataclass(frozen=True)
class LoopHooks:
    """What a loop reports (to the engine's guard and metrics), and the faults it applies."""

    faults: FaultInjector | None = None
    # Units of work done (tokens generated, items answered): a watcher reads the counter as proof
    # of progress, and a long generation must not look like a stalled one.
    on_progress: Callable[[int], object] | None = None
    # Prompt tokens a prefill pass (or a chunk of a long prompt) computed: progress too, so that a
    # long prefill on an otherwise idle server is not taken for a stall.
    on_prefill: Callable[[int], object] | None = None
    on_step: Callable[[int], object] | None = None  # rows in each forward pass
    on_oom: Callable[[BaseException], object] | None = None
    on_fatal: Callable[[str], object] | None = None
    after_release: Callable[[], object] | None = None  # a grant went back to the gate
    on_prefix_lookup: Callable[[int, int], object] | None = None  # prompt tokens looked up, found cached
    on_nonfinite: Callable[[], object] | None = None  # a step's logits held NaN or infinities


class LoopThread:
    def __init__(self, name: str, hooks: LoopHooks) -> None:
        self.faults = hooks.faults
        self.on_progress = hooks.on_progress
        self.on_prefill = hooks.on_prefill
        self.on_step = hooks.on_step
        self.on_oom = hooks.on_oom
        self.on_fatal = hooks.on_fatal
        self.after_release = hooks.after_release
        self.on_prefix_lookup = hooks.on_prefix_lookup
        self.on_nonfinite = hooks.on_nonfinite
        self.poison_reason: str | None = None
        self._cond = threading.Condition()
        self._stopping = False
        self._forwards = 0
        self._largest = 0
        self._peak = 0
        self._threads: set[int] = set()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self, timeout: float = 10.0) -> None:
        """Stop after the step in progress and wait for the loop thread to end: a thread killed
        inside torch at interpreter exit aborts the process ("terminate called ...")."""
        with self._cond:
            self._stopping = True
            self._cond.notify_all()
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join(timeout)

    def _run(self) -> None:
        raise NotImplementedError
