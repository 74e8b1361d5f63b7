"""When the workload's ledger is told that our pod goes (`DrainHandle.before_act`): before the first
eviction, and again only after the API refused one. An attempt whose answer was lost may have
evicted the pod, so its replacement is created from then on and the mark must stay where it was."""

from __future__ import annotations

from typing import Any

from gpu_watchdog.watchdog.core.names import HANG
from gpu_watchdog.watchdog.core.policy import Decision
from gpu_watchdog.watchdog.core.settings import RestartSettings
from gpu_watchdog.watchdog.edge.effects.restart import KubeRestarter
from gpu_watchdog.watchdog.edge.kube.kube_api import ApiError


class Pod:
    """Our pod's API: the dry runs pass; the real evictions answer `answers` in turn."""

    pod_name, namespace = "llm-0", "serving"

    def __init__(self, answers: list[BaseException | None]) -> None:
        self.answers = answers
        self.evictions = 0

    def evict(self, name: str, namespace: str, grace: int | None, dry_run: bool = False) -> None:
        if dry_run:
            return
        self.evictions += 1
        answer = self.answers.pop(0)
        if answer is not None:
            raise answer

    def record_event(self, *args: Any, **kwargs: Any) -> None:
        return None


class Drain:
    def __init__(self, ledger_ok: list[bool] | None = None) -> None:
        self.marks: list[float] = []
        self.ledger_ok = ledger_ok or []

    async def begin(self) -> None:
        return None

    async def lift(self, why: str) -> None:
        return None

    async def before_act(self, at: float) -> None:
        # The executor's: a ledger that cannot be told is said, and the act goes on.
        if not self.ledger_ok or self.ledger_ok.pop(0):
            self.marks.append(at)


async def restart(answers: list[BaseException | None], drain: Drain) -> tuple[Any, Pod]:
    clock = iter(float(t) for t in range(100, 200, 10))
    pod = Pod(answers)
    restarter = KubeRestarter(pod, RestartSettings(retry_initial=0.001, retry_max=0.001, max_attempts=5),  # type: ignore[arg-type]
                              wall_clock=lambda: next(clock))
    return await restarter.restart(Decision("restart", HANG, {}), drain), pod


async def test_a_lost_answer_keeps_the_mark_a_refusal_moves_it() -> None:
    drain = Drain()
    outcome, pod = await restart([TimeoutError("read timed out"), None], drain)
    assert outcome.done and pod.evictions == 2
    assert drain.marks == [100.0]  # the first try may have evicted it: its mark stands
    drain = Drain()
    outcome, pod = await restart([ApiError(429, "Too Many Requests", "disruption budget"), None], drain)
    assert outcome.done and drain.marks == [100.0, 110.0]  # refused: nothing went, the mark follows the next try
    drain = Drain()
    outcome, pod = await restart([ApiError(503, "Service Unavailable", ""), None], drain)
    assert outcome.done and drain.marks == [100.0]  # the server's own failure may have acted


async def test_a_ledger_that_cannot_be_told_never_holds_the_eviction_and_a_pod_gone_already_says_so() -> None:
    drain = Drain(ledger_ok=[False])
    outcome, pod = await restart([None], drain)
    assert outcome.done and pod.evictions == 1 and drain.marks == []
    drain = Drain()
    outcome, _ = await restart([ApiError(404, "Not Found", "")], drain)
    assert outcome.done and outcome.gone
