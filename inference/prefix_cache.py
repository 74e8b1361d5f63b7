"""The prefix cache: the keys and values of prompts already prefilled, reused by prompts that begin the same way.

Prompts that share a beginning (a system prompt, the turns of a chat so far, a few-shot block,
the context an evaluation scores several continuations against) need not have it computed again:
a joiner whose prompt starts with cached blocks is prefilled from the end of them. vLLM keeps
one by default; so does this engine.

Blocks of `BLOCK` tokens are keyed by their tokens and the block before them, compared exactly
(a dict of token tuples, not a hash of them: two prompts that differ anywhere before a block never
share it, whatever their hashes). A block is only reachable through its whole chain from the
first token. The blocks live in one pool allocated once at the cache's size (its pages are only
touched as blocks fill them), a few tensor operations per prompt rather than one per block. The
least recently used block goes when the pool is full; a block whose parent went is unreachable
and goes in turn. Only the decode thread uses it.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

import torch

BLOCK = 16  # tokens per block: what one hit saves at least, and the granularity of a match

_Key = tuple[int, tuple[int, ...]]  # (the previous block's id, or -1 for the first; this block's tokens)


@dataclass
class _Block:
    id: int
    slot: int  # its place in the pool


@dataclass(frozen=True)
class Hit:
    """The cached beginning of a prompt: [layers, 2 (keys, values), kv heads, tokens, head dim]."""

    kv: torch.Tensor

    @property
    def tokens(self) -> int:
        return int(self.kv.shape[3])


class PrefixCache:
    def __init__(self, max_bytes: int) -> None:
        self.max_bytes = max_bytes
        self._blocks: OrderedDict[_Key, _Block] = OrderedDict()
        self._next_id = 0
        # [slots, layers, 2, kv heads, BLOCK, head dim], made at the first insert (the model's shape).
        self._pool: torch.Tensor | None = None
        self._free: list[int] = []
        # Prompt tokens looked up, and how many of them were found: the hit rate, as vLLM counts it.
        self.queried_tokens = 0
        self.hit_tokens = 0

    def __len__(self) -> int:
        return len(self._blocks)

    @property
    def bytes(self) -> int:
        """Held by cached blocks."""
        return len(self._blocks) * self._block_bytes

    @property
    def _block_bytes(self) -> int:
        return 0 if self._pool is None else self._pool[0].numel() * self._pool.element_size()

    def peek(self, ids: Sequence[int]) -> int:
        """How many tokens of `ids` `lookup` would find, without touching anything."""
        return BLOCK * len(self._chain(ids))

    def lookup(self, ids: Sequence[int]) -> Hit | None:
        """The longest cached beginning of `ids`, in whole blocks, leaving at least its last token to
        compute (the next token's logits come from it)."""
        self.queried_tokens += len(ids)
        found = self._chain(ids)
        if not found:
            return None
        assert self._pool is not None
        for key, _ in found:
            self._blocks.move_to_end(key)
        slots = torch.tensor([b.slot for _, b in found], device=self._pool.device)
        blocks = self._pool.index_select(0, slots)  # [n, layers, 2, kvh, BLOCK, d]
        n, layers, two, heads, _, dim = blocks.shape
        kv = blocks.permute(1, 2, 3, 0, 4, 5).reshape(layers, two, heads, n * BLOCK, dim)
        self.hit_tokens += n * BLOCK
        return Hit(kv)

    def insert(self, ids: Sequence[int], keys: Sequence[torch.Tensor], values: Sequence[torch.Tensor],
               start: int = 0) -> None:
        """Keep the whole blocks of `ids` whose keys and values are given: per layer
        [kv heads, len(ids) - start, head dim], the tokens from `start` (a block boundary) on;
        the blocks before `start` must be cached already (else nothing after them could be found)."""
        whole = len(ids) // BLOCK
        if self.max_bytes <= 0 or whole * BLOCK <= start:
            return
        assert start % BLOCK == 0
        if self._pool is None and not self._make_pool(len(keys), keys[0]):
            return
        parent, new, slots = -1, [], []
        for i, chunk in enumerate(_chunks(ids, whole)):
            key = (parent, chunk)
            block = self._blocks.get(key)
            if block is None:
                if i * BLOCK < start:
                    return  # evicted since the lookup: what follows could never be found
                slot = self._slot(protect=parent)
                if slot is None:
                    break
                block = _Block(self._next_id, slot)
                self._next_id += 1
                self._blocks[key] = block
                new.append(i - start // BLOCK)
                slots.append(slot)
            else:
                self._blocks.move_to_end(key)
            parent = block.id
        if not new:
            return
        pool = self._pool
        assert pool is not None
        where = torch.tensor(slots, device=pool.device)
        which = torch.tensor(new, device=pool.device)
        # A copy of its own, in the pool (the batch's cache is cut and grown in place): per layer, the
        # given tokens seen as [kv heads, blocks, BLOCK, head dim] (a view), the new blocks written.
        for layer, (k, v) in enumerate(zip(keys, values, strict=True)):
            for side, t in ((0, k), (1, v)):
                count = t.shape[1] // BLOCK
                blocks = t[:, : count * BLOCK].unflatten(1, (count, BLOCK)).transpose(0, 1)
                pool[where, layer, side] = blocks.index_select(0, which).to(pool.dtype)

    def clear(self) -> int:
        """Drop every block and the pool (an OOM: the memory is worth more to the running batch); bytes freed."""
        freed = 0 if self._pool is None else self._pool.numel() * self._pool.element_size()
        self._blocks.clear()
        self._pool, self._free = None, []
        return freed

    def _chain(self, ids: Sequence[int]) -> list[tuple[_Key, _Block]]:
        parent, found = -1, []
        for chunk in _chunks(ids, (len(ids) - 1) // BLOCK):
            key = (parent, chunk)
            block = self._blocks.get(key)
            if block is None:
                break
            found.append((key, block))
            parent = block.id
        return found

    def _make_pool(self, layers: int, like: torch.Tensor) -> bool:
        heads, _, dim = like.shape
        block_bytes = layers * 2 * heads * BLOCK * dim * like.element_size()
        slots = self.max_bytes // block_bytes
        if slots < 1:
            return False
        self._pool = torch.empty((slots, layers, 2, heads, BLOCK, dim), dtype=like.dtype, device=like.device)
        self._free = list(range(slots - 1, -1, -1))
        return True

    def _slot(self, protect: int) -> int | None:
        """A free slot, the least recently used block's if none is (never the block just walked)."""
        if self._free:
            return self._free.pop()
        for key, block in self._blocks.items():
            if block.id != protect:
                del self._blocks[key]
                return block.slot
        return None


def _chunks(ids: Sequence[int], blocks: int) -> list[tuple[int, ...]]:
    return [tuple(ids[i * BLOCK:(i + 1) * BLOCK]) for i in range(blocks)]
