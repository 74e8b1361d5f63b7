"""The `gpu-watchdog` command line: each half adds its own commands; `up` and `bench` use both."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from typing import Any

from gpu_watchdog import __version__
from gpu_watchdog.units import positive_int
from gpu_watchdog.watchdog.cli import commands as sidecar_cli

try:
    from gpu_watchdog.inference import cli as inference_cli
except ImportError as exc:  # the sidecar's image carries only the sidecar
    inference_cli = None  # type: ignore[assignment]
    _INFERENCE_MISSING = str(exc)
else:
    _INFERENCE_MISSING = ""


def _int_list(value: str) -> tuple[int, ...]:
    try:
        items = tuple(int(v) for v in value.split(",") if v.strip())
    except ValueError:
        raise argparse.ArgumentTypeError("expected comma-separated positive integers, e.g. 1,2,4,8") from None
    if not items or any(i < 1 for i in items):
        raise argparse.ArgumentTypeError("expected comma-separated positive integers, e.g. 1,2,4,8")
    return items


def _without_inference(sub: Any, name: str, help: str) -> None:
    # Registered all the same, taking any flags, so that no command or flag is ever dropped silently:
    # it answers with what this install lacks instead of "invalid choice" or "unrecognized arguments".
    p = sub.add_parser(name, help=f"{help} (needs the inference half)", add_help=False)
    p.set_defaults(run_command=_cmd_no_inference, takes_any=True)


def _cmd_no_inference(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    print(f"gpu-watchdog {args.command}: this install carries only the sidecar (gpu_watchdog.inference is not"
          f" importable: {_INFERENCE_MISSING}); use the inference image, or pip install 'gpu-watchdog[inference]'"
          " from the full distribution", file=sys.stderr)
    return 2


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="gpu-watchdog", description=__doc__)
    parser.add_argument("--version", action="version", version=f"gpu-watchdog {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    if inference_cli is not None:
        inference_cli.add_commands(sub)
    else:
        _without_inference(sub, "serve", "run the inference server")
        _without_inference(sub, "plan", "compute (or measure) the admission limit")
    sidecar_cli.add_commands(sub)
    if inference_cli is not None:
        up = sub.add_parser("up", help="inference server + watchdog on this machine (local restarts)")
        from gpu_watchdog.inference.settings import add_flags

        add_flags(up, for_up=True)
        up.add_argument("--config", metavar="FILE", help="watchdog config (restart strategy is forced to local)")
        up.add_argument("--watchdog-port", type=int, default=9402)
        up.set_defaults(run_command=_cmd_up)
    else:
        _without_inference(sub, "up", "inference server + watchdog on this machine (local restarts)")

    bench = sub.add_parser("bench", help="load-test a /v1/completions server across concurrency levels")
    bench.add_argument("--url", default="http://127.0.0.1:8000")
    bench.add_argument("--concurrency", type=_int_list, default=(1, 2, 4, 8, 16, 32), metavar="1,2,4,...")
    bench.add_argument("--requests", type=positive_int, default=64, help="requests per concurrency step")
    bench.add_argument("--duration", type=float, default=None, metavar="S", help="seconds per step instead")
    bench.add_argument("--prompt-len", type=positive_int, default=32, help="prompt length in characters")
    bench.add_argument("--max-tokens", type=positive_int, default=32)
    bench.add_argument("--max-tries", type=positive_int, default=5)
    bench.add_argument("--control-url", default=None, help="control API for memory and admission figures")
    bench.add_argument("--token-file", default=None, help="control token (GPU_WATCHDOG_TOKEN wins)")
    bench.add_argument("--label", default="server", help="mode name in the table")
    bench.add_argument("--out", default=None, metavar="DIR", help="write CSV, JSON and PNG here")
    bench.set_defaults(run_command=_cmd_bench)
    return parser


def _cmd_up(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    from gpu_watchdog.inference.settings import SettingsError, from_args, to_argv
    from gpu_watchdog.watchdog.cli.up import up_main

    try:
        child = [sys.executable, "-m", "gpu_watchdog", "serve", *to_argv(from_args(args))]
    except SettingsError as exc:
        parser.error(str(exc))
    return up_main(args, child)


def _cmd_bench(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    try:
        # A load generator, not part of the sidecar: it ships with the source tree, not the images.
        from gpu_watchdog.benchmarks.loadgen import BenchSettings, bench_main
    except ImportError:
        print("gpu-watchdog bench: the load generator (benchmarks/loadgen.py) comes with the source"
              " checkout; run it from a clone (make install)", file=sys.stderr)
        return 2
    from gpu_watchdog.token import read_token

    token = read_token(args.token_file) if args.control_url else None
    return bench_main(BenchSettings(
        url=args.url, concurrency=args.concurrency, requests_per_step=args.requests, duration_s=args.duration,
        prompt_len=args.prompt_len, max_tokens=args.max_tokens, max_tries=args.max_tries,
        control_url=args.control_url, token=token, label=args.label), args.out)


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args, unknown = parser.parse_known_args(argv)
    if unknown and not getattr(args, "takes_any", False):
        parser.error(f"unrecognized arguments: {' '.join(unknown)}")
    result: int = args.run_command(args, parser)
    return result
