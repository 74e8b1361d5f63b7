"""The inference half's commands: serve and plan (the console script adds them)."""

from __future__ import annotations

import argparse
import os
import sys
from typing import Any

from gpu_watchdog.inference.settings import add_flags
from gpu_watchdog.units import format_bytes, parse_ratio, parse_size, positive_int


def _size(value: str) -> int:
    try:
        return parse_size(value)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _ratio_or_size(value: str) -> tuple[str, float]:
    if value.strip().endswith("%"):
        try:
            return ("ratio", parse_ratio(value))
        except ValueError as exc:
            raise argparse.ArgumentTypeError(str(exc)) from None
    return ("bytes", float(_size(value)))


def add_commands(sub: Any) -> None:
    """`sub`: the console script's subparsers; each command's function is its `run_command` default."""
    serve = sub.add_parser("serve", help="run the inference server")
    add_flags(serve)
    serve.set_defaults(run_command=_cmd_serve)

    plan = sub.add_parser("plan", help="compute (or measure) the admission limit")
    plan.add_argument("--total", type=_size, help="GPU memory, e.g. 24GiB")
    plan.add_argument("--base", type=_size, help="steady memory after warm-up: weights + context + cache")
    plan.add_argument("--peak", type=_size, help="peak memory of one request at the longest prompt + output")
    plan.add_argument("--reserve", type=_ratio_or_size, default=None, help="safety reserve, e.g. 12%% or 3GiB")
    plan.add_argument("--workers", type=positive_int, default=1, help="worker processes sharing the GPU")
    plan.add_argument("--model", metavar="DIR", help="measure this model (needs a CUDA device)")
    plan.add_argument("--handler", default="causal-lm", metavar="NAME|module:attr",
                      help="measure one item of this handler instead of one sequence (embeddings, classifier, ...)")
    plan.add_argument("--max-input", type=positive_int, default=None)
    plan.add_argument("--max-output", type=positive_int, default=None)
    plan.set_defaults(run_command=_cmd_plan)


def _cmd_serve(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    from gpu_watchdog.inference.settings import SettingsError, from_args

    if args.model is not None and not os.path.isdir(args.model):
        parser.error(f"--model {args.model}: not a directory (expected a local Hugging Face model directory)")
    try:
        settings = from_args(args)
    except SettingsError as exc:
        parser.error(str(exc))
    try:
        from gpu_watchdog.inference import main as serve_main
    except ImportError as exc:
        parser.error(f"serve needs the inference extra (pip install 'gpu-watchdog[inference]'): {exc}")
    from gpu_watchdog import logs

    logs.configure("inference")
    return serve_main.run(settings)


def _cmd_plan(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    from gpu_watchdog.inference.planner import PlanError, plan

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
        from gpu_watchdog.inference.measure import MeasureError, measure_plan

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
