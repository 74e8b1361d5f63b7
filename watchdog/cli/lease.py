"""`gpu-watchdog fleet`, `quarantine` and `placement`: the workload's Lease read and changed by an
operator, with the config and the rights of one of its pods' sidecars."""

from __future__ import annotations

import dataclasses
import sys
import time
from typing import Any

from gpu_watchdog import logs
from gpu_watchdog.watchdog.core.settings import Settings
from gpu_watchdog.watchdog.edge.config import ConfigError, load
from gpu_watchdog.watchdog.edge.executor import FleetLedger
from gpu_watchdog.watchdog.runtime.wiring import build_ledger, build_placer, placer_for, resolve_workload


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

    from gpu_watchdog.watchdog.core import fleet
    from gpu_watchdog.watchdog.edge.effects.fleet import LedgerUnavailable

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

    from gpu_watchdog.watchdog.core import quarantine

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

    from gpu_watchdog.watchdog.core import placement

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
        placer = placer_for(settings, workload)
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
