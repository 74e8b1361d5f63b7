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
from transformers.cache_utils import DynamicLayer


class NotStitchable(Exception):
    """The model's cache is not a plain per-layer KV list (sliding windows, recurrent state)."""


class GrowingLayer(DynamicLayer):
    """A plain dynamic KV layer that appends each step's keys and values into spare room.

    The stock layer concatenates at every step, copying the whole cache of every row each time
    (a fifth of a decode step at 32 rows of 256 tokens on CPU). Here `keys`/`values` are views
    of a buffer with room to grow; a step writes only its own column. Whatever replaces them from
    outside (a batch stitched, rows cut out, a step rolled back) is taken over at the next step.
    """

    def __init__(self, keys: torch.Tensor, values: torch.Tensor) -> None:
        super().__init__()
        self.device = keys.device
        self.keys, self.values = keys, values
        self.is_initialized = True
        self._room: tuple[torch.Tensor, torch.Tensor] | None = None

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any, **kwargs: Any
               ) -> tuple[torch.Tensor, torch.Tensor]:
        assert self.keys is not None and self.values is not None
        length, n = int(self.keys.shape[-2]), int(key_states.shape[-2])
        room = self._room
        if room is None or not _inside(self.keys, room[0]) or not _inside(self.values, room[1]) \
                or length + n > room[0].shape[-2]:
            # A tenth more room than needed, at least 16 columns: few copies, little memory held back.
            width = length + n + max(16, (length + n) // 10)
            room = (_roomy(key_states, width), _roomy(value_states, width))
            room[0][:, :, :length] = self.keys
            room[1][:, :, :length] = self.values
            self._room = room
        room[0][:, :, length:length + n] = key_states
        room[1][:, :, length:length + n] = value_states
        self.keys, self.values = room[0][:, :, :length + n], room[1][:, :, :length + n]
        return self.keys, self.values


def _inside(view: torch.Tensor, room: torch.Tensor) -> bool:
    """Whether `view` is the leading columns of `room` (what `update` left, or a rollback of it)."""
    return (view.data_ptr() == room.data_ptr() and view.shape[:2] == room.shape[:2]
            and view.shape[-1] == room.shape[-1] and view.stride() == room.stride())


def _roomy(new: torch.Tensor, width: int) -> torch.Tensor:
    return torch.empty((*new.shape[:2], width, new.shape[-1]), dtype=new.dtype, device=new.device)


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
        for a, b in zip(mine, theirs, strict=True):
            a.keys = torch.cat([_pad_left(a.keys, width), _pad_left(b.keys, width)], dim=0)
            a.values = torch.cat([_pad_left(a.values, width), _pad_left(b.values, width)], dim=0)
        self.mask = torch.cat([_pad_left_2d(self.mask, width), _pad_left_2d(other.mask, width)], dim=0)

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
        for layer in layers_of(self.cache):
            layer.keys = layer.keys.index_select(0, index)[:, :, start:]
            layer.values = layer.values.index_select(0, index)[:, :, start:]


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


def _pad_left(t: torch.Tensor, width: int) -> torch.Tensor:
    missing = width - t.shape[-2]
    return t if missing == 0 else F.pad(t, (0, 0, missing, 0))


def _pad_left_2d(t: torch.Tensor, width: int) -> torch.Tensor:
    missing = width - t.shape[-1]
    return t if missing == 0 else F.pad(t, (missing, 0), value=0)
