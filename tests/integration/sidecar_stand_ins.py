"""Stand-ins for the sidecar's edges (NVML, the restarter, the drain), so that the real `Watchdog` runs
in a test with no GPU and no cluster, and a test reads back what it was asked to do. Shared because
many tests need the same absent driver or the same restarter that only records."""

from __future__ import annotations

from typing import Any

from gpu_watchdog.watchdog.core.policy import Decision
from gpu_watchdog.watchdog.edge.effects.restart import DrainHandle, RestartOutcome
from gpu_watchdog.watchdog.edge.samplers.nvml import NvmlUnavailable


class NoNvml:
    """No driver here: the hardware edge reports itself unavailable."""

    def open(self) -> None:
        raise NvmlUnavailable("NVML Shared Library Not Found")

    def uuids(self) -> list[str]:
        return []

    def read(self, uuid: str) -> Any:
        raise AssertionError("never read")

    def wait_xid(self, timeout_ms: int) -> list[tuple[str | None, int]]:
        return []

    def recovery_action(self, uuid: str) -> int | None:
        raise AssertionError("never read")

    def close(self) -> None:
        return None


class Restarter:
    strategy = "local"

    def __init__(self, done: bool) -> None:
        self.done = done
        self.calls: list[str] = []

    async def restart(self, decision: Decision, drain: DrainHandle) -> RestartOutcome:
        self.calls.append(decision.reason)
        return RestartOutcome(self.done, "done" if self.done else "refused")

    async def target_served(self, at_wall: float) -> None:
        return None

    async def record_event(self, decision: Decision, action: str, prefix: str = "") -> str | None:
        return None  # no cluster


class RecordingRestarter:
    strategy = "none"

    def __init__(self) -> None:
        self.calls: list[Decision] = []

    async def restart(self, decision: Decision, drain: DrainHandle) -> RestartOutcome:
        self.calls.append(decision)
        return RestartOutcome(False, "recorded")

    async def target_served(self, at_wall: float) -> None:
        return None

    async def record_event(self, decision: Decision, action: str, prefix: str = "") -> str | None:
        return None  # no cluster


class RecordingDrain:
    """The drain's calls, in order (the restarter owns when; the executor owns how)."""

    def __init__(self) -> None:
        self.calls: list[str] = []

    async def begin(self) -> None:
        self.calls.append("begin")

    async def lift(self, why: str) -> None:
        self.calls.append(f"lift:{why}")

    async def before_act(self, at: float) -> None:
        return None
