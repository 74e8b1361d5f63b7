"""The decode loop's step, in process: the lean forward pass beside the model's own, interleaved in one run.

Usage: python -m gpu_watchdog.benchmarks.step [--rows 1,4,16,32] [--prompt 256] [--steps 64] [--model small|large]
       [--threads N] [--rounds 3]

Each cell runs `rows` prompts of `prompt` tokens together through the engine (one prefill, then
`steps` decode steps, greedy, ignore_eos) with either forward, alternating rounds so that other
work on the machine lands on both alike. It reports wall milliseconds per step (prefill amortised
the same for both), the best round of each, the ratio, and whether both answered the same tokens.
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import torch

from gpu_watchdog.benchmarks._procs import machine
from gpu_watchdog.benchmarks.make_model import make
from gpu_watchdog.benchmarks.peer_vllm import make_tiny_model
from gpu_watchdog.inference import model as model_mod
from gpu_watchdog.inference.engine import Engine, GenRequest
from gpu_watchdog.inference.handlers.causal_lm import CausalLM


def _run(lm: model_mod.LoadedModel, rows: int, prompt: int, steps: int) -> tuple[float, list[list[int]]]:
    engine = Engine(CausalLM(lm), max_rows=rows)
    try:
        prompts = [[(7 * r + i) % 200 + 3 for i in range(prompt)] for r in range(rows)]
        t0 = time.perf_counter()
        results = engine.generate([GenRequest(p, max_tokens=steps, ignore_eos=True) for p in prompts])
        elapsed = time.perf_counter() - t0
    finally:
        engine.stop()
    return elapsed / steps * 1000, [list(r.token_ids) for r in results]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rows", default="1,4,16,32")
    p.add_argument("--prompt", type=int, default=256)
    p.add_argument("--steps", type=int, default=64)
    p.add_argument("--model", choices=("small", "large"), default="small")
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's choice)")
    p.add_argument("--rounds", type=int, default=3)
    args = p.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        directory = (make_tiny_model(work / "small") if args.model == "small"
                     else make(work / "large", hidden=768, layers=12, heads=12, vocab=2048, context=1024, seed=0))
        lean = model_mod.load_pretrained(str(directory), torch.device("cpu"))
        # Loaded apart: the lean pass lays the weights out anew, which the model's own forward would share.
        generic = model_mod.load_pretrained(str(directory), torch.device("cpu"), lean=False)
    assert lean.lean is not None, lean.forward_path
    print(f"{machine()}; torch threads {torch.get_num_threads()}; model {args.model}; "
          f"prompt {args.prompt} tokens, {args.steps} steps, best of {args.rounds} rounds")
    print("| rows | ms/step lean | ms/step transformers | lean / transformers | same tokens |")
    print("|---:|---:|---:|---:|---|")
    for rows in (int(r) for r in args.rows.split(",")):
        best = {"lean": float("inf"), "transformers": float("inf")}
        tokens: dict[str, list[list[int]]] = {}
        for _ in range(args.rounds):
            for name, lm in (("lean", lean), ("transformers", generic)):
                ms, tokens[name] = _run(lm, rows, args.prompt, args.steps)
                best[name] = min(best[name], ms)
        same = "yes" if tokens["lean"] == tokens["transformers"] else "NO"
        print(f"| {rows} | {best['lean']:.2f} | {best['transformers']:.2f} | "
              f"{best['lean'] / best['transformers']:.2f}x | {same} |", flush=True)


if __name__ == "__main__":
    main()
