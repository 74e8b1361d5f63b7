"""From a config file to a running watchdog: the restarter and the Kubernetes parts its settings
call for, then the loop until a signal."""

from __future__ import annotations

import asyncio
import dataclasses
import signal
import sys
import time
from typing import TYPE_CHECKING, Any

from gpu_watchdog import logs
from gpu_watchdog.watchdog.actions.node import NodeReporter
from gpu_watchdog.watchdog.actions.restart import ReportOnlyRestarter, Restarter
from gpu_watchdog.watchdog.app import Watchdog
from gpu_watchdog.watchdog.config import ConfigError, Settings, load, replace, workload_of
from gpu_watchdog.watchdog.executor import FleetLedger

if TYPE_CHECKING:
    from gpu_watchdog.watchdog.actions.placement import Placer

log = logs.get("watchdog")


def _kube_reachable(settings: Settings) -> bool:
    """Evict and delete need the Kubernetes API; `container` uses it where it has it (its Events, the
    workload's budget, the pod rung) and works without it, on a verdict file alone."""
    k = settings.kubernetes
    if settings.restart.strategy in ("evict", "delete"):
        return True
    return settings.restart.strategy == "container" and bool(k.pod_name and k.namespace)


WORKLOAD_TRIES = 3  # reads of our own pod at start (1 s, then 2 s apart) before the name stands in


def resolve_workload(settings: Settings) -> str:
    """The restart budget's key: `kubernetes.workload` where an operator set it; else our pod's
    controller, read from the API at start; the pod's name pattern only where the pod cannot be read."""
    k = settings.kubernetes
    if k.workload or not _kube_reachable(settings):
        return workload_of(settings)
    from gpu_watchdog.watchdog.actions.kube import PodActions, load_api_client

    error = ""
    for attempt in range(WORKLOAD_TRIES):
        try:
            api = load_api_client(k.kubeconfig, k.request_timeout)
            workload = PodActions(api, k.pod_name, k.namespace, k.request_timeout).owner_workload()
        except Exception as exc:  # 403, timeouts, an API not yet reachable: try again, then the name
            error = f"{getattr(exc, 'status', None) or type(exc).__name__}: {str(exc)[:200]}"
            if attempt + 1 < WORKLOAD_TRIES:
                time.sleep(2**attempt)
            continue
        log.info("workload", workload=workload, source="ownerReferences")
        return workload
    fallback = workload_of(settings)
    log.warning("workload_unknown", error=error, workload=fallback, source="pod name", tries=WORKLOAD_TRIES)
    return fallback


def build_restarter(settings: Settings, workload: str | None = None) -> Restarter:
    from gpu_watchdog.watchdog.actions.kube import PodActions, load_api_client
    from gpu_watchdog.watchdog.actions.restart import ContainerRestarter, KubeRestarter

    strategy = settings.restart.strategy
    if strategy == "none":
        return ReportOnlyRestarter()
    if strategy == "local":
        raise ConfigError(["restart.strategy: local only works under `gpu-watchdog up`, which owns the process"])
    k = settings.kubernetes
    pod: KubeRestarter | None = None
    if _kube_reachable(settings):
        api = load_api_client(k.kubeconfig, k.request_timeout)
        # The pod rung of `container` evicts, as `evict` does.
        pod_settings = dataclasses.replace(settings.restart, strategy="evict") if strategy == "container" \
            else settings.restart
        pod = KubeRestarter(PodActions(api, k.pod_name, k.namespace, k.request_timeout), pod_settings,
                            workload=workload if workload is not None else workload_of(settings),
                            node=k.node_name or None)
    if strategy == "container":
        return ContainerRestarter(settings.restart.verdict_file, pod)
    assert pod is not None
    return pod


def build_node_reporter(settings: Settings) -> NodeReporter | None:
    """Only where restarts go through Kubernetes: the Events to read back are written there."""
    if not _kube_reachable(settings):
        return None
    from gpu_watchdog.watchdog.actions.kube import load_api_client

    k = settings.kubernetes
    e = settings.policy.escalation
    return NodeReporter(load_api_client(k.kubeconfig, k.request_timeout), k.namespace, k.node_name,
                        k.request_timeout, e.node_condition, e.node_event)


def build_ledger(settings: Settings, workload: str) -> FleetLedger | None:
    """The workload's Lease, where restarts go through Kubernetes: its replicas always, and its slots
    and breaker where `policy.fleet.enabled`."""
    if not _kube_reachable(settings):
        return None
    from gpu_watchdog.watchdog.actions.fleet import LeaseLedger, lease_name
    from gpu_watchdog.watchdog.actions.kube import load_api_client

    k = settings.kubernetes
    return LeaseLedger(load_api_client(k.kubeconfig, k.request_timeout), k.namespace,
                       lease_name(workload, settings.policy.fleet.lease_name), workload, k.pod_name,
                       k.request_timeout)


def build_placer(settings: Settings, workload: str) -> Placer | None:
    """Where placement is on (policy.placement.strategy other than off) and restarts go through Kubernetes."""
    if settings.policy.placement.strategy == "off" or not _kube_reachable(settings):
        return None
    return _placer(settings, workload)


def _placer(settings: Settings, workload: str) -> Placer:
    from gpu_watchdog.watchdog.actions.kube import load_api_client
    from gpu_watchdog.watchdog.actions.placement import Placer

    k = settings.kubernetes
    return Placer(load_api_client(k.kubeconfig, k.request_timeout), k.namespace, k.pod_name, k.node_name, workload,
                  k.request_timeout)


def _open_ledger(config_path: str, command: str, without: str) -> tuple[Settings, str, FleetLedger] | int:
    """The CLI's way to the workload's Lease, with the sidecar's config and rights: (settings,
    workload, ledger), or the exit code once the reason it cannot is printed (`without`: where the
    config reaches no Kubernetes API)."""
    logs.configure("watchdog", stream=sys.stderr)  # stdout is the answer
    try:
        settings = load(config_path)
        workload = resolve_workload(settings)
        ledger = build_ledger(settings, workload)
    except ConfigError as exc:
        for line in exc.errors:
            print(f"error: {line}", file=sys.stderr)
        return 2
    except Exception as exc:
        print(f"gpu-watchdog {command}: {exc}", file=sys.stderr)
        return 2
    if ledger is None:
        print(f"gpu-watchdog {command}: {without} (restart.strategy {settings.restart.strategy})", file=sys.stderr)
        return 2
    return settings, workload, ledger


def fleet_main(config_path: str, action: str) -> int:
    """`gpu-watchdog fleet status|reset-breaker`: the ledger as this pod's sidecar sees it, with its rights."""
    import json

    from gpu_watchdog.watchdog import fleet
    from gpu_watchdog.watchdog.actions.fleet import LedgerUnavailable

    opened = _open_ledger(config_path, "fleet",
                          "this config restarts through no Kubernetes API: there is no fleet ledger")
    if isinstance(opened, int):
        return opened
    settings, workload, ledger = opened
    s = settings.policy.fleet
    try:
        if action == "reset-breaker":
            before = ledger.update(lambda led, now: (fleet.reset_breaker(led, now), fleet.breaker_open(led)))
            print(f"breaker of {workload} reset" + (f" (it was open for {before.reason} since {before.opened_at:.0f})"
                                                    if before is not None else " (it was not open)"))
            return 0
        current = fleet.prune(s, ledger.read(), time.time())
        replicas = ledger.replicas()
    except LedgerUnavailable as exc:
        print(f"gpu-watchdog fleet: {exc}", file=sys.stderr)
        return 1
    except Exception as exc:
        print(f"gpu-watchdog fleet: {getattr(exc, 'status', None) or type(exc).__name__}: {str(exc)[:300]}",
              file=sys.stderr)
        return 1
    breaker = fleet.breaker_open(current)
    print(json.dumps({"workload": workload, "lease": ledger.name, "replicas": replicas,
                      "max_unavailable": fleet.unavailable_slots(s, replicas),
                      "restarting": [dataclasses.asdict(sl) for sl in current.slots],
                      "breaker": None if breaker is None else dataclasses.asdict(breaker),
                      "restarts_in_window": len(current.restarts)}, indent=2))
    return 0


def quarantine_main(config_path: str, action: str, fingerprint: str | None) -> int:
    """`gpu-watchdog quarantine list|lift FP`: the workload's quarantine in its Lease, with this pod's
    sidecar's rights. A lift reaches every replica at its sidecar's next sync (5 s)."""
    import json

    from gpu_watchdog.watchdog import quarantine

    opened = _open_ledger(config_path, "quarantine",
                          "this config reaches no Kubernetes API: the quarantine is this sidecar's own (see its"
                          " /status); lift one with DELETE /control/quarantine on the server")
    if isinstance(opened, int):
        return opened
    settings, workload, ledger = opened
    try:
        if action == "lift":
            assert fingerprint is not None

            def lift(records: quarantine.Records, now: float
                     ) -> tuple[quarantine.Records, tuple[quarantine.Records, bool]]:
                new, was = quarantine.lift_records(records, fingerprint, now)
                return new, (new, was)

            records, was = ledger.update_records(lift)
            if not was:
                print(f"gpu-watchdog quarantine: {fingerprint} is not quarantined in {workload}", file=sys.stderr)
                return 1
            for q in records.quarantined:
                if q.fingerprint == fingerprint:
                    try:
                        ledger.report_quarantine(q, lifted=True)
                    except Exception as exc:  # lifted all the same: the Event is the record of it
                        print(f"gpu-watchdog quarantine: lifted; its Event was not written: {exc}", file=sys.stderr)
            print(f"{fingerprint} lifted in {workload}: every replica serves it again within 5 s")
            return 0
        records = ledger.read_records()
    except Exception as exc:  # LedgerUnavailable, an API error
        print(f"gpu-watchdog quarantine: {getattr(exc, 'status', None) or type(exc).__name__}: {str(exc)[:300]}",
              file=sys.stderr)
        return 1
    now = time.time()
    print(json.dumps({"workload": workload, "lease": ledger.name, "enabled": settings.policy.quarantine.enabled,
                      "quarantined": [quarantine.describe(q, now) for q in records.quarantined if now < q.until],
                      "failures_in_window": len(records.failures)}, indent=2))
    return 0


def placement_main(config_path: str, action: str, name: str | None) -> int:
    """`gpu-watchdog placement list|clear NAME`: the cards the workload keeps out of placement, from its
    Lease, with this pod's sidecar's rights; `clear` lifts our taints on a node, a DeviceTaintRule or a
    card now (never one we did not place)."""
    import json

    from gpu_watchdog.watchdog import placement

    opened = _open_ledger(config_path, "placement", "this config reaches no Kubernetes API: nothing is tainted")
    if isinstance(opened, int):
        return opened
    settings, workload, ledger = opened
    s = settings.policy.placement
    try:
        records = ledger.read_placement()
        if action == "list":
            now = time.time()
            placer = build_placer(settings, workload)
            rules: list[dict[str, Any]] | None = []
            if placer is not None and s.strategy in ("device", "node"):  # `none` may read no rules
                try:
                    rules = placer.rules()
                except Exception as exc:  # the records are the answer; the cluster's side is extra
                    print(f"gpu-watchdog placement: the DeviceTaintRules could not be listed: {exc}", file=sys.stderr)
                    rules = None
            print(json.dumps({"workload": workload, "lease": ledger.name, "strategy": s.strategy,
                              "tainted": [placement.describe(t, now) for t in records.taints],
                              "device_taint_rules": None if rules is None else [r["metadata"]["name"] for r in rules],
                              "remembered": _remembered(records, "card"),
                              "remembered_nodes": _remembered(records, "node"),
                              "lifts": [dataclasses.asdict(x) for x in records.lifts]},
                             indent=2))
            return 0
        assert name is not None
        found = placement.find(records, name)
        if not found:
            print(f"gpu-watchdog placement: no taint of gpu-watchdog on {name} in {workload}'s records"
                  " (a taint placed by anyone else is never touched)", file=sys.stderr)
            return 1
        # Whatever the strategy now: a taint recorded under an earlier one is still ours to lift.
        placer = _placer(settings, workload)
        for taint in found:
            # The record first: a sidecar's reconcile keeps what the records hold in the cluster, and
            # would put back a taint lifted before its record.
            def lift(rec: placement.Records, at: float, t: placement.Taint = taint) -> tuple[placement.Records, None]:
                return placement.lifted(s, rec, t, at, "operator"), None

            def restore(rec: placement.Records, at: float, t: placement.Taint = taint
                        ) -> tuple[placement.Records, None]:
                return placement.restore(rec, t), None

            ledger.update_placement(lift)
            try:
                outcome = placer.lift(taint)
            except Exception:
                ledger.update_placement(restore)
                raise
            print(f"{taint.kind} {taint.target} (card {taint.card}): {outcome}")
        return 0
    except Exception as exc:  # LedgerUnavailable, an API error
        print(f"gpu-watchdog placement: {getattr(exc, 'status', None) or type(exc).__name__}: {str(exc)[:300]}",
              file=sys.stderr)
        return 1


def _remembered(records: Any, by: str) -> list[dict[str, Any]]:
    """The remembered remediations, one row per card (with its node) or per node (with its cards): the
    days they were remediated on, the reasons."""
    rows: dict[str, dict[str, Any]] = {}
    for r in records.remediations:
        key = r.card if by == "card" else r.node
        row = rows.setdefault(key, {"card": r.card, "node": r.node, "days": set(), "reasons": set(), "count": 0}
                              if by == "card" else {"node": r.node, "cards": set(), "days": set(), "reasons": set(),
                                                    "count": 0})
        if by == "node":
            row["cards"].add(r.card)
        row["days"].add(time.strftime("%Y-%m-%d", time.gmtime(r.at)))
        row["reasons"].add(r.reason)
        row["count"] += 1
    return [{**row, **{k: sorted(v) for k, v in row.items() if isinstance(v, set)}} for row in rows.values()]


async def run_until_signal(watchdog: Watchdog) -> None:
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    await watchdog.start()
    await stop.wait()
    # Stopping never acts: no drain, no restart, just leave; what our server answered is said first
    # (a scale-down or a rollout removes the pod, and with it the only word that a suspect was answered).
    await watchdog.executor.leaving()
    await watchdog.stop()


def run_main(config_path: str, record: str | None = None) -> int:
    logs.configure("watchdog")
    try:
        settings = load(config_path)
        if record is not None:
            settings = replace(settings, "recorder", path=record)
        workload = resolve_workload(settings)
        restarter = build_restarter(settings, workload)
        node = build_node_reporter(settings)
        ledger = build_ledger(settings, workload)
        placer = build_placer(settings, workload)
    except ConfigError as exc:
        for line in exc.errors:
            print(f"error: {line}", file=sys.stderr)
        print(f"gpu-watchdog run: invalid config {config_path}", file=sys.stderr)
        return 2
    except Exception as exc:  # kubeconfig missing, refused pod, ...
        print(f"gpu-watchdog run: {exc}", file=sys.stderr)
        return 2
    try:
        watchdog = Watchdog(settings, restarter, node=node, restart_events=node, workload=workload, ledger=ledger,
                            placer=placer)
        asyncio.run(run_until_signal(watchdog))
    except OSError as exc:
        print(f"gpu-watchdog run: cannot listen on {settings.server.host}:{settings.server.port}: {exc.strerror}",
              file=sys.stderr)
        return 2
    return 0
