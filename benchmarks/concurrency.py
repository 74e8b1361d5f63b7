"""The seed's table, measured: unbounded vs semaphore vs full (memory-budget admission + batching).

Usage: python -m gpu_watchdog.benchmarks.concurrency [--concurrency 1,2,4,8,16,32] [--requests N] [--out DIR]

The three modes run on the same model in one invocation, one after the other (never at the same
time, so they do not compete for the CPU/GPU):
- unbounded: no gate (a limit no load reaches) and no batching;
- semaphore: the seed's fixed gate of N slots, no batching;
- full: admission by the memory budget (`auto`: measured on CUDA; 64 slots on CPU) + continuous batching.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import time
from pathlib import Path

from gpu_watchdog.benchmarks._procs import ROOT, machine, serve
from gpu_watchdog.benchmarks.loadgen import (
    BenchSettings,
    StepResult,
    markdown_table,
    ratio_table,
    run_sweep,
    write_files,
)


def modes(slots: int, max_batch: int) -> dict[str, list[str]]:
    return {
        "unbounded": ["--max-concurrency", "100000", "--max-batch-size", "1", "--max-queue", "100000"],
        "semaphore": ["--max-concurrency", str(slots), "--max-batch-size", "1"],
        "full": ["--max-concurrency", "auto", "--max-batch-size", str(max_batch)],
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--concurrency", default="1,2,4,8,16,32")
    p.add_argument("--requests", type=int, default=64)
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--prompt-len", type=int, default=32)
    p.add_argument("--slots", type=int, default=8, help="the semaphore mode's fixed gate")
    p.add_argument("--max-batch", type=int, default=256)
    p.add_argument("--device", default="auto")
    p.add_argument("--model", default=None)
    p.add_argument("--memory-fraction", default=None, help="cap each server's share of the GPU")
    p.add_argument("--out", default=str(ROOT / "benchmarks" / "results"))
    p.add_argument("--stem", default="concurrency")
    args = p.parse_args()
    conc = tuple(int(c) for c in args.concurrency.split(","))
    out = Path(args.out)
    results: list[StepResult] = []
    report = ""
    for mode, flags in modes(args.slots, args.max_batch).items():
        extra = ["--device", args.device] + (["--model", args.model] if args.model else [])
        if args.memory_fraction:
            extra += ["--memory-fraction", args.memory_fraction, "--max-tokens-limit", str(args.max_tokens)]
        server = serve([*flags, *extra], out / "logs" / f"{args.stem}-{mode}.log")
        try:
            s = BenchSettings(url=server.url, concurrency=conc, requests_per_step=args.requests,
                              max_tokens=args.max_tokens, prompt_len=args.prompt_len, control_url=server.control,
                              token=server.token, label=mode)
            started = time.monotonic()
            results.extend(asyncio.run(run_sweep(s, show_progress=sys.stderr.isatty())))
            print(f"{mode}: {time.monotonic() - started:.1f}s", flush=True)
        finally:
            server.running.stop()
        # After every mode, so a run cut short (a time limit on a borrowed GPU) still leaves its figures.
        report = write_report(args, results, out)
    print(report)


def write_report(args: argparse.Namespace, results: list[StepResult], out: Path) -> str:
    report = "\n\n".join([
        f"# Concurrency sweep ({args.stem})",
        f"Machine: {machine()}",
        f"Model: {args.model or 'built-in'}; {args.requests} requests per step; prompt {args.prompt_len} chars;"
        f" max_tokens {args.max_tokens}; clients retry 503s with backoff (200 ms x 2^n, Retry-After honoured,"
        f" at most 5 tries). Semaphore uses {args.slots} slots, unbatched; full is `auto` admission with"
        f" continuous batching of up to {args.max_batch} sequences."
        + (f" Each server capped at {args.memory_fraction} of the GPU's memory." if args.memory_fraction else ""),
        markdown_table(results),
        "## full / semaphore (same run)",
        ratio_table(results, "full", "semaphore"),
        "## full / unbounded (same run)",
        ratio_table(results, "full", "unbounded"),
    ])
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{args.stem}.md").write_text(report + "\n", encoding="utf-8")
    write_files(results, out, args.stem)
    return report


if __name__ == "__main__":
    main()
