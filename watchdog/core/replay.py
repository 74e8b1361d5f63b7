"""A flight recording folded through the same core the sidecar runs: its decisions again, or what it
would have decided with other settings.

The history is rebuilt from the recording's `start` line and every input after it, folded in order
by `state.reduce`; at each `tick` the core decides (`policy.decide` for the watched target,
`policy.other_workers` for the other workers) with the settings given, and what it decides is set
beside what the sidecar decided there. With the recording's own settings the two are the same,
tick for tick. With others, the inputs stay those of the recorded world: after the first
difference, what the servers did next is what they did after the sidecar's own decisions.

Pure: lines in, output lines out; `replay_cli` reads the files and prints.
"""

from __future__ import annotations

import datetime
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from gpu_watchdog.watchdog.core import policy, recording, state
from gpu_watchdog.watchdog.core.history import History
from gpu_watchdog.watchdog.core.names import FLEET_HOLDS
from gpu_watchdog.watchdog.core.recording import RecordingError
from gpu_watchdog.watchdog.core.report import Report
from gpu_watchdog.watchdog.core.samples import DecisionRecord, WorkerRestarted
from gpu_watchdog.watchdog.core.settings import Settings

DIFFS_KEPT = 20  # differences listed in the summary; all are counted


@dataclass
class Replay:
    """`settings_for`: the settings to decide with, given those the recording holds (the recording's
    own, or an operator's what-if)."""

    settings_for: Callable[[Mapping[str, Any]], Settings]
    history: History | None = None
    settings: Settings | None = None
    budget_from_events: bool = False
    mono: float = 0.0
    wall: float = 0.0
    ticks: int = 0
    decided: int = 0
    recorded: int = 0
    differing: int = 0
    diffs: list[dict[str, Any]] = field(default_factory=list)
    # `--summary`: what was decided, per reason and per pod, over every recording fed (None: not asked).
    report: Report | None = None
    _printed: dict[tuple[str, str, str, Any], dict[str, Any]] = field(default_factory=dict)
    _last_tick: dict[str, set[tuple[str, str, Any]]] = field(default_factory=dict)

    def feed(self, line: Any) -> list[dict[str, Any]]:
        """One line of the recording (parsed JSON); what to print for it."""
        if not isinstance(line, Mapping):
            raise RecordingError(f"expected a JSON object, got {type(line).__name__}")
        kind = line.get("kind")
        if kind == recording.START:
            return self._start(line)
        if self.history is None or self.settings is None:
            raise RecordingError("a recording begins with a start line")
        if kind == recording.INPUT:
            return self._input(line)
        if kind == recording.TICK:
            return self._tick(line)
        raise RecordingError(f"unknown line kind {kind!r}")

    def summary_report(self) -> dict[str, Any]:
        """The `--summary` report over everything fed (`watchdog.core.report`)."""
        assert self.report is not None
        if self.history is not None:
            self.report.seen(self.history)
        return self.report.as_json()

    def summary(self) -> dict[str, Any]:
        return {"kind": "summary", "ticks": self.ticks, "decisions": self.decided, "recorded_decisions": self.recorded,
                "identical": self.differing == 0, "differing_ticks": self.differing, "differences": self.diffs}

    # -- lines -------------------------------------------------------------------------------------

    def _start(self, line: Mapping[str, Any]) -> list[dict[str, Any]]:
        version = line.get("version")
        if not isinstance(version, int) or version > recording.VERSION:
            raise RecordingError(f"recorded by another release of gpu-watchdog (version {version!r}; this one"
                                 f" reads {recording.VERSION})")
        settings = line.get("settings")
        if not isinstance(settings, Mapping):
            raise RecordingError("start: settings: expected an object")
        mono, wall = line.get("mono"), line.get("wall")
        if not isinstance(mono, int | float) or not isinstance(wall, int | float):
            raise RecordingError("start: mono and wall: expected numbers")
        if self.report is not None and self.history is not None:
            self.report.seen(self.history)  # the recording before this one, as it ended
        self.settings = self.settings_for(settings)
        self.history = recording.decode_history(line.get("history"))
        if self.report is not None:
            self.report.start(self.history, self.settings.policy.enforce)
        self.budget_from_events = bool(line.get("budget_from_events"))
        self.mono, self.wall = float(mono), float(wall)
        self._printed.clear()
        self._last_tick.clear()
        return []

    def _input(self, line: Mapping[str, Any]) -> list[dict[str, Any]]:
        assert self.history is not None and self.settings is not None
        outcome = recording.decode_input(line.get("type"), line.get("v"))
        state.reduce(self.history, outcome, self.settings.policy.admission)
        out: list[dict[str, Any]] = []
        if isinstance(outcome, DecisionRecord) and self.report is not None:
            self.report.outcome(outcome.action, outcome.reason, outcome.outcome)
        if isinstance(outcome, DecisionRecord):
            # The sidecar's own word on what became of a decision: started, held, blocked, done, ...
            out.append({"kind": "outcome", "at": self._date(self.history.started_at + outcome.at),
                        "t": round(outcome.at, 3), "action": outcome.action, "reason": outcome.reason,
                        "outcome": outcome.outcome, **_held(outcome)})
        if isinstance(outcome, state.RestartEnded | state.RestartCancelled | WorkerRestarted):
            # A restart that ended opens a new episode: the next restart decided is a new one.
            self._printed = {k: v for k, v in self._printed.items() if k[1] != "restart"}
        return out

    def _tick(self, line: Mapping[str, Any]) -> list[dict[str, Any]]:
        assert self.history is not None and self.settings is not None
        now = line.get("now")
        if isinstance(now, bool) or not isinstance(now, int | float):
            raise RecordingError("tick: now: expected a number")
        core = line.get("core", recording.POD)
        if core == recording.POD:
            decisions = policy.decide(self.settings.policy, self.history, float(now), self.budget_from_events)
        elif core == recording.WORKERS:
            decisions = policy.other_workers(self.settings.policy, self.history, float(now), self.budget_from_events)
        else:
            raise RecordingError(f"tick: unknown core {core!r}")
        recorded = line.get("decisions", [])
        if not isinstance(recorded, list):
            raise RecordingError("tick: decisions: expected a list")
        replayed = [recording.decision_json(d) for d in decisions]
        self.ticks += 1
        self.recorded += len(recorded)
        if self.report is not None:
            self.report.at(self.wall + (float(now) - self.mono))
        t = round(float(now) - self.history.started_at, 3)
        if replayed != recorded:
            self.differing += 1
            if len(self.diffs) < DIFFS_KEPT:
                self.diffs.append({"at": self._date(float(now)), "t": t, "recorded": recorded, "replayed": replayed})
        return self._print(str(core), float(now), t, replayed, [recording.encode(d.detail) for d in decisions])

    def _print(self, core: str, now: float, t: float, replayed: list[dict[str, Any]],
               evidence: list[Any]) -> list[dict[str, Any]]:
        """A decision once per episode: a restart asked again while it is held, or reported blocked
        at every tick, is the same decision; a cache flush or an admission change is new each time
        it comes back after a tick without it."""
        out = []
        seen: set[tuple[str, str, Any]] = set()
        for d, why in zip(replayed, evidence, strict=True):
            key = (core, d["action"], d["reason"], d.get("worker"))
            seen.add(key[1:])
            again = key[1:] in self._last_tick.get(core, set())
            if d["action"] == "restart" and self._printed.get(key) == d:
                continue
            if d["action"] != "restart" and again:
                continue
            self._printed[key] = d
            self.decided += 1
            out.append({"kind": "decision", "at": self._date(now), "t": t, **d, "evidence": why})
        self._last_tick[core] = seen
        return out

    def _date(self, mono: float) -> str:
        return iso(self.wall + (mono - self.mono))


def iso(wall: float) -> str:
    """A wall-clock time as the replay writes it: UTC, to the millisecond."""
    at = datetime.datetime.fromtimestamp(wall, tz=datetime.UTC)
    return at.strftime("%Y-%m-%dT%H:%M:%S.") + f"{at.microsecond // 1000:03d}Z"


def _held(record: DecisionRecord) -> dict[str, Any]:
    """What held a restart: the fleet's ledger, by why (a budget's block is on the decision itself)."""
    return {"held": record.outcome} if record.outcome in FLEET_HOLDS else {}
