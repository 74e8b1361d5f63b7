"""Answers checked under load: no false `corrupt` in a long saturated run, and what the probes cost.

    python -m benchmarks.answers_checked [--clients 32] [--seconds 60] [--rounds 3] [--out DIR]
    python -m benchmarks.answers_checked --server vllm [--vllm-bench]   # beside vLLM's CPU build

`serve` on CPU with the built-in model (or vLLM on a generated tiny model), `--clients` closed-loop
clients with mixed prompt and output lengths, so continuous batching runs at every step with rows
joining and leaving. Side by side in one run: phases with the probes off and on, alternating, each
`--seconds` long. In an "on" phase probes run back to back (the worst case: the default asks one
every 10 canary intervals): the control canary's probe on its reserved slot, and probes through the
completions route with `logprobs` as the sidecar asks any OpenAI-compatible server. Every answer is
compared (`watchdog.core.correctness.compare`, the default margin and tolerance) with the answer the same
probe got on the idle server; a deviation would be a false `corrupt`.

With `--vllm-bench` the load is vLLM's own benchmark client (`vllm bench serve`, random dataset,
c=`--clients`), run once with probes alongside and once without.

Writes `answers_checked.json` and `.md` to `--out` (default benchmarks/results/). Figures only: no
pass or fail (the tests assert behaviour, not timing).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import sys
import tempfile
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import aiohttp

from gpu_watchdog.benchmarks._procs import ROOT, serve
from gpu_watchdog.watchdog.core import correctness
from gpu_watchdog.watchdog.core.settings import CorrectnessSettings

SETTINGS = CorrectnessSettings(enabled=True)


@dataclass
class Tally:
    probes: int = 0
    matches: int = 0
    deviations: list[dict[str, Any]] = field(default_factory=list)
    unanswered: int = 0

    def add(self, result: correctness.Comparison | None) -> None:
        if result is None:
            self.unanswered += 1
            return
        self.probes += 1
        if result.deviation:
            self.deviations.append({"result": result.result, **dict(result.detail)})
        else:
            self.matches += 1


@dataclass
class Phase:
    probes_on: bool
    seconds: float
    completions: int = 0
    tokens: int = 0
    errors: int = 0

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.seconds if self.seconds > 0 else 0.0


class Target:
    """Where the load and the probes go: a base URL, and the control API where there is one."""

    def __init__(self, url: str, model: str | None, control: str | None, token: str | None = None) -> None:
        self.url = url
        self.model = model
        self.control = control
        self.token = token

    def body(self, prompt: str, max_tokens: int, logprobs: int | None = None) -> dict[str, Any]:
        body: dict[str, Any] = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0}
        if logprobs:
            body["logprobs"] = logprobs
        if self.model:
            body["model"] = self.model
        return body

    async def ask_openai(self, session: aiohttp.ClientSession, prompt: str) -> correctness.Answer | None:
        body = self.body(prompt, SETTINGS.tokens, SETTINGS.top_logprobs)
        try:
            async with session.post(self.url + "/v1/completions", json=body,
                                    timeout=aiohttp.ClientTimeout(total=60)) as r:
                if r.status != 200:
                    return None
                data = await r.json()
            return correctness.from_openai(correctness.probe_id(prompt), data["choices"][0])
        except (aiohttp.ClientError, TimeoutError, ValueError, KeyError):
            return None

    async def ask_control(self, session: aiohttp.ClientSession, prompt: str) -> correctness.Answer | None:
        assert self.control is not None
        body = {"timeout": 30, "probe": {"prompt": prompt, "max_tokens": SETTINGS.tokens,
                                         "top_logprobs": SETTINGS.top_logprobs}}
        try:
            async with session.post(self.control + "/control/canary", json=body,
                                    headers={"Authorization": f"Bearer {self.token}"},
                                    timeout=aiohttp.ClientTimeout(total=60)) as r:
                data = await r.json()
            if not data.get("ok"):
                return None
            return correctness.from_control(correctness.probe_id(prompt), data["answer"])
        except (aiohttp.ClientError, TimeoutError, ValueError, KeyError):
            return None


async def client(session: aiohttp.ClientSession, t: Target, rng: random.Random, stop: asyncio.Event,
                 phase: list[Phase]) -> None:
    """Closed loop: mixed prompt lengths (8 to 200 characters) and outputs (4 to 64 tokens)."""
    words = "the of a GPU memory row card answer kernel batch token fleet probe replica".split()
    while not stop.is_set():
        prompt = " ".join(rng.choice(words) for _ in range(rng.randint(2, 40)))[:200]
        body = t.body(prompt, rng.randint(4, 64))
        current = phase[-1]
        try:
            async with session.post(t.url + "/v1/completions", json=body,
                                    timeout=aiohttp.ClientTimeout(total=120)) as r:
                data = await r.json(content_type=None)
                if r.status == 200:
                    current.completions += 1
                    current.tokens += int(data["usage"]["completion_tokens"])
                else:
                    current.errors += 1
        except (aiohttp.ClientError, TimeoutError, ValueError, KeyError):
            current.errors += 1


async def prober(ask: Any, session: aiohttp.ClientSession, reference: dict[str, correctness.Answer],
                 tally: Tally, on: asyncio.Event, stop: asyncio.Event, offset: int) -> None:
    prompts = list(reference)
    i = offset
    while not stop.is_set():
        if not on.is_set():
            await asyncio.sleep(0.05)
            continue
        prompt = prompts[i % len(prompts)]
        i += 1
        got = await ask(session, prompt)
        tally.add(None if got is None else correctness.compare(SETTINGS, reference[prompt], got))


async def reference_of(ask: Any, session: aiohttp.ClientSession, prompts: list[str]) -> dict[str, correctness.Answer]:
    out = {}
    for p in prompts:
        got = await ask(session, p)
        if got is None:
            raise RuntimeError(f"the idle server answered no probe for {p!r}")
        out[p] = got
    return out


async def run(t: Target, clients: int, seconds: float, rounds: int, probers: int, load: bool = True
              ) -> dict[str, Any]:
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=clients + probers + 8)) as session:
        prompts = list(correctness.PROMPTS)
        asks = [("openai", t.ask_openai)] + ([("control", t.ask_control)] if t.control else [])
        refs = {name: await reference_of(ask, session, prompts) for name, ask in asks}
        tallies = {name: Tally() for name, _ in asks}
        stop, on = asyncio.Event(), asyncio.Event()
        phases: list[Phase] = [Phase(False, 0.0)]
        rng = random.Random(0)
        tasks = [asyncio.create_task(client(session, t, random.Random(rng.random()), stop, phases))
                 for _ in range(clients if load else 0)]
        for name, ask in asks:
            # The control canary answers one probe at a time (its reserved slot); the public route takes more.
            for k in range(1 if name == "control" else probers):
                tasks.append(asyncio.create_task(prober(ask, session, refs[name], tallies[name], on, stop, k)))
        await asyncio.sleep(min(5.0, seconds / 4))  # the batch fills before anything is measured
        for _ in range(rounds):
            for probes_on in (False, True):
                phases.append(Phase(probes_on, seconds))
                if probes_on:
                    on.set()
                else:
                    on.clear()
                await asyncio.sleep(seconds)
        stop.set()
        on.clear()
        await asyncio.gather(*tasks, return_exceptions=True)
    measured = phases[1:]
    off = [p for p in measured if not p.probes_on]
    on_ = [p for p in measured if p.probes_on]
    return {
        "clients": clients, "seconds_per_phase": seconds, "rounds": rounds,
        "phases": [{**asdict(p), "tokens_per_s": round(p.tokens_per_s, 2)} for p in measured],
        "tokens_per_s_off": round(sum(p.tokens for p in off) / sum(p.seconds for p in off), 2),
        "tokens_per_s_on": round(sum(p.tokens for p in on_) / sum(p.seconds for p in on_), 2),
        "probes": {name: {"compared": x.probes, "matches": x.matches, "deviations": len(x.deviations),
                          "unanswered": x.unanswered, "first_deviations": x.deviations[:5]}
                   for name, x in tallies.items()},
        "margin": SETTINGS.margin, "tolerance": SETTINGS.tolerance,
    }


async def run_vllm_bench(t: Target, python: Path, tokenizer: Path, clients: int, prompts: int, probers: int
                         ) -> dict[str, Any]:
    """vLLM's own client as the load, run twice side by side: without the probes, then with them."""
    from gpu_watchdog.benchmarks.vllm_bench import bench_serve

    async with aiohttp.ClientSession() as session:
        reference = await reference_of(t.ask_openai, session, list(correctness.PROMPTS))
        tally, stop, on = Tally(), asyncio.Event(), asyncio.Event()
        tasks = [asyncio.create_task(prober(t.ask_openai, session, reference, tally, on, stop, k))
                 for k in range(probers)]
        runs = {}
        for probes_on in (False, True):
            if probes_on:
                on.set()
            before = tally.probes + tally.unanswered
            bench = await asyncio.to_thread(bench_serve, python, t.url, t.model or "", tokenizer, prompts=prompts,
                                            input_len=128, output_len=128, concurrency=clients)
            on.clear()
            runs["on" if probes_on else "off"] = {
                "output_tokens_per_s": round(float(bench["output_throughput"]), 2),
                "completed": bench.get("completed"), "duration_s": round(float(bench["duration"]), 2),
                "median_tpot_ms": bench.get("median_tpot_ms"), "probes": tally.probes + tally.unanswered - before}
        stop.set()
        await asyncio.gather(*tasks, return_exceptions=True)
    return {"clients": clients, "prompts_per_run": prompts, "runs": runs,
            "probes": {"openai": {"compared": tally.probes, "matches": tally.matches,
                                  "deviations": len(tally.deviations), "unanswered": tally.unanswered,
                                  "first_deviations": tally.deviations[:5]}},
            "margin": SETTINGS.margin, "tolerance": SETTINGS.tolerance}


def markdown(name: str, r: dict[str, Any]) -> str:
    lines = [f"### {name}: {r['clients']} clients, {r['rounds']} x ({r['seconds_per_phase']:g} s off, "
             f"{r['seconds_per_phase']:g} s on)", "",
             "| probes | compared | matches | deviations | unanswered |", "|---|---|---|---|---|"]
    for route, p in r["probes"].items():
        lines.append(f"| {route} | {p['compared']} | {p['matches']} | {p['deviations']} | {p['unanswered']} |")
    lines += ["", "| phase | probes | completions | tokens/s | errors |", "|---|---|---|---|---|"]
    for i, ph in enumerate(r["phases"]):
        lines.append(f"| {i + 1} | {'on' if ph['probes_on'] else 'off'} | {ph['completions']} | "
                     f"{ph['tokens_per_s']} | {ph['errors']} |")
    lines += ["", f"Throughput, probes off: {r['tokens_per_s_off']} tokens/s; on (back to back): "
                  f"{r['tokens_per_s_on']} tokens/s.", ""]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.answers_checked", description=__doc__.splitlines()[0])
    ap.add_argument("--server", choices=("bundled", "vllm"), default="bundled")
    ap.add_argument("--clients", type=int, default=32)
    ap.add_argument("--seconds", type=float, default=60.0)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--probers", type=int, default=2, help="probes in flight at once on the completions route")
    ap.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results")
    ap.add_argument("--vllm-bench", action="store_true", help="vLLM's own benchmark client as the load (--server vllm)")
    ap.add_argument("--prompts", type=int, default=1024, help="requests per `vllm bench serve` run")
    args = ap.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    python: Path | None = None
    model: Path | None = None
    with tempfile.TemporaryDirectory(prefix="answers-checked-") as tmp:
        workdir = Path(tmp)
        if args.server == "bundled":
            served = serve(["--device", "cpu"], workdir / "serve.log")
            target = Target(served.url, None, served.control, served.token)
            stop = served.running.stop
        else:
            from gpu_watchdog.benchmarks.peer_vllm import SERVED_NAME, make_tiny_model, start_vllm, vllm_python

            python = vllm_python()
            if python is None:
                print("no vLLM venv (make vllm)", file=sys.stderr)
                return 2
            model = make_tiny_model(workdir / "model")
            server = start_vllm(python, model, workdir, max_num_seqs=64)
            target = Target(server.url, SERVED_NAME, None)
            stop = server.stop
        try:
            if args.vllm_bench:
                assert python is not None and model is not None, "--vllm-bench needs --server vllm"
                result = asyncio.run(run_vllm_bench(target, python, model, args.clients, args.prompts, args.probers))
            else:
                result = asyncio.run(run(target, args.clients, args.seconds, args.rounds, args.probers))
        finally:
            stop()
    result["server"] = args.server
    stem = f"answers_checked_{args.server}{'_bench' if args.vllm_bench else ''}"
    text = bench_markdown(result) if args.vllm_bench else markdown(args.server, result)
    (args.out / f"{stem}.json").write_text(json.dumps(result, indent=2) + "\n")
    (args.out / f"{stem}.md").write_text(text)
    print(text)
    return 0


def bench_markdown(r: dict[str, Any]) -> str:
    p = r["probes"]["openai"]
    lines = [f"### vLLM under `vllm bench serve` (random 128/128, c={r['clients']}, {r['prompts_per_run']} requests"
             " per run)", "", "| probes | compared | matches | deviations | unanswered |", "|---|---|---|---|---|",
             f"| completions + logprobs | {p['compared']} | {p['matches']} | {p['deviations']} | {p['unanswered']} |",
             "", "| run | output tokens/s | median TPOT (ms) | duration (s) | probes during it |",
             "|---|---|---|---|---|"]
    for name, run_ in r["runs"].items():
        tpot = run_["median_tpot_ms"]
        lines.append(f"| probes {name} | {run_['output_tokens_per_s']} | "
                     f"{'' if tpot is None else round(float(tpot), 2)} | {run_['duration_s']} | {run_['probes']} |")
    return "\n".join([*lines, ""])


if __name__ == "__main__":
    sys.exit(main())
