"""The bundled server beside vLLM's CPU build, side by side on one generated model, in one run.

Usage: python -m gpu_watchdog.benchmarks.vs_vllm [--vllm-python PATH] [--concurrency 1,2,4,16,32] [--requests N]

Generates the model (random-weight Llama, hidden 256, 4 layers, vocab 2,048; no download), then
serves it three times, one after the other so they never compete for the cores:
- vllm: `vllm.entrypoints.openai.api_server` at its defaults (installed by `make vllm`);
- ours: `gpu-watchdog serve --model DIR` at its defaults;
- ours-unbatched: the same with `--max-batch-size 1` (what batching must never be worse than).
The same client (`benchmarks.loadgen`, greedy 32-token completions) drives each. Writes
benchmarks/results/vs_vllm.{md,csv,json,png}: generated tokens/s, p50 and p99 per concurrency,
the ratios ours/vLLM, and each server's idle RSS.
"""

from __future__ import annotations

import argparse
import asyncio
import math
import sys
import tempfile
import time
from pathlib import Path

import requests

from gpu_watchdog.benchmarks._procs import ROOT, machine, serve
from gpu_watchdog.benchmarks.loadgen import BenchSettings, StepResult, markdown_table, write_files
from gpu_watchdog.benchmarks.peer_vllm import make_tiny_model, start_vllm, vllm_python


def rss_bytes(pids: list[int]) -> int:
    """Resident memory of these processes together, from /proc."""
    total = 0
    for pid in pids:
        try:
            for line in Path(f"/proc/{pid}/status").read_text().splitlines():
                if line.startswith("VmRSS:"):
                    total += int(line.split()[1]) * 1024
        except (OSError, ValueError, IndexError):
            continue
    return total


ANSWER_PROMPTS = ("request 0: tell me about GPUs", "the quick brown fox", "hello", "memory, memory, memory")


def answers(url: str, max_tokens: int) -> list[str]:
    """Greedy answers to fixed prompts: the two servers must agree on them for the comparison to be fair."""
    out = []
    for prompt in ANSWER_PROMPTS:
        r = requests.post(url + "/v1/completions", json={"prompt": prompt, "max_tokens": max_tokens,
                                                         "temperature": 0}, timeout=60)
        r.raise_for_status()
        out.append(r.json()["choices"][0]["text"])
    return out


def sweep(url: str, label: str, args: argparse.Namespace) -> list[StepResult]:
    conc = tuple(int(c) for c in args.concurrency.split(","))
    # Untimed first: lazy initialisation, and whatever the previous server left running on the cores.
    asyncio.run(_run(BenchSettings(url=url, concurrency=(4,), requests_per_step=16, max_tokens=args.max_tokens,
                                   prompt_len=args.prompt_len, label="warm-up")))
    results: list[StepResult] = []
    for c in conc:
        # Enough requests that every client runs several in a row: the steady state, not the ramp.
        s = BenchSettings(url=url, concurrency=(c,), requests_per_step=max(args.requests, 4 * c),
                          max_tokens=args.max_tokens, prompt_len=args.prompt_len, label=label)
        results.extend(asyncio.run(_run(s)))
        r = results[-1]
        print(f"{label} c={c}: {r.tokens_per_s:.1f} tok/s p50 {r.p50_s:.3f}s p99 {r.p99_s:.3f}s"
              f" errors {r.errors}", flush=True)
    return results


async def _run(s: BenchSettings) -> list[StepResult]:
    from gpu_watchdog.benchmarks.loadgen import run_sweep

    return await run_sweep(s, show_progress=False)


def ratio_rows(results: list[StepResult], ours: str, theirs: str) -> str:
    by = {(r.mode, r.concurrency): r for r in results}
    lines = [f"| conc. | tok/s {ours} | tok/s {theirs} | {ours}/{theirs} | p50 {ours} / {theirs} s |"
             f" p99 {ours} / {theirs} s |", "|---:|---:|---:|---:|---:|---:|"]
    for c in sorted({r.concurrency for r in results}):
        a, b = by.get((ours, c)), by.get((theirs, c))
        if a is None or b is None:
            continue
        ratio = a.tokens_per_s / b.tokens_per_s if b.tokens_per_s else math.nan
        lines.append(f"| {c} | {a.tokens_per_s:.1f} | {b.tokens_per_s:.1f} | {ratio:.2f}x |"
                     f" {a.p50_s:.3f} / {b.p50_s:.3f} | {a.p99_s:.3f} / {b.p99_s:.3f} |")
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--vllm-python", default=None, help="the vLLM venv's python (default: .venv-vllm)")
    p.add_argument("--concurrency", default="1,2,4,16,32")
    p.add_argument("--requests", type=int, default=48, help="requests per step (at least 4 per client)")
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--prompt-len", type=int, default=32)
    p.add_argument("--skip-vllm", action="store_true", help="measure only our two modes")
    p.add_argument("--out", default=str(ROOT / "benchmarks" / "results"))
    args = p.parse_args()
    out = Path(args.out)
    work = Path(tempfile.mkdtemp(prefix="vs-vllm-"))
    model = make_tiny_model(work / "model")
    results: list[StepResult] = []
    idle: dict[str, int] = {}
    said: dict[str, list[str]] = {}

    python = Path(args.vllm_python) if args.vllm_python else vllm_python()
    if not args.skip_vllm:
        if python is None:
            sys.exit("no vLLM venv: run `make vllm` (or pass --vllm-python)")
        started = time.monotonic()
        vllm = start_vllm(python, model, work / "vllm", max_num_seqs=None, eager=False)
        print(f"vllm up in {time.monotonic() - started:.0f}s", flush=True)
        try:
            time.sleep(2)
            idle["vllm"] = rss_bytes([vllm.proc.pid, *vllm.engine_pids()])
            said["vllm"] = answers(vllm.url, args.max_tokens)
            results.extend(sweep(vllm.url, "vllm", args))
        finally:
            vllm.stop()

    for label, flags in (("ours", []), ("ours-unbatched", ["--max-batch-size", "1"])):
        server = serve(["--model", str(model), *flags], out / "logs" / f"vs_vllm-{label}.log")
        try:
            time.sleep(2)
            idle[label] = rss_bytes([server.running.proc.pid])
            said[label] = answers(server.url, args.max_tokens)
            results.extend(sweep(server.url, label, args))
        finally:
            server.running.stop()
        report = write_report(args, results, idle, said, out)
    print(report)


def write_report(args: argparse.Namespace, results: list[StepResult], idle: dict[str, int],
                 said: dict[str, list[str]], out: Path) -> str:
    rss = ", ".join(f"{k} {v / 2**20:.0f} MiB" for k, v in idle.items())
    agree = {label: texts == said.get("ours") for label, texts in said.items() if label != "ours"}
    parts = [
        "# The bundled server beside vLLM (CPU build), side by side",
        f"Machine: {machine()}",
        f"Model: generated Llama (hidden 256, 4 layers, 4 heads, vocab 2,048, fp32), {args.max_tokens}-token"
        f" greedy completions of {args.prompt_len}-character prompts, at least {args.requests} requests per"
        " step (4 per client), after 16 untimed warm-up requests. Servers at their defaults, run one after the"
        " other; ours-unbatched is"
        " `--max-batch-size 1`. Rerun: `python -m gpu_watchdog.benchmarks.vs_vllm` (`make vllm` first).",
        f"Idle RSS after start: {rss} (vLLM: the API server, engine core and worker together).",
        f"Greedy answers to {len(ANSWER_PROMPTS)} fixed prompts identical to ours: "
        + (", ".join(f"{k} {'yes' if v else 'NO'}" for k, v in agree.items()) or "n/a"),
    ]
    if any(r.mode == "vllm" for r in results):
        parts += ["## ours / vLLM", ratio_rows(results, "ours", "vllm")]
    parts += ["## ours / ours-unbatched", ratio_rows(results, "ours", "ours-unbatched"),
              "## All steps", markdown_table(results)]
    report = "\n\n".join(parts)
    out.mkdir(parents=True, exist_ok=True)
    (out / "vs_vllm.md").write_text(report + "\n", encoding="utf-8")
    write_files(results, out, "vs_vllm")
    return report


if __name__ == "__main__":
    main()
