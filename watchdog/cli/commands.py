"""The sidecar's commands: run, check-config, fleet, quarantine, placement, replay (the console script adds them)."""

from __future__ import annotations

import argparse
from typing import Any

CHART_CONFIG = "/etc/gpu-watchdog/config.yaml"


def add_commands(sub: Any) -> None:
    """`sub`: the console script's subparsers; each command's function is its `run_command` default."""
    run = sub.add_parser("run", help="run the watchdog sidecar")
    run.add_argument("--config", required=True, metavar="FILE")
    run.add_argument("--record", metavar="FILE", default=None,
                     help="append every input the core sees to FILE (recorder.path), for `gpu-watchdog replay`")
    run.set_defaults(run_command=_cmd_run)

    replay = sub.add_parser("replay", help="print a flight recording's decisions again, or what other settings"
                                           " would have decided")
    replay.add_argument("files", nargs="+", metavar="FILE", help="the recording (FILE.1, then FILE, after a rotation)")
    replay.add_argument("--config", metavar="FILE", default=None,
                        help="decide with this config instead of the one recorded")
    replay.add_argument("--set", dest="sets", action="append", default=[], metavar="KEY=VALUE",
                        help="decide with this setting changed (repeatable): --set policy.hang.consecutive_timeouts=5")
    replay.add_argument("--summary", nargs="?", const="text", default=None, choices=("text", "json"),
                        help="instead of each decision, what was decided per reason and per pod over the recordings"
                             " (one file per pod: every pod's at once), what the shadow actions would have cost and"
                             " what held the others back; `--summary json` for one JSON object")
    replay.set_defaults(run_command=_cmd_replay)

    fleet = sub.add_parser("fleet", help="the workload's restart ledger: who is restarting, the breaker")
    fleet.add_argument("action", choices=("status", "reset-breaker"),
                       help="status: print the ledger; reset-breaker: let restarts go on once the fault is fixed")
    fleet.add_argument("--config", default=CHART_CONFIG, metavar="FILE",
                       help="the sidecar's config (default: the chart's, inside the watchdog container)")
    fleet.set_defaults(run_command=_cmd_fleet)

    quarantine = sub.add_parser("quarantine", help="request fingerprints refused fleet-wide (the query of death)")
    quarantine.add_argument("action", choices=("list", "lift"),
                            help="list: the quarantined fingerprints and their evidence; lift: serve one again")
    quarantine.add_argument("fingerprint", nargs="?", help="the fingerprint to lift (from list or the access log)")
    quarantine.add_argument("--config", default=CHART_CONFIG, metavar="FILE",
                            help="the sidecar's config (default: the chart's, inside the watchdog container)")
    quarantine.set_defaults(run_command=_cmd_quarantine)

    placement = sub.add_parser("placement", help="GPUs kept out of the next placement (policy.placement): the"
                                                 " workload's taints and what is remembered of its cards")
    placement.add_argument("action", choices=("list", "clear"),
                           help="list: the taints and the remembered remediations; clear: lift our taints now")
    placement.add_argument("name", nargs="?", metavar="NODE|DEVICE",
                           help="clear: a node, a DeviceTaintRule or a card (from list); only our taints are lifted")
    placement.add_argument("--config", default=CHART_CONFIG, metavar="FILE",
                           help="the sidecar's config (default: the chart's, inside the watchdog container)")
    placement.set_defaults(run_command=_cmd_placement)

    check = sub.add_parser("check-config", help="validate a watchdog config file")
    check.add_argument("file")
    check.set_defaults(run_command=_cmd_check_config)


def _cmd_run(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    from gpu_watchdog.watchdog.cli.run import run_main

    return run_main(args.config, args.record)


def _cmd_replay(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    from gpu_watchdog.watchdog.cli.replay import replay_main

    return replay_main(args.files, args.config, args.sets, summary=args.summary)


def _cmd_fleet(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    from gpu_watchdog.watchdog.cli.lease import fleet_main

    return fleet_main(args.config, args.action)


def _cmd_quarantine(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    if (args.action == "lift") != (args.fingerprint is not None):
        parser.error("quarantine lift needs a FINGERPRINT; quarantine list takes none")
    from gpu_watchdog.watchdog.cli.lease import quarantine_main

    return quarantine_main(args.config, args.action, args.fingerprint)


def _cmd_placement(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    if (args.action == "clear") != (args.name is not None):
        parser.error("placement clear needs a NODE or DEVICE; placement list takes none")
    from gpu_watchdog.watchdog.cli.lease import placement_main

    return placement_main(args.config, args.action, args.name)


def _cmd_check_config(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    from gpu_watchdog.watchdog.edge.config import check_config_main

    return check_config_main(args.file)
