"""The `causal-lm` handler (the default): text generation, run by the engine's decode loop with
continuous batching; served through the OpenAI completions and chat routes."""

from __future__ import annotations

import torch

from gpu_watchdog.inference import model as model_mod
from gpu_watchdog.inference.capabilities import GENERATE
from gpu_watchdog.inference.engine_api import GenRequest

CANARY_PROMPT = "ping"


def canary_request(lm: model_mod.LoadedModel) -> GenRequest:
    """The canary's work for a causal LM: one token of a short prompt, on the path every request takes."""
    return GenRequest(lm.codec.encode(CANARY_PROMPT), max_tokens=1)


class CausalLM:
    capabilities = frozenset({GENERATE})

    def __init__(self, lm: model_mod.LoadedModel | None = None) -> None:
        """`lm`: a model already loaded (warm-up, measuring, tests); else `load` loads one."""
        self._lm = lm

    @property
    def loaded(self) -> bool:
        return self._lm is not None

    @property
    def lm(self) -> model_mod.LoadedModel:
        assert self._lm is not None, "load() first"
        return self._lm

    def load(self, model: str | None, device: torch.device) -> None:
        self._lm = model_mod.load(model, device)

    def sample(self) -> GenRequest:
        return canary_request(self.lm)
