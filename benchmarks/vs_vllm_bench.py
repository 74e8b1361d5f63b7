"""The bundled server beside vLLM's CPU build, both measured by vLLM's own client (`vllm bench serve`).

Usage: python -m gpu_watchdog.benchmarks.vs_vllm_bench [--vllm-python PATH] [--concurrency 1,4,16,32]
       [--shapes 128x32,256x64,256x128] [--models small,85m] [--prompts-per-client 2] [--rounds 3]

For each generated model (random weights, no download: `small` is hidden 256 / 4 layers, `85m`
hidden 768 / 12 layers), both servers run at their defaults, started fresh, and
`vllm bench serve --dataset-name random` (unchanged: it sends ignore_eos, so every answer has its
full length) runs every cell of concurrency x (input/output tokens) against one, then the other
(the order alternating from cell to cell), so that a slow minute of a shared machine lands on
both alike. A round is the whole matrix with one seed for every cell, the client's default way
(its seed is 0): prompts then repeat from cell to cell, as they would for anyone running it twice,
and each server's prefix cache (vLLM's is on by default, so is ours) sees the same sequence.
Each round takes the next seed; the table gives each cell's median over the rounds. Writes
benchmarks/results/vs_vllm_bench.{md,json,png}: output tokens/s, TTFT and TPOT p50/p99 per cell,
and ours/vLLM.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from gpu_watchdog.benchmarks._procs import ROOT, machine, serve
from gpu_watchdog.benchmarks.make_model import make
from gpu_watchdog.benchmarks.peer_vllm import SERVED_NAME, make_tiny_model, start_vllm, vllm_python
from gpu_watchdog.benchmarks.vllm_bench import bench_serve

METRICS = ("output_throughput", "p50_ttft_ms", "p99_ttft_ms", "p50_tpot_ms", "p99_tpot_ms")


def _model(name: str, work: Path) -> Path:
    if name == "small":
        return make_tiny_model(work / "small")
    return make(work / name, hidden=768, layers=12, heads=12, vocab=2048, context=1024, seed=0)


def _cells(args: argparse.Namespace) -> list[tuple[int, int, int]]:
    shapes = [tuple(int(x) for x in s.split("x")) for s in args.shapes.split(",")]
    return [(c, i, o) for c in (int(x) for x in args.concurrency.split(",")) for i, o in shapes]


def _round(python: Path, urls: dict[str, str], model: Path, cells: list[tuple[int, int, int]], per_client: int,
           seed: int, runs: dict[str, dict[str, list[dict[str, Any]]]]) -> None:
    for n, (c, i, o) in enumerate(cells):
        order = ("vllm", "ours") if (n + seed) % 2 == 0 else ("ours", "vllm")
        for name in order:
            r = bench_serve(python, urls[name], SERVED_NAME, model, prompts=max(8, c * per_client), input_len=i,
                            output_len=o, concurrency=c, seed=seed)
            row = {k: r.get(k) for k in (*METRICS, "completed", "failed")}
            runs[name].setdefault(f"{c}|{i}|{o}", []).append(row)
            print(f"  seed {seed} {name} c={c} {i}/{o}: {row}", flush=True)


def _median(rows: list[dict[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key in (*METRICS, "completed", "failed"):
        values = [r[key] for r in rows if isinstance(r.get(key), int | float)]
        out[key] = (sum(values) if key == "failed" else statistics.median(values)) if values else None
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--vllm-python", default=None)
    p.add_argument("--concurrency", default="1,4,16,32")
    p.add_argument("--shapes", default="128x32,256x64,256x128")
    p.add_argument("--models", default="small,85m")
    p.add_argument("--prompts-per-client", type=int, default=2)
    p.add_argument("--rounds", type=int, default=3, help="the matrix this many times, seeds 0, 1, ...")
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
    all_runs: dict[str, dict[str, dict[str, list[dict[str, Any]]]]] = {}
    for name in args.models.split(","):
        model = _model(name, work)
        runs: dict[str, dict[str, list[dict[str, Any]]]] = {"vllm": {}, "ours": {}}
        for seed in range(args.rounds):
            # Fresh servers each round: neither cache carries the last round's prompts over.
            started = time.monotonic()
            vllm = start_vllm(python, model, work / f"vllm-{name}-{seed}", max_num_seqs=None, eager=False)
            server = None
            try:
                server = serve(["--model", str(model), "--served-model-name", SERVED_NAME],
                               out / "logs" / f"vs_vllm_bench-{name}.log")
                print(f"{name}: both up in {time.monotonic() - started:.0f}s", flush=True)
                _round(python, {"vllm": vllm.url, "ours": server.url}, model, cells, args.prompts_per_client, seed,
                       runs)
            finally:
                vllm.stop()
                if server is not None:
                    server.running.stop()
        all_runs[name] = runs
        for side in ("vllm", "ours"):
            results[f"{name}|{side}"] = {cell: _median(rows) for cell, rows in runs[side].items()}
        write_report(args, results, out, all_runs)
    print((out / "vs_vllm_bench.md").read_text())


def _ratio(a: Any, b: Any) -> str:
    return f"{a / b:.2f}x" if isinstance(a, int | float) and isinstance(b, int | float) and b else "-"


def _pair(a: dict[str, Any], b: dict[str, Any], key: str) -> str:
    x, y = a.get(key), b.get(key)
    return f"{x:.1f} / {y:.1f}" if isinstance(x, int | float) and isinstance(y, int | float) else "-"


def write_report(args: argparse.Namespace, results: dict[str, dict[str, dict[str, Any]]], out: Path,
                 runs: dict[str, Any] | None = None) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / "vs_vllm_bench.json").write_text(json.dumps({"machine": machine(), "args": vars(args),
                                                         "results": results, "runs": runs or {}}, indent=1))
    lines = ["# Ours beside vLLM, measured by `vllm bench serve` (random dataset, ignore_eos)\n",
             f"Machine: {machine()}. Command: `python -m gpu_watchdog.benchmarks.vs_vllm_bench"
             f" --concurrency {args.concurrency} --shapes {args.shapes} --models {args.models}"
             f" --prompts-per-client {args.prompts_per_client} --rounds {args.rounds}`: both servers fresh each"
             f" round, cells alternating which goes first, one seed per round (0, 1, ...) for every cell, so"
             f" prompts repeat from cell to cell as the client's default seed makes them and both prefix caches"
             f" see the same sequence; each figure is the median over the rounds (failed: the sum). Load average"
             f" when written: {' '.join(f'{x:.1f}' for x in os.getloadavg())} (other work on the same cores skews"
             f" the figures); OMP_WAIT_POLICY={os.environ.get('OMP_WAIT_POLICY', 'unset')} for both servers.\n",
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
    plot(results, out / "vs_vllm_bench.png")


PANELS = (("output_throughput", "output tokens/s"), ("p50_ttft_ms", "p50 TTFT"), ("p99_ttft_ms", "p99 TTFT"),
          ("p50_tpot_ms", "p50 TPOT"), ("p99_tpot_ms", "p99 TPOT"))


def plot(results: dict[str, dict[str, dict[str, Any]]], path: Path) -> None:
    """One panel per metric (rows) and model (columns): ours / vLLM per cell, grouped by concurrency,
    a bar per tokens in/out. Above 1 is better for tokens/s, below 1 for the latencies."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    models = list(dict.fromkeys(k.split("|")[0] for k in results))
    fig, axes = plt.subplots(len(PANELS), len(models), figsize=(5.5 * len(models), 2.2 * len(PANELS)),
                             squeeze=False, sharex="col")
    for col, model in enumerate(models):
        ours, theirs = results.get(f"{model}|ours", {}), results.get(f"{model}|vllm", {})
        concurrencies = list(dict.fromkeys(cell.split("|")[0] for cell in theirs))
        shapes = list(dict.fromkeys("/".join(cell.split("|")[1:]) for cell in theirs))
        width = 0.8 / max(1, len(shapes))
        for row, (key, title) in enumerate(PANELS):
            ax = axes[row][col]
            for k, shape in enumerate(shapes):
                xs, ys = [], []
                for x, c in enumerate(concurrencies):
                    cell = f"{c}|{shape.replace('/', '|')}"
                    a, b = ours.get(cell, {}), theirs.get(cell, {})
                    if isinstance(a.get(key), int | float) and isinstance(b.get(key), int | float) and b[key]:
                        xs.append(x + (k - (len(shapes) - 1) / 2) * width)
                        ys.append(a[key] / b[key])
                ax.bar(xs, ys, width, label=f"{shape} tokens")
            ax.axhline(1.0, color="k", linewidth=0.8)
            ax.set_ylabel(f"{title}\nours / vLLM", fontsize=8)
            if row == 0:
                hint = "  (tokens/s: higher is better; latencies: lower)" if col == 0 else ""
                ax.set_title(f"model {model}{hint}", fontsize=9)
                ax.legend(fontsize=7, loc="lower right")
            ax.set_xticks(range(len(concurrencies)), [f"c={c}" for c in concurrencies], fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)

if __name__ == "__main__":
    main()
