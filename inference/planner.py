"""Concurrency planner: how many requests fit in GPU memory at once.

Pure arithmetic, no I/O: N_max = floor((M_total - M_base - M_reserve) / M_peak), with the rules
that keep it honest:
- M_reserve is at least 10 % of the card (the seed recommends 10-15 %),
- M_peak is measured at the largest allowed prompt + output, never the average,
- every worker process on the same GPU carries its own CUDA context and weights, so the
  budget is divided between workers.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

MIN_RESERVE_RATIO = 0.10


class PlanError(ValueError):
    """The inputs cannot give a usable plan; the message says which input is wrong."""


@dataclass(frozen=True)
class CostModel:
    """Peak memory of one sequence as a linear function of its length (prompt + output tokens).

    Fitted from two measurements; `fixed` covers per-request workspace, `per_token` the
    activations and KV cache that grow with length.
    """

    fixed_bytes: float
    per_token_bytes: float

    def peak_bytes(self, tokens: int) -> float:
        return max(1.0, self.fixed_bytes + self.per_token_bytes * max(tokens, 1))

    @classmethod
    def fit(cls, short_tokens: int, short_peak: float, long_tokens: int, long_peak: float) -> CostModel:
        if long_tokens <= short_tokens:
            raise PlanError("fit needs two different lengths, the second longer")
        slope = max(0.0, (long_peak - short_peak) / (long_tokens - short_tokens))
        fixed = max(0.0, short_peak - slope * short_tokens)
        return cls(fixed_bytes=fixed, per_token_bytes=slope)


@dataclass(frozen=True)
class Plan:
    total_bytes: int
    base_bytes: int
    reserve_bytes: int
    peak_bytes: int
    workers: int
    budget_bytes: int
    max_concurrency: int
    notes: tuple[str, ...]

    def helm_values(self) -> str:
        return (
            "inference:\n"
            "  admission:\n"
            f"    maxConcurrency: {self.max_concurrency}\n"
            f"    # budget {self.budget_bytes} bytes = total {self.total_bytes} - base {self.base_bytes}"
            f" - reserve {self.reserve_bytes}, per worker ({self.workers})\n"
            f"    # peak per request {self.peak_bytes} bytes at the longest allowed prompt + output\n"
        )


def plan(
    total_bytes: int,
    base_bytes: int,
    peak_bytes: int,
    reserve_bytes: int | None = None,
    reserve_ratio: float | None = None,
    workers: int = 1,
    context_bytes: int = 0,
) -> Plan:
    """Compute the admission limit for one worker.

    `base_bytes` is one worker's steady state after warm-up (weights + CUDA context + warm
    cache). `context_bytes`, when given separately, is added once per worker.
    """
    if total_bytes <= 0:
        raise PlanError("total must be positive")
    if base_bytes < 0:
        raise PlanError("base must not be negative")
    if peak_bytes <= 0:
        raise PlanError("peak must be positive (measure it at the longest prompt + output)")
    if workers < 1:
        raise PlanError("workers must be at least 1")
    notes: list[str] = []
    if reserve_bytes is None:
        ratio = MIN_RESERVE_RATIO if reserve_ratio is None else reserve_ratio
        if not 0.0 <= ratio < 1.0:
            raise PlanError("reserve ratio must be between 0 and 1")
        reserve_bytes = math.ceil(total_bytes * ratio)
    minimum = math.ceil(total_bytes * MIN_RESERVE_RATIO)
    if reserve_bytes < minimum:
        notes.append(f"reserve raised from {reserve_bytes} to {minimum} bytes (at least 10 % of the card)")
        reserve_bytes = minimum
    per_worker_base = base_bytes + context_bytes
    budget_all = total_bytes - reserve_bytes - workers * per_worker_base
    if budget_all <= 0:
        raise PlanError(
            f"no memory left for requests: {workers} worker(s) x base {per_worker_base} bytes"
            f" + reserve {reserve_bytes} bytes >= total {total_bytes} bytes"
        )
    budget = budget_all // workers
    n_max = budget // peak_bytes
    if n_max < 1:
        notes.append("one request at the longest length does not fit: shorten max tokens or use a bigger GPU")
    if workers > 1:
        notes.append(f"{workers} workers share the card: each carries its own context and weights")
    return Plan(
        total_bytes=total_bytes,
        base_bytes=per_worker_base,
        reserve_bytes=reserve_bytes,
        peak_bytes=peak_bytes,
        workers=workers,
        budget_bytes=int(budget),
        max_concurrency=int(n_max),
        notes=tuple(notes),
    )
