"""The Kubernetes client's modules, imported at their first use.

A sidecar with no Kubernetes API to talk to (local mode, strategy none) never imports the client,
which is the larger part of its memory. For the type checker the client is untyped either way.
"""

from __future__ import annotations

import importlib
from typing import Any


class _OnFirstUse:
    def __init__(self, module: str) -> None:
        self._module = module

    def __getattr__(self, name: str) -> Any:
        return getattr(importlib.import_module(self._module), name)


client: Any = _OnFirstUse("kubernetes.client")
config: Any = _OnFirstUse("kubernetes.config")
