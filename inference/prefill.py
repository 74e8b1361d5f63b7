"""Prefill: how the step's joiners get their prompts computed, for the decode loop.

Joiners are prefilled in passes of like lengths (`batch.passes`), the shortest first; a prompt
over the step's budget a chunk per step on top of its own cache; prompt beginnings the prefix
cache holds are reused, and the blocks it does not hold yet are kept for the next. A base of
`decode.DecodeLoop`, run on its thread: the forward pass, scoring and joining the batch are the
loop's, declared here as what prefill needs of it.
"""

from __future__ import annotations

from typing import Any

import torch

from gpu_watchdog.inference import batch, scoring
from gpu_watchdog.inference.engine_api import TokenLogprob
from gpu_watchdog.inference.kv import (
    KVBatch,
    cache_holding,
    growing,
    layers_of,
    prefill_after,
    prefill_inputs,
    stitchable,
)
from gpu_watchdog.inference.model import LoadedModel
from gpu_watchdog.inference.prefix_cache import BLOCK, Hit, PrefixCache
from gpu_watchdog.inference.sequence import Partial, Seq


class PrefillSteps:
    """The decode loop's prefill half (its state and its forward pass are the loop's)."""

    lm: LoadedModel
    prefill_tokens: int
    score_chunk: int
    prefix_cache: PrefixCache | None
    on_prefill: Any
    on_prefix_lookup: Any
    _partial: Partial | None
    _stitchable: bool
    _stitch_known: bool

    def _forward(self, ids: torch.Tensor, mask: torch.Tensor, positions: torch.Tensor, cache: Any,
                 all_logits: bool = False, states: bool = False) -> Any:
        raise NotImplementedError

    def _scoring_forward(self, ids: torch.Tensor, mask: torch.Tensor, positions: torch.Tensor, cache: Any
                         ) -> tuple[Any, torch.Tensor, scoring.Head | None]:
        raise NotImplementedError

    def _score_prompts(self, rows: torch.Tensor, head: scoring.Head | None, joiners: list[Seq],
                       scored: list[Seq]) -> None:
        raise NotImplementedError

    @staticmethod
    def _scored(seq: Seq, entries: list[TokenLogprob | None]) -> None:
        raise NotImplementedError

    def _join(self, joiners: list[Seq], out: Any, group: KVBatch) -> None:
        raise NotImplementedError

    def _chunked(self, seq: Seq) -> bool:
        """Whether this joiner is prefilled over several steps: a plain per-layer cache (sliding
        windows keep only their window) and a prompt over the budget, scored or not."""
        return not seq.canary and self._stitchable and self._to_compute(seq) > self.prefill_tokens

    def _cacheable(self, seq: Seq) -> bool:
        return self.prefix_cache is not None and self._stitchable and not seq.canary

    def _to_compute(self, seq: Seq) -> int:
        """The prompt tokens its prefill computes: those the prefix cache does not hold."""
        ids = seq.prefill_ids
        if not self._cacheable(seq) or seq.scoring:
            return len(ids)
        assert self.prefix_cache is not None
        return len(ids) - self.prefix_cache.peek(ids)

    def _prefill(self, joiners: list[Seq]) -> None:
        """Prefill the step's joiners in passes of like lengths (`batch.passes`), the shortest first:
        each pass's joiners stream their first token before the next pass is computed."""
        if not self._stitch_known or not self._stitchable:
            # Passes are stitched together: a cache that cannot be (or may not be) takes them in one.
            self._prefill_pass(joiners)
            return
        computed = [self._to_compute(s) for s in joiners]
        for indices in batch.passes(computed):
            self._prefill_pass([joiners[i] for i in indices])

    def _prefill_pass(self, joiners: list[Seq]) -> None:
        lm = self.lm
        scored = [s for s in joiners if s.scoring]
        hits = [self._lookup(s) for s in joiners]
        past: Any = None
        if any(h is not None for h in hits):
            ids, mask, positions, past = prefill_after([s.prefill_ids for s in joiners],
                                                       [None if h is None else h.kv for h in hits],
                                                       lm.codec.pad_id, lm.model.config)
        else:
            ids, mask, positions = prefill_inputs([s.prefill_ids for s in joiners], lm.codec.pad_id, lm.device)
        if scored:
            out, rows, head = self._scoring_forward(ids, mask, positions, past)
            self._score_prompts(rows, head, joiners, scored)
            del rows
        else:
            out = self._forward(ids, mask, positions, past)
        if self.on_prefill is not None:
            self.on_prefill(sum(len(s.prefill_ids) - (0 if h is None else h.tokens)
                                for s, h in zip(joiners, hits, strict=True)))
        cache = cache_of(out)
        group = KVBatch(cache, mask)
        self._remember(joiners, group)
        if past is not None:
            group.compact()
        self._join(joiners, out, group)

    def _lookup(self, seq: Seq) -> Hit | None:
        if not self._cacheable(seq) or seq.scoring:
            return None
        assert self.prefix_cache is not None
        hit = self.prefix_cache.lookup(seq.prefill_ids)
        seq.cached_tokens = 0 if hit is None else hit.tokens
        if self.on_prefix_lookup is not None:
            self.on_prefix_lookup(len(seq.prefill_ids), seq.cached_tokens)
        return hit

    def _remember(self, seqs: list[Seq], kv: KVBatch) -> None:
        """Keep the blocks of their prompts the prefix cache does not hold yet (each row's last columns)."""
        wanted = [(row, s) for row, s in enumerate(seqs) if self._cacheable(s)
                  and len(s.prefill_ids) // BLOCK * BLOCK > s.cached_tokens]
        if not wanted or not stitchable(kv.cache):
            return
        assert self.prefix_cache is not None
        layers = layers_of(kv.cache)
        width = kv.width
        for row, seq in wanted:
            ids = seq.prefill_ids
            cols = slice(width - (len(ids) - seq.cached_tokens), width)
            self.prefix_cache.insert(ids, [layer.keys[row, :, cols] for layer in layers],
                                     [layer.values[row, :, cols] for layer in layers], start=seq.cached_tokens)

    def _prefill_chunk(self, partial: Partial) -> None:
        """The next chunk of a long prompt, on top of its own cache; the last one makes it a row."""
        lm = self.lm
        ids = partial.seq.prefill_ids
        if not partial.looked_up:
            partial.looked_up = True
            hit = self._lookup(partial.seq)
            if hit is not None:
                mask = torch.ones((1, hit.tokens), dtype=torch.long, device=lm.device)
                partial.kv, partial.done = KVBatch(cache_holding(hit.kv[:, :, None], lm.model.config), mask), hit.tokens
        chunk = ids[partial.done: partial.done + self.prefill_tokens]
        n = len(chunk)
        new = torch.ones((1, n), dtype=torch.long, device=lm.device)
        mask = new if partial.kv is None else torch.cat([partial.kv.mask, new], dim=1)
        positions = torch.arange(partial.done, partial.done + n, device=lm.device)[None, :]
        chunk_ids = torch.tensor([chunk], dtype=torch.long, device=lm.device)
        past = None if partial.kv is None else partial.kv.cache
        seq = partial.seq
        if seq.scoring:
            out, rows, head = self._scoring_forward(chunk_ids, mask, positions, past)
            # This chunk's positions predict the prompt's next tokens (the last one, the answer's first).
            targets = seq.request.prompt_ids[partial.done + 1: partial.done + n + 1]
            partial.scored += scoring.score(rows[0, : len(targets)], head, targets,
                                            int(seq.request.prompt_logprobs or 0), lm.allowed_tokens,
                                            self.score_chunk)
            del rows
        else:
            out = self._forward(chunk_ids, mask, positions, past)
        if self.on_prefill is not None:
            self.on_prefill(n)
        cache = cache_of(out)
        growing(cache)
        partial.kv, partial.done = KVBatch(cache, mask), partial.done + n
        if partial.done < len(ids):
            return
        self._partial = None
        if seq.scoring:
            self._scored(seq, partial.scored)
        self._remember([partial.seq], partial.kv)
        self._join([partial.seq], out, partial.kv)


def cache_of(out: Any) -> Any:
    cache = getattr(out, "cache", None)
    return cache if cache is not None else getattr(out, "past_key_values", None)
