"""The flight recording's lines: what the core saw, written as JSON and read back as the same records.

A recording is one JSON object per line:
- `start`: the settings the sidecar ran with, whether its budget came from the workload's Events,
  the history it began from (empty at start; the whole history again at the top of each rotated
  file, so that every file replays on its own) and the two clocks, to date what follows;
- `in`: one input folded into the history (a sample, an edge's outcome, a decision's record), in
  the order it was folded;
- `tick`: one evaluation of the core: its time and, where it decided anything, the decisions
  (`core`: `pod` for the watched target, `workers` for the other workers' rung).

Pure: no file and no clock. Records round-trip through their type hints, so a record that gains a
field is written and read with it. Nothing here ever holds request text or a secret: the inputs
carry fingerprints, figures and error classes only.
"""

from __future__ import annotations

import dataclasses
import types
import typing
from collections import deque
from collections.abc import Mapping
from typing import Any

from gpu_watchdog.watchdog.core import state
from gpu_watchdog.watchdog.core.history import History
from gpu_watchdog.watchdog.core.policy import Decision

VERSION = 1
START, INPUT, TICK = "start", "in", "tick"
POD, WORKERS = "pod", "workers"  # which core decided at a tick

# Every input the fold takes, by its type's name.
INPUTS: dict[str, type[Any]] = {t.__name__: t for t in typing.get_args(state.Outcome)}


class RecordingError(ValueError):
    """A line that is not a recording's: what is wrong with it (the reader names the line)."""


def encode(value: Any) -> Any:
    """A record as JSON: dataclasses field by field, tuples and deques as lists."""
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: encode(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if isinstance(value, tuple | list | deque):
        return [encode(v) for v in value]
    if isinstance(value, Mapping):
        return {str(k): encode(v) for k, v in value.items()}
    return value


def _decode(value: Any, tp: Any, where: str) -> Any:
    if tp is Any:
        return value
    origin = typing.get_origin(tp)
    args = typing.get_args(tp)
    if origin in (typing.Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        rest = [a for a in args if a is not type(None)]
        return _decode(value, rest[0], where)
    if dataclasses.is_dataclass(tp) and isinstance(tp, type):
        return decode_record(tp, value, where)
    if origin is tuple:
        if not isinstance(value, list):
            raise RecordingError(f"{where}: expected a list, got {type(value).__name__}")
        if len(args) == 2 and args[1] is Ellipsis:
            return tuple(_decode(v, args[0], f"{where}[{i}]") for i, v in enumerate(value))
        if len(args) != len(value):
            raise RecordingError(f"{where}: expected {len(args)} items, got {len(value)}")
        return tuple(_decode(v, a, f"{where}[{i}]") for i, (a, v) in enumerate(zip(args, value, strict=True)))
    if origin is dict or tp is dict:
        if not isinstance(value, Mapping):
            raise RecordingError(f"{where}: expected an object, got {type(value).__name__}")
        key_tp, value_tp = args if len(args) == 2 else (str, Any)
        return {(int(k) if key_tp is int else k): _decode(v, value_tp, f"{where}.{k}") for k, v in value.items()}
    if tp is float:
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise RecordingError(f"{where}: expected a number, got {value!r}")
        return float(value)
    if tp is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise RecordingError(f"{where}: expected an integer, got {value!r}")
        return value
    if tp is bool:
        if not isinstance(value, bool):
            raise RecordingError(f"{where}: expected true or false, got {value!r}")
        return value
    if tp is str:
        if not isinstance(value, str):
            raise RecordingError(f"{where}: expected a string, got {value!r}")
        return value
    return value


def decode_record(cls: type[Any], data: Any, where: str = "") -> Any:
    """One record of type `cls` from its JSON; a field the JSON lacks takes its default."""
    if not isinstance(data, Mapping):
        raise RecordingError(f"{where or cls.__name__}: expected an object, got {type(data).__name__}")
    hints = typing.get_type_hints(cls)
    kwargs = {f.name: _decode(data[f.name], hints[f.name], f"{where}.{f.name}" if where else f.name)
              for f in dataclasses.fields(cls) if f.init and f.name in data}
    try:
        return cls(**kwargs)
    except TypeError as exc:
        raise RecordingError(f"{where or cls.__name__}: {exc}") from None


def decode_input(name: Any, data: Any) -> state.Outcome:
    cls = INPUTS.get(name) if isinstance(name, str) else None
    if cls is None:
        raise RecordingError(f"unknown input type {name!r}")
    return typing.cast(state.Outcome, decode_record(cls, data, name))


def decode_history(data: Any) -> History:
    """The history from its JSON, its logs bounded as the sidecar's are."""
    if not isinstance(data, Mapping) or "started_at" not in data:
        raise RecordingError("history: expected an object with started_at")
    hints = typing.get_type_hints(History)
    h = History(started_at=_decode(data["started_at"], float, "history.started_at"))
    for f in dataclasses.fields(History):
        if f.name not in data or f.name == "started_at":
            continue
        value, tp, where = data[f.name], hints[f.name], f"history.{f.name}"
        current = getattr(h, f.name)
        if isinstance(current, deque):
            current.extend(_decode(value, _tuple_of(typing.get_args(tp)[0]), where))
        elif f.name in ("worker_canaries", "worker_actions"):
            item = typing.get_args(typing.get_args(tp)[1])[0]
            if not isinstance(value, Mapping):
                raise RecordingError(f"{where}: expected an object")
            setattr(h, f.name, {int(k): deque(_decode(v, _tuple_of(item), f"{where}.{k}"),
                                               maxlen=state.WORKER_CANARIES_KEPT) for k, v in value.items()})
        else:
            setattr(h, f.name, _decode(value, tp, where))
    return h


def _tuple_of(item: Any) -> Any:
    return tuple.__class_getitem__((item, ...))


def decision_json(d: Decision) -> dict[str, Any]:
    """What a decision is, for the recording and the replay alike (its figures left out: they are
    the inputs', recorded already)."""
    out: dict[str, Any] = {"action": d.action, "reason": d.reason}
    if d.action == "restart":
        out.update(rung=d.rung, drain=d.drain)
        if "worker" in d.detail:
            out["worker"] = d.detail["worker"]
        if not d.allowed:
            out["blocked_by"] = d.blocked_by
    elif "limit" in d.detail:
        out["limit"] = d.detail["limit"]
    if not d.enforced:
        out["shadow"] = True
    return out


def settings_json(settings: Any) -> dict[str, Any]:
    """The settings as recorded: all of them but what a request or a secret may be written in (the
    HTTP canary's body and headers), which the core never reads."""
    data = encode(settings)
    http = data.get("target", {}).get("http")
    if isinstance(http, dict):
        http.update(body=None, body_file=None, headers={k: "<not recorded>" for k in http.get("headers") or {}})
    return typing.cast(dict[str, Any], data)


def start_line(settings: Mapping[str, Any], history: History, budget_from_events: bool, mono: float,
               wall: float) -> dict[str, Any]:
    return {"kind": START, "version": VERSION, "mono": mono, "wall": wall, "settings": settings,
            "budget_from_events": budget_from_events, "history": encode(history)}


def input_line(outcome: state.Outcome) -> dict[str, Any]:
    return {"kind": INPUT, "type": type(outcome).__name__, "v": encode(outcome)}


def tick_line(now: float, decisions: list[Decision], core: str = POD) -> dict[str, Any]:
    line: dict[str, Any] = {"kind": TICK, "now": now}
    if core != POD:
        line["core"] = core
    if decisions:
        line["decisions"] = [decision_json(d) for d in decisions]
    return line
