"""`gpu-watchdog replay FILE...`: a flight recording's decisions printed again, one JSON object per
line, or what the sidecar would have decided with `--config FILE` or `--set KEY=VALUE` instead.

Exit 0 with the decisions and a summary line; 1 where a line of a recording is not one (the
decisions up to it printed, the line named); 2 for settings that do not load."""

from __future__ import annotations

import contextlib
import copy
import json
import os
import sys
from collections.abc import Mapping, Sequence
from typing import Any, TextIO

import yaml

from gpu_watchdog.watchdog.core.recording import RecordingError
from gpu_watchdog.watchdog.core.replay import Replay, iso
from gpu_watchdog.watchdog.core.report import Report, render
from gpu_watchdog.watchdog.core.settings import Settings
from gpu_watchdog.watchdog.edge import config


def parse_assignment(text: str) -> tuple[list[str], Any]:
    """`policy.hang.consecutive_timeouts=5` -> (['policy', 'hang', 'consecutive_timeouts'], 5): the
    value read as YAML reads it (numbers, booleans, `30s`)."""
    key, sep, raw = text.partition("=")
    if not sep or not key.strip() or any(not part for part in key.strip().split(".")):
        raise ValueError(f"--set takes KEY=VALUE with a dotted key, like policy.hang.consecutive_timeouts=5;"
                         f" got {text!r}")
    try:
        value = yaml.safe_load(raw) if raw.strip() else ""
    except yaml.YAMLError:
        value = raw
    return key.strip().split("."), value


def with_changes(base: Mapping[str, Any], changes: Sequence[tuple[list[str], Any]]) -> dict[str, Any]:
    data: dict[str, Any] = copy.deepcopy(dict(base))
    for path, value in changes:
        node = data
        for part in path[:-1]:
            child = node.get(part)
            if not isinstance(child, dict):
                child = node[part] = {}
            node = child
        node[path[-1]] = value
    return data


def replay_main(files: Sequence[str], config_file: str | None, sets: Sequence[str], out: TextIO = sys.stdout,
                err: TextIO = sys.stderr, summary: str | None = None) -> int:
    """`summary`: instead of the decisions, the report over the recordings (`watchdog.core.report`), as text or
    as one JSON object (`json`)."""
    try:
        return _replay(files, config_file, sets, out, err, summary)
    except BrokenPipeError:
        # The reader stopped reading (`| head`): what it took was printed, and that is all it wanted.
        with contextlib.suppress(OSError):
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0


def _replay(files: Sequence[str], config_file: str | None, sets: Sequence[str], out: TextIO, err: TextIO,
            summary: str | None) -> int:
    try:
        changes = [parse_assignment(s) for s in sets]
        chosen = config.read_yaml(config_file) if config_file is not None else None
        if chosen is not None and not isinstance(chosen, Mapping):
            raise config.ConfigError([f"{config_file}: expected a mapping of settings"])
    except ValueError as exc:  # ConfigError too
        for line in getattr(exc, "errors", [str(exc)]):
            print(f"gpu-watchdog replay: {line}", file=err)
        return 2
    what_if = chosen is not None or bool(changes)

    def settings_for(recorded: Mapping[str, Any]) -> Settings:
        return config.build(with_changes(chosen if chosen is not None else recorded, changes))

    replay = Replay(settings_for, report=Report() if summary is not None else None)
    for path in files:
        try:
            fh = open(path, encoding="utf-8")
        except OSError as exc:
            print(f"gpu-watchdog replay: cannot read {path}: {exc.strerror}", file=err)
            return 2
        with fh:
            for number, text in enumerate(fh, 1):
                if not text.strip():
                    continue
                try:
                    line = json.loads(text)
                    printed = replay.feed(line)
                except json.JSONDecodeError as exc:
                    cut = "" if text.endswith("\n") else " (the line is cut short: the recording ends mid-write)"
                    print(f"{path}:{number}: not a JSON line: {exc.msg} at column {exc.colno}{cut}", file=err)
                    return _end(replay, out, err, what_if, 1, summary)
                except RecordingError as exc:
                    print(f"{path}:{number}: {exc}", file=err)
                    return _end(replay, out, err, what_if, 1, summary)
                except config.ConfigError as exc:
                    for e in exc.errors:
                        print(f"gpu-watchdog replay: {e}", file=err)
                    return 2
                if summary is not None:
                    continue
                for item in printed:
                    print(json.dumps(item, separators=(", ", ": ")), file=out)
    if replay.history is None:
        print(f"gpu-watchdog replay: {', '.join(files)}: no start line: not a flight recording", file=err)
        return 1
    return _end(replay, out, err, what_if, 0, summary)


def _end(replay: Replay, out: TextIO, err: TextIO, what_if: bool, code: int, report_as: str | None = None) -> int:
    if report_as is not None:
        report = replay.summary_report()
        if report_as == "json":
            print(json.dumps(report, indent=2), file=out)
        else:
            print(render(report, iso), file=out, end="")
        return code
    summary = replay.summary()
    print(json.dumps(summary, separators=(", ", ": ")), file=out)
    if what_if:
        word = ("the same decisions as the recording" if summary["identical"] else
                f"different decisions at {summary['differing_ticks']} of {summary['ticks']} evaluations,"
                f" the first at {summary['differences'][0]['at']}")
        print(f"what-if: {word}", file=err)
    elif not summary["identical"]:
        print(f"replay: {summary['differing_ticks']} evaluations decided otherwise than the recording says;"
              " a recording from another release?", file=err)
    return code
