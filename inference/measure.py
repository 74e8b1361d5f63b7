"""`gpu-watchdog plan` without figures: measure M_base and M_peak of a model on the CUDA device."""

from __future__ import annotations

import torch

from inference import model as model_mod
from inference.engine import Engine, GenRequest
from inference.planner import CostModel, Plan, plan


class MeasureError(RuntimeError):
    pass


def measure_plan(
    model_dir: str | None, max_input: int | None, max_output: int | None, workers: int,
    reserve: tuple[str, float] | None,
) -> Plan:
    if not torch.cuda.is_available():
        raise MeasureError("no CUDA device to measure on: pass --total, --base and --peak to compute a plan")
    dev = torch.device("cuda")
    lm = model_mod.load(model_dir, dev)
    engine = Engine(lm)
    max_input = max_input or lm.context_len // 2
    max_output = max_output or lm.context_len - max_input
    if max_input + max_output > lm.context_len:
        raise MeasureError(f"--max-input + --max-output exceed the model's context of {lm.context_len} tokens")
    unit = lm.codec.encode("measure ")

    def run(prompt_len: int, new_tokens: int) -> float:
        prompt = (unit * (prompt_len // len(unit) + 1))[:prompt_len]
        torch.cuda.synchronize(dev)
        torch.cuda.reset_peak_memory_stats(dev)
        before = torch.cuda.memory_allocated(dev)
        engine.generate([GenRequest(prompt_ids=prompt, max_tokens=new_tokens)])
        torch.cuda.synchronize(dev)
        return float(torch.cuda.max_memory_allocated(dev) - before)

    run(8, 1)  # warm-up: CUDA context, kernels, cache
    short = run(16, 1)
    longest = run(max_input, max_output)
    cost = CostModel.fit(17, short, max_input + max_output, longest)
    torch.cuda.empty_cache()
    free, total = torch.cuda.mem_get_info(dev)
    base = int(total - free)  # weights, CUDA context and what this process keeps cached
    kind, value = reserve if reserve is not None else ("ratio", 0.12)
    return plan(int(total), base, int(cost.peak_bytes(max_input + max_output)),
                reserve_bytes=int(value) if kind == "bytes" else None,
                reserve_ratio=value if kind == "ratio" else None, workers=workers)
