"""What the executor says about restarts it could not record: an episode, said once and over when
no restart is wanted any more."""

from __future__ import annotations

from typing import Any

from gpu_watchdog.watchdog.core.names import HANG
from gpu_watchdog.watchdog.core.policy import Decision
from gpu_watchdog.watchdog.core.timing import NOT_RECORDED_HOLD_S
from gpu_watchdog.watchdog.edge.config import from_mapping
from gpu_watchdog.watchdog.edge.effects.restart import NOT_RECORDED, DrainHandle, RestartOutcome
from gpu_watchdog.watchdog.edge.executor import Executor
from gpu_watchdog.watchdog.edge.metrics import WatchdogMetrics
from tests.traces import Trace


class Scripted:
    """Answers each restart with the next outcome of its script."""

    strategy = "evict"

    def __init__(self, *outcomes: RestartOutcome) -> None:
        self.outcomes = list(outcomes)

    async def restart(self, decision: Decision, drain: DrainHandle) -> RestartOutcome:
        return self.outcomes.pop(0)


def executor(restarter: Scripted, now: list[float]) -> Executor:
    settings = from_mapping({"target": {"openai_url": "http://127.0.0.1:9", "metrics_url": None},
                             "kubernetes": {"pod_name": "model-0", "namespace": "serving"}})
    trace = Trace(settings)
    return Executor(settings=settings, restarter=restarter, metrics=WatchdogMetrics(lambda: None),  # type: ignore[arg-type]
                    clock=lambda: now[0], wall_clock=lambda: 1e9 + now[0], control=None,
                    history=lambda: trace.history, fold=trace.fold, workload="model")


REFUSED = RestartOutcome(False, f"{NOT_RECORDED}: HTTP 403 Forbidden", not_recorded=True)
DECISION = Decision("restart", HANG, {})


async def test_not_recorded_is_an_episode_over_when_an_event_is_written(capsys: Any) -> None:
    now = [100.0]
    ex = executor(Scripted(REFUSED, REFUSED, RestartOutcome(False, "gave up: 429"),
                           RestartOutcome(True, "evict accepted", recorded=True)), now)
    outcomes = []
    for _ in range(4):
        ended, record = await ex.restart(DECISION, ex.fold)
        ex.fold(ended)  # as the restart procedure folds it
        outcomes.append((record, ex.not_recorded_now() is not None))
        now[0] += 60
    # Refused twice (one episode); a try that never reached the Event (a disruption budget's
    # 429s) says nothing about it; a written Event ends it.
    assert outcomes == [("not_recorded", True), ("not_recorded", True), ("failed", True), ("done", False)]
    out = capsys.readouterr().out
    assert out.count(NOT_RECORDED + " ") == 1 and out.count("restart_recorded_again") == 1


async def test_not_recorded_ends_when_no_restart_is_wanted_any_more() -> None:
    now = [0.0]
    ex = executor(Scripted(REFUSED), now)
    ended, _ = await ex.restart(DECISION, ex.fold)
    ex.fold(ended)
    now[0] = NOT_RECORDED_HOLD_S - 1
    assert ex.not_recorded_now() is not None
    now[0] = NOT_RECORDED_HOLD_S + 1  # no attempt for longer than the longest backoff allows
    assert ex.not_recorded_now() is None
