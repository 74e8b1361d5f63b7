"""Choosing each sequence's next token (greedy, temperature, top-k/top-p/min-p, penalties, bias, seeded),
the log-probabilities reported to clients, and cutting text at stop strings."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from gpu_watchdog.inference.engine_api import SamplingParams, TokenLogprob


@dataclass(frozen=True)
class RowTokens:
    """What a row's penalties look at: its prompt and what it generated so far."""

    prompt: Sequence[int]
    generated: Sequence[int]
    eos_id: int | None = None


def new_generator(params: SamplingParams, device: torch.device) -> torch.Generator | None:
    """A request with a seed draws from its own generator, so its answer does not depend on its neighbours."""
    if params.greedy or params.seed is None:
        return None
    gen = torch.Generator(device=device)
    gen.manual_seed(params.seed)
    return gen


def adjust(logits: torch.Tensor, p: SamplingParams, history: RowTokens) -> torch.Tensor:
    """One row's logits after min_tokens, logit_bias and the penalties (the order vLLM applies them)."""
    logits = logits.clone()
    vocab = logits.shape[-1]
    if p.min_tokens and len(history.generated) < p.min_tokens:
        ends = [t for t in (*p.stop_token_ids, history.eos_id) if t is not None and 0 <= t < vocab]
        if ends:
            logits[ends] = float("-inf")
    for token, bias in p.logit_bias:
        if 0 <= token < vocab:
            logits[token] += bias
    if p.repetition_penalty != 1.0:
        seen = torch.tensor(sorted({*history.prompt, *history.generated}), dtype=torch.long, device=logits.device)
        seen = seen[seen < vocab]
        if seen.numel():
            vals = logits[seen]
            logits[seen] = torch.where(vals > 0, vals / p.repetition_penalty, vals * p.repetition_penalty)
    if (p.presence_penalty or p.frequency_penalty) and history.generated:
        counts = torch.bincount(torch.tensor(list(history.generated), dtype=torch.long, device=logits.device),
                                minlength=vocab)[:vocab].to(logits.dtype)
        logits -= p.frequency_penalty * counts + p.presence_penalty * (counts > 0).to(logits.dtype)
    # A vanishing repetition penalty divides by almost nothing: keep the scores orderable.
    return torch.nan_to_num(logits, nan=float("-inf"), posinf=torch.finfo(logits.dtype).max, neginf=float("-inf"))


def sample(logits: torch.Tensor, params: Sequence[SamplingParams],
           generators: Sequence[torch.Generator | None],
           histories: Sequence[RowTokens] | None = None) -> list[int]:
    """One next token per row of `logits` [rows, vocab]."""
    best = logits.argmax(dim=-1)
    if all(p.greedy and not p.adjusts_logits for p in params):
        return [int(t) for t in best.tolist()]
    chosen = best.tolist()
    for i, p in enumerate(params):
        row = logits[i]
        if p.adjusts_logits:
            assert histories is not None, "penalties need each row's history"
            row = adjust(row, p, histories[i])
            if p.greedy:
                chosen[i] = int(row.argmax())
        if p.greedy:
            continue
        probs = torch.softmax(row / max(p.temperature, 1e-4), dim=-1)
        if p.min_p > 0.0:
            probs = probs.masked_fill(probs < p.min_p * probs.max(), 0.0)
        if 0 < p.top_k < probs.shape[-1]:
            kth = probs.topk(p.top_k).values[-1]
            probs = probs.masked_fill(probs < kth, 0.0)
        if not bool(torch.isfinite(probs).all()) or float(probs.sum()) <= 0.0:
            chosen[i] = int(row.argmax())  # nothing left to draw from (every score -inf): the best one
            continue
        if p.top_p < 1.0:
            probs = _top_p(probs / probs.sum(), p.top_p)
        chosen[i] = int(torch.multinomial(probs, 1, generator=generators[i]))
    return [int(t) for t in chosen]


def _top_p(probs: torch.Tensor, top_p: float) -> torch.Tensor:
    """Keep the smallest set of most likely tokens whose mass reaches top_p (always at least one)."""
    ordered, order = probs.sort(descending=True)
    drop = (ordered.cumsum(-1) - ordered) >= top_p
    drop[..., 0] = False  # a top_p below float precision (5e-324 is 0 in float32) still keeps the best
    ordered = ordered.masked_fill(drop, 0.0)
    kept = torch.zeros_like(probs).scatter(-1, order, ordered)
    return kept / kept.sum()


def token_logprobs(logits: torch.Tensor, chosen: Sequence[int], k: int | Sequence[int]) -> list[TokenLogprob]:
    """Log-probabilities of `chosen` [rows] under `logits` [rows, vocab], with each row's top `k`.

    Computed from the model's own distribution, before temperature and penalties, as vLLM reports
    them by default: a client scoring text gets the model's probabilities, not the sampler's.
    """
    ks = [k] * len(chosen) if isinstance(k, int) else list(k)
    logp = torch.log_softmax(logits.float(), dim=-1)
    index = torch.tensor(list(chosen), dtype=torch.long, device=logp.device)
    picked = logp.gather(-1, index[:, None])[:, 0].tolist()
    widest = min(max(ks, default=0), logp.shape[-1])
    if widest > 0:
        values, ids = logp.topk(widest, dim=-1)
        tops = list(zip(ids.tolist(), values.tolist(), strict=True))
    else:
        tops = [([], [])] * len(picked)
    out: list[TokenLogprob] = []
    for token, lp, (top_ids, top_vals), n in zip(chosen, picked, tops, ks, strict=True):
        top = [(int(token), float(lp))]
        top += [(int(t), float(v)) for t, v in zip(top_ids[:n], top_vals[:n], strict=True) if t != token]
        out.append(TokenLogprob(int(token), float(lp), tuple(top)))
    return out


class StopText:
    """Assembles a sequence's text and ends it at the first stop string, which is emitted only when
    `include_stop` asks for it.

    Text that could still turn into a stop string is held back until it cannot, so a streaming
    client never receives part of one.
    """

    def __init__(self, stops: Sequence[str], include_stop: bool = False) -> None:
        self.stops = tuple(s for s in stops if s)
        self.include_stop = include_stop
        self._hold = max((len(s) for s in self.stops), default=1) - 1
        self.text = ""
        self._emitted = 0
        self.stopped = False

    def feed(self, piece: str) -> str:
        """Add decoded text; what may be emitted now."""
        if self.stopped:
            return ""
        search_from = max(0, len(self.text) - self._hold)
        self.text += piece
        if self.stops:
            hits = [(i, s) for i, s in ((self.text.find(s, search_from), s) for s in self.stops) if i >= 0]
            if hits:
                at, stop = min(hits)
                self.text = self.text[: at + len(stop) if self.include_stop else at]
                self.stopped = True
                return self._emit(len(self.text))
        return self._emit(len(self.text) - self._hold if self.stops else len(self.text))

    def flush(self) -> str:
        """The sequence ended otherwise: release what was held back."""
        return self._emit(len(self.text))

    def _emit(self, upto: int) -> str:
        if upto <= self._emitted:
            return ""
        out = self.text[self._emitted: upto]
        self._emitted = upto
        return out
