"""Answers checked: the fleet's reference answer to a probe set, and how one answer is compared to it.

Pure: probe answers and the workload's records in, a comparison, an agreement or new records out. No
I/O, no clock of its own (times are wall-clock seconds, since the records are shared by every pod of
the workload, in an annotation of its Lease beside the fleet's ledger).

- A probe is a fixed prompt answered greedily for a few tokens, with each step's best log-probabilities.
  A step's token is compared only where the reference's margin over the runner-up is wide
  (`margin`): batching, kernels and cards that differ in the last bits do not flip those. Its
  log-probability is compared within `tolerance`; a non-finite one is always a deviation. After a
  step whose token may legitimately differ (a narrow margin), nothing further is compared: the
  continuation is another text.
- The reference is per model, per device class (the GPU's name) and per pod template (a rollout, new
  weights, starts a new one). It is the replicas' agreement, never the first answer: each card's
  latest answers are one vote, and a reference is agreed when at least `quorum` cards answer alike
  and they are more than half of the cards that answered. Once agreed it is kept as it was agreed,
  so a fleet that later turns bad cannot vote it away. A card corrupt from its first answer is in the
  minority; two cards that disagree agree on nothing, and nothing is acted on.
"""

from __future__ import annotations

import hashlib
import json
import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, replace
from typing import Any

from gpu_watchdog.watchdog.core.settings import CorrectnessSettings

ANNOTATION = "gpu-watchdog.io/correctness"  # on the workload's Lease, beside the fleet's ledger
VERSION = 1
SUBMISSIONS_KEPT = 32  # per reference key: the newest cards' answers
KEYS_KEPT = 8  # reference keys (model x device class x template): older ones are past rollouts

# The comparison's results (`gpu_watchdog_correctness_probes_total{result}`).
MATCH = "match"
TOKEN = "token"  # a different greedy token where the reference's margin was wide
LOGPROB = "logprob"  # a log-probability off by more than the tolerance
NONFINITE = "nonfinite"  # a NaN or infinite log-probability, or the server failed the step for one
NO_REFERENCE = "no_reference"  # the fleet has not agreed on a reference: nothing compared
UNANSWERED = "unanswered"  # no answer to compare (a timeout, an error, an answer that is not a probe's)
DEVIATIONS = (TOKEN, LOGPROB, NONFINITE)
RESULTS = (MATCH, *DEVIATIONS, NO_REFERENCE, UNANSWERED)

# Our own probe set: short prompts of plain text. Which of them are informative (a wide first margin)
# is the agreed reference's to say, for the model at hand.
PROMPTS = (
    "The capital of France is",
    "1, 2, 3, 4, 5,",
    "Monday, Tuesday, Wednesday,",
    "the quick brown fox jumps over the",
    "A B C D E F G",
    "To be or not to be, that is the",
    "January, February, March,",
    "Hello, world! Hello, world! Hello,",
)


class RecordsError(ValueError):
    """The Lease's correctness annotation is not ours."""


@dataclass(frozen=True)
class Step:
    """One generated token: its id (or text), its log-probability, and its lead over the runner-up
    (None where the server gave no log-probabilities: the greedy tokens alone are compared)."""

    token: str
    logprob: float | None = None
    margin: float | None = None


@dataclass(frozen=True)
class Answer:
    probe: str  # the probe's id (`probe_id`): records never hold a prompt's text
    steps: tuple[Step, ...]


@dataclass(frozen=True)
class Submission:
    """One card's answers to the probe set (`card`: the GPU's UUID, else the node, else the pod)."""

    card: str
    pod: str
    at: float
    answers: tuple[Answer, ...]

    def answer(self, probe: str) -> Answer | None:
        return next((a for a in self.answers if a.probe == probe), None)


@dataclass(frozen=True)
class Reference:
    """An agreed reference: the answers, the cards that agreed, and when."""

    answers: tuple[Answer, ...]
    cards: tuple[str, ...]
    at: float

    def answer(self, probe: str) -> Answer | None:
        return next((a for a in self.answers if a.probe == probe), None)


@dataclass(frozen=True)
class Entry:
    key: str
    submissions: tuple[Submission, ...] = ()
    reference: Reference | None = None


@dataclass(frozen=True)
class Records:
    entries: tuple[Entry, ...] = ()

    def entry(self, key: str) -> Entry | None:
        return next((e for e in self.entries if e.key == key), None)


@dataclass(frozen=True)
class Comparison:
    result: str  # of RESULTS
    detail: Mapping[str, Any]

    @property
    def deviation(self) -> bool:
        return self.result in DEVIATIONS


@dataclass(frozen=True)
class Agreement:
    """What the fleet agrees on: the reference (None: not agreed, `why` says so)."""

    reference: Reference | None
    why: str
    cards: int  # cards that answered
    agreeing: int  # the largest group that answered alike


def probe_id(prompt: str) -> str:
    return hashlib.sha256(prompt.encode()).hexdigest()[:12]


def reference_key(model: str | None, device_class: str | None, template: str | None) -> str:
    """One reference per model, device class and pod template."""
    return f"{model or 'unknown'}|{device_class or 'unknown'}|{template or 'unknown'}"


# -- answers as servers give them ----------------------------------------------------------------------


def from_control(probe: str, answer: Mapping[str, Any]) -> Answer:
    """A control API's probe answer (`{"tokens": [...], "top": [[[id, logprob], ...], ...]}`; an agent's
    app may give its tokens alone, as ids or texts); ValueError when it is not one."""
    tokens, tops = answer.get("tokens"), answer.get("top")
    if not isinstance(tokens, list) or not tokens or (tops is not None and (
            not isinstance(tops, list) or len(tops) != len(tokens))):
        raise ValueError("a probe answer has `tokens` and, where given, one `top` list per token")
    steps = []
    for i, token in enumerate(tokens):
        if isinstance(token, bool) or not isinstance(token, int | str):
            raise ValueError("a probe's token is an id or a text")
        if tops is None:
            steps.append(Step(str(token)))
            continue
        top = tops[i]
        pairs = [(str(p[0]), _float(p[1])) for p in top if isinstance(p, list) and len(p) == 2] \
            if isinstance(top, list) else []
        if not pairs:
            raise ValueError("a probe step's `top` is [token, logprob] pairs")
        steps.append(_step(str(token), pairs))
    return Answer(probe, tuple(steps))


def from_openai(probe: str, choice: Mapping[str, Any]) -> Answer:
    """An OpenAI-compatible completion's first choice: its `logprobs` (`tokens`, `token_logprobs`,
    `top_logprobs`), else its text alone as one step. ValueError when it has neither."""
    lp = choice.get("logprobs")
    if isinstance(lp, Mapping) and isinstance(lp.get("tokens"), list) and lp["tokens"]:
        tokens, chosen = lp["tokens"], lp.get("token_logprobs") or [None] * len(lp["tokens"])
        tops = lp.get("top_logprobs") or [None] * len(tokens)
        steps = []
        for token, value, top in zip(tokens, chosen, tops, strict=False):
            pairs = sorted(((str(t), _float(v)) for t, v in top.items()), key=_rank) \
                if isinstance(top, Mapping) else []
            if not pairs or pairs[0][0] != str(token):
                pairs = [(str(token), _float(value)), *[p for p in pairs if p[0] != str(token)]]
            steps.append(_step(str(token), pairs))
        return Answer(probe, tuple(steps))
    text = choice.get("text")
    if not isinstance(text, str):
        raise ValueError("a completion's choice has neither logprobs nor text")
    return Answer(probe, (Step(text),))


def _rank(pair: tuple[str, float]) -> float:
    return -pair[1] if math.isfinite(pair[1]) else math.inf


def _float(value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float | str):
        raise ValueError(f"not a log-probability: {str(value)[:40]}")
    return float(value)  # "NaN" and "Infinity" as some servers write them, too


def _step(token: str, pairs: list[tuple[str, float]]) -> Step:
    chosen = next((v for t, v in pairs if t == token), pairs[0][1])
    others = [v for t, v in pairs if t != token]
    return Step(token, chosen, chosen - max(others) if others else None)


# -- the comparison -------------------------------------------------------------------------------------


def compare(settings: CorrectnessSettings, ref: Answer, got: Answer) -> Comparison:
    """`got` against the reference's answer to the same probe."""
    for i, r in enumerate(ref.steps):
        if i >= len(got.steps):
            if r.margin is None or r.margin >= settings.margin:
                # Cut short where the reference went on with a wide margin (an end that was not there).
                return Comparison(TOKEN, {"probe": ref.probe, "step": i, "expected": r.token, "got": None})
            break
        g = got.steps[i]
        if g.logprob is not None and not math.isfinite(g.logprob):
            return Comparison(NONFINITE, {"probe": ref.probe, "step": i, "logprob": str(g.logprob)})
        wide = r.margin is None or r.margin >= settings.margin
        if g.token != r.token:
            if wide:
                return Comparison(TOKEN, {"probe": ref.probe, "step": i, "expected": r.token, "got": g.token,
                                          "margin": None if r.margin is None else round(r.margin, 4)})
            break  # a narrow margin may flip: what follows is another text, not compared
        if r.logprob is not None and g.logprob is not None and abs(g.logprob - r.logprob) > settings.tolerance:
            return Comparison(LOGPROB, {"probe": ref.probe, "step": i, "expected": round(r.logprob, 4),
                                        "got": round(g.logprob, 4), "tolerance": settings.tolerance})
        if not wide:
            break
    return Comparison(MATCH, {"probe": ref.probe})


def informative(settings: CorrectnessSettings, ref: Reference) -> list[str]:
    """The probes worth asking: those whose reference's first token leads by a wide margin (or whose
    server gave no margins: the greedy tokens alone)."""
    return [a.probe for a in ref.answers if a.steps and (a.steps[0].margin is None
                                                          or a.steps[0].margin >= settings.margin)]


def alike(settings: CorrectnessSettings, a: Submission, b: Submission) -> bool:
    """Two cards answered alike: every probe both answered compares as a match, either way round."""
    shared = [(x, b.answer(x.probe)) for x in a.answers]
    pairs = [(x, y) for x, y in shared if y is not None]
    return bool(pairs) and all(compare(settings, x, y).result == MATCH and compare(settings, y, x).result == MATCH
                               for x, y in pairs)


# -- the agreement --------------------------------------------------------------------------------------


def latest_by_card(subs: Iterable[Submission]) -> list[Submission]:
    """Each card's newest submission: one vote per card, however many pods it ran."""
    best: dict[str, Submission] = {}
    for s in subs:
        if s.card not in best or s.at >= best[s.card].at:
            best[s.card] = s
    return sorted(best.values(), key=lambda s: s.card)


def agree(settings: CorrectnessSettings, entry: Entry | None, now: float) -> Agreement:
    """The reference agreed for this key: the kept one, else the largest group of cards that answered
    alike, if it has `quorum` cards and more than half of those that answered."""
    if entry is not None and entry.reference is not None:
        ref = entry.reference
        return Agreement(ref, "agreed", len(ref.cards), len(ref.cards))
    votes = latest_by_card(entry.submissions if entry is not None else ())
    if not votes:
        return Agreement(None, "no answers yet", 0, 0)
    groups = [[v for v in votes if v is s or alike(settings, s, v)] for s in votes]
    best = max(groups, key=len)
    n, k = len(votes), len(best)
    if k < settings.quorum:
        why = (f"{k} card(s) answered alike, {settings.quorum} needed" if n >= settings.quorum
               else f"{n} card(s) answered, {settings.quorum} needed")
        return Agreement(None, why, n, k)
    if 2 * k <= n:
        return Agreement(None, f"no majority: the largest group of {k} of {n} cards answering alike is not more"
                               " than half", n, k)
    center = best[0]
    return Agreement(Reference(center.answers, tuple(sorted(v.card for v in best)), now), "agreed", n, k)


def submit(settings: CorrectnessSettings, records: Records, key: str, sub: Submission, now: float
           ) -> tuple[Records, Agreement]:
    """Our card's answers in the records for `key`, and the agreement they make (kept once agreed)."""
    entry = records.entry(key) or Entry(key)
    kept = [s for s in entry.submissions if s.card != sub.card]
    entry = replace(entry, submissions=tuple(sorted([*kept, sub], key=lambda s: s.at)[-SUBMISSIONS_KEPT:]))
    agreement = agree(settings, entry, now)
    if entry.reference is None and agreement.reference is not None:
        entry = replace(entry, reference=agreement.reference)
    others = [e for e in records.entries if e.key != key]
    return Records((*others, entry)[-KEYS_KEPT:]), agreement


# -- the annotation ---------------------------------------------------------------------------------------


def _answer_json(a: Answer) -> dict[str, Any]:
    return {"probe": a.probe, "steps": [[s.token, _num(s.logprob), _num(s.margin)] for s in a.steps]}


def _num(v: float | None) -> float | str | None:
    if v is None:
        return None
    return round(v, 4) if math.isfinite(v) else str(v)


def dump(records: Records) -> str:
    return json.dumps({"version": VERSION, "entries": [
        {"key": e.key,
         "submissions": [{"card": s.card, "pod": s.pod, "at": round(s.at, 3),
                          "answers": [_answer_json(a) for a in s.answers]} for s in e.submissions],
         "reference": None if e.reference is None else {
             "cards": list(e.reference.cards), "at": round(e.reference.at, 3),
             "answers": [_answer_json(a) for a in e.reference.answers]}}
        for e in records.entries]}, separators=(",", ":"), sort_keys=True)


def parse(text: str | None) -> Records:
    """The annotation's records (none: empty); RecordsError when it is not ours."""
    if not text:
        return Records()
    try:
        data = json.loads(text)
        if not isinstance(data, dict) or data.get("version") != VERSION:
            raise RecordsError(f"version: expected {VERSION}")
        entries = []
        for e in data["entries"]:
            ref = e.get("reference")
            entries.append(Entry(str(e["key"]), tuple(
                Submission(str(s["card"]), str(s["pod"]), float(s["at"]), _answers(s["answers"]))
                for s in e["submissions"]), None if ref is None else Reference(
                _answers(ref["answers"]), tuple(str(c) for c in ref["cards"]), float(ref["at"]))))
        return Records(tuple(entries))
    except RecordsError:
        raise
    except (ValueError, KeyError, TypeError, AttributeError) as exc:
        raise RecordsError(f"not correctness records: {str(exc)[:120]}") from None


def _answers(raw: Any) -> tuple[Answer, ...]:
    return tuple(Answer(str(a["probe"]), tuple(
        Step(str(t), None if lp is None else float(lp), None if m is None else float(m))
        for t, lp, m in a["steps"])) for a in raw)


def describe(agreement: Agreement) -> dict[str, Any]:
    ref = agreement.reference
    return {"agreed": ref is not None, "why": agreement.why, "cards": agreement.cards,
            "agreeing": agreement.agreeing, "reference_cards": None if ref is None else list(ref.cards),
            "probes": None if ref is None else len(ref.answers)}
