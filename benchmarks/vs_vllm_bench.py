"""The bundled server beside vLLM's CPU build, both measured by vLLM's own client (`vllm bench serve`).

Usage: python -m benchmarks.vs_vllm_bench [--vllm-python PATH] [--concurrency 1,4,16,32]
       [--shapes 128x32,256x64,256x128] [--models small,85m] [--prompts-per-client 4]

For each generated model (random weights, no download: `small` is hidden 256 / 4 layers, `85m`
hidden 768 / 12 layers), each server runs alone (vLLM at its defaults, then ours at its defaults),
and `vllm bench serve --dataset-name random` (unchanged: it sends ignore_eos, so every answer has
its full length) runs every cell of concurrency x (input/output tokens). Writes
benchmarks/results/vs_vllm_bench.{md,json,png}: output tokens/s, TTFT and TPOT p50/p99 per cell,
and ours/vLLM.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from benchmarks._procs import ROOT, machine, serve
from benchmarks.make_model import make
from benchmarks.peer_vllm import SERVED_NAME, make_tiny_model, start_vllm, vllm_python
from benchmarks.vllm_bench import bench_serve

METRICS = ("output_throughput", "p50_ttft_ms", "p99_ttft_ms", "p50_tpot_ms", "p99_tpot_ms")


def _model(name: str, work: Path) -> Path:
    if name == "small":
        return make_tiny_model(work / "small")
    return make(work / name, hidden=768, layers=12, heads=12, vocab=2048, context=1024, seed=0)


def _cells(args: argparse.Namespace) -> list[tuple[int, int, int]]:
    shapes = [tuple(int(x) for x in s.split("x")) for s in args.shapes.split(",")]
    return [(c, i, o) for c in (int(x) for x in args.concurrency.split(",")) for i, o in shapes]


def _run(python: Path, url: str, model: Path, cells: list[tuple[int, int, int]], per_client: int
         ) -> dict[str, dict[str, Any]]:
    out: dict[str, dict[str, Any]] = {}
    for c, i, o in cells:
        r = bench_serve(python, url, SERVED_NAME, model, prompts=max(8, c * per_client), input_len=i, output_len=o,
                        concurrency=c)
        row = {k: r.get(k) for k in (*METRICS, "completed", "failed")}
        out[f"{c}|{i}|{o}"] = row
        print(f"  c={c} {i}/{o}: {row}", flush=True)
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--vllm-python", default=None)
    p.add_argument("--concurrency", default="1,4,16,32")
    p.add_argument("--shapes", default="128x32,256x64,256x128")
    p.add_argument("--models", default="small,85m")
    p.add_argument("--prompts-per-client", type=int, default=4)
    p.add_argument("--omp-spin", action="store_true",
                   help="leave OMP_WAIT_POLICY alone (default: PASSIVE for both servers)")
    p.add_argument("--out", default=str(ROOT / "benchmarks" / "results"))
    args = p.parse_args()
    if not args.omp_spin:
        # On cores shared with other work, OpenMP threads that spin at every barrier wait for each
        # other: a 2-thread forward pass of the small model took 94 ms instead of 2.4 ms here.
        os.environ["OMP_WAIT_POLICY"] = "PASSIVE"
    python = Path(args.vllm_python) if args.vllm_python else vllm_python()
    if python is None:
        sys.exit("no vLLM venv: run `make vllm` (or pass --vllm-python)")
    out = Path(args.out)
    work = Path(tempfile.mkdtemp(prefix="vs-vllm-bench-"))
    cells = _cells(args)
    results: dict[str, dict[str, dict[str, Any]]] = {}
    for name in args.models.split(","):
        model = _model(name, work)
        started = time.monotonic()
        vllm = start_vllm(python, model, work / f"vllm-{name}", max_num_seqs=None, eager=False)
        print(f"{name}: vllm up in {time.monotonic() - started:.0f}s", flush=True)
        try:
            results[f"{name}|vllm"] = _run(python, vllm.url, model, cells, args.prompts_per_client)
        finally:
            vllm.stop()
        server = serve(["--model", str(model), "--served-model-name", SERVED_NAME],
                       out / "logs" / f"vs_vllm_bench-{name}.log")
        try:
            results[f"{name}|ours"] = _run(python, server.url, model, cells, args.prompts_per_client)
        finally:
            server.running.stop()
        write_report(args, results, out)
    print((out / "vs_vllm_bench.md").read_text())


def _ratio(a: Any, b: Any) -> str:
    return f"{a / b:.2f}x" if isinstance(a, int | float) and isinstance(b, int | float) and b else "-"


def _pair(a: dict[str, Any], b: dict[str, Any], key: str) -> str:
    x, y = a.get(key), b.get(key)
    return f"{x:.1f} / {y:.1f}" if isinstance(x, int | float) and isinstance(y, int | float) else "-"


def write_report(args: argparse.Namespace, results: dict[str, dict[str, dict[str, Any]]], out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / "vs_vllm_bench.json").write_text(json.dumps({"machine": machine(), "args": vars(args),
                                                         "results": results}, indent=1))
    lines = ["# Ours beside vLLM, measured by `vllm bench serve` (random dataset, ignore_eos)\n",
             f"Machine: {machine()}. Command: `python -m benchmarks.vs_vllm_bench"
             f" --concurrency {args.concurrency} --shapes {args.shapes} --models {args.models}"
             f" --prompts-per-client {args.prompts_per_client}`. Load average when written:"
             f" {' '.join(f'{x:.1f}' for x in os.getloadavg())} (other work on the same cores skews the figures);"
             f" OMP_WAIT_POLICY={os.environ.get('OMP_WAIT_POLICY', 'unset')} for both servers.\n",
             "| model | concurrency | in/out | out tok/s ours / vLLM | ratio | p50 TTFT ms ours / vLLM | "
             "p99 TTFT ms ours / vLLM | p99 TTFT ratio | p50 TPOT ms ours / vLLM | p99 TPOT ms ours / vLLM | "
             "failed ours / vLLM |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for model in dict.fromkeys(k.split("|")[0] for k in results):
        ours, theirs = results.get(f"{model}|ours", {}), results.get(f"{model}|vllm", {})
        for cell in theirs:
            a, b = ours.get(cell, {}), theirs[cell]
            c, i, o = cell.split("|")

            lines.append(f"| {model} | {c} | {i}/{o} | {_pair(a, b, 'output_throughput')} | "
                         f"{_ratio(a.get('output_throughput'), b.get('output_throughput'))} | "
                         f"{_pair(a, b, 'p50_ttft_ms')} | {_pair(a, b, 'p99_ttft_ms')} | "
                         f"{_ratio(a.get('p99_ttft_ms'), b.get('p99_ttft_ms'))} | {_pair(a, b, 'p50_tpot_ms')} | "
                         f"{_pair(a, b, 'p99_tpot_ms')} | {a.get('failed', '-')} / {b.get('failed')} |")
    (out / "vs_vllm_bench.md").write_text("\n".join(lines) + "\n")
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    fig, ax = plt.subplots(figsize=(10, 4))
    labels, ratios = [], []
    for model in dict.fromkeys(k.split("|")[0] for k in results):
        ours, theirs = results.get(f"{model}|ours", {}), results.get(f"{model}|vllm", {})
        for cell, b in theirs.items():
            a = ours.get(cell, {})
            if isinstance(a.get("output_throughput"), int | float) and b.get("output_throughput"):
                labels.append(f"{model}\nc{cell.replace('|', ' ', 1).replace('|', '/')}")
                ratios.append(a["output_throughput"] / b["output_throughput"])
    ax.bar(range(len(ratios)), ratios)
    ax.axhline(1.0, color="k", linewidth=0.8)
    ax.set_xticks(range(len(ratios)), labels, fontsize=7)
    ax.set_ylabel("output tokens/s, ours / vLLM")
    fig.tight_layout()
    fig.savefig(out / "vs_vllm_bench.png", dpi=100)
    plt.close(fig)


if __name__ == "__main__":
    main()
