"""Answers checked, the edge: ask the probes, agree a reference with the fleet through the workload's
Lease, fold each comparison in, and have the core decide (`policy` holds the `corrupt` rule).

Once per server process, after it first serves, every probe of the set is asked and the answers are
this card's vote for the reference (`correctness.submit`, a compare-and-swap on the Lease). After
that, one informative probe every `every` canary intervals is compared with the agreed reference.
Without an agreed reference nothing is compared and nothing is acted on; it is said once.
"""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import Awaitable, Callable
from typing import Any

from gpu_watchdog import logs
from gpu_watchdog.watchdog.core import correctness, policy
from gpu_watchdog.watchdog.core.edges import CorrectnessSeen
from gpu_watchdog.watchdog.core.history import History
from gpu_watchdog.watchdog.core.samples import ProbeSample
from gpu_watchdog.watchdog.core.settings import Settings
from gpu_watchdog.watchdog.core.state import Outcome
from gpu_watchdog.watchdog.edge.metrics import WatchdogMetrics
from gpu_watchdog.watchdog.edge.samplers.probe import ProbeAnswer, Prober

log = logs.get("watchdog.correctness")


class LocalRecords:
    """The records where there is no Lease (`gpu-watchdog up`, no Kubernetes API): this card alone,
    which never makes a quorum, so nothing is ever acted on; the answers are still shown."""

    def __init__(self, wall_clock: Callable[[], float]) -> None:
        self.records = correctness.Records()
        self.wall_clock = wall_clock

    def read_correctness(self) -> correctness.Records:
        return self.records

    def update_correctness(self, decide: Callable[[correctness.Records, float], tuple[correctness.Records, Any]]
                           ) -> Any:
        self.records, result = decide(self.records, self.wall_clock())
        return result


class AnswerCheck:
    def __init__(self, *, settings: Settings, prober: Prober, ledger: Any, metrics: WatchdogMetrics,
                 history: Callable[[], History], fold: Callable[[Outcome], None],
                 evaluate: Callable[[], Awaitable[None]], clock: Callable[[], float],
                 wall_clock: Callable[[], float], template: Callable[[], Awaitable[str | None]], pod: str,
                 node: str | None, device_reported: bool = False) -> None:
        self.settings = settings
        self.c = settings.policy.correctness
        self.prober = prober
        self.ledger = ledger if ledger is not None else LocalRecords(wall_clock)
        self.metrics = metrics
        self.history = history
        self.fold = fold
        self.evaluate = evaluate
        self.clock = clock
        self.template = template
        self.pod = pod
        self.node = node
        # The server's memory report names its device: no vote before it has (the key would change).
        self.device_reported = device_reported
        self.prompts = {correctness.probe_id(p): p for p in (self.c.prompts or correctness.PROMPTS)}
        self._voted: tuple[str | None, str] | None = None  # (the server process, the key) our vote is for
        self._reference: correctness.Reference | None = None
        self._key: str | None = None
        self._next = 0
        self._said: str | None = None
        self._nonfinite: float | None = None  # the engine's count of failed non-finite steps, as last read

    def interval(self) -> float:
        return self.settings.canary.interval * self.c.every

    async def round(self) -> None:
        h = self.history()
        if h.served_at is None or h.restart_in_progress:
            return  # a server that has not served yet, or is going: its answers say nothing
        device = _device_class(h)
        if device is None and self.device_reported:
            return  # its device not read yet: a reference agreed now would be under a key about to change
        key = correctness.reference_key(await self.prober.model(), device, await self.template())
        if key != self._key:
            self._key, self._reference, self._voted = key, None, None
        instance = _instance(h)
        voted = self._voted != (instance, key)
        if voted:
            await self._vote(h, key, instance)  # its answers compared at once where a reference stands
        elif self._reference is None:
            await self._look(key)
        if self._reference is not None and not voted:  # the next probe, decided on after each round
            self._engine_nonfinite(h, instance)
            await self._compare_next()
        await self.evaluate()

    def _engine_nonfinite(self, h: History, instance: str | None) -> None:
        """Steps the engine failed for non-finite logits since the last round (its metrics page): evidence
        like a probe's, once a reference is agreed (the count starts again with a new process)."""
        counts = [s.nonfinite for s in h.server_since_epoch() if s.nonfinite is not None]
        if not counts:
            return
        seen, self._nonfinite = self._nonfinite, counts[-1]
        if seen is not None and counts[-1] > seen:
            self._record(correctness.NONFINITE, {"evidence": "engine", "steps": counts[-1] - seen}, instance)

    def _card(self, h: History) -> str:
        gpus = policy.our_gpus(h)
        return gpus[0] if gpus else self.node or self.pod

    async def _vote(self, h: History, key: str, instance: str | None) -> None:
        """Every probe asked; a complete set of finite answers is this card's vote. Answers that an
        agreed reference already exists for are compared at once (a replacement checked at start)."""
        if self._reference is None:
            await self._look(key, quiet=True)  # a fleet that agreed before us: our answers are compared at once
        answers: list[correctness.Answer] = []
        for pid, prompt in self.prompts.items():
            got = await self._ask(prompt)
            if got.answer is None:
                self._record(correctness.NONFINITE if got.nonfinite and self._reference is not None
                             else correctness.UNANSWERED, {"probe": pid, "error": got.error}, got.instance_id)
                return  # asked again next round: a card that answers NaN has no vote
            answers.append(got.answer)
        sub = correctness.Submission(self._card(h), self.pod, 0.0, tuple(answers))

        def decide(rec: correctness.Records, at: float) -> tuple[correctness.Records, correctness.Agreement]:
            return correctness.submit(self.c, rec, key, dataclasses.replace(sub, at=at), at)

        try:
            agreement = await asyncio.to_thread(self.ledger.update_correctness, decide)
        except Exception as exc:  # an API that refuses: the vote is cast again next round
            self._say("unreadable", "correctness_records_unavailable", error=str(exc)[:300])
            return
        self._voted = (instance, key)
        log.info("correctness_voted", key=key, card=sub.card, probes=len(answers),
                 agreed=agreement.reference is not None, why=agreement.why, cards=agreement.cards,
                 agreeing=agreement.agreeing)
        self._agreed(agreement)
        if self._reference is not None:
            for answer in answers:
                ref = self._reference.answer(answer.probe)
                if ref is not None and answer.probe in correctness.informative(self.c, self._reference):
                    self._compared(correctness.compare(self.c, ref, answer), instance)

    async def _look(self, key: str, quiet: bool = False) -> None:
        """The agreement as the records stand (`quiet`: only taken where there is one)."""
        try:
            records = await asyncio.to_thread(self.ledger.read_correctness)
        except Exception as exc:
            if not quiet:
                self._say("unreadable", "correctness_records_unavailable", error=str(exc)[:300])
            return
        agreement = correctness.agree(self.c, records.entry(key), 0.0)
        if not quiet or agreement.reference is not None:
            self._agreed(agreement)

    def _agreed(self, agreement: correctness.Agreement) -> None:
        self._reference = agreement.reference
        seen = {**correctness.describe(agreement), "key": self._key}
        if seen != self.history().edge.correctness:
            self.fold(CorrectnessSeen(seen))
        self.metrics.correctness_reference.set(1 if agreement.reference is not None else 0)
        if agreement.reference is None:
            self._record(correctness.NO_REFERENCE, {"why": agreement.why}, _instance(self.history()))
            self._say("no_reference:" + agreement.why, "correctness_no_reference", why=agreement.why,
                      cards=agreement.cards, action="nothing compared, nothing acted on")
        else:
            self._say("agreed", "correctness_reference", cards=list(agreement.reference.cards), reference=self._key,
                      probes=len(correctness.informative(self.c, agreement.reference)))

    async def _compare_next(self) -> None:
        ref = self._reference
        assert ref is not None
        asked = correctness.informative(self.c, ref)
        if not asked:
            self._say("uninformative", "correctness_no_informative_probe", margin=self.c.margin,
                      action="no probe's first token leads by the margin: nothing compared")
            return
        pid = asked[self._next % len(asked)]
        self._next += 1
        got = await self._ask(self.prompts.get(pid, ""))
        if got.answer is None:
            result = correctness.NONFINITE if got.nonfinite else correctness.UNANSWERED
            self._record(result, {"probe": pid, "error": got.error}, got.instance_id)
            return
        expected = ref.answer(pid)
        assert expected is not None
        self._compared(correctness.compare(self.c, expected, got.answer), got.instance_id)

    async def _ask(self, prompt: str) -> ProbeAnswer:
        if not prompt:
            return ProbeAnswer(None, "a probe of the reference that this sidecar's probe set does not hold")
        return await self.prober.ask(prompt, self.c.tokens, self.c.top_logprobs)

    def _compared(self, comparison: correctness.Comparison, instance: str | None) -> None:
        if comparison.deviation:
            log.warning("correctness_deviation", result=comparison.result, **dict(comparison.detail))
        self._record(comparison.result, dict(comparison.detail), instance)

    def _record(self, result: str, detail: dict[str, Any], instance: str | None) -> None:
        self.metrics.correctness_probes.labels(result=result).inc()
        self.fold(ProbeSample(self.clock(), result, detail, instance))

    def _say(self, key: str, event: str, **fields: Any) -> None:
        if self._said != key:
            self._said = key
            log.info(event, **fields)


def _instance(h: History) -> str | None:
    for c in reversed(h.canaries):
        if c.instance_id is not None:
            return c.instance_id
    return None


def _device_class(h: History) -> str | None:
    """The card's class as NVML names it (with its driver), else as the server's memory report does."""
    gpu = next((f"{g.name} driver {g.driver}" if g.driver else g.name for g in h.gpus if g.available and g.name), None)
    return gpu or next((t.device for t in reversed(h.torch) if t.reachable), None)
