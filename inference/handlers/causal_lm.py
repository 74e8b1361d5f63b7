"""The `causal-lm` handler (the default): text generation, run by the engine's decode loop with
continuous batching; served through the OpenAI completions and chat routes."""

from __future__ import annotations

import torch

from gpu_watchdog.inference import model as model_mod
from gpu_watchdog.inference.engine_api import GenRequest
from gpu_watchdog.inference.handler import GENERATE

CANARY_PROMPT = "ping"


class CausalLM:
    capabilities = frozenset({GENERATE})

    def __init__(self) -> None:
        self._lm: model_mod.LoadedModel | None = None

    @property
    def lm(self) -> model_mod.LoadedModel:
        assert self._lm is not None, "load() first"
        return self._lm

    def load(self, model: str | None, device: torch.device) -> None:
        self._lm = model_mod.load(model, device)

    def sample(self) -> GenRequest:
        return GenRequest(self.lm.codec.encode(CANARY_PROMPT), max_tokens=1)
