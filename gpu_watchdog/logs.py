"""Structured logging shared by both processes: JSON lines unless stdout is a terminal."""

from __future__ import annotations

import logging
import sys
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
    def add_component(_: Any, __: str, event: MutableMapping[str, Any]) -> MutableMapping[str, Any]:
        # Not a contextvar: callbacks scheduled from worker threads run without this context.
        event.setdefault("component", component)
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
        logger_factory=structlog.PrintLoggerFactory(file=out),
        cache_logger_on_first_use=False,
    )
    # Library loggers (aiohttp access log, kubernetes client) would print unstructured text;
    # keep their warnings, routed through the same stream.
    logging.basicConfig(stream=sys.stdout, level=logging.WARNING, format="%(name)s %(levelname)s %(message)s")
    logging.getLogger("aiohttp.access").setLevel(logging.ERROR)


def get(name: str) -> Any:
    # Initial values stay lazy: binding here would freeze the configuration before configure() runs.
    return structlog.get_logger(logger_name=name)
