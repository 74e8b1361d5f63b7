"""Detection latency: from an injected fault to the watchdog's action, at default and short settings.

Usage: python -m gpu_watchdog.benchmarks.detection [--profiles short,default]

Each profile runs `gpu-watchdog up --fault-injection` and injects, one after the other,
`fragmentation` (action: empty_cache), `context_loss` and `hang` (action: restart), timing
injection -> decision from the watchdog's /status, and decision -> model serving again.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path
from typing import Any

import requests
import yaml

from gpu_watchdog.benchmarks._procs import ROOT, free_port, machine, start, wait_ok

PROFILES: dict[str, dict[str, Any]] = {
    "default": {},
    "short": {"sampling": {"torch_interval": "500ms", "server_interval": "500ms"},
              "canary": {"interval": "1s", "timeout": "1s"}},
}
FAULTS = (("fragmentation", "empty_cache", "fragmentation_drift"), ("context_loss", "restart", "context_loss"),
          ("hang", "restart", "hang"))


def decisions(url: str) -> list[dict[str, Any]]:
    data: list[dict[str, Any]] = requests.get(url + "/status", timeout=5).json()["last_decisions"]
    return data


def serving(api: str) -> bool:
    try:
        r = requests.post(api + "/v1/completions", json={"prompt": "x", "max_tokens": 1}, timeout=5)
        return r.status_code == 200
    except requests.RequestException:
        return False


def run_profile(name: str, out: Path) -> list[dict[str, Any]]:
    cfg = out / "logs" / f"detection-{name}.yaml"
    cfg.write_text(yaml.safe_dump(PROFILES[name] or {"canary": {"interval": "30s"}}))
    port, control, wport = free_port(), free_port(), free_port()
    token = f"detect-{port}"
    up = start(["up", "--fault-injection", "--host", "127.0.0.1", "--port", str(port), "--control-port",
                str(control), "--watchdog-port", str(wport), "--config", str(cfg)],
               out / "logs" / f"detection-{name}.log", env={"GPU_WATCHDOG_TOKEN": token})
    wd, api = f"http://127.0.0.1:{wport}", f"http://127.0.0.1:{port}"
    rows = []
    try:
        wait_ok(wd + "/readyz", up)
        for fault, action, reason in FAULTS:
            wait_ok(wd + "/readyz", up)
            seen = len(decisions(wd))
            t0 = time.monotonic()
            r = requests.post(f"http://127.0.0.1:{control}/control/fault", json={"kind": fault},
                              headers={"Authorization": f"Bearer {token}"}, timeout=10)
            r.raise_for_status()
            detected = None
            while time.monotonic() - t0 < 600:
                new = [d for d in decisions(wd)[seen:] if d["action"] == action and d["reason"] == reason]
                if new:
                    detected = time.monotonic() - t0
                    break
                time.sleep(0.05)
            served = None
            if detected is not None:
                while time.monotonic() - t0 < 900:
                    ready = requests.get(wd + "/readyz", timeout=5).status_code == 200
                    if ready and serving(api):
                        served = time.monotonic() - t0
                        break
                    time.sleep(0.05)
            rows.append({"profile": name, "fault": fault, "action": f"{action} ({reason})",
                         "detect_s": detected, "serving_again_s": served})
            print(rows[-1], flush=True)
    finally:
        up.stop()
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--profiles", default="short,default")
    p.add_argument("--out", default=str(ROOT / "benchmarks" / "results"))
    args = p.parse_args()
    out = Path(args.out)
    (out / "logs").mkdir(parents=True, exist_ok=True)
    rows = [row for name in args.profiles.split(",") for row in run_profile(name, out)]
    liveness = {"context_loss": "never while the process answers /healthz (our server exits instead: kubelet"
                                " restarts it after the exit)",
                "hang": "never (the event loop still answers /healthz)",
                "fragmentation": "never (no memory signal)"}
    lines = ["# Detection latency", f"Machine: {machine()}",
             "Profiles: `default` = canary every 30 s (timeout 10 s), allocator every 5 s; `short` = canary every 1 s"
             " (timeout 1 s), allocator every 0.5 s. Hang needs 3 consecutive canary timeouts.",
             "A plain Kubernetes liveness probe with defaults (period 10 s, failure threshold 3) notices a dead"
             " process after ~30 s and never a live process that cannot infer.",
             "", "| profile | fault | action | detected after s | serving again after s | plain liveness probe |",
             "|---|---|---|---:|---:|---|"]
    for r in rows:
        det = "not detected" if r["detect_s"] is None else f"{r['detect_s']:.2f}"
        srv = "n/a" if r["serving_again_s"] is None else f"{r['serving_again_s']:.2f}"
        lines.append(f"| {r['profile']} | {r['fault']} | {r['action']} | {det} | {srv} | {liveness[r['fault']]} |")
    report = "\n".join(lines)
    print(report)
    (out / "detection.md").write_text(report + "\n", encoding="utf-8")


if __name__ == "__main__":
    main()
