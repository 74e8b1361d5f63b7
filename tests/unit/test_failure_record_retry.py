"""A failure whose record the workload's Lease refuses is tried again after a while, not at every
evaluation: a restart the budget blocks is decided again several times a second."""

from __future__ import annotations

from typing import Any

from gpu_watchdog.watchdog.core.names import CONTEXT_LOSS
from gpu_watchdog.watchdog.core.policy import Decision
from gpu_watchdog.watchdog.edge import executor as executor_module
from gpu_watchdog.watchdog.edge.config import from_mapping
from gpu_watchdog.watchdog.edge.executor import Executor
from gpu_watchdog.watchdog.edge.metrics import WatchdogMetrics
from tests.traces import Trace


class Control:
    async def requests(self, timeout: float = 3.0, evidence: bool = False) -> dict[str, Any]:
        assert evidence  # the restart's read takes the failure's evidence
        return {"instance_id": "p1", "inflight": ["aaaaaaaaaaaaaaaa"], "newest": "aaaaaaaaaaaaaaaa", "completed": []}


class RefusingLedger:
    name = "gpu-watchdog-demo"

    def __init__(self) -> None:
        self.writes = 0

    def update_records(self, decide: Any) -> Any:
        self.writes += 1
        raise RuntimeError("409 Conflict (three times)")


class Restarter:
    strategy = "evict"


async def test_a_refused_record_is_tried_again_after_a_while_not_at_every_evaluation() -> None:
    now = [100.0]
    ledger = RefusingLedger()
    settings = from_mapping({"restart": {"strategy": "none"}, "kubernetes": {"pod_name": "demo-abc-12345"}})
    trace = Trace(settings)
    ex = Executor(settings=settings, restarter=Restarter(), metrics=WatchdogMetrics(lambda: None),  # type: ignore[arg-type]
                  clock=lambda: now[0], wall_clock=lambda: 1_800_000_000.0 + now[0],
                  control=Control(), history=lambda: trace.history, fold=trace.fold,  # type: ignore[arg-type]
                  workload="demo", ledger=ledger)  # type: ignore[arg-type]
    decision = Decision("restart", CONTEXT_LOSS, {}, drain=False, allowed=False, blocked_by="restart_budget",
                        instance_id="p1")
    assert await ex.record_failure(decision) == ("aaaaaaaaaaaaaaaa",)
    assert ledger.writes == 1
    for _ in range(10):  # decided again at every evaluation while the budget blocks it
        now[0] += 0.5
        await ex.record_failure(decision)
    assert ledger.writes == 1
    now[0] += executor_module.RECORD_RETRY_S
    await ex.record_failure(decision)
    assert ledger.writes == 2 and trace.history.edge.records_error is not None
