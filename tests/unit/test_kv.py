"""The batch's KV layers that grow in place: what the model reads is always what concatenation gives."""

from __future__ import annotations

import torch
from transformers.cache_utils import DynamicCache, DynamicLayer

from gpu_watchdog.inference.kv import GrowingLayer, growing, layers_of

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


def test_compact_right_aligns_each_rows_tokens_and_keeps_their_order() -> None:
    from gpu_watchdog.inference.kv import KVBatch

    # Rows as a prefill from cached prefixes leaves them: [pad, prefix, pad, rest], here 20 columns wide
    # for at most 4 real tokens a row.
    mask = torch.zeros(3, 20, dtype=torch.long)
    mask[0, [1, 2, 19]] = 1
    mask[1, [0, 1, 18, 19]] = 1
    mask[2, [18, 19]] = 1
    values = torch.arange(60, dtype=torch.float32).reshape(3, 1, 20, 1).expand(3, 2, 20, 3).contiguous()
    cache = DynamicCache()
    cache.layers = [GrowingLayer(values.clone(), -values.clone())]
    kv = KVBatch(cache, mask)
    kv.compact()
    assert kv.mask.tolist() == [[0, 1, 1, 1], [1, 1, 1, 1], [0, 0, 1, 1]]
    assert kv.next_positions().tolist() == [[3], [4], [2]]
    layer = cache.layers[0]
    real = layer.keys[:, 0, :, 0][kv.mask.bool()].tolist()
    assert real == [1.0, 2.0, 19.0, 20.0, 21.0, 38.0, 39.0, 58.0, 59.0]
    assert torch.equal(layer.values, -layer.keys)
    assert torch.equal(layer.keys[:, 0], layer.keys[:, 1])  # every head moved alike
    # Written with room to grow: the next step appends in place.
    room = layer._room
    layer.update(torch.ones(3, 2, 1, 3), torch.ones(3, 2, 1, 3))
    assert layer._room is room
    # A few columns of padding are not worth a copy.
    narrow = KVBatch(cache, torch.tensor([[0, 1, 0, 1, 1], [1, 1, 1, 1, 1], [0, 0, 0, 1, 1]]))
    before = cache.layers[0]
    narrow.compact()
    assert cache.layers[0] is before


def test_rows_that_leave_and_groups_that_join_keep_room_to_grow_without_another_copy() -> None:
    from gpu_watchdog.inference.kv import KVBatch

    def batch(rows: int, width: int, seed: int) -> tuple[KVBatch, torch.Tensor, torch.Tensor]:
        k, v = cols(width, seed, rows), cols(width, seed + 1, rows)
        cache = DynamicCache()
        cache.layers = [GrowingLayer(k.clone(), v.clone())]
        return KVBatch(cache, torch.ones(rows, width, dtype=torch.long)), k, v

    kv, ref_k, ref_v = batch(3, 6, 0)
    other, ok, ov = batch(2, 4, 10)
    kv.stitch(other)
    # The narrower group is padded on the left with zeros, masked out.
    pad = torch.zeros(2, HEADS, 2, DIM)
    ref_k = torch.cat([ref_k, torch.cat([pad, ok], dim=2)])
    ref_v = torch.cat([ref_v, torch.cat([pad, ov], dim=2)])
    layer = kv.cache.layers[0]
    assert torch.equal(layer.keys, ref_k) and torch.equal(layer.values, ref_v)
    room = layer._room
    k, v = cols(1, 50, 5), cols(1, 51, 5)
    got_k, got_v = layer.update(k, v)
    assert layer._room is room  # appended into the stitched buffer's room
    ref_k, ref_v = torch.cat([ref_k, k], dim=2), torch.cat([ref_v, v], dim=2)
    assert torch.equal(got_k, ref_k) and torch.equal(got_v, ref_v)
    # The three widest rows leave: the two left start with two columns of padding everywhere.
    kv.mask = torch.cat([kv.mask, torch.ones(5, 1, dtype=torch.long)], dim=1)
    kv.keep([4, 3])
    layer = kv.cache.layers[0]
    ref_k, ref_v = ref_k[[4, 3], :, 2:], ref_v[[4, 3], :, 2:]
    assert kv.width == 5 and torch.equal(layer.keys, ref_k) and torch.equal(layer.values, ref_v)
    room = layer._room
    k, v = cols(1, 60, 2), cols(1, 61, 2)
    got_k, got_v = layer.update(k, v)
    assert layer._room is room  # the view moved past the dropped columns; the data did not
    assert torch.equal(got_k, torch.cat([ref_k, k], dim=2)) and torch.equal(got_v, torch.cat([ref_v, v], dim=2))
