"""The `embeddings` handler: BERT-, RoBERTa- or XLM-R-shaped encoders, one vector per input."""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from gpu_watchdog.inference.capabilities import EMBED, PREDICT
from gpu_watchdog.inference.handlers import pooling
from gpu_watchdog.inference.handlers.encoder import Encoder


class Embeddings(Encoder):
    capabilities = frozenset({EMBED, PREDICT})

    def __init__(self) -> None:
        super().__init__()
        self.pooling = pooling.Pooling()
        self.dimensions = 0
        # Sizes the model was trained to be cut to (Matryoshka); any other `dimensions` is refused.
        self.shorter: frozenset[int] = frozenset()

    def load(self, model: str | None, device: torch.device) -> None:
        from transformers import AutoModel

        directory = self.load_encoder(model, device, AutoModel)
        self.pooling = pooling.read(directory)
        config = self.model.config
        self.dimensions = int(config.hidden_size)
        declared = getattr(config, "matryoshka_dimensions", None)
        if isinstance(declared, list):
            self.shorter = frozenset(int(d) for d in declared)
        elif getattr(config, "is_matryoshka", False):
            self.shorter = frozenset(range(1, self.dimensions + 1))

    def decode(self, body: dict[str, Any]) -> list[list[int]]:
        return self.items(body)

    def predict(self, items: list[list[int]]) -> list[np.ndarray]:
        out, mask = self.forward(items)
        vectors = pooling.pool(out.last_hidden_state, mask, self.pooling)
        return list(vectors.cpu().numpy())

    def encode(self, output: np.ndarray) -> list[float]:
        return [float(x) for x in output]
