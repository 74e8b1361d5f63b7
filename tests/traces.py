"""Histories built by folding, as the sidecar builds them: inputs go through `state.reduce`, the core
decides at each tick, and what it saw is written as a flight recording would hold it.

    trace = Trace(Settings())
    trace.fold(CanarySample(...))
    trace.tick(31.0)          # the decisions the core took there
    trace.lines               # the recording: a start line, then every input and tick
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable
from typing import Any

from gpu_watchdog.watchdog.core import policy, recording, state
from gpu_watchdog.watchdog.core.history import History
from gpu_watchdog.watchdog.core.policy import Decision
from gpu_watchdog.watchdog.core.settings import Settings


class Trace:
    def __init__(self, settings: Settings, *, started_at: float = 0.0, budget_from_events: bool = False,
                 wall: float = 1_800_000_000.0, **history: Any) -> None:
        self.settings = settings
        self.budget_from_events = budget_from_events
        self.history = History(started_at=started_at, epoch=started_at, **history)
        self.lines: list[dict[str, Any]] = [recording.start_line(
            recording.settings_json(settings), self.history, budget_from_events, started_at, wall)]
        self.decided: list[tuple[float, Decision]] = []

    def fold(self, *outcomes: state.Outcome) -> Trace:
        for outcome in outcomes:
            self.lines.append(recording.input_line(outcome))
            state.reduce(self.history, outcome, self.settings.policy.admission)
        return self

    def tick(self, now: float, core: str = recording.POD) -> list[Decision]:
        if core == recording.POD:
            decisions = policy.decide(self.settings.policy, self.history, now, self.budget_from_events)
        else:
            decisions = policy.other_workers(self.settings.policy, self.history, now, self.budget_from_events)
        self.lines.append(recording.tick_line(now, decisions, core))
        self.decided.extend((now, d) for d in decisions)
        return decisions

    def run(self, steps: Iterable[tuple[float, state.Outcome | None]]) -> Trace:
        """(time, input) pairs: each input folded, then a tick at its time, as the loop evaluates
        after every sample (None: a tick alone)."""
        for at, outcome in steps:
            if outcome is not None:
                self.fold(outcome)
            self.tick(at)
        return self


def with_policy(settings: Settings, **changes: Any) -> Settings:
    """`settings` with sections of its policy replaced: with_policy(s, hang=HangSettings(...))."""
    return dataclasses.replace(settings, policy=dataclasses.replace(settings.policy, **changes))
