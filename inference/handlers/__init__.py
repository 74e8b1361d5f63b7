"""The built-in handlers, by the name `--handler` takes."""

from __future__ import annotations

from collections.abc import Callable

from gpu_watchdog.inference.handler import Handler
from gpu_watchdog.inference.handlers.causal_lm import CausalLM
from gpu_watchdog.inference.handlers.classifier import Classifier
from gpu_watchdog.inference.handlers.embeddings import Embeddings

BUILTIN: dict[str, Callable[[], Handler]] = {
    "causal-lm": CausalLM,
    "embeddings": Embeddings,
    "classifier": Classifier,
}
