"""Measuring a model's memory on its CUDA device: one routine for `serve --max-concurrency auto` and `plan`.

Both ask the same questions of the same engine path, so they cannot disagree on one card:
- the base: what the process keeps reserved once the measuring runs' blocks are returned
  (weights and warm cache), and, apart, the CUDA context and other non-torch use;
- the peak of one sequence, fitted as a line between a short run and the longest one planned.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from gpu_watchdog.inference import handler as handler_mod
from gpu_watchdog.inference import model as model_mod
from gpu_watchdog.inference.engine import Engine
from gpu_watchdog.inference.engine_api import GenRequest
from gpu_watchdog.inference.handler import RequestHandler
from gpu_watchdog.inference.handlers.causal_lm import CausalLM
from gpu_watchdog.inference.planner import CostModel, Plan, plan

SHORT_PROMPT = 16


class MeasureError(RuntimeError):
    pass


@dataclass(frozen=True)
class Measurement:
    total_bytes: int
    base_bytes: int
    context_bytes: int
    cost: CostModel
    longest_tokens: int

    @property
    def peak_bytes(self) -> int:
        return int(self.cost.peak_bytes(self.longest_tokens))


def filler(engine: Engine, tokens: int) -> list[int]:
    unit = engine.lm.codec.encode("measure ")
    return (unit * (tokens // len(unit) + 1))[: max(1, tokens)]


def _peak(dev: torch.device, run: Callable[[], object]) -> float:
    """The most memory `run` allocated above what was allocated before it."""
    torch.cuda.synchronize(dev)
    torch.cuda.reset_peak_memory_stats(dev)
    before = torch.cuda.memory_allocated(dev)
    run()
    torch.cuda.synchronize(dev)
    return float(torch.cuda.max_memory_allocated(dev) - before)


def measure(engine: Engine, prompt_tokens: int, new_tokens: int) -> Measurement:
    """Peak memory of one sequence of `prompt_tokens` + `new_tokens`, and the base, on CUDA."""
    if not engine.is_cuda:
        raise MeasureError("no CUDA device to measure on")

    def peak(prompt: int, new: int) -> float:
        return _peak(engine.device, lambda: engine.generate([GenRequest(prompt_ids=filler(engine, prompt),
                                                                        max_tokens=new)]))

    peak(8, 1)  # warm-up: kernels, allocator, cuBLAS workspace
    short = peak(SHORT_PROMPT, 1)
    longest = peak(prompt_tokens, new_tokens)
    cost = CostModel.fit(SHORT_PROMPT + 1, short, prompt_tokens + new_tokens, longest)
    return _with_base(engine, cost, prompt_tokens + new_tokens)


def measure_items(engine: Engine, sized_item: Callable[[int], Any], longest_tokens: int) -> Measurement:
    """Peak memory of one item of a request-level handler, fitted between a short item and the
    longest the model takes, and the base, on CUDA: the same questions `measure` asks of a sequence."""
    if not engine.is_cuda:
        raise MeasureError("no CUDA device to measure on")

    def peak(tokens: int) -> float:
        item = sized_item(tokens)
        return _peak(engine.device, lambda: engine.predict_now([item]))

    peak(8)  # warm-up: kernels, allocator, cuBLAS workspace
    short = peak(SHORT_PROMPT)
    longest = peak(longest_tokens)
    cost = CostModel.fit(SHORT_PROMPT, short, longest_tokens, longest)
    return _with_base(engine, cost, longest_tokens)


def _with_base(engine: Engine, cost: CostModel, longest_tokens: int) -> Measurement:
    """The base once the measuring runs' blocks are returned; the context and other non-torch use apart."""
    dev = engine.device
    torch.cuda.empty_cache()
    base = int(torch.cuda.memory_reserved(dev))
    free, total = torch.cuda.mem_get_info(dev)
    context = max(0, int(total - free) - base)
    return Measurement(int(total), base, context, cost, longest_tokens)


def measure_plan(
    model_dir: str | None, max_input: int | None, max_output: int | None, workers: int,
    reserve: tuple[str, float] | None, handler: str = "causal-lm",
) -> Plan:
    request_level = None
    if handler != "causal-lm":
        # A bad name or a handler that cannot be measured is said before any device is asked for.
        request_level = _measurable_handler(handler)
    if not torch.cuda.is_available():
        raise MeasureError("no CUDA device to measure on: pass --total, --base and --peak to compute a plan")
    if request_level is not None:
        m = _measure_handler(request_level, model_dir, max_input)
    else:
        lm = model_mod.load(model_dir, torch.device("cuda"))
        max_input = max_input or lm.context_len // 2
        max_output = max_output or lm.context_len - max_input
        if max_input + max_output > lm.context_len:
            raise MeasureError(f"--max-input + --max-output exceed the model's context of {lm.context_len} tokens")
        engine = Engine(CausalLM(lm))
        try:
            m = measure(engine, max_input, max_output)
        finally:
            engine.stop()
    kind, value = reserve if reserve is not None else ("ratio", 0.12)
    return plan(m.total_bytes, m.base_bytes, m.peak_bytes, reserve_bytes=int(value) if kind == "bytes" else None,
                reserve_ratio=value if kind == "ratio" else None, workers=workers, context_bytes=m.context_bytes)


def _measurable_handler(spec: str) -> RequestHandler:
    try:
        handler = handler_mod.resolve(spec)
    except handler_mod.HandlerError as exc:
        raise MeasureError(str(exc)) from None
    if not isinstance(handler, RequestHandler):
        raise MeasureError(f"--handler {spec}: needs decode, predict and encode")
    if getattr(handler, "sized_sample", None) is None:
        raise MeasureError(f"--handler {spec}: has no sized_sample(tokens), so one item's memory cannot be measured;"
                           " pass --total, --base and --peak")
    return handler


def _measure_handler(handler: RequestHandler, model_dir: str | None, max_input: int | None) -> Measurement:
    """One item's peak at two sizes through the engine `serve` runs, as `serve --max-concurrency auto` does."""
    device = torch.device("cuda")
    handler.load(model_dir, device)
    engine = Engine(handler, device=device)
    try:
        longest = min(max_input or engine.context_len, engine.context_len)
        return measure_items(engine, handler.sized_sample, longest)  # type: ignore[attr-defined]
    finally:
        engine.stop()
