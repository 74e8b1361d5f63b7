"""The prefix cache's rules: whole blocks, exact chains from the first token, least recently used first out."""

from __future__ import annotations

import torch

from gpu_watchdog.inference.prefix_cache import BLOCK, PrefixCache

LAYERS, HEADS, DIM = 2, 2, 4


def kv_for(ids: list[int]) -> torch.Tensor:
    """Keys and values that say which token and which position they belong to."""
    t = torch.tensor(ids, dtype=torch.float32)
    pos = torch.arange(len(ids), dtype=torch.float32)
    one = (t * 1000 + pos)[None, None, None, :, None].expand(LAYERS, 2, HEADS, len(ids), DIM)
    return one.clone()


def put(cache: PrefixCache, ids: list[int], kv: torch.Tensor, start: int = 0) -> None:
    cache.insert(ids, list(kv[:, 0]), list(kv[:, 1]), start=start)


def block_bytes() -> int:
    return LAYERS * 2 * HEADS * BLOCK * DIM * 4


def test_a_prompt_finds_the_whole_blocks_another_prompt_began_with_and_their_values() -> None:
    cache = PrefixCache(1 << 20)
    first = list(range(100, 100 + 3 * BLOCK + 5))
    put(cache, first, kv_for(first))
    assert len(cache) == 3  # the last 5 tokens make no whole block
    second = [*first[:2 * BLOCK + 3], 7, 8, 9]
    hit = cache.lookup(second)
    assert hit is not None and hit.tokens == 2 * BLOCK
    assert torch.equal(hit.kv, kv_for(first)[:, :, :, : 2 * BLOCK])
    assert (cache.queried_tokens, cache.hit_tokens) == (len(second), 2 * BLOCK)


def test_the_last_token_is_always_left_to_compute() -> None:
    cache = PrefixCache(1 << 20)
    ids = list(range(2 * BLOCK))
    put(cache, ids, kv_for(ids))
    hit = cache.lookup(ids)
    assert hit is not None and hit.tokens == BLOCK
    assert cache.peek(ids) == BLOCK


def test_a_block_matches_only_after_the_same_blocks_before_it() -> None:
    cache = PrefixCache(1 << 20)
    a = list(range(3 * BLOCK))
    put(cache, a, kv_for(a))
    # Same second and third blocks, another first one: nothing is shared.
    b = [999] * BLOCK + a[BLOCK:]
    assert cache.lookup(b) is None
    assert cache.peek(b) == 0


def test_insert_from_a_cached_prefix_stores_only_what_follows_it() -> None:
    cache = PrefixCache(1 << 20)
    head = list(range(BLOCK))
    put(cache, head, kv_for(head))
    longer = head + list(range(500, 500 + 2 * BLOCK))
    put(cache, longer, kv_for(longer)[:, :, :, BLOCK:], start=BLOCK)
    hit = cache.lookup([*longer, 1])
    assert hit is not None and hit.tokens == 3 * BLOCK
    assert torch.equal(hit.kv, kv_for(longer))


def test_the_least_recently_used_blocks_leave_first_and_the_size_holds() -> None:
    cache = PrefixCache(4 * block_bytes())
    a, b = list(range(2 * BLOCK)), list(range(1000, 1000 + 2 * BLOCK))
    put(cache, a, kv_for(a))
    put(cache, b, kv_for(b))
    assert cache.bytes == 4 * block_bytes()
    assert cache.lookup([*a, 1]) is not None  # a is now the more recent
    c = list(range(2000, 2000 + 2 * BLOCK))
    put(cache, c, kv_for(c))
    assert cache.bytes <= cache.max_bytes
    assert cache.peek([*b, 1]) == 0 and cache.peek([*a, 1]) == 2 * BLOCK and cache.peek([*c, 1]) == 2 * BLOCK
    assert cache.clear() == 4 * block_bytes() and len(cache) == 0


def test_peek_changes_nothing_and_a_zero_size_keeps_nothing() -> None:
    cache = PrefixCache(2 * block_bytes())
    a, b = list(range(2 * BLOCK)), list(range(50, 50 + 2 * BLOCK))
    put(cache, a, kv_for(a))
    assert cache.peek([*a, 1]) == 2 * BLOCK
    assert cache.queried_tokens == 0
    put(cache, b, kv_for(b))  # a was not touched by peek: it is the one to go
    assert cache.peek([*a, 1]) == 0 and cache.peek([*b, 1]) == 2 * BLOCK
    off = PrefixCache(0)
    put(off, a, kv_for(a))
    assert len(off) == 0 and off.lookup(a) is None
