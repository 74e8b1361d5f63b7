"""The `classifier` handler: sequence-classification models; probabilities over the model's labels."""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from gpu_watchdog.inference.capabilities import CLASSIFY, PREDICT
from gpu_watchdog.inference.handlers.encoder import Encoder


class Classifier(Encoder):
    capabilities = frozenset({CLASSIFY, PREDICT})

    def __init__(self) -> None:
        super().__init__()
        self.labels: list[str] = []

    def load(self, model: str | None, device: torch.device) -> None:
        from transformers import AutoModelForSequenceClassification

        self.load_encoder(model, device, AutoModelForSequenceClassification)
        config = self.model.config
        id2label = getattr(config, "id2label", None) or {}
        self.labels = [str(id2label.get(i, id2label.get(str(i), f"LABEL_{i}"))) for i in range(config.num_labels)]

    def decode(self, body: dict[str, Any]) -> list[list[int]]:
        return self.items(body)

    def predict(self, items: list[list[int]]) -> list[np.ndarray]:
        out, _ = self.forward(items)
        probs = torch.softmax(out.logits.float(), dim=-1)
        return list(probs.cpu().numpy())

    def encode(self, output: np.ndarray) -> dict[str, Any]:
        best = int(np.argmax(output))
        return {"label": self.labels[best], "probs": [float(p) for p in output], "num_classes": len(self.labels)}
