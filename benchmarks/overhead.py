"""What the watchdog costs: throughput and p99 with and without the sidecar, and its idle footprint.

Usage: python -m gpu_watchdog.benchmarks.overhead [--requests N] [--idle-seconds S] [--reps R]

One `full`-mode server; the load runs at concurrency 16 alternately with no sidecar, with the
sidecar at default rates and at 10x default rates (A/B/C interleaved, repeated), so drift hits all
variants alike. Then the sidecar watches an idle server for a while: CPU seconds (from /proc,
scaled to an hour), RSS, and CPU time per sampling tick.

Throughput differences under 1 % drown in run-to-run noise on a small machine, so the cost is
also accounted directly: the sidecar's CPU plus the extra server CPU its canaries and allocator
reads cause (server idle with vs without the sidecar), as a share of the machine's cores.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import time
from pathlib import Path

import requests
import yaml

from gpu_watchdog.benchmarks._procs import ROOT, Running, free_port, machine, serve, start, wait_ok
from gpu_watchdog.benchmarks.loadgen import BenchSettings, run_sweep

RATES = {
    "default": {"sampling": {"nvml_interval": "1s", "torch_interval": "5s", "server_interval": "5s"},
                "canary": {"interval": "30s", "timeout": "10s"}},
    "10x": {"sampling": {"nvml_interval": "100ms", "torch_interval": "500ms", "server_interval": "500ms"},
            "canary": {"interval": "3s", "timeout": "10s"}},
}
CLK_TCK = os.sysconf("SC_CLK_TCK")
CORES = os.cpu_count() or 1


def cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / CLK_TCK  # utime + stime


def rss_bytes(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    return 0


def start_watchdog(server_control: str, token: str, rate: str, out: Path) -> tuple[Running, str]:
    port = free_port()
    cfg = out / "logs" / f"watchdog-{rate}.yaml"
    cfg.write_text(yaml.safe_dump({**RATES[rate], "target": {"control_url": server_control, "token_file": None},
                                   "restart": {"strategy": "none"}, "server": {"host": "127.0.0.1", "port": port}}))
    running = start(["run", "--config", str(cfg)], out / "logs" / f"overhead-watchdog-{rate}.log",
                    env={"GPU_WATCHDOG_TOKEN": token})
    url = f"http://127.0.0.1:{port}"
    wait_ok(url + "/readyz", running, timeout=60)
    return running, url


def ticks(url: str) -> float:
    text = requests.get(url + "/metrics", timeout=5).text
    return sum(float(line.split()[1]) for line in text.splitlines()
               if line.startswith("gpu_watchdog_sample_duration_seconds_count"))


def sidecar_cpu_and_ticks(wd: Running | None, url: str) -> tuple[float, float]:
    return (cpu_seconds(wd.proc.pid), ticks(url)) if wd is not None else (0.0, 0.0)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--requests", type=int, default=160)
    p.add_argument("--concurrency", type=int, default=16)
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--idle-seconds", type=float, default=60.0)
    p.add_argument("--out", default=str(ROOT / "benchmarks" / "results"))
    args = p.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    server = serve(["--max-concurrency", "auto"], out / "logs" / "overhead-server.log")
    runs: dict[str, list[tuple[float, float]]] = {"none": [], "default": [], "10x": []}
    # Sidecar CPU seconds and machine CPU-seconds (wall x cores) summed over the loaded runs: a
    # single run lasts seconds, below what /proc's 10 ms ticks resolve at default rates.
    load_cpu: dict[str, list[float]] = {"default": [0.0, 0.0], "10x": [0.0, 0.0]}
    idle: dict[str, dict[str, float]] = {}
    server_pid = server.running.proc.pid
    try:
        for _ in range(args.reps):
            for variant in ("none", "default", "10x"):
                wd = None
                if variant != "none":
                    wd, _url = start_watchdog(server.control, server.token, variant, out)
                try:
                    c0 = cpu_seconds(wd.proc.pid) if wd is not None else 0.0
                    s = BenchSettings(url=server.url, concurrency=(args.concurrency,),
                                      requests_per_step=args.requests, label=variant)
                    [r] = asyncio.run(run_sweep(s, show_progress=False))
                    runs[variant].append((r.throughput_rps, r.p99_s))
                    if wd is not None:
                        load_cpu[variant][0] += cpu_seconds(wd.proc.pid) - c0
                        load_cpu[variant][1] += r.wall_s * CORES
                    print(f"{variant}: {r.throughput_rps:.2f} req/s p99 {r.p99_s:.3f}s errors {r.errors}", flush=True)
                finally:
                    if wd is not None:
                        wd.stop()
        for variant in ("none", "default", "10x"):
            wd, url = start_watchdog(server.control, server.token, variant, out) if variant != "none" else (None, "")
            try:
                time.sleep(2.0)
                s0, t0 = cpu_seconds(server_pid), time.monotonic()
                c0, k0 = sidecar_cpu_and_ticks(wd, url)
                time.sleep(args.idle_seconds)
                s1, t1 = cpu_seconds(server_pid), time.monotonic()
                c1, k1 = sidecar_cpu_and_ticks(wd, url)
                idle[variant] = {"cpu_s_per_hour": (c1 - c0) * 3600.0 / (t1 - t0),
                                 "server_cpu_s_per_hour": (s1 - s0) * 3600.0 / (t1 - t0),
                                 "rss_mib": rss_bytes(wd.proc.pid) / 2**20 if wd is not None else 0.0,
                                 "cpu_ms_per_tick": 1000.0 * (c1 - c0) / max(1.0, k1 - k0), "ticks": k1 - k0}
                print(f"idle {variant}: {idle[variant]}", flush=True)
            finally:
                if wd is not None:
                    wd.stop()
    finally:
        server.running.stop()

    def med(variant: str, i: int) -> float:
        return statistics.median(v[i] for v in runs[variant])

    lines = [
        "# Watchdog overhead",
        f"Machine: {machine()}",
        f"`full` mode server (built-in model), concurrency {args.concurrency}, {args.requests} requests per run,"
        f" variants interleaved, {args.reps} repetitions; medians.",
        "| sidecar | throughput req/s | vs none | p99 s | vs none |",
        "|---|---:|---:|---:|---:|",
    ]
    for variant in ("none", "default", "10x"):
        tp, p99 = med(variant, 0), med(variant, 1)
        lines.append(f"| {variant} | {tp:.2f} | {tp / med('none', 0):.3f}x | {p99:.3f} | {p99 / med('none', 1):.3f}x |")
    lines += ["", f"Idle watching ({args.idle_seconds:.0f} s per variant, scaled to one hour; CPU from /proc):",
              "", "| rates | sidecar CPU s/h | CPU ms per sampling tick | RSS MiB | server CPU s/h | vs no sidecar |",
              "|---|---:|---:|---:|---:|---:|"]
    base = idle["none"]["server_cpu_s_per_hour"]
    for variant in ("default", "10x"):
        v = idle[variant]
        lines.append(f"| {variant} | {v['cpu_s_per_hour']:.1f} | {v['cpu_ms_per_tick']:.2f} | {v['rss_mib']:.1f} |"
                     f" {v['server_cpu_s_per_hour']:.1f} | {v['server_cpu_s_per_hour'] - base:+.1f} |")
    lines += ["", f"Server idle without a sidecar: {base:.1f} CPU s/h.", "",
              f"Accounted cost (what the sidecar consumes, resolvable where throughput noise is not): its own CPU"
              f" plus the server CPU its canaries and allocator reads add, as a share of this machine's"
              f" {CORES} cores; and the sidecar's own CPU during all loaded runs together (ticks of 10 ms).", "",
              "| rates | idle: sidecar + server extra, CPU s/h | share of the machine | under load: sidecar CPU s"
              " | share of the machine |", "|---|---:|---:|---:|---:|"]
    for variant in ("default", "10x"):
        v = idle[variant]
        cost = v["cpu_s_per_hour"] + max(0.0, v["server_cpu_s_per_hour"] - base)
        used, capacity = load_cpu[variant]
        lines.append(f"| {variant} | {cost:.1f} | {100 * cost / (3600 * CORES):.3f} % | {used:.2f} |"
                     f" {100 * used / capacity:.3f} % |")
    lines += ["", "Raw runs (req/s, p99 s): " + "; ".join(f"{k}: {v}" for k, v in runs.items())]
    report = "\n".join(lines)
    print(report)
    (out / "overhead.md").write_text(report + "\n", encoding="utf-8")


if __name__ == "__main__":
    main()
