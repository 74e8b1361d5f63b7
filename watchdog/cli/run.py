"""`gpu-watchdog run`: from a config file to a running sidecar, until a signal."""

from __future__ import annotations

import asyncio
import sys

from gpu_watchdog import logs
from gpu_watchdog.watchdog.edge.config import ConfigError, load, replace
from gpu_watchdog.watchdog.runtime.app import Watchdog
from gpu_watchdog.watchdog.runtime.wiring import (
    api_client,
    build_ledger,
    build_node_reporter,
    build_placer,
    build_restarter,
    resolve_workload,
    run_until_signal,
)


def run_main(config_path: str, record: str | None = None) -> int:
    logs.configure("watchdog")
    try:
        settings = load(config_path)
        if record is not None:
            settings = replace(settings, "recorder", path=record)
        workload = resolve_workload(settings)
        api = api_client(settings)
        restarter = build_restarter(settings, workload, api)
        node = build_node_reporter(settings, api)
        ledger = build_ledger(settings, workload, api)
        placer = build_placer(settings, workload, api)
    except ConfigError as exc:
        for line in exc.errors:
            print(f"error: {line}", file=sys.stderr)
        print(f"gpu-watchdog run: invalid config {config_path}", file=sys.stderr)
        return 2
    except Exception as exc:  # kubeconfig missing, refused pod, ...
        print(f"gpu-watchdog run: {exc}", file=sys.stderr)
        return 2
    try:
        # The workload's records are stamped by the API server's clock, whatever this node's says.
        watchdog = Watchdog(settings, restarter, node=node, restart_events=node, workload=workload, ledger=ledger,
                            placer=placer, cluster_clock=None if api is None else api.now)
        asyncio.run(run_until_signal(watchdog))
    except OSError as exc:
        print(f"gpu-watchdog run: cannot listen on {settings.server.host}:{settings.server.port}: {exc.strerror}",
              file=sys.stderr)
        return 2
    return 0
