"""Fault injection: every failure the watchdog reacts to can be produced on a CPU.

Only active when the server starts with `--fault-injection`. Faults act at the engine's
hardware edge (just before a forward pass, and on the allocator figures), so the rest of the
process handles them exactly as it would handle the real thing.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass
from typing import Any

from gpu_watchdog.inference.errors import FatalCudaError

FAULT_KINDS = ("context_loss", "oom", "hang", "fragmentation", "slow", "memory_cap", "corrupt", "clear")
# How `corrupt` computes wrong: every logit moved by up to `amount` in a pattern fixed for the process
# (a flipped weight bit moves scores; a wide margin survives a small move, a narrow one does not), or
# NaN in every step (a kernel writing garbage).
CORRUPT_MODES = ("perturb", "nonfinite")
# The kinds that act on one request's work: with `when_prompt_contains`, they fire only for requests
# whose prompt, messages or input contain the string, every time, until `clear` (a query of death).
PER_REQUEST_KINDS = ("context_loss", "oom", "hang", "slow")
TRIGGER_MAX = 1000

# Raised as the engine's own types (`FatalCudaError`, `torch.OutOfMemoryError`): errors are told
# apart by type, and no text makes an exception sticky or an OOM.
INJECTED_FATAL_MESSAGE = "CUDA error: an illegal memory access was encountered (injected fault)"


class FaultError(ValueError):
    """A fault request that names an unknown kind or a bad parameter."""


@dataclass(frozen=True)
class Fragmentation:
    ratio: float
    sticky: bool


class FaultInjector:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._context_loss = False
        self._oom_remaining = 0
        self._hang = threading.Event()
        self._unhang = threading.Event()
        self._slow_s = 0.0
        self._fragmentation: Fragmentation | None = None
        # A simulated card: more sequences than this in the engine at once run out of memory.
        self._memory_cap: int | None = None
        self.injected_ooms = 0
        self._when: dict[str, str] = {}  # kind -> the prompt substring it fires for
        self._slow_s_marked = 0.0
        # Persistent until the process exits, as a bad memory row is: `clear` leaves it.
        self._corrupt: tuple[str, float] | None = None
        self._pattern: Any = None

    def marks(self, text: str) -> frozenset[str]:
        """The per-request faults a request with this prompt text triggers."""
        with self._lock:
            return frozenset(kind for kind, s in self._when.items() if s in text)

    def inject(self, kind: str, params: dict[str, Any]) -> dict[str, Any]:
        if kind not in FAULT_KINDS:
            raise FaultError(f"kind: must be one of {', '.join(FAULT_KINDS)}")
        trigger = params.get("when_prompt_contains")
        if trigger is not None:
            if kind not in PER_REQUEST_KINDS:
                raise FaultError(f"when_prompt_contains: only for {', '.join(PER_REQUEST_KINDS)}, not {kind}")
            if not isinstance(trigger, str) or not 0 < len(trigger) <= TRIGGER_MAX:
                raise FaultError(f"when_prompt_contains: must be a non-empty string of at most {TRIGGER_MAX}"
                                 " characters")
        with self._lock:
            if trigger is not None:
                if kind == "slow":
                    self._slow_s_marked = _float_param(params, "delay_s", 0.5, 0.0, 60.0)
                if kind == "hang":
                    self._unhang.clear()
                self._when[kind] = trigger
            elif kind == "context_loss":
                self._context_loss = True
            elif kind == "oom":
                count = _int_param(params, "count", 1, 1, 1000)
                self._oom_remaining += count
            elif kind == "hang":
                self._unhang.clear()
                self._hang.set()
            elif kind == "fragmentation":
                ratio = _float_param(params, "ratio", 0.6, 0.0, 0.99)
                sticky = params.get("sticky", False)
                if not isinstance(sticky, bool):
                    raise FaultError("sticky: must be a boolean")
                self._fragmentation = Fragmentation(ratio=ratio, sticky=sticky)
            elif kind == "slow":
                self._slow_s = _float_param(params, "delay_s", 0.5, 0.0, 60.0)
            elif kind == "memory_cap":
                if "sequences" not in params:
                    raise FaultError("sequences: required (the most sequences the simulated card holds)")
                self._memory_cap = _int_param(params, "sequences", 0, 1, 100_000)
            elif kind == "corrupt":
                mode = params.get("mode", "perturb")
                if mode not in CORRUPT_MODES:
                    raise FaultError(f"mode: must be one of {', '.join(CORRUPT_MODES)}")
                self._corrupt = (mode, _float_param(params, "amount", 8.0, 0.0, 1e6))
                self._pattern = None
            elif kind == "clear":
                self._context_loss = False
                self._oom_remaining = 0
                self._hang.clear()
                self._unhang.set()
                self._slow_s = 0.0
                self._fragmentation = None
                self._memory_cap = None
                self._when.clear()
            return self.describe()

    def describe(self) -> dict[str, Any]:
        return {
            "context_loss": self._context_loss,
            "oom_remaining": self._oom_remaining,
            "hang": self._hang.is_set(),
            "slow_s": self._slow_s,
            "memory_cap": self._memory_cap,
            "corrupt": None if self._corrupt is None else {"mode": self._corrupt[0], "amount": self._corrupt[1]},
            "when_prompt_contains": {kind: len(s) for kind, s in self._when.items()},  # lengths, not texts
            "fragmentation": None
            if self._fragmentation is None
            else {"ratio": self._fragmentation.ratio, "sticky": self._fragmentation.sticky},
        }

    def before_forward(self, active_sequences: int = 0, marks: frozenset[str] = frozenset()) -> None:
        """Called in the worker thread right before GPU work: raise, block or delay as injected.
        `marks`: the per-request faults the work's requests trigger (`marks`)."""
        if marks:
            self._marked(marks)
        with self._lock:
            fatal = self._context_loss
            oom = self._oom_remaining > 0
            if oom and not fatal:
                self._oom_remaining -= 1
            oom = oom or self._over_cap(active_sequences)
            if oom and not fatal:
                self.injected_ooms += 1
            slow = self._slow_s
        if fatal:
            raise FatalCudaError(INJECTED_FATAL_MESSAGE)
        if oom:
            raise _oom_error()
        if self._hang.is_set():
            # A hung kernel never returns; only `clear` (or the process dying) releases it.
            self._unhang.wait()
        if slow > 0:
            time.sleep(slow)

    def _marked(self, marks: frozenset[str]) -> None:
        with self._lock:
            live = marks & self._when.keys()
            if "oom" in live:
                self.injected_ooms += 1
            delay = self._slow_s_marked if "slow" in live else 0.0
        if "context_loss" in live:
            raise FatalCudaError(INJECTED_FATAL_MESSAGE)
        if "oom" in live:
            raise _oom_error()
        if "hang" in live:
            self._unhang.wait()
        if delay > 0:
            time.sleep(delay)

    def _over_cap(self, active_sequences: int) -> bool:
        return self._memory_cap is not None and active_sequences > self._memory_cap

    def during_forward(self, active_sequences: int = 0, marks: frozenset[str] = frozenset()) -> None:
        """Called between decoding steps: a lost context fails the very next kernel, a hang stops it,
        and more sequences than the simulated card holds run out of memory."""
        if marks:
            self._marked(marks)
        if self._context_loss:
            raise FatalCudaError(INJECTED_FATAL_MESSAGE)
        with self._lock:
            over = self._over_cap(active_sequences)
            if over:
                self.injected_ooms += 1
        if over:
            raise _oom_error()
        if self._hang.is_set():
            self._unhang.wait()

    def on_logits(self, logits: Any) -> Any:
        """Called in the loop thread with a step's logits [rows, vocab]: what a corrupt card computes."""
        corrupt = self._corrupt
        if corrupt is None:
            return logits
        mode, amount = corrupt
        import torch

        if mode == "nonfinite":
            return torch.full_like(logits, float("nan"))
        vocab = logits.shape[-1]
        if self._pattern is None or self._pattern.shape[-1] != vocab or self._pattern.device != logits.device:
            gen = torch.Generator().manual_seed(0x5EED)
            self._pattern = (torch.rand(vocab, generator=gen) * 2 - 1).to(logits.device) * amount
        return logits + self._pattern

    @property
    def fragmentation(self) -> Fragmentation | None:
        return self._fragmentation

    def on_empty_cache(self) -> bool:
        """Emptying the cache cures an injected non-sticky fragmentation. True when it did."""
        with self._lock:
            if self._fragmentation is not None and not self._fragmentation.sticky:
                self._fragmentation = None
                return True
            return False


def _oom_error() -> BaseException:
    import torch

    return torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB (injected fault)")


def _int_param(params: dict[str, Any], name: str, default: int, lo: int, hi: int) -> int:
    value = params.get(name, default)
    if isinstance(value, bool) or not isinstance(value, int) or not lo <= value <= hi:
        raise FaultError(f"{name}: must be an integer between {lo} and {hi}")
    return value


def _float_param(params: dict[str, Any], name: str, default: float, lo: float, hi: float) -> float:
    value = params.get(name, default)
    if isinstance(value, bool) or not isinstance(value, int | float) or not lo <= value <= hi:
        raise FaultError(f"{name}: must be a number between {lo} and {hi}")
    return float(value)
