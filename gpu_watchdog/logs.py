"""Structured logging shared by both processes: JSON lines unless stdout is a terminal.

Each line leaves in one `write(2)` of its own, unbuffered: processes that share a stdout (the
workers of one server, a pre-fork server's children) never interleave inside a line, and a
process that ends by `os._exit` (a poisoned context) has lost nothing it logged. A line that
names its worker and GPU says so in every line (`GPU_WATCHDOG_WORKER`, `CUDA_VISIBLE_DEVICES`).
"""

from __future__ import annotations

import io
import logging
import os
import sys
import threading
from collections.abc import MutableMapping
from typing import Any, TextIO

import structlog


def configure(component: str, level: str = "info", force_json: bool | None = None, stream: TextIO | None = None
              ) -> None:
    """Send every log line to stdout (`stream`: elsewhere, for a command whose stdout is its answer):
    JSON when piped (kubectl logs, CI), coloured on a TTY."""
    out = stream or sys.stdout
    as_json = (not out.isatty()) if force_json is None else force_json
    renderer: Any = structlog.processors.JSONRenderer() if as_json else structlog.dev.ConsoleRenderer()
    where = placement()

    def add_component(_: Any, __: str, event: MutableMapping[str, Any]) -> MutableMapping[str, Any]:
        # Not a contextvar: callbacks scheduled from worker threads run without this context.
        event.setdefault("component", component)
        for key, value in where.items():
            event.setdefault(key, value)
        return event

    structlog.configure(
        processors=[
            structlog.contextvars.merge_contextvars,
            add_component,
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="iso", utc=True),
            structlog.processors.format_exc_info,
            renderer,
        ],
        wrapper_class=structlog.make_filtering_bound_logger(logging.getLevelNamesMapping()[level.upper()]),
        logger_factory=lambda *_: WholeLines(out),
        cache_logger_on_first_use=False,
    )
    # Library loggers (aiohttp access log, kubernetes client) would print unstructured text;
    # keep their warnings, routed through the same stream.
    logging.basicConfig(stream=sys.stdout, level=logging.WARNING, format="%(name)s %(levelname)s %(message)s")
    logging.getLogger("aiohttp.access").setLevel(logging.ERROR)


def get(name: str) -> Any:
    # Initial values stay lazy: binding here would freeze the configuration before configure() runs.
    return structlog.get_logger(logger_name=name)


def placement() -> dict[str, str]:
    """The worker and the GPU this process runs as, where it was started as one of several."""
    named = {"worker": os.environ.get("GPU_WATCHDOG_WORKER"), "gpu": os.environ.get("CUDA_VISIBLE_DEVICES")}
    return {key: value for key, value in named.items() if value}


class WholeLines:
    """structlog's logger: one rendered line, one `write(2)`; a stream without a descriptor (a
    test's capture) gets an ordinary write and flush."""

    _lock = threading.Lock()

    def __init__(self, stream: TextIO) -> None:
        self._stream = stream

    def msg(self, message: str) -> None:
        data = (message + "\n").encode("utf-8", "replace")
        with self._lock:
            try:
                fd = self._stream.fileno()
            except (AttributeError, OSError, io.UnsupportedOperation, ValueError):
                self._stream.write(message + "\n")
                self._stream.flush()
                return
            self._stream.flush()  # anything printed through the buffer goes first, in order
            view = memoryview(data)
            while view:  # a blocking write may still be partial (a signal); the rest follows at once
                view = view[os.write(fd, view):]

    log = debug = info = warning = warn = error = critical = exception = failure = fatal = msg
