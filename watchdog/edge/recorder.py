"""The flight recorder: every input the core sees, appended to a file a thread writes, so that the
loop never waits on a disk.

Bounded: the file is rotated once it would pass half of `recorder.max_bytes` (FILE becomes FILE.1,
the older FILE.1 is dropped), so the two together stay within it; each file begins with a `start`
line holding the whole history at that moment and replays on its own (`gpu-watchdog replay`).
Lines the thread cannot keep up with are dropped and counted; a write that fails is counted and
said once; neither stops the sidecar. What is written comes from `watchdog.core.recording`: samples,
outcomes and decisions, never request text, a token or a secret.
"""

from __future__ import annotations

import json
import os
import queue
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

from gpu_watchdog import logs

log = logs.get("watchdog")

QUEUE_LINES = 10_000  # lines waiting for the thread; past that they are dropped (and counted)


class FlightRecorder:
    """Appends JSON lines to `path` from a thread of its own. `header` makes the `start` line of a
    new file (the history as it is then); it is called in the loop, before the file rotates."""

    def __init__(self, path: str, max_bytes: int, header: Callable[[], dict[str, Any]],
                 on_failure: Callable[[str], None] = lambda why: None) -> None:
        self.path = Path(path)
        self.max_bytes = max_bytes
        self.header = header
        self.on_failure = on_failure
        self.dropped = 0
        self.failed = 0
        self.written_bytes = 0
        self._size = 0
        self._header_size = 0  # the current file's start line: a file is never rotated before a line follows it
        self._queue: queue.Queue[bytes | None] = queue.Queue(maxsize=QUEUE_LINES)
        self._said: set[str] = set()
        self._fd: int | None = None
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="flight-recorder", daemon=True)
        self._thread.start()
        if self.path.exists():
            self._put(None)  # the last run's recording is kept as FILE.1, not overwritten
        self._start_file()

    def record(self, line: dict[str, Any]) -> None:
        """One line, queued; never blocks. Rotation is decided here, in the loop: the next file's
        header is the history as this line leaves it."""
        data = self._line(line)
        if self._size + len(data) > self.max_bytes // 2 and self._size > self._header_size:
            self._put(None)  # the thread rotates here, in order with the lines around it
            self._start_file()
        self._put(data)

    def _start_file(self) -> None:
        header = self._line(self.header())
        self._size = 0
        self._put(header)
        self._header_size = self._size

    def stop(self, timeout: float = 5.0) -> None:
        if self._thread is None:
            return
        try:
            self._queue.put(b"", timeout=timeout)  # the end: everything before it is written
        except queue.Full:
            pass
        self._thread.join(timeout)
        self._thread = None

    def status(self) -> dict[str, Any]:
        return {"path": str(self.path), "max_bytes": self.max_bytes, "written_bytes": self.written_bytes,
                "dropped_lines": self.dropped, "failed_writes": self.failed}

    # -- the loop's side --------------------------------------------------------------------------

    def _line(self, line: dict[str, Any]) -> bytes:
        return (json.dumps(line, separators=(",", ":"), default=str) + "\n").encode()

    def _put(self, data: bytes | None) -> None:
        try:
            self._queue.put_nowait(data)
        except queue.Full:
            self.dropped += 1
            self._failure("queue_full", "recorder_lines_dropped", queued=QUEUE_LINES,
                          action="the recording has a gap here; the sidecar goes on")
            return
        if data is not None:
            self._size += len(data)

    def _failure(self, why: str, event: str, **fields: Any) -> None:
        self.on_failure(why)
        if why not in self._said:  # said once per kind: a full disk must not flood the log
            self._said.add(why)
            log.warning(event, path=str(self.path), **fields)

    # -- the thread's side ------------------------------------------------------------------------

    def _run(self) -> None:
        while True:
            data = self._queue.get()
            if data == b"":
                break
            if data is None:
                self._rotate()
                continue
            self._write(data)
        self._close()

    def _open(self) -> int | None:
        if self._fd is None:
            try:
                self.path.parent.mkdir(parents=True, exist_ok=True)
                self._fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_APPEND, 0o600)
            except OSError as exc:
                self.failed += 1
                self._failure("open", "recorder_write_failed", error=exc.strerror,
                              action="nothing is recorded until it can be written")
        return self._fd

    def _write(self, data: bytes) -> None:
        fd = self._open()
        if fd is None:
            return
        try:
            os.write(fd, data)  # one line, one write: a reader never sees half of one but at a crash
            self.written_bytes += len(data)
        except OSError as exc:
            self.failed += 1
            self._failure("write", "recorder_write_failed", error=exc.strerror,
                          action="this line is lost; the sidecar goes on")

    def _rotate(self) -> None:
        self._close()
        try:
            os.replace(self.path, self.path.with_name(self.path.name + ".1"))
        except OSError as exc:
            if not isinstance(exc, FileNotFoundError):
                self.failed += 1
                self._failure("rotate", "recorder_write_failed", error=exc.strerror,
                              action="the file is started again in place")

    def _close(self) -> None:
        if self._fd is not None:
            try:
                os.close(self._fd)
            except OSError:
                pass
            self._fd = None
