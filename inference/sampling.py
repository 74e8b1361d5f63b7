"""Choosing each sequence's next token (greedy, temperature, top-p, seeded) and cutting text at stop strings."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 0.0
    top_p: float = 1.0
    seed: int | None = None

    @property
    def greedy(self) -> bool:
        return self.temperature <= 0.0


def new_generator(params: SamplingParams, device: torch.device) -> torch.Generator | None:
    """A request with a seed draws from its own generator, so its answer does not depend on its neighbours."""
    if params.greedy or params.seed is None:
        return None
    gen = torch.Generator(device=device)
    gen.manual_seed(params.seed)
    return gen


def sample(logits: torch.Tensor, params: Sequence[SamplingParams],
           generators: Sequence[torch.Generator | None]) -> list[int]:
    """One next token per row of `logits` [rows, vocab]."""
    best = logits.argmax(dim=-1)
    if all(p.greedy for p in params):
        return [int(t) for t in best.tolist()]
    chosen = best.tolist()
    for i, p in enumerate(params):
        if p.greedy:
            continue
        probs = torch.softmax(logits[i] / max(p.temperature, 1e-4), dim=-1)
        if p.top_p < 1.0:
            probs = _top_p(probs, p.top_p)
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


class StopText:
    """Assembles a sequence's text and ends it at the first stop string, which is never emitted.

    Text that could still turn into a stop string is held back until it cannot, so a streaming
    client never receives part of one.
    """

    def __init__(self, stops: Sequence[str]) -> None:
        self.stops = tuple(s for s in stops if s)
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
            hits = [i for i in (self.text.find(s, search_from) for s in self.stops) if i >= 0]
            if hits:
                self.text = self.text[: min(hits)]
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
