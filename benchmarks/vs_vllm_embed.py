"""Embeddings side by side: the bundled `embeddings` handler beside vLLM's pooling runner, one run.

Usage: python -m gpu_watchdog.benchmarks.vs_vllm_embed [--vllm-python PATH] [--concurrency 1,4,16] [--inputs 1,4]
       [--requests 64]

Generates one encoder (BERT-shaped, 2 layers, hidden 256, random weights, a sentence-transformers
pooling config: mean + normalize; no download), then serves it twice, one after the other so
they never compete for the cores:
- vllm: `vllm serve`-equivalent API server with `--runner pooling --convert embed` (installed by
  `make vllm`), `--dtype float32`;
- ours: `gpu-watchdog serve --handler embeddings --model DIR` at its defaults.
The same client (closed-loop aiohttp clients, `POST /v1/embeddings`, `encoding_format: float`)
drives each: inputs/s, p50 and p99 per concurrency and inputs per request. Before measuring,
both servers' vectors are compared with a plain in-process `transformers` forward (cosine).
Writes benchmarks/results/vs_vllm_embed.{md,json}.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Any

import aiohttp
import numpy as np
import requests

from gpu_watchdog.benchmarks._procs import ROOT, free_port, machine, serve, stop_process
from gpu_watchdog.benchmarks.make_encoder import make
from gpu_watchdog.benchmarks.peer_vllm import vllm_python

TEXTS = ["the gpu server answered fast", "memory queue health", "hello world", "the canary probe was ok",
         "batch token cache", "watchdog classify label good bad", "yes no ok", "the embedding vector"]
NAME = "encoder"


def start_vllm(python: Path, model: Path, workdir: Path, timeout: float = 600.0) -> tuple[subprocess.Popen[bytes], str]:
    port = free_port()
    workdir.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "VLLM_NO_USAGE_STATS": "1", "VLLM_CPU_KVCACHE_SPACE": "1",
           "VLLM_CACHE_ROOT": str(workdir / "cache"), "TORCHINDUCTOR_CACHE_DIR": str(workdir / "inductor"),
           "TMPDIR": str(workdir)}
    log = workdir / "vllm.log"
    proc = subprocess.Popen(
        [str(python), "-m", "vllm.entrypoints.openai.api_server", "--model", str(model), "--served-model-name", NAME,
         "--runner", "pooling", "--convert", "embed", "--dtype", "float32", "--max-model-len", "512",
         "--host", "127.0.0.1", "--port", str(port)],
        stdout=open(log, "wb"), stderr=subprocess.STDOUT, env=env, cwd=str(workdir))
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"vLLM exited ({proc.returncode}):\n{log.read_text(errors='replace')[-3000:]}")
        try:
            if requests.get(url + "/v1/models", timeout=2).status_code == 200:
                return proc, url
        except requests.RequestException:
            pass
        time.sleep(0.5)
    stop_process(proc, 30)
    raise RuntimeError(f"vLLM not up within {timeout}s; see {log}")


def reference(model: Path) -> np.ndarray:
    import torch
    from transformers import AutoModel, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model)
    enc = AutoModel.from_pretrained(model).eval()
    rows = []
    with torch.inference_mode():
        for text in TEXTS:
            hidden = enc(**tok(text, return_tensors="pt")).last_hidden_state[0]
            rows.append(torch.nn.functional.normalize(hidden.mean(dim=0), dim=0).numpy())
    return np.stack(rows)


def vectors(url: str) -> np.ndarray:
    r = requests.post(url + "/v1/embeddings", json={"model": NAME, "input": TEXTS, "encoding_format": "float"},
                      timeout=120)
    r.raise_for_status()
    return np.array([d["embedding"] for d in r.json()["data"]])


def min_cosine(a: np.ndarray, b: np.ndarray) -> float:
    a = a / np.linalg.norm(a, axis=1, keepdims=True)
    b = b / np.linalg.norm(b, axis=1, keepdims=True)
    return float((a * b).sum(axis=1).min())


async def step(url: str, concurrency: int, inputs: int, total: int, timeout_s: float
               ) -> tuple[list[float], float, int]:
    latencies: list[float] = []
    errors = 0
    sent = 0
    deadline = time.monotonic() + timeout_s

    async def client(session: aiohttp.ClientSession, k: int) -> None:
        nonlocal sent, errors
        while sent < total and time.monotonic() < deadline:
            sent += 1
            batch = [TEXTS[(sent + k + j) % len(TEXTS)] for j in range(inputs)]
            t0 = time.perf_counter()
            async with session.post(url + "/v1/embeddings", json={"model": NAME, "input": batch,
                                                                   "encoding_format": "float"}) as r:
                await r.read()
                if r.status == 200:
                    latencies.append(time.perf_counter() - t0)
                else:
                    errors += 1

    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=120)) as session:
        start = time.perf_counter()
        await asyncio.gather(*(client(session, k) for k in range(concurrency)))
        wall = time.perf_counter() - start
    return latencies, wall, errors


def pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))] if ordered else float("nan")


def sweep(url: str, label: str, args: argparse.Namespace) -> list[dict[str, Any]]:
    asyncio.run(step(url, 4, 4, 32, args.step_timeout))  # warm-up
    rows = []
    for inputs in (int(i) for i in args.inputs.split(",")):
        for conc in (int(c) for c in args.concurrency.split(",")):
            lat, wall, errors = asyncio.run(step(url, conc, inputs, args.requests, args.step_timeout))
            row = {"server": label, "inputs_per_request": inputs, "concurrency": conc, "ok": len(lat),
                   "errors": errors, "inputs_per_s": round(len(lat) * inputs / wall, 1),
                   "p50_ms": round(pct(lat, 0.5) * 1000, 1), "p99_ms": round(pct(lat, 0.99) * 1000, 1)}
            print(json.dumps(row), flush=True)
            rows.append(row)
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--vllm-python", type=Path, default=None)
    p.add_argument("--concurrency", default="1,4,16")
    p.add_argument("--inputs", default="1,4")
    p.add_argument("--requests", type=int, default=160)
    p.add_argument("--step-timeout", type=float, default=120.0)
    p.add_argument("--out", default=str(ROOT / "benchmarks" / "results"))
    args = p.parse_args()
    python = args.vllm_python or vllm_python()
    if python is None:
        raise SystemExit("no vLLM venv: run `make vllm` or pass --vllm-python")
    out = Path(args.out)
    rows: list[dict[str, Any]] = []
    agreement: dict[str, float] = {}
    with tempfile.TemporaryDirectory(prefix="vs-vllm-embed-") as tmp:
        model = make(Path(tmp) / NAME, "bert", pooling="mean", hidden=256, layers=2, heads=4)
        expected = reference(model)
        proc, url = start_vllm(python, model, Path(tmp) / "vllm")
        try:
            agreement["vllm"] = min_cosine(vectors(url), expected)
            rows += sweep(url, "vllm", args)
        finally:
            stop_process(proc, 30)
        server = serve(["--handler", "embeddings", "--model", str(model), "--served-model-name", NAME,
                        "--device", "cpu"], out / "logs" / "vs_vllm_embed-ours.log")
        try:
            agreement["ours"] = min_cosine(vectors(server.url), expected)
            rows += sweep(server.url, "ours", args)
        finally:
            server.running.stop()
    (out / "vs_vllm_embed.json").write_text(json.dumps({"machine": machine(), "agreement": agreement, "rows": rows},
                                                       indent=1))
    lines = ["# Embeddings: ours beside vLLM's pooling runner", "", f"Machine: {machine()}", "",
             "Model: generated BERT, 2 layers, hidden 256, mean pooling + normalize (sentence-transformers config);"
             f" {args.requests} requests per step, closed-loop clients, `encoding_format: float`; vLLM with"
             " `--runner pooling --convert embed --dtype float32`, ours `--handler embeddings` at its defaults;"
             f" load average at the end {os.getloadavg()[0]:.1f} (the cores are shared).", "",
             "Vectors against a plain transformers forward, lowest cosine: "
             + ", ".join(f"{k} {v:.6f}" for k, v in agreement.items()), "",
             "| inputs/req | conc. | vLLM inputs/s | ours inputs/s | ours/vLLM | vLLM p50 ms | ours p50 ms |"
             " vLLM p99 ms | ours p99 ms | errors (vLLM/ours) |",
             "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|"]
    for r in (r for r in rows if r["server"] == "ours"):
        v = next(x for x in rows if x["server"] == "vllm" and x["concurrency"] == r["concurrency"]
                 and x["inputs_per_request"] == r["inputs_per_request"])
        ratio = r["inputs_per_s"] / v["inputs_per_s"] if v["inputs_per_s"] else float("nan")
        lines.append(f"| {r['inputs_per_request']} | {r['concurrency']} | {v['inputs_per_s']} | {r['inputs_per_s']} |"
                     f" {ratio:.2f} | {v['p50_ms']} | {r['p50_ms']} | {v['p99_ms']} | {r['p99_ms']} |"
                     f" {v['errors']}/{r['errors']} |")
    (out / "vs_vllm_embed.md").write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
