"""The handler protocol: what any PyTorch model provides to be served behind the admission gate.

A handler loads its model on a device, decodes a request body into items, predicts on a list of
items, encodes one output, and names a `sample()` item for the canary; optionally it weighs an
item (`cost`, e.g. its tokens) for admission and for the batch's token budget. The engine runs
request-level handlers through one batch loop; the causal LM is a handler too, whose items are
generated token by token in the decode loop instead.

What a handler can do (`capabilities`, named in `inference.capabilities`) decides which HTTP routes
it serves. A handler of one's own is named `module:attr` and needs nothing but this file's contract.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any, Protocol, runtime_checkable

import torch

# A handler of one's own names what it can do with these (their definitions are in `capabilities`).
from gpu_watchdog.inference.capabilities import CLASSIFY, EMBED, GENERATE, PREDICT

__all__ = ["CLASSIFY", "EMBED", "GENERATE", "PREDICT", "Handler", "HandlerError", "RequestHandler", "item_cost",
           "resolve"]


class HandlerError(RuntimeError):
    """A handler that cannot be found or loaded; the message names the flag or file at fault."""


@runtime_checkable
class Handler(Protocol):
    """Every handler: what it can do, how it loads, and what the canary sends it."""

    capabilities: frozenset[str]

    def load(self, model: str | None, device: torch.device) -> None: ...

    def sample(self) -> Any: ...


@runtime_checkable
class RequestHandler(Handler, Protocol):
    """A model answered one request at a time (classifiers, embedders, detectors), batched by items.

    `decode` raises `inference.validation.BadRequest` (naming the field) for input it cannot use.
    `predict` returns one output per item, in order; it runs in the engine's thread, under
    `torch.inference_mode()`, never on the event loop. `cost` is optional (default 1 per item).
    """

    def decode(self, body: dict[str, Any]) -> list[Any]: ...

    def predict(self, items: list[Any]) -> list[Any]: ...

    def encode(self, output: Any) -> Any: ...


def item_cost(handler: RequestHandler) -> Callable[[Any], int]:
    """The handler's per-item weight in tokens, or 1 when it declares none."""
    cost = getattr(handler, "cost", None)
    if cost is None:
        return lambda _item: 1
    return lambda item: max(1, int(cost(item)))


def resolve(spec: str) -> Handler:
    """A handler instance from a built-in name or `module:attr` (a class or a factory)."""
    from gpu_watchdog.inference.handlers import BUILTIN

    if spec in BUILTIN:
        return BUILTIN[spec]()
    module_name, _, attr = spec.partition(":")
    if not attr:
        raise HandlerError(f"--handler {spec}: not a built-in ({', '.join(BUILTIN)}) nor module:attr")
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise HandlerError(f"--handler {spec}: cannot import {module_name}: {exc}") from None
    factory = getattr(module, attr, None)
    if factory is None or not callable(factory):
        raise HandlerError(f"--handler {spec}: {module_name} has no callable {attr}")
    try:
        handler = factory()
    except Exception as exc:  # a factory that needs arguments, or fails: the user's code, said as such
        raise HandlerError(f"--handler {spec}: calling {attr}() failed: {type(exc).__name__}: {exc}") from None
    missing = [name for name in ("capabilities", "load", "sample", "decode", "predict", "encode")
               if not hasattr(handler, name)]
    if missing:
        raise HandlerError(f"--handler {spec}: the handler lacks {', '.join(missing)}")
    if not isinstance(handler.capabilities, frozenset | set) or not handler.capabilities:
        raise HandlerError(f"--handler {spec}: capabilities must be a non-empty set, e.g. {{'predict'}}")
    handler.capabilities = frozenset(handler.capabilities)
    if GENERATE in handler.capabilities:
        raise HandlerError(f"--handler {spec}: text generation is served by the built-in causal-lm handler")
    return handler  # type: ignore[no-any-return]
