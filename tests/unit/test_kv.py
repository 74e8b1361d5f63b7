"""The batch's KV layers that grow in place: what the model reads is always what concatenation gives."""

from __future__ import annotations

import torch
from transformers.cache_utils import DynamicCache, DynamicLayer

from inference.kv import GrowingLayer, growing, layers_of

ROWS, HEADS, DIM = 3, 2, 4


def cols(n: int, seed: int, rows: int = ROWS) -> torch.Tensor:
    return torch.randn(rows, HEADS, n, DIM, generator=torch.Generator().manual_seed(seed))


def test_steps_rollbacks_and_replacements_read_like_concatenation() -> None:
    prefill_k, prefill_v = cols(5, 0), cols(5, 1)
    layer = GrowingLayer(prefill_k, prefill_v)
    ref_k, ref_v = prefill_k, prefill_v
    copies, rows = 0, ROWS
    for step in range(60):
        k, v = cols(1, 100 + step, rows), cols(1, 200 + step, rows)
        room_before = layer._room
        got_k, got_v = layer.update(k, v)
        copies += room_before is None or layer._room is not room_before
        ref_k, ref_v = torch.cat([ref_k, k], dim=-2), torch.cat([ref_v, v], dim=-2)
        assert torch.equal(got_k, ref_k) and torch.equal(got_v, ref_v)
        if step == 20:
            # A step that failed part-way is rolled back by slicing: the next one writes over it.
            width = ref_k.shape[-2] - 1
            layer.keys, layer.values = layer.keys[:, :, :width], layer.values[:, :, :width]
            ref_k, ref_v = ref_k[:, :, :width], ref_v[:, :, :width]
        if step == 40:
            # Rows leave and leading padding goes (KVBatch.keep): fresh tensors, taken over.
            keep = torch.tensor([2, 0])
            layer.keys = layer.keys.index_select(0, keep)[:, :, 3:]
            layer.values = layer.values.index_select(0, keep)[:, :, 3:]
            ref_k, ref_v = ref_k.index_select(0, keep)[:, :, 3:], ref_v.index_select(0, keep)[:, :, 3:]
            rows = 2
    # Room is made a few times over 60 steps, not at every step.
    assert 3 <= copies <= 8


def test_only_plain_dynamic_layers_grow() -> None:
    cache = DynamicCache()
    cache.update(cols(4, 0), cols(4, 1), 0)
    cache.update(cols(4, 2), cols(4, 3), 1)
    assert all(type(layer) is DynamicLayer for layer in cache.layers)
    before = [layer.keys for layer in cache.layers]
    growing(cache)
    assert all(type(layer) is GrowingLayer for layer in layers_of(cache))
    assert all(torch.equal(layer.keys, k) for layer, k in zip(cache.layers, before, strict=True))
    k, v = cols(1, 9), cols(1, 10)
    got_k, _ = cache.update(k, v, 0)
    assert torch.equal(got_k, torch.cat([before[0], k], dim=-2))
