"""The flight recorder at its edge: lines written whole by a thread of its own, the file rotated
within its bound with each file replayable on its own, a file that cannot be written counted and
said once, and a loop that never waits on it."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any

import pytest

from gpu_watchdog.watchdog.edge import recorder as recorder_module
from gpu_watchdog.watchdog.edge.recorder import FlightRecorder


def header(n: list[int]) -> dict[str, Any]:
    n[0] += 1
    return {"kind": "start", "n": n[0]}


def lines(path: Path) -> list[dict[str, Any]]:
    return [json.loads(x) for x in path.read_text().splitlines()]


def test_the_file_rotates_within_its_bound_each_part_beginning_with_its_history(tmp_path: Path) -> None:
    path = tmp_path / "flight.jsonl"
    starts = [0]
    rec = FlightRecorder(str(path), 64 * 1024, lambda: header(starts))
    rec.start()
    for i in range(3000):
        rec.record({"kind": "tick", "now": i, "pad": "x" * 40})
    rec.stop()
    older, newer = lines(path.with_name("flight.jsonl.1")), lines(path)
    assert older[0]["kind"] == newer[0]["kind"] == "start" and newer[0]["n"] > older[0]["n"]
    assert os.path.getsize(path) + os.path.getsize(path.with_name("flight.jsonl.1")) <= 64 * 1024
    ticks = [x["now"] for x in older + newer if x["kind"] == "tick"]
    assert ticks == list(range(ticks[0], 3000)), "the two files hold the newest lines, in order, none lost"
    assert oct(path.stat().st_mode & 0o777) == "0o600"
    assert rec.dropped == 0 and rec.failed == 0


def test_a_recording_left_by_the_last_run_is_kept_as_the_older_file(tmp_path: Path) -> None:
    path = tmp_path / "flight.jsonl"
    path.write_text('{"kind": "start", "n": "last run"}\n')
    rec = FlightRecorder(str(path), 1 << 20, lambda: {"kind": "start", "n": "this run"})
    rec.start()
    rec.stop()
    assert lines(path.with_name("flight.jsonl.1"))[0]["n"] == "last run" and lines(path)[0]["n"] == "this run"


def test_a_file_that_cannot_be_written_is_counted_and_said_once(tmp_path: Path, capsys: pytest.CaptureFixture[str]
                                                                  ) -> None:
    blocker = tmp_path / "not-a-folder"
    blocker.write_text("")
    whys: list[str] = []
    rec = FlightRecorder(str(blocker / "flight.jsonl"), 1 << 20, lambda: {"kind": "start"}, whys.append)
    rec.start()
    for i in range(20):
        rec.record({"kind": "tick", "now": i})
    rec.stop()
    assert rec.failed == 21 and whys == ["open"] * 21
    said = [line for line in capsys.readouterr().out.splitlines() if "recorder_write_failed" in line]
    assert len(said) == 1 and "not-a-folder" in said[0]


def test_the_loop_never_waits_on_a_slow_disk(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(recorder_module, "QUEUE_LINES", 50)
    rec = FlightRecorder(str(tmp_path / "flight.jsonl"), 1 << 20, lambda: {"kind": "start"})
    real_write = os.write

    def slow_write(fd: int, data: bytes) -> int:
        time.sleep(0.05)  # a disk that takes 50 ms a line
        return real_write(fd, data)

    monkeypatch.setattr(recorder_module.os, "write", slow_write)
    rec.start()
    for i in range(500):
        rec.record({"kind": "tick", "now": i})
    rec.stop(timeout=10)
    # Had the loop waited for the disk, every line would have been written and none dropped.
    assert rec.dropped > 0 and rec.written_bytes < 500 * 20
