"""How token vectors become one sentence vector: read from a sentence-transformers config, or the default.

A directory with `modules.json` names its pooling module (`1_Pooling/config.json`: CLS, mean, max
or last token) and whether a `Normalize` module follows. Without one, the default is mean pooling
over the real (unpadded) tokens, then L2 normalization: what most sentence-embedding models use.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch

from gpu_watchdog.inference.handler import HandlerError

MODES = {
    "pooling_mode_cls_token": "cls",
    "pooling_mode_mean_tokens": "mean",
    "pooling_mode_max_tokens": "max",
    "pooling_mode_lasttoken": "last",
}
_UNSUPPORTED = ("pooling_mode_mean_sqrt_len_tokens", "pooling_mode_weightedmean_tokens")
_ST = "sentence_transformers.models."
_PASSIVE = {_ST + "Transformer", _ST + "Pooling", _ST + "Normalize"}


@dataclass(frozen=True)
class Pooling:
    mode: str = "mean"
    normalize: bool = True
    source: str = "default (mean pooling, L2-normalized)"


def read(directory: Path) -> Pooling:
    """The pooling this directory declares; HandlerError naming the file and key it cannot follow."""
    modules_path = directory / "modules.json"
    if not modules_path.exists():
        return Pooling()
    try:
        modules = json.loads(modules_path.read_text(encoding="utf-8"))
        types = [(str(m["type"]), str(m.get("path", ""))) for m in modules]
    except (ValueError, TypeError, KeyError) as exc:
        raise HandlerError(f"{modules_path}: not a sentence-transformers module list: {exc}") from None
    other = [t for t, _ in types if t not in _PASSIVE]
    if other:
        raise HandlerError(f"{modules_path}: module {other[0]} is not supported (Transformer, Pooling and"
                           " Normalize are)")
    pooling_dirs = [p for t, p in types if t == _ST + "Pooling"]
    normalize = any(t == _ST + "Normalize" for t, _ in types)
    if not pooling_dirs:
        return Pooling("cls", normalize, f"{modules_path} (no Pooling module: CLS)")
    config_path = directory / pooling_dirs[0] / "config.json"
    try:
        config = json.loads(config_path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise HandlerError(f"{config_path}: cannot read the pooling config: {exc}") from None
    for key in _UNSUPPORTED:
        if config.get(key):
            raise HandlerError(f"{config_path}: {key} is not supported (cls, mean, max or last token are)")
    chosen = [mode for key, mode in MODES.items() if config.get(key)]
    if len(chosen) != 1:
        raise HandlerError(f"{config_path}: exactly one of {', '.join(MODES)} must be true")
    return Pooling(chosen[0], normalize, str(config_path))


def pool(hidden: torch.Tensor, mask: torch.Tensor, pooling: Pooling) -> torch.Tensor:
    """[batch, tokens, dim] with a right-padded [batch, tokens] mask -> [batch, dim] in float32."""
    hidden = hidden.float()
    m = mask.unsqueeze(-1).to(hidden.dtype)
    if pooling.mode == "cls":
        out = hidden[:, 0]
    elif pooling.mode == "mean":
        out = (hidden * m).sum(dim=1) / m.sum(dim=1).clamp(min=1.0)
    elif pooling.mode == "max":
        out = hidden.masked_fill(m == 0, float("-inf")).max(dim=1).values
    else:
        last = mask.sum(dim=1) - 1
        out = hidden[torch.arange(hidden.shape[0], device=hidden.device), last]
    if pooling.normalize:
        out = torch.nn.functional.normalize(out, p=2, dim=-1)
    return out
