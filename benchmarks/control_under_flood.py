"""The control API under a flood of the largest prompts: does the watchdog's view of the server stay in time?

Usage: python -m gpu_watchdog.benchmarks.control_under_flood [--model DIR] [--clients 16] [--seconds 20]
       [--flood context,body] [--out benchmarks/results/control_under_flood.md]

Starts `gpu-watchdog serve` on CPU (the built-in model, or `--model DIR`; prefix cache off, so that
every prompt is computed), finds the largest inputs by the server's own 400/413 rules and floods
`POST /v1/completions` with them from N concurrent clients in another process:

- `context`: the longest prompt the model's context admits with `max_tokens: 1` (one more
  character is refused), answered 200;
- `body`: a prompt as large as the body limit lets through, which is read, tokenized and only
  then refused with 413 (`prompt`): the most tokenizer work one request can ask for.

Meanwhile this process calls the control port as the sidecar does (`GET /control/memory` with the
sidecar's 5 s timeout, `POST /control/canary` with the canary's 10 s + 2 s) and prints p50/p99/max
of each, idle and during each flood.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import multiprocessing
import random
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import requests

from gpu_watchdog.benchmarks._procs import ROOT, Endpoints, machine, serve
from gpu_watchdog.inference.settings import ServeSettings

# As the sidecar calls them: ControlClient.memory's timeout, the canary's default (canary.timeout).
MEMORY_TIMEOUT_S = 5.0
CANARY_TIMEOUT_S = 10.0
CANARY_HTTP_MARGIN_S = 2.0
MAX_BODY_BYTES = ServeSettings.max_body_bytes
_WORDS = ("kernel", "tensor", "budget", "fragment", "allocator", "canary", "prefill", "decode", "sidecar",
          "watchdog", "évènement", "naïve", "größe", "東京", "模型", "推理", "λόγος", "данные", "0x1f", "42")


def filler(chars: int, seed: int = 0) -> str:
    """Text of exactly `chars` characters, varied enough that a real tokenizer does real work."""
    rng = random.Random(seed)
    parts: list[str] = []
    size = 0
    while size < chars:
        word = rng.choice(_WORDS) + rng.choice((" ", " ", " ", ", ", ". ", "\n"))
        parts.append(word)
        size += len(word)
    return "".join(parts)[:chars]


@dataclass
class Timings:
    name: str
    timeout_s: float
    latencies: list[float] = field(default_factory=list)
    failures: int = 0  # no answer within the timeout, or not a 200 (a canary: not ok)

    def row(self, phase: str) -> str:
        v = sorted(self.latencies)
        return (f"| {phase} | {self.name} | {len(v)} | {_ms(_pct(v, 0.5))} | {_ms(_pct(v, 0.99))} |"
                f" {_ms(v[-1] if v else None)} | {self.failures} |")

    def summary(self) -> dict[str, Any]:
        v = sorted(self.latencies)
        return {"calls": len(v), "p50_s": _pct(v, 0.5), "p99_s": _pct(v, 0.99), "max_s": v[-1] if v else None,
                "failures": self.failures, "timeout_s": self.timeout_s}


def _pct(values: list[float], q: float) -> float | None:
    if not values:
        return None
    return values[min(len(values) - 1, max(0, math.ceil(q * len(values)) - 1))]


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value * 1000:.0f} ms"


# -- the largest inputs ---------------------------------------------------------------------------


def _tokens(srv: Endpoints, text: str) -> int:
    r = requests.post(srv.url + "/tokenize", json={"prompt": text}, timeout=120)
    r.raise_for_status()
    return int(r.json()["count"])


def _complete(srv: Endpoints, text: str) -> requests.Response:
    return requests.post(srv.url + "/v1/completions", json={"prompt": text, "max_tokens": 1}, timeout=300)


def largest_prompt(srv: Endpoints) -> tuple[str, int, int]:
    """The longest filler the context admits with one token to generate: (text, its tokens, context)."""
    context = int(requests.get(srv.url + "/v1/models", timeout=10).json()["data"][0]["max_model_len"])
    fits = lambda chars: _tokens(srv, filler(chars)) + 1 <= context  # noqa: E731 - prompt + max_tokens
    lo, hi = 1, 2
    while fits(hi):
        lo, hi = hi, hi * 2
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if fits(mid) else (lo, mid)
    text = filler(lo)
    # The server's own rules, checked: this one is served, one character more is refused.
    ok, over = _complete(srv, text), _complete(srv, filler(hi))
    if ok.status_code != 200 or over.status_code not in (400, 413):
        raise SystemExit(f"the largest prompt is not where /tokenize says: {ok.status_code}, {over.status_code}")
    return text, _tokens(srv, text), context


def largest_body() -> bytes:
    """A completion body of filler just under the body limit (256 bytes to spare)."""
    chars = MAX_BODY_BYTES // 2
    while True:
        body = json.dumps({"prompt": filler(chars, seed=1), "max_tokens": 1}).encode()
        if len(body) <= MAX_BODY_BYTES - 256:
            break
        chars = chars * 9 // 10
    while True:
        bigger = json.dumps({"prompt": filler(chars * 21 // 20, seed=1), "max_tokens": 1}).encode()
        if len(bigger) > MAX_BODY_BYTES - 256:
            break
        chars, body = chars * 21 // 20, bigger
    return body


def largest_body_prompt(srv: Endpoints) -> bytes:
    """The largest body, checked: one over the limit is refused as a body, this one only once its prompt
    was counted (413 naming `prompt`)."""
    over = json.dumps({"prompt": "x" * MAX_BODY_BYTES, "max_tokens": 1}).encode()
    r = requests.post(srv.url + "/v1/completions", data=over, headers={"Content-Type": "application/json"},
                      timeout=120)
    if r.status_code != 413 or r.json()["error"]["param"] != "body":
        raise SystemExit(f"a body over {MAX_BODY_BYTES} bytes was not refused as such: {r.status_code} {r.text[:200]}")
    body = largest_body()
    r = requests.post(srv.url + "/v1/completions", data=body, headers={"Content-Type": "application/json"},
                      timeout=300)
    if r.status_code != 413 or r.json()["error"]["param"] != "prompt":
        raise SystemExit(f"the largest body was not refused as a long prompt: {r.status_code} {r.text[:200]}")
    return body


# -- the flood (another process, so that its client work does not time our probes) ------------------


def _flood_process(url: str, body: bytes, clients: int, seconds: float, out: Any) -> None:
    out.put(asyncio.run(flood(url, body, clients, seconds)))


async def flood(url: str, body: bytes, clients: int, seconds: float) -> dict[str, int]:
    """`clients` concurrent clients posting `body` to /v1/completions for `seconds`; the answers by status.

    The requests still unanswered then are dropped, as clients that gave up would.
    """
    statuses: Counter[str] = Counter()
    connector = aiohttp.TCPConnector(limit=clients)
    async with aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout(total=600)) as session:

        async def client() -> None:
            while True:
                try:
                    async with session.post(url + "/v1/completions", data=body,
                                            headers={"Content-Type": "application/json"}) as r:
                        await r.read()
                        statuses[str(r.status)] += 1
                except (aiohttp.ClientError, TimeoutError) as exc:
                    statuses[type(exc).__name__] += 1

        tasks = [asyncio.create_task(client()) for _ in range(clients)]
        await asyncio.sleep(seconds)
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
    return dict(statuses)


# -- the probes -------------------------------------------------------------------------------------


async def _call(session: aiohttp.ClientSession, method: str, url: str, body: Any, t: Timings) -> None:
    start = time.perf_counter()
    ok = False
    try:
        async with asyncio.timeout(t.timeout_s):
            async with session.request(method, url, json=body) as r:
                data = await r.json(content_type=None)
                ok = r.status == 200 and data.get("ok", True) is True
    except (TimeoutError, aiohttp.ClientError, ValueError):
        pass
    t.latencies.append(min(time.perf_counter() - start, t.timeout_s))
    t.failures += 0 if ok else 1


async def probe(srv: Endpoints, seconds: float, stop: asyncio.Event | None = None) -> tuple[Timings, Timings]:
    """Time the control API as the sidecar calls it, for `seconds` or until `stop` is set."""
    memory = Timings("GET /control/memory", MEMORY_TIMEOUT_S)
    canary = Timings("POST /control/canary", CANARY_TIMEOUT_S + CANARY_HTTP_MARGIN_S)
    loop = asyncio.get_running_loop()
    deadline = loop.time() + seconds
    headers = {"Authorization": f"Bearer {srv.token}"}

    def going() -> bool:
        return loop.time() < deadline and not (stop is not None and stop.is_set())

    async with aiohttp.ClientSession(headers=headers) as session:

        async def every(interval: float, method: str, path: str, body: Any, t: Timings) -> None:
            while going():
                await _call(session, method, srv.control + path, body, t)
                await asyncio.sleep(interval)

        await asyncio.gather(every(0.25, "GET", "/control/memory", None, memory),
                             every(0.5, "POST", "/control/canary", {"timeout": CANARY_TIMEOUT_S}, canary))
    return memory, canary


async def under_flood(srv: Endpoints, body: bytes, clients: int, seconds: float
                      ) -> tuple[Timings, Timings, dict[str, int]]:
    ctx = multiprocessing.get_context("spawn")
    results = ctx.Queue()
    flood = ctx.Process(target=_flood_process, args=(srv.url, body, clients, seconds, results), daemon=True)
    flood.start()
    # The flood's clients need a moment to start (a fresh interpreter); probe once they are sending.
    await asyncio.sleep(2.0)
    memory, canary = await probe(srv, seconds - 2.0)
    statuses: dict[str, int] = await asyncio.to_thread(results.get, True, 900)
    await asyncio.to_thread(flood.join, 30)
    return memory, canary, statuses


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", help="a local Hugging Face causal-LM directory (default: the built-in model)")
    p.add_argument("--clients", type=int, default=16)
    p.add_argument("--seconds", type=float, default=20.0)
    p.add_argument("--flood", default="context,body", help="comma-separated: context, body")
    p.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "control_under_flood.md")
    p.add_argument("--label", default="", help="a note for the table (e.g. which build was measured)")
    p.add_argument("--append", action="store_true", help="add this run to --out instead of replacing it")
    a = p.parse_args()
    floods = [f.strip() for f in a.flood.split(",") if f.strip()]
    if set(floods) - {"context", "body"}:
        raise SystemExit("--flood takes context and/or body")
    flags = ["--device", "cpu", "--prefix-cache", "0"] + (["--model", a.model] if a.model else [])
    logs = a.out.parent / "logs"
    srv = serve(flags, logs / "control_under_flood-serve.log")
    rows: list[str] = []
    report: dict[str, Any] = {"machine": machine(), "model": a.model or "built-in", "clients": a.clients,
                              "seconds": a.seconds, "label": a.label, "phases": {}}
    try:
        text, tokens, context = largest_prompt(srv)
        print(f"context {context} tokens; the largest admitted prompt: {len(text)} characters, {tokens} tokens")
        payloads = {"context": json.dumps({"prompt": text, "max_tokens": 1}).encode()}
        if "body" in floods:
            payloads["body"] = largest_body_prompt(srv)
            print(f"the largest body: {len(payloads['body'])} bytes (limit {MAX_BODY_BYTES}), refused 413 `prompt`")
        memory, canary = asyncio.run(probe(srv, 5.0))
        rows += [memory.row("idle"), canary.row("idle")]
        report["phases"]["idle"] = {"memory": memory.summary(), "canary": canary.summary()}
        for name in floods:
            memory, canary, statuses = asyncio.run(under_flood(srv, payloads[name], a.clients, a.seconds))
            phase = f"{name} flood ({len(payloads[name])} B bodies; answers {statuses})"
            rows += [memory.row(phase), canary.row(phase)]
            report["phases"][name] = {"memory": memory.summary(), "canary": canary.summary(), "answers": statuses,
                                      "body_bytes": len(payloads[name])}
            print(rows[-2], rows[-1], sep="\n")
    finally:
        srv.running.stop()
    table = "\n".join(["| phase | call | calls | p50 | p99 | max | failed |", "|---|---|---|---|---|---|---|", *rows])
    heading = "##" if a.append else "#"
    text_out = (f"{heading} Control API latency under a flood of the largest prompts"
                f"{': ' + a.label if a.label else ''}\n\n"
                f"{report['machine']}; model: {report['model']} (context {context}); {a.clients} clients,"
                f" {a.seconds:g} s per flood. Failed: no answer within the sidecar's timeout"
                f" ({MEMORY_TIMEOUT_S:g} s memory, {CANARY_TIMEOUT_S:g} + {CANARY_HTTP_MARGIN_S:g} s canary)"
                f" or not ok.\n\n{table}\n")
    print(text_out)
    a.out.parent.mkdir(parents=True, exist_ok=True)
    runs_path = a.out.with_suffix(".json")
    runs: list[Any] = json.loads(runs_path.read_text()) if a.append and runs_path.exists() else []
    with a.out.open("a" if a.append else "w") as fh:
        fh.write(("\n" if a.append else "") + text_out)
    runs_path.write_text(json.dumps([*runs, report], indent=2) + "\n")


if __name__ == "__main__":
    main()
