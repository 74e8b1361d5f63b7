"""Where the kept recordings lie (tests/fixtures/recordings/) and the decisions a replay printed, read
the same way by the replay command's tests and the kept recordings' regression tests."""

from __future__ import annotations

from pathlib import Path
from typing import Any

FIXTURES = Path(__file__).resolve().parent.parent / "fixtures" / "recordings"


def decisions(printed: list[dict[str, Any]]) -> list[tuple[str, str]]:
    return [(p["action"], p["reason"]) for p in printed if p["kind"] == "decision"]
