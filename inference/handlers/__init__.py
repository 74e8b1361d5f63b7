"""The built-in handlers, by the name `--handler` takes."""

from __future__ import annotations

from collections.abc import Callable

from inference.handler import Handler
from inference.handlers.causal_lm import CausalLM
from inference.handlers.classifier import Classifier
from inference.handlers.embeddings import Embeddings

BUILTIN: dict[str, Callable[[], Handler]] = {
    "causal-lm": CausalLM,
    "embeddings": Embeddings,
    "classifier": Classifier,
}
