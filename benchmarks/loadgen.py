"""`gpu-watchdog bench` (benchmarks/loadgen.py): a load generator against any OpenAI-compatible `/v1/completions`.

Clients retry like the seed recommends (200 ms, 400 ms, 800 ms ..., at most 5 tries, honouring
`Retry-After`), so a 503 counts as a retry, not a loss. Figures the server cannot give (peak GPU
memory on a CPU) are reported as missing, never invented.
"""

from __future__ import annotations

import asyncio
import csv
import json
import math
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import aiohttp

RETRYABLE = (429, 502, 503, 504)


@dataclass(frozen=True)
class BenchSettings:
    url: str
    concurrency: tuple[int, ...] = (1, 2, 4, 8, 16, 32)
    requests_per_step: int = 64
    duration_s: float | None = None
    prompt_len: int = 32
    max_tokens: int = 32
    max_tries: int = 5
    backoff_initial_s: float = 0.2
    request_timeout_s: float = 120.0
    control_url: str | None = None
    token: str | None = None
    label: str = "server"


@dataclass
class StepResult:
    mode: str
    concurrency: int
    requests: int
    ok: int
    errors: int
    retries: int
    p50_s: float
    p95_s: float
    p99_s: float
    throughput_rps: float
    tokens_per_s: float
    wall_s: float
    peak_memory_bytes: int | None
    memory_note: str
    admission_limit: int | None
    mean_batch_size: float | None
    largest_batch: int | None
    error_kinds: dict[str, int] = field(default_factory=dict)


def percentile(values: Sequence[float], q: float) -> float:
    """Nearest-rank percentile; NaN for no values."""
    if not values:
        return math.nan
    ordered = sorted(values)
    rank = max(1, math.ceil(q / 100.0 * len(ordered)))
    return ordered[min(rank, len(ordered)) - 1]


def backoff_delay(attempt: int, initial: float, retry_after: str | None) -> float:
    """The seed's schedule (initial x 2^attempt), but never sooner than the server asked."""
    delay = initial * (2**attempt)
    if retry_after:
        try:
            delay = max(delay, float(retry_after))
        except ValueError:
            pass
    return delay


def make_prompt(i: int, length: int) -> str:
    base = f"request {i}: tell me about GPUs and memory. "
    return (base * (length // len(base) + 1))[:length]


@dataclass
class _Tally:
    latencies: list[float] = field(default_factory=list)
    ok: int = 0
    errors: int = 0
    retries: int = 0
    tokens: int = 0
    error_kinds: dict[str, int] = field(default_factory=dict)

    def error(self, kind: str) -> None:
        self.errors += 1
        self.error_kinds[kind] = self.error_kinds.get(kind, 0) + 1


async def one_request(session: aiohttp.ClientSession, s: BenchSettings, i: int, tally: _Tally,
                      clock: Callable[[], float]) -> None:
    body = {"prompt": make_prompt(i, s.prompt_len), "max_tokens": s.max_tokens, "temperature": 0}
    start = clock()
    for attempt in range(s.max_tries):
        retry_after = None
        try:
            async with session.post(s.url.rstrip("/") + "/v1/completions", json=body,
                                    timeout=aiohttp.ClientTimeout(total=s.request_timeout_s)) as resp:
                if resp.status == 200:
                    data = await resp.json()
                    tally.ok += 1
                    tally.tokens += int(data.get("usage", {}).get("completion_tokens", 0))
                    tally.latencies.append(clock() - start)
                    return
                await resp.read()
                if resp.status not in RETRYABLE:
                    tally.error(f"http_{resp.status}")
                    return
                retry_after = resp.headers.get("Retry-After")
                kind = f"http_{resp.status}"
        except (aiohttp.ClientError, TimeoutError) as exc:
            kind = type(exc).__name__
        if attempt == s.max_tries - 1:
            tally.error(kind)
            return
        tally.retries += 1
        await asyncio.sleep(backoff_delay(attempt, s.backoff_initial_s, retry_after))


async def _control(session: aiohttp.ClientSession, s: BenchSettings, path: str) -> dict[str, Any] | None:
    if not s.control_url:
        return None
    headers = {"Authorization": f"Bearer {s.token}"} if s.token else {}
    try:
        async with session.get(s.control_url.rstrip("/") + path, headers=headers,
                               timeout=aiohttp.ClientTimeout(total=5)) as resp:
            if resp.status != 200:
                return None
            data: dict[str, Any] = await resp.json()
            return data
    except (aiohttp.ClientError, TimeoutError, ValueError):
        return None


async def _batch_counters(session: aiohttp.ClientSession, s: BenchSettings) -> tuple[float, float] | None:
    try:
        async with session.get(s.url.rstrip("/") + "/metrics", timeout=aiohttp.ClientTimeout(total=5)) as resp:
            text = await resp.text()
    except (aiohttp.ClientError, TimeoutError):
        return None
    total = count = None
    for line in text.splitlines():
        if line.startswith("gpu_inference_batch_size_sum "):
            total = float(line.split()[1])
        elif line.startswith("gpu_inference_batch_size_count "):
            count = float(line.split()[1])
    return None if total is None or count is None else (total, count)


async def run_step(session: aiohttp.ClientSession, s: BenchSettings, concurrency: int,
                   progress: Callable[[int], None] | None = None) -> StepResult:
    loop = asyncio.get_running_loop()
    tally = _Tally()
    counter = iter(range(10**9))
    deadline = None if s.duration_s is None else loop.time() + s.duration_s
    peak: list[int] = []
    limits: list[int] = []
    device = {"name": None}
    before = await _batch_counters(session, s)

    async def worker() -> None:
        while True:
            i = next(counter)
            if deadline is None and i >= s.requests_per_step:
                return
            if deadline is not None and loop.time() >= deadline:
                return
            await one_request(session, s, i, tally, loop.time)
            if progress is not None:
                progress(1)

    async def sample_memory() -> None:
        while True:
            m = await _control(session, s, "/control/memory")
            if m is not None:
                device["name"] = m.get("device")
                if m.get("device") == "cuda":
                    peak.append(int(m.get("reserved_bytes", 0)))
                limit = (m.get("admission") or {}).get("limit")
                if isinstance(limit, int):
                    limits.append(limit)
            await asyncio.sleep(0.2)

    sampler = loop.create_task(sample_memory())
    start = loop.time()
    await asyncio.gather(*(worker() for _ in range(concurrency)))
    wall = loop.time() - start
    sampler.cancel()
    await asyncio.gather(sampler, return_exceptions=True)
    after = await _batch_counters(session, s)
    engine = await _control(session, s, "/control/memory")
    mean_batch = None
    if before is not None and after is not None and after[1] > before[1]:
        mean_batch = (after[0] - before[0]) / (after[1] - before[1])
    if device["name"] == "cuda" and peak:
        peak_bytes, note = max(peak), "torch reserved (control API)"
    elif device["name"] is None:
        peak_bytes, note = None, "no control API: not measured"
    else:
        peak_bytes, note = None, f"{device['name']}: no CUDA allocator"
    return StepResult(
        mode=s.label, concurrency=concurrency, requests=tally.ok + tally.errors, ok=tally.ok, errors=tally.errors,
        retries=tally.retries, p50_s=percentile(tally.latencies, 50), p95_s=percentile(tally.latencies, 95),
        p99_s=percentile(tally.latencies, 99), throughput_rps=tally.ok / wall if wall > 0 else 0.0,
        tokens_per_s=tally.tokens / wall if wall > 0 else 0.0, wall_s=wall, peak_memory_bytes=peak_bytes,
        memory_note=note, admission_limit=max(limits) if limits else None, mean_batch_size=mean_batch,
        largest_batch=(engine or {}).get("engine", {}).get("largest_batch") if engine else None,
        error_kinds=tally.error_kinds,
    )


async def run_sweep(s: BenchSettings, show_progress: bool = True) -> list[StepResult]:
    results: list[StepResult] = []
    bar: Any = None
    total = None if s.duration_s is not None else s.requests_per_step * len(s.concurrency)
    if show_progress:
        try:
            from tqdm import tqdm

            bar = tqdm(total=total, desc=f"{s.label}", unit="req", file=sys.stderr, leave=False)
        except ImportError:
            bar = None
    connector = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=connector) as session:
        for c in s.concurrency:
            if bar is not None:
                bar.set_postfix(concurrency=c)
            results.append(await run_step(session, s, c, bar.update if bar is not None else None))
    if bar is not None:
        bar.close()
    return results


# -- reports -----------------------------------------------------------------------------------

def _fmt(v: float | None, unit: str = "", digits: int = 3) -> str:
    if v is None or (isinstance(v, float) and math.isnan(v)):
        return "n/a"
    return f"{v:.{digits}f}{unit}"


def markdown_table(results: Sequence[StepResult]) -> str:
    head = ("| mode | conc. | ok | errors | retries | p50 s | p95 s | p99 s | req/s | tok/s | peak GPU mem |"
            " admission | mean batch |\n|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|---:|---:|")
    rows = []
    for r in results:
        mem = f"{r.peak_memory_bytes / 2**30:.2f} GiB" if r.peak_memory_bytes is not None else r.memory_note
        rows.append(f"| {r.mode} | {r.concurrency} | {r.ok} | {r.errors} | {r.retries} | {_fmt(r.p50_s)} |"
                    f" {_fmt(r.p95_s)} | {_fmt(r.p99_s)} | {_fmt(r.throughput_rps, digits=2)} |"
                    f" {_fmt(r.tokens_per_s, digits=1)} | {mem} | {r.admission_limit if r.admission_limit else 'n/a'}"
                    f" | {_fmt(r.mean_batch_size, digits=2)} |")
    return "\n".join([head, *rows])


def ratio_table(results: Sequence[StepResult], numerator: str, denominator: str) -> str:
    by = {(r.mode, r.concurrency): r for r in results}
    lines = [f"| conc. | throughput {numerator}/{denominator} | p99 {numerator}/{denominator} |", "|---:|---:|---:|"]
    for c in sorted({r.concurrency for r in results}):
        a, b = by.get((numerator, c)), by.get((denominator, c))
        if a is None or b is None:
            continue
        tp = a.throughput_rps / b.throughput_rps if b.throughput_rps else math.nan
        p99 = a.p99_s / b.p99_s if b.p99_s and not math.isnan(b.p99_s) else math.nan
        lines.append(f"| {c} | {_fmt(tp, 'x', 2)} | {_fmt(p99, 'x', 2)} |")
    return "\n".join(lines)


def write_files(results: Sequence[StepResult], out_dir: Path, stem: str) -> list[Path]:
    out_dir.mkdir(parents=True, exist_ok=True)
    rows = [asdict(r) for r in results]
    csv_path = out_dir / f"{stem}.csv"
    with csv_path.open("w", newline="", encoding="utf-8") as fh:
        writer = csv.DictWriter(fh, fieldnames=[k for k in rows[0] if k != "error_kinds"] + ["error_kinds"])
        writer.writeheader()
        for row in rows:
            writer.writerow({**row, "error_kinds": json.dumps(row["error_kinds"])})
    json_path = out_dir / f"{stem}.json"
    json_path.write_text(json.dumps(rows, indent=2, default=str), encoding="utf-8")
    written = [csv_path, json_path]
    png = plot(results, out_dir / f"{stem}.png")
    if png is not None:
        written.append(png)
    return written


def plot(results: Sequence[StepResult], path: Path) -> Path | None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib not installed: no plot written (pip install 'gpu-watchdog[dev]')", file=sys.stderr)
        return None
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4))
    for mode in dict.fromkeys(r.mode for r in results):
        rs = [r for r in results if r.mode == mode]
        xs = [r.concurrency for r in rs]
        ax1.plot(xs, [r.p99_s for r in rs], marker="o", label=mode)
        ax2.plot(xs, [r.throughput_rps for r in rs], marker="o", label=mode)
    for ax, title, unit in ((ax1, "p99 latency", "seconds"), (ax2, "throughput", "requests/s")):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("concurrency")
        ax.set_ylabel(unit)
        ax.set_title(title)
        ax.grid(True, alpha=0.3)
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def bench_main(s: BenchSettings, out_dir: str | None) -> int:
    started = time.strftime("%Y%m%d-%H%M%S")
    results = asyncio.run(run_sweep(s, show_progress=sys.stderr.isatty()))
    print(markdown_table(results))
    if out_dir:
        for p in write_files(results, Path(out_dir), f"bench-{s.label}-{started}"):
            print(f"wrote {p}", file=sys.stderr)
    return 0 if all(r.ok > 0 for r in results) else 1
