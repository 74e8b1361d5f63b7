"""The `gpu-watchdog` command line."""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence

from watchdog import __version__
from watchdog.units import format_bytes, parse_ratio, parse_size


def _size(value: str) -> int:
    try:
        return parse_size(value)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _ratio_or_size(value: str) -> tuple[str, float]:
    if value.strip().endswith("%"):
        try:
            return "ratio", parse_ratio(value)
        except ValueError as exc:
            raise argparse.ArgumentTypeError(str(exc)) from None
    return "bytes", float(_size(value))


def _positive_int(value: str) -> int:
    try:
        n = int(value)
    except ValueError:
        raise argparse.ArgumentTypeError("must be a positive integer") from None
    if n < 1:
        raise argparse.ArgumentTypeError("must be a positive integer")
    return n


def _add_serve_flags(p: argparse.ArgumentParser, for_up: bool = False) -> None:
    try:
        from inference.settings import add_flags
    except ImportError:  # pragma: no cover - the package ships both; a broken install says so
        return
    add_flags(p, for_up=for_up)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="gpu-watchdog", description=__doc__)
    parser.add_argument("--version", action="version", version=f"gpu-watchdog {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    serve = sub.add_parser("serve", help="run the inference server")
    _add_serve_flags(serve)

    run = sub.add_parser("run", help="run the watchdog sidecar")
    run.add_argument("--config", required=True, metavar="FILE")

    up = sub.add_parser("up", help="inference server + watchdog on this machine (local restarts)")
    _add_serve_flags(up, for_up=True)
    up.add_argument("--config", metavar="FILE", help="watchdog config (restart strategy is forced to local)")
    up.add_argument("--watchdog-port", type=int, default=9402)

    fleet = sub.add_parser("fleet", help="the workload's restart ledger: who is restarting, the breaker")
    fleet.add_argument("action", choices=("status", "reset-breaker"),
                       help="status: print the ledger; reset-breaker: let restarts go on once the fault is fixed")
    fleet.add_argument("--config", default="/etc/gpu-watchdog/config.yaml", metavar="FILE",
                       help="the sidecar's config (default: the chart's, inside the watchdog container)")

    quarantine = sub.add_parser("quarantine", help="request fingerprints refused fleet-wide (the query of death)")
    quarantine.add_argument("action", choices=("list", "lift"),
                            help="list: the quarantined fingerprints and their evidence; lift: serve one again")
    quarantine.add_argument("fingerprint", nargs="?", help="the fingerprint to lift (from list or the access log)")
    quarantine.add_argument("--config", default="/etc/gpu-watchdog/config.yaml", metavar="FILE",
                            help="the sidecar's config (default: the chart's, inside the watchdog container)")

    check = sub.add_parser("check-config", help="validate a watchdog config file")
    check.add_argument("file")

    plan = sub.add_parser("plan", help="compute (or measure) the admission limit")
    plan.add_argument("--total", type=_size, help="GPU memory, e.g. 24GiB")
    plan.add_argument("--base", type=_size, help="steady memory after warm-up: weights + context + cache")
    plan.add_argument("--peak", type=_size, help="peak memory of one request at the longest prompt + output")
    plan.add_argument("--reserve", type=_ratio_or_size, default=None, help="safety reserve, e.g. 12%% or 3GiB")
    plan.add_argument("--workers", type=_positive_int, default=1, help="worker processes sharing the GPU")
    plan.add_argument("--model", metavar="DIR", help="measure this model (needs a CUDA device)")
    plan.add_argument("--handler", default="causal-lm", metavar="NAME|module:attr",
                      help="measure one item of this handler instead of one sequence (embeddings, classifier, ...)")
    plan.add_argument("--max-input", type=_positive_int, default=None)
    plan.add_argument("--max-output", type=_positive_int, default=None)
    bench = sub.add_parser("bench", help="load-test a /v1/completions server across concurrency levels")
    bench.add_argument("--url", default="http://127.0.0.1:8000")
    bench.add_argument("--concurrency", type=_int_list, default=(1, 2, 4, 8, 16, 32), metavar="1,2,4,...")
    bench.add_argument("--requests", type=_positive_int, default=64, help="requests per concurrency step")
    bench.add_argument("--duration", type=float, default=None, metavar="S", help="seconds per step instead")
    bench.add_argument("--prompt-len", type=_positive_int, default=32, help="prompt length in characters")
    bench.add_argument("--max-tokens", type=_positive_int, default=32)
    bench.add_argument("--max-tries", type=_positive_int, default=5)
    bench.add_argument("--control-url", default=None, help="control API for memory and admission figures")
    bench.add_argument("--token-file", default=None, help="control token (GPU_WATCHDOG_TOKEN wins)")
    bench.add_argument("--label", default="server", help="mode name in the table")
    bench.add_argument("--out", default=None, metavar="DIR", help="write CSV, JSON and PNG here")
    return parser


def _int_list(value: str) -> tuple[int, ...]:
    try:
        items = tuple(int(v) for v in value.split(",") if v.strip())
    except ValueError:
        raise argparse.ArgumentTypeError("expected comma-separated positive integers, e.g. 1,2,4,8") from None
    if not items or any(i < 1 for i in items):
        raise argparse.ArgumentTypeError("expected comma-separated positive integers, e.g. 1,2,4,8")
    return items


def _cmd_serve(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    try:
        from inference import main as serve_main
        from inference.settings import SettingsError, from_args
    except ImportError as exc:
        parser.error(f"serve needs the inference extra (pip install 'gpu-watchdog[inference]'): {exc}")
    if args.model is not None and not os.path.isdir(args.model):
        parser.error(f"--model {args.model}: not a directory (expected a local Hugging Face model directory)")
    try:
        settings = from_args(args)
    except SettingsError as exc:
        parser.error(str(exc))
    from watchdog import logs

    logs.configure("inference")
    return serve_main.run(settings)


def _cmd_plan(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    from inference.planner import PlanError, plan

    given = [args.total, args.base, args.peak]
    if any(v is not None for v in given):
        if any(v is None for v in given):
            parser.error("plan: --total, --base and --peak go together (or none of them, to measure on a GPU)")
        reserve_bytes = reserve_ratio = None
        if args.reserve is not None:
            kind, value = args.reserve
            if kind == "ratio":
                reserve_ratio = value
            else:
                reserve_bytes = int(value)
        try:
            result = plan(args.total, args.base, args.peak, reserve_bytes=reserve_bytes,
                          reserve_ratio=reserve_ratio, workers=args.workers)
        except PlanError as exc:
            print(f"gpu-watchdog plan: {exc}", file=sys.stderr)
            return 2
    else:
        from inference.measure import MeasureError, measure_plan

        try:
            result = measure_plan(args.model, args.max_input, args.max_output, args.workers, args.reserve,
                                  args.handler)
        except MeasureError as exc:
            print(f"gpu-watchdog plan: {exc}", file=sys.stderr)
            return 2
    print(f"total   {format_bytes(result.total_bytes):>12}")
    print(f"base    {format_bytes(result.base_bytes):>12}  (per worker: weights + CUDA context + warm cache)")
    print(f"reserve {format_bytes(result.reserve_bytes):>12}")
    one = "one item at the longest input" if getattr(args, "handler", "causal-lm") != "causal-lm" \
        else "one request at the longest prompt + output"
    print(f"peak    {format_bytes(result.peak_bytes):>12}  ({one})")
    print(f"budget  {format_bytes(result.budget_bytes):>12}  per worker x {result.workers}")
    print(f"N_max = floor(budget / peak) = {result.max_concurrency}")
    for note in result.notes:
        print(f"note: {note}")
    print("\n# Helm values")
    print(result.helm_values(), end="")
    return 0 if result.max_concurrency >= 1 else 1


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command == "serve":
        return _cmd_serve(args, parser)
    if args.command == "plan":
        return _cmd_plan(args, parser)
    if args.command == "check-config":
        from watchdog.config import check_config_main

        return check_config_main(args.file)
    if args.command == "run":
        from watchdog.wiring import run_main

        return run_main(args.config)
    if args.command == "fleet":
        from watchdog.wiring import fleet_main

        return fleet_main(args.config, args.action)
    if args.command == "quarantine":
        if (args.action == "lift") != (args.fingerprint is not None):
            parser.error("quarantine lift needs a FINGERPRINT; quarantine list takes none")
        from watchdog.wiring import quarantine_main

        return quarantine_main(args.config, args.action, args.fingerprint)
    if args.command == "bench":
        try:
            # A load generator, not part of the sidecar: it ships with the source tree, not the images.
            from benchmarks.loadgen import BenchSettings, bench_main
        except ImportError:
            print("gpu-watchdog bench: the load generator (benchmarks/loadgen.py) comes with the source"
                  " checkout; run it from a clone (make install)", file=sys.stderr)
            return 2
        from watchdog.contract import read_token

        token = read_token(args.token_file) if args.control_url else None
        return bench_main(BenchSettings(
            url=args.url, concurrency=args.concurrency, requests_per_step=args.requests, duration_s=args.duration,
            prompt_len=args.prompt_len, max_tokens=args.max_tokens, max_tries=args.max_tries,
            control_url=args.control_url, token=token, label=args.label), args.out)
    if args.command == "up":
        from inference.settings import SettingsError, from_args, to_argv
        from watchdog.up import up_main

        try:
            child = [sys.executable, "-m", "watchdog", "serve", *to_argv(from_args(args))]
        except SettingsError as exc:
            parser.error(str(exc))
        return up_main(args, child)
    parser.error(f"unknown command {args.command}")
    return 2


if __name__ == "__main__":
    sys.exit(main())
