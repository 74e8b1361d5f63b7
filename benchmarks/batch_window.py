"""The batching window, measured: a classifier at concurrency 1-32 with windows of 0, 10 and 50 ms.

Usage: python -m gpu_watchdog.benchmarks.batch_window [--windows 0,10,50] [--concurrency 1,2,4,8,16,32]
       [--requests 96] [--model DIR] [--out DIR]

One server per window, one after the other (never at the same time). Each step runs closed-loop
clients (each sends its next request when the last one answers) until `--requests` have been
answered; one input per request. Reported: p50 and p99 latency, items/s, and the mean batch the
server formed (its own `gpu_inference_batch_size` histogram). Without `--model` a classifier is
generated (BERT-shaped, random weights, no download).
"""

from __future__ import annotations

import argparse
import asyncio
import csv
import json
import os
import tempfile
import time
from pathlib import Path
from typing import Any

import aiohttp
import requests

from gpu_watchdog.benchmarks._procs import ROOT, machine, serve

TEXTS = ["the gpu server answered fast", "memory queue health", "hello world", "the canary probe was ok",
         "batch token cache", "watchdog classify label good bad"]


def batch_stats(metrics_url: str) -> tuple[float, float]:
    """(sum, count) of the server's batch-size histogram."""
    from prometheus_client.parser import text_string_to_metric_families

    total = count = 0.0
    for family in text_string_to_metric_families(requests.get(metrics_url, timeout=10).text):
        for s in family.samples:
            if s.name == "gpu_inference_batch_size_sum":
                total = s.value
            elif s.name == "gpu_inference_batch_size_count":
                count = s.value
    return total, count


async def step(url: str, concurrency: int, total: int, timeout_s: float) -> tuple[list[float], float, int]:
    """Latencies of `total` requests from `concurrency` closed-loop clients, the wall time, errors."""
    latencies: list[float] = []
    errors = 0
    sent = 0
    deadline = time.monotonic() + timeout_s

    async def client(session: aiohttp.ClientSession, k: int) -> None:
        nonlocal sent, errors
        while sent < total and time.monotonic() < deadline:
            sent += 1
            body = {"input": TEXTS[(sent + k) % len(TEXTS)]}
            t0 = time.perf_counter()
            async with session.post(url + "/v1/classify", json=body) as r:
                await r.read()
                if r.status == 200:
                    latencies.append(time.perf_counter() - t0)
                else:
                    errors += 1

    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=60)) as session:
        start = time.perf_counter()
        await asyncio.gather(*(client(session, k) for k in range(concurrency)))
        wall = time.perf_counter() - start
    return latencies, wall, errors


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))] if ordered else float("nan")


def plot(rows: list[dict[str, Any]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(15, 4.2))
    for window in sorted({r["window_ms"] for r in rows}):
        mine = [r for r in rows if r["window_ms"] == window]
        x = [r["concurrency"] for r in mine]
        for ax, key in zip(axes, ("p50_ms", "p99_ms", "items_per_s"), strict=True):
            ax.plot(x, [r[key] for r in mine], marker="o", label=f"window {window:g} ms")
    for ax, title in zip(axes, ("p50 latency (ms)", "p99 latency (ms)", "items/s"), strict=True):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("concurrent clients")
        ax.set_title(title)
        ax.grid(alpha=0.3)
    axes[0].legend()
    fig.suptitle("Classifier behind the gate: batching window vs concurrency")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--windows", default="0,10,50")
    p.add_argument("--concurrency", default="1,2,4,8,16,32")
    p.add_argument("--requests", type=int, default=96)
    p.add_argument("--step-timeout", type=float, default=120.0)
    p.add_argument("--model", default=None)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--device", default="cpu")
    p.add_argument("--threads", type=int, default=1,
                   help="torch threads in the server; on a shared CPU, spinning OpenMP threads make a mess of timings")
    p.add_argument("--out", default=str(ROOT / "benchmarks" / "results"))
    p.add_argument("--stem", default="batch_window")
    args = p.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    if args.threads:
        os.environ["OMP_NUM_THREADS"] = str(args.threads)  # the servers inherit it
    model = args.model
    if model is None:
        from gpu_watchdog.benchmarks.make_encoder import make

        model = str(make(Path(tempfile.mkdtemp()) / "classifier", "bert", task="classify", hidden=args.hidden,
                         layers=args.layers, heads=4))
    rows: list[dict[str, Any]] = []
    for window in (float(w) for w in args.windows.split(",")):
        server = serve(["--handler", "classifier", "--model", model, "--device", args.device,
                        "--batch-window-ms", str(window), "--max-batch-size", "64"],
                       out / "logs" / f"{args.stem}-{window:g}ms.log")
        try:
            # Warm-up: kernels and the allocator, outside the measurement.
            asyncio.run(step(server.url, 4, 32, args.step_timeout))
            for conc in (int(c) for c in args.concurrency.split(",")):
                before = batch_stats(server.url + "/metrics")
                lat, wall, errors = asyncio.run(step(server.url, conc, args.requests, args.step_timeout))
                after = batch_stats(server.url + "/metrics")
                batches = after[1] - before[1]
                row = {"window_ms": window, "concurrency": conc, "ok": len(lat), "errors": errors,
                       "p50_ms": round(percentile(lat, 0.5) * 1000, 2),
                       "p99_ms": round(percentile(lat, 0.99) * 1000, 2),
                       "items_per_s": round(len(lat) / wall, 1),
                       "mean_batch": round((after[0] - before[0]) / batches, 2) if batches else 0.0}
                rows.append(row)
                print(json.dumps(row), flush=True)
        finally:
            server.running.stop()
    with open(out / f"{args.stem}.csv", "w", newline="") as fh:
        writer = csv.DictWriter(fh, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)
    (out / f"{args.stem}.json").write_text(json.dumps({"machine": machine(), "rows": rows}, indent=1))
    described = (f"generated BERT classifier, hidden {args.hidden}, {args.layers} layers" if args.model is None
                 else args.model)
    lines = [f"# Batching window study ({args.stem})", "", f"Machine: {machine()}", "",
             f"Model: {described};"
             f" {args.requests} requests per step, one input each, closed-loop clients; --max-batch-size 64;"
             f" OMP_NUM_THREADS={os.environ.get('OMP_NUM_THREADS', 'unset')} in the server;"
             f" load average at the end {os.getloadavg()[0]:.1f};"
             " the server on its own process, the clients in another.", "",
             "| window ms | conc. | ok | errors | p50 ms | p99 ms | items/s | mean batch |",
             "|---:|---:|---:|---:|---:|---:|---:|---:|"]
    lines += [f"| {r['window_ms']:g} | {r['concurrency']} | {r['ok']} | {r['errors']} | {r['p50_ms']} | {r['p99_ms']} |"
              f" {r['items_per_s']} | {r['mean_batch']} |" for r in rows]
    (out / f"{args.stem}.md").write_text("\n".join(lines) + "\n")
    plot(rows, out / f"{args.stem}.png")


if __name__ == "__main__":
    main()
