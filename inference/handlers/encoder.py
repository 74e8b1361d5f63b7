"""What the built-in encoder handlers share: a local Hugging Face directory, its tokenizer, padded batches."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from gpu_watchdog.inference.handler import HandlerError
from gpu_watchdog.inference.handlers.inputs import MAX_INPUTS, InputLimits, token_items
from gpu_watchdog.inference.model import pick_dtype

SAMPLE_TEXT = "ping"


def model_dir(path: str | None) -> Path:
    if path is None:
        raise HandlerError("--model DIR is required: a local Hugging Face directory")
    directory = Path(path)
    if not directory.is_dir():
        raise HandlerError(f"--model {path}: not a directory")
    if not (directory / "config.json").exists():
        raise HandlerError(f"--model {path}: no config.json (expected a Hugging Face model directory)")
    return directory


def position_limit(config: Any, tokenizer: Any) -> int:
    """The most tokens one input may have: the model's positions, less RoBERTa's offset."""
    positions = int(getattr(config, "max_position_embeddings", 0) or 512)
    if "roberta" in str(getattr(config, "model_type", "")) or "camembert" in str(getattr(config, "model_type", "")):
        # RoBERTa-style position ids start after the padding id: two positions are never used.
        positions -= int(getattr(config, "pad_token_id", 1) or 1) + 1
    declared = getattr(tokenizer, "model_max_length", None)
    if isinstance(declared, int) and 0 < declared < positions:
        positions = declared
    return positions


class Encoder:
    """A loaded encoder: token items in, the model's output for a padded batch out."""

    def __init__(self) -> None:
        self.model: Any = None
        self.tokenizer: Any = None
        self.device = torch.device("cpu")
        self.limits = InputLimits(MAX_INPUTS, 512, 1)
        self.pad_id = 0
        self.name = ""

    @property
    def max_tokens(self) -> int:
        return self.limits.max_tokens

    def load_encoder(self, path: str | None, device: torch.device, auto_class: Any) -> Path:
        from transformers import AutoTokenizer

        directory = model_dir(path)
        dtype = pick_dtype(device)
        try:
            self.tokenizer = AutoTokenizer.from_pretrained(directory, local_files_only=True)
            model: Any = auto_class.from_pretrained(directory, local_files_only=True, dtype=dtype)
        except (OSError, ValueError, KeyError) as exc:
            raise HandlerError(f"--model {path}: cannot load: {exc}") from None
        self.model = model.to(device).eval()
        self.device = device
        self.name = directory.name
        pad = self.tokenizer.pad_token_id
        self.pad_id = int(pad if pad is not None else getattr(self.model.config, "pad_token_id", 0) or 0)
        vocab = int(getattr(self.model.config, "vocab_size", 0) or len(self.tokenizer))
        self.limits = InputLimits(MAX_INPUTS, position_limit(self.model.config, self.tokenizer), vocab)
        return directory

    # -- the handler protocol's shared parts -------------------------------------------------

    def tokenize(self, texts: list[str]) -> list[list[int]]:
        ids: list[list[int]] = self.tokenizer(texts, add_special_tokens=True, truncation=False)["input_ids"]
        return ids

    def items(self, body: dict[str, Any]) -> list[list[int]]:
        return token_items(body.get("input"), self.tokenize, self.limits)

    def cost(self, item: list[int]) -> int:
        return len(item)

    def sample(self) -> list[int]:
        return self.tokenize([SAMPLE_TEXT])[0]

    def sized_sample(self, tokens: int) -> list[int]:
        """An item of exactly `tokens` tokens (its special tokens kept), for measuring memory."""
        ids = self.sample()
        middle = ids[1] if len(ids) > 2 else ids[0]
        return [ids[0], *[middle] * max(0, tokens - 2), ids[-1]][:max(1, tokens)]

    def forward(self, items: list[list[int]]) -> tuple[Any, torch.Tensor]:
        """The model's output on a right-padded batch, and its attention mask."""
        width = max(len(ids) for ids in items)
        ids = torch.full((len(items), width), self.pad_id, dtype=torch.long)
        mask = torch.zeros((len(items), width), dtype=torch.long)
        for row, item in enumerate(items):
            ids[row, : len(item)] = torch.tensor(item, dtype=torch.long)
            mask[row, : len(item)] = 1
        ids, mask = ids.to(self.device), mask.to(self.device)
        return self.model(input_ids=ids, attention_mask=mask), mask
