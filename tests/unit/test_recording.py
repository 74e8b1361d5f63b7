"""The flight recording's lines: every input the fold takes, and the history itself, written as JSON
and read back equal; what is not a recording's line is refused saying what is wrong."""

from __future__ import annotations

import dataclasses
import json
import types
import typing
from collections import deque
from typing import Any

import pytest

from gpu_watchdog.watchdog.core import recording
from gpu_watchdog.watchdog.core.history import History
from gpu_watchdog.watchdog.core.recording import RecordingError
from gpu_watchdog.watchdog.core.samples import CanarySample, TorchSample, WorkerRestarted
from gpu_watchdog.watchdog.core.state import RestartEnded, reduce
from gpu_watchdog.watchdog.edge.config import from_mapping


def example(tp: Any, n: int = 0) -> Any:
    """A value of `tp` unlike its defaults, so that a field lost on the way shows."""
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin in (typing.Union, types.UnionType):
        return example(next(a for a in args if a is not type(None)), n)
    if dataclasses.is_dataclass(tp) and isinstance(tp, type):
        hints = typing.get_type_hints(tp)
        return tp(**{f.name: example(hints[f.name], n + i) for i, f in enumerate(dataclasses.fields(tp))})
    if origin is tuple:
        if len(args) == 2 and args[1] is Ellipsis:
            return (example(args[0], n), example(args[0], n + 1))
        return tuple(example(a, n + i) for i, a in enumerate(args))
    if origin is dict or tp is dict:
        return {"k": [1, 2, {"n": n}]}
    if tp is Any:
        return {"any": [n, "x"]}
    return {float: 1.25 + n, int: 7 + n, str: f"s{n}", bool: True}[tp]


@pytest.mark.parametrize("name", sorted(recording.INPUTS))
def test_every_input_comes_back_as_it_was_written(name: str) -> None:
    value = example(recording.INPUTS[name])
    line = json.loads(json.dumps(recording.input_line(value)))
    assert line["kind"] == "in" and line["type"] == name
    assert recording.decode_input(line["type"], line["v"]) == value


def test_the_history_comes_back_with_its_logs_bounded_as_they_were() -> None:
    h = History(started_at=5.0, epoch=5.0, pod="p-1", node="n-1", worker_count=2)
    for i in range(300):
        reduce(h, CanarySample(at=6.0 + i, ok=i % 7 != 0, latency_s=0.01, error_class=None, instance_id="a"))
    reduce(h, TorchSample(at=10.0, reachable=True, admission_limit=16, instance_id="a"))
    reduce(h, WorkerRestarted(at=11.0, worker=1, reason="hang", instance_id="b"))
    reduce(h, RestartEnded(at=12.0, reason="hang", done=True, keep_unready=False))
    back = recording.decode_history(json.loads(json.dumps(recording.encode(h))))
    assert recording.encode(back) == recording.encode(h)
    assert back.canaries.maxlen == h.canaries.maxlen == 256 and len(back.canaries) == 256
    assert isinstance(back.worker_actions[1], deque) and back.worker_actions[1].maxlen == h.worker_actions[1].maxlen


def test_a_field_the_line_lacks_takes_its_default_and_a_wrong_type_is_named() -> None:
    assert recording.decode_input("CanarySample", {"at": 1, "ok": True, "latency_s": 0.5, "error_class": None}) \
        == CanarySample(at=1.0, ok=True, latency_s=0.5, error_class=None)
    with pytest.raises(RecordingError, match=r"CanarySample\.latency_s: expected a number, got 'fast'"):
        recording.decode_input("CanarySample", {"at": 1, "ok": True, "latency_s": "fast", "error_class": None})
    with pytest.raises(RecordingError, match="unknown input type 'Telepathy'"):
        recording.decode_input("Telepathy", {})
    with pytest.raises(RecordingError, match="CanarySample"):
        recording.decode_input("CanarySample", {"ok": True})  # `at` has no default


def test_no_request_text_or_secret_reaches_the_recording(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("POD_NAME", "p")
    monkeypatch.setenv("POD_NAMESPACE", "n")
    s = from_mapping({"target": {"http": {"url": "http://127.0.0.1:9/predict", "body": {"inputs": "a prompt"},
                                          "headers": {"Authorization": "Bearer s3cret"}}}})
    text = json.dumps(recording.settings_json(s))
    assert "s3cret" not in text and "a prompt" not in text
    assert json.loads(text)["target"]["http"]["headers"] == {"Authorization": "<not recorded>"}
    assert json.loads(text)["policy"]["hang"]["consecutive_timeouts"] == 3
