"""Parsing of human durations (`30s`, `10m`, `24h`) and sizes (`512MiB`, `24GiB`)."""

from __future__ import annotations

import argparse
import re

_DURATION = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*(ms|s|m|h|d)?\s*$")
_DURATION_UNITS = {"ms": 0.001, "s": 1.0, "m": 60.0, "h": 3600.0, "d": 86400.0}
_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([KMGT]i?B|B)?\s*$", re.IGNORECASE)
_SIZE_UNITS = {
    "b": 1,
    "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
    "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40,
}


def parse_duration(value: object) -> float:
    """Seconds from `30s`/`10m`/`24h`/`250ms` or a bare number of seconds."""
    if isinstance(value, bool):
        raise ValueError(f"expected a duration like 30s, got {value!r}")
    if isinstance(value, int | float):
        return float(value)
    if not isinstance(value, str):
        raise ValueError(f"expected a duration like 30s, got {value!r}")
    m = _DURATION.match(value)
    if not m:
        raise ValueError(f"expected a duration like 30s, 10m or 24h, got {value!r}")
    return float(m.group(1)) * _DURATION_UNITS[m.group(2) or "s"]


def parse_size(value: object) -> int:
    """Bytes from `512MiB`/`24GiB`/`1GB` or a bare number of bytes."""
    if isinstance(value, bool):
        raise ValueError(f"expected a size like 512MiB, got {value!r}")
    if isinstance(value, int | float):
        return int(value)
    if not isinstance(value, str):
        raise ValueError(f"expected a size like 512MiB, got {value!r}")
    m = _SIZE.match(value)
    if not m:
        raise ValueError(f"expected a size like 512MiB or 24GiB, got {value!r}")
    return int(float(m.group(1)) * _SIZE_UNITS[(m.group(2) or "B").lower()])


def parse_ratio(value: object) -> float:
    """A ratio 0..1 from `0.12` or `12%`."""
    if isinstance(value, str) and value.strip().endswith("%"):
        value = float(value.strip()[:-1]) / 100.0
    if isinstance(value, bool) or not isinstance(value, int | float | str):
        raise ValueError(f"expected a ratio like 0.12 or 12%, got {value!r}")
    try:
        r = float(value)
    except ValueError as exc:
        raise ValueError(f"expected a ratio like 0.12 or 12%, got {value!r}") from exc
    if not 0.0 <= r <= 1.0:
        raise ValueError(f"ratio must be between 0 and 1, got {r}")
    return r


def parse_share(value: object) -> str:
    """A count of replicas (`2`) or a share of them (`25%`), kept as written: its meaning needs the
    replica count, known only while running (`fleet.unavailable_slots`)."""
    if isinstance(value, bool):
        raise ValueError(f"expected a count like 2 or a percentage like 25%, got {value!r}")
    if isinstance(value, int):
        if value < 1:
            raise ValueError(f"must be at least 1, got {value}")
        return str(value)
    if isinstance(value, str):
        m = re.match(r"^\s*(\d+(?:\.\d+)?)\s*%\s*$", value)
        if m and 0 < float(m.group(1)) <= 100:
            return f"{float(m.group(1)):g}%"
        if re.match(r"^\s*\d+\s*$", value) and int(value) >= 1:
            return str(int(value))
    raise ValueError(f"expected a count like 2 or a percentage like 25% (above 0, at most 100%), got {value!r}")


def format_bytes(n: float) -> str:
    for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(n) >= size:
            return f"{n / size:.2f} {unit}"
    return f"{int(n)} B"


def positive_int(value: str) -> int:
    """An argparse type: a whole number of at least one."""
    try:
        n = int(value)
    except ValueError:
        raise argparse.ArgumentTypeError("must be a positive integer") from None
    if n < 1:
        raise argparse.ArgumentTypeError("must be a positive integer")
    return n
