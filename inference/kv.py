"""The running batch's KV cache: left-padded rows that join and leave between decoding steps.

Every row's newest token sits in the last column, older tokens to its left, padding (masked out)
further left. A joining group is prefilled on its own and stitched in by padding the shorter
side; a finished row is cut out, and columns that became padding in every row are dropped, so the
batch is never wider than its longest live sequence.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from transformers.cache_utils import DynamicCache, DynamicLayer


class NotStitchable(Exception):
    """The model's cache is not a plain per-layer KV list (sliding windows, recurrent state)."""


class GrowingLayer(DynamicLayer):
    """A plain dynamic KV layer that appends each step's keys and values into spare room.

    The stock layer concatenates at every step, copying the whole cache of every row each time
    (a fifth of a decode step at 32 rows of 256 tokens on CPU). Here `keys`/`values` are views
    of a buffer with room to grow (from some column of it on: leading columns that became padding
    everywhere are dropped by moving the view, not the data); a step writes only its own column.
    Rows that leave and groups that join (`keep_rows`, `stitched`) make the new buffer with room
    in the same copy; whatever else replaces them from outside (a step rolled back, a plain
    tensor) is taken over at the next step.
    """

    def __init__(self, keys: torch.Tensor, values: torch.Tensor,
                 room: tuple[torch.Tensor, torch.Tensor] | None = None) -> None:
        super().__init__()
        self.device = keys.device
        self.keys, self.values = keys, values
        self.is_initialized = True
        self._room = room

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any, **kwargs: Any
               ) -> tuple[torch.Tensor, torch.Tensor]:
        assert self.keys is not None and self.values is not None
        length, n = int(self.keys.shape[-2]), int(key_states.shape[-2])
        start = self._start()
        room = self._room
        if room is None or start is None or start + length + n > room[0].shape[-2]:
            room = (_roomy(key_states, length + n), _roomy(value_states, length + n))
            room[0][:, :, :length] = self.keys
            room[1][:, :, :length] = self.values
            self._room, start = room, 0
        end = start + length
        room[0][:, :, end:end + n] = key_states
        room[1][:, :, end:end + n] = value_states
        self.keys, self.values = room[0][:, :, start:end + n], room[1][:, :, start:end + n]
        return self.keys, self.values

    def _start(self) -> int | None:
        """The column of the room where `keys`/`values` begin, or None if they are not views of it."""
        if self._room is None or self.keys is None or self.values is None:
            return None
        start = _offset(self.keys, self._room[0])
        return start if start is not None and start == _offset(self.values, self._room[1]) else None

    def keep_rows(self, index: torch.Tensor, drop: int) -> None:
        """Keep these rows, in this order, without their first `drop` columns."""
        assert self.keys is not None and self.values is not None
        start, length = self._start(), int(self.keys.shape[-2])
        if start is None or self._room is None:
            self.keys = self.keys.index_select(0, index)[:, :, drop:]
            self.values = self.values.index_select(0, index)[:, :, drop:]
            return
        # The room's rows, spare columns and all: the next steps append without a copy.
        room = (self._room[0].index_select(0, index), self._room[1].index_select(0, index))
        self._room = room
        self.keys = room[0][:, :, start + drop:start + length]
        self.values = room[1][:, :, start + drop:start + length]

    @staticmethod
    def stitched(mine: Any, theirs: Any, width: int) -> GrowingLayer:
        """`mine`'s rows above `theirs`', both left-padded to `width`, in a buffer with room to grow."""
        keys = _stacked(mine.keys, theirs.keys, width)
        values = _stacked(mine.values, theirs.values, width)
        return GrowingLayer(keys[:, :, :width], values[:, :, :width], (keys, values))


# Columns of padding a compaction must save to be worth its copy (a block of the prefix cache).
_COMPACT_AT_LEAST = 16


def _offset(view: torch.Tensor, room: torch.Tensor) -> int | None:
    """Where `view` begins among `room`'s columns, if it is `room[:, :, s:s + n]` for some s."""
    if view.shape[:2] != room.shape[:2] or view.shape[-1] != room.shape[-1] or view.stride() != room.stride():
        return None
    step = room.stride(2) * room.element_size()
    delta = view.data_ptr() - room.data_ptr()
    if delta < 0 or delta % step:
        return None
    start = delta // step
    return start if start + view.shape[-2] <= room.shape[-2] else None


def _roomy(new: torch.Tensor, needed: int, rows: int | None = None) -> torch.Tensor:
    # A tenth more room than needed, at least 16 columns: few copies, little memory held back.
    width = needed + max(16, needed // 10)
    shape = (new.shape[0] if rows is None else rows, new.shape[1], width, new.shape[-1])
    return torch.empty(shape, dtype=new.dtype, device=new.device)


def _stacked(a: torch.Tensor, b: torch.Tensor, width: int) -> torch.Tensor:
    out = _roomy(a, width, rows=a.shape[0] + b.shape[0])
    for rows, t in ((slice(0, a.shape[0]), a), (slice(a.shape[0], None), b)):
        pad = width - t.shape[-2]
        # Padding is masked out, but must be finite: 0 x NaN is NaN even where a mask says 0.
        out[rows, :, :pad].zero_()
        out[rows, :, pad:width] = t
    return out


def growing(cache: Any) -> None:
    """Swap a stitchable cache's plain layers for growing ones (their tensors kept as they are)."""
    layers = layers_of(cache)
    for i, layer in enumerate(layers):
        if type(layer) is DynamicLayer and layer.keys is not None and layer.values is not None and layer.keys.numel():
            cache.layers[i] = GrowingLayer(layer.keys, layer.values)


def layers_of(cache: Any) -> list[Any]:
    layers = getattr(cache, "layers", None)
    if layers is None:
        raise NotStitchable(f"{type(cache).__name__} has no per-layer KV")
    for layer in layers:
        # Exactly the plain dynamic layer (or ours): a sliding-window layer keeps only its window,
        # and padding it to another length would shift what it keeps.
        if type(layer) not in (DynamicLayer, GrowingLayer) or not hasattr(layer, "keys"):
            raise NotStitchable(f"{type(layer).__name__} layers cannot be stitched")
    return list(layers)


def stitchable(cache: Any) -> bool:
    try:
        layers_of(cache)
    except NotStitchable:
        return False
    return True


@dataclass
class KVBatch:
    """A batch's cache and attention mask [rows, width]; rows in the order the engine keeps them."""

    cache: Any
    mask: torch.Tensor

    @property
    def rows(self) -> int:
        return int(self.mask.shape[0])

    @property
    def width(self) -> int:
        return int(self.mask.shape[1])

    def next_positions(self) -> torch.Tensor:
        """Each row's position for its next token: the real tokens it holds."""
        return self.mask.sum(dim=1, keepdim=True)

    def grow(self) -> None:
        """One more column for the token about to be fed to every row."""
        self.mask = F.pad(self.mask, (0, 1), value=1)

    def rollback(self, width: int) -> None:
        """Undo a step that failed part-way: some layers may already hold its column."""
        self.mask = self.mask[:, :width]
        for layer in layers_of(self.cache):
            if layer.keys.shape[-2] > width:
                layer.keys = layer.keys[:, :, :width]
                layer.values = layer.values[:, :, :width]

    def stitch(self, other: KVBatch) -> None:
        """Append `other`'s rows below this batch's, padding the narrower one on the left."""
        width = max(self.width, other.width)
        mine, theirs = layers_of(self.cache), layers_of(other.cache)
        for i, (a, b) in enumerate(zip(mine, theirs, strict=True)):
            self.cache.layers[i] = GrowingLayer.stitched(a, b, width)
        self.mask = torch.cat([_pad_left_2d(self.mask, width), _pad_left_2d(other.mask, width)], dim=0)

    def compact(self) -> None:
        """Right-align each row's real tokens, so the batch is no wider than its longest row.

        A prefill from cached prefixes leaves padding between a row's prefix and its rest (see
        `DecodeLoop`): kept, every later step would attend over the longest prefix plus the
        longest rest, up to twice the longest row. Attention does not care where a token's key
        sits, only which keys the mask admits (positions went in through the rotation). Done only
        where it saves a block of columns or more: the copy costs about what a few steps over
        the padding would."""
        mask = self.mask.bool()
        width = int(mask.sum(dim=1).max())
        if width + _COMPACT_AT_LEAST > mask.shape[1] or not stitchable(self.cache):
            return
        # A stable sort of 0/1 puts each row's padding first and its real columns after, in order.
        source = torch.argsort(mask.to(torch.int8), dim=1, stable=True)[:, -width:]
        rows = torch.arange(mask.shape[0], device=mask.device)[:, None].expand_as(source)
        self.mask = torch.gather(self.mask, 1, source)
        for i, layer in enumerate(layers_of(self.cache)):
            # Indexing whole [kv heads, head dim] slices: 2.5x faster than a gather of every element.
            keys, values = _roomy(layer.keys, width), _roomy(layer.values, width)
            keys[:, :, :width] = layer.keys[rows, :, source].permute(0, 2, 1, 3)
            values[:, :, :width] = layer.values[rows, :, source].permute(0, 2, 1, 3)
            self.cache.layers[i] = GrowingLayer(keys[:, :, :width], values[:, :, :width], (keys, values))

    def keep(self, rows: list[int]) -> None:
        """Keep only these rows (in this order), then drop leading columns that are padding everywhere."""
        index = torch.tensor(rows, dtype=torch.long, device=self.mask.device)
        mask = self.mask.index_select(0, index)
        if not stitchable(self.cache):
            # Rows can still leave (every cache layer can select batch rows); columns stay.
            for layer in self.cache.layers:
                layer.batch_select_indices(index)
            self.mask = mask
            return
        live = mask.any(dim=0)
        start = int(live.long().argmax()) if bool(live.any()) else mask.shape[1]
        self.mask = mask[:, start:]
        for i, layer in enumerate(layers_of(self.cache)):
            if not isinstance(layer, GrowingLayer):
                layer = self.cache.layers[i] = GrowingLayer(layer.keys, layer.values)
            layer.keep_rows(index, start)


def prefill_inputs(prompts: list[list[int]], pad_id: int, device: torch.device
                   ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Left-padded ids, mask and per-row positions for a group of prompts."""
    longest = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), longest), pad_id, dtype=torch.long)
    mask = torch.zeros((len(prompts), longest), dtype=torch.long)
    for i, p in enumerate(prompts):
        ids[i, longest - len(p):] = torch.tensor(p, dtype=torch.long)
        mask[i, longest - len(p):] = 1
    ids, mask = ids.to(device), mask.to(device)
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    return ids, mask, positions


def prefill_after(prompts: list[list[int]], cached: list[torch.Tensor | None], pad_id: int, config: Any
                  ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, Any]:
    """The inputs of a prefill whose rows start from cached beginnings: `cached[i]`, the keys and
    values of prompt i's first tokens ([layers, 2, kv heads, tokens, head dim]) or None, become
    the past (left-padded to the longest), and the rest of each prompt the new tokens (left-padded
    too), so a row reads [padding, cached, padding, rest] (`KVBatch.compact` closes the gap after).
    The mask and the positions count only real tokens."""
    first = next(c for c in cached if c is not None)
    counts = [0 if c is None else int(c.shape[3]) for c in cached]
    ids, rest_mask, _ = prefill_inputs([p[n:] for p, n in zip(prompts, counts, strict=True)], pad_id, first.device)
    width = max(counts)
    layers, _, kv_heads, _, dim = first.shape
    past = torch.zeros((layers, 2, len(prompts), kv_heads, width, dim), dtype=first.dtype, device=first.device)
    past_mask = torch.zeros((len(prompts), width), dtype=torch.long, device=first.device)
    for row, kv in enumerate(cached):
        if kv is not None:
            past[:, :, row, :, width - kv.shape[3]:] = kv
            past_mask[row, width - kv.shape[3]:] = 1
    mask = torch.cat([past_mask, rest_mask], dim=1)
    positions = (mask.cumsum(-1) - 1).clamp(min=0)[:, width:]
    return ids, mask, positions, cache_holding(past, config)


def cache_holding(past: torch.Tensor, config: Any) -> Any:
    """A model cache holding `past` [layers, 2, rows, kv heads, tokens, head dim] as its keys and values."""
    cache = DynamicCache(config=config)
    for i in range(int(past.shape[0])):
        cache.layers[i] = GrowingLayer(past[i, 0], past[i, 1])
    return cache


def _pad_left_2d(t: torch.Tensor, width: int) -> torch.Tensor:
    missing = width - t.shape[-1]
    return t if missing == 0 else F.pad(t, (missing, 0), value=0)
