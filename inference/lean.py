"""A lean forward pass for Llama-shaped decoders, used by the decode loop in place of the model's own.

Why: a small model's decode step is per-operation overhead, not arithmetic. The generic Hugging
Face forward builds its masks and position tensors through general machinery, runs q, k and v (and
the MLP's gate and up) as separate products and rotates q and k apart; on CPU every one of those
small operations also wakes the OpenMP team. This pass runs the same weights with the operations
the step needs: one product for q/k/v and one for gate/up (the module weights become views of the
fused tensors, so nothing is held twice), one rotation for q and k together, the attention mask
built straight from the batch's [rows, width] mask. The cache is the same per-layer cache the engine
stitches, cuts and rolls back, updated through the same `update()` call.

Only architectures whose every operation is reproduced here are taken (`lean_forward` says which
and why not); everything else keeps the model's own forward.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

# Decoder-only models that are exactly: RMSNorm, rotary q/k, (grouped-query) attention, SiLU-gated
# MLP, final RMSNorm, lm_head. Qwen2 adds q/k/v biases, which the fused product carries.
_ARCHITECTURES = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM")


@dataclass
class LeanOutput:
    logits: torch.Tensor
    past_key_values: Any


class LeanForward:
    """Calls as the decode loop calls a model: (ids, mask, positions, cache, all_logits)."""

    def __init__(self, model: Any) -> None:
        self.model = model
        inner = model.model
        config = model.config
        self.embed = inner.embed_tokens
        self.norm = inner.norm
        self.rotary = inner.rotary_emb
        self.lm_head = model.lm_head
        self.config = config
        self.layers = [_Layer(layer) for layer in inner.layers]

    def __call__(self, ids: torch.Tensor, mask: torch.Tensor, positions: torch.Tensor, cache: Any,
                 all_logits: bool = False) -> LeanOutput:
        from transformers.cache_utils import DynamicCache

        if cache is None:
            cache = DynamicCache(config=self.config)
        rows, steps = int(ids.shape[0]), int(ids.shape[1])
        x = self.embed(ids)
        cos, sin = self.rotary(x, positions)
        # [rows, 1, 1, heads' dim]: broadcast over heads.
        cos, sin = cos.unsqueeze(2), sin.unsqueeze(2)
        attn_mask = _attention_mask(mask, steps)
        for i, layer in enumerate(self.layers):
            x = layer(x, cos, sin, attn_mask, cache, i, rows, steps)
        if not all_logits:
            x = x[:, -1:]
        return LeanOutput(logits=self.lm_head(self.norm(x)), past_key_values=cache)


class _Layer:
    def __init__(self, layer: Any) -> None:
        attn, mlp = layer.self_attn, layer.mlp
        self.in_norm, self.post_norm = layer.input_layernorm, layer.post_attention_layernorm
        self.head_dim = int(attn.head_dim)
        self.heads = int(attn.q_proj.weight.shape[0]) // self.head_dim
        self.kv_heads = int(attn.k_proj.weight.shape[0]) // self.head_dim
        self.scaling = float(attn.scaling)
        self.qkv_w, self.qkv_b = _fuse(attn.q_proj, attn.k_proj, attn.v_proj)
        self.o_proj = attn.o_proj
        self.gate_up_w, _ = _fuse(mlp.gate_proj, mlp.up_proj)
        self.down = mlp.down_proj
        self.inter = int(mlp.gate_proj.weight.shape[0])

    def __call__(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, attn_mask: torch.Tensor | None,
                 cache: Any, index: int, rows: int, steps: int) -> torch.Tensor:
        h, d, kvh = self.heads, self.head_dim, self.kv_heads
        qkv = F.linear(self.in_norm(x), self.qkv_w, self.qkv_b).view(rows, steps, h + 2 * kvh, d)
        # q and k are adjacent in the fused product: one rotation for both.
        qk = qkv[:, :, : h + kvh]
        qk = qk * cos + _rotate_half(qk) * sin
        q = qk[:, :, :h].transpose(1, 2)
        k = qk[:, :, h:].transpose(1, 2)
        v = qkv[:, :, h + kvh:].transpose(1, 2)
        k, v = cache.layers[index].update(k, v) if index < len(cache.layers) else cache.update(k, v, index)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask, scale=self.scaling,
                                             enable_gqa=h != kvh)
        x = x + self.o_proj(out.transpose(1, 2).reshape(rows, steps, h * d))
        gate, up = F.linear(self.post_norm(x), self.gate_up_w).split(self.inter, dim=-1)
        return x + self.down(F.silu(gate) * up)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def _fuse(*linears: Any) -> tuple[torch.Tensor, torch.Tensor | None]:
    """One weight (and bias) for several products of the same input; the modules keep views of it."""
    weight = torch.cat([m.weight.data for m in linears], dim=0)
    offset = 0
    for m in linears:
        n = int(m.weight.shape[0])
        m.weight.data = weight[offset: offset + n]
        offset += n
    if all(m.bias is None for m in linears):
        return weight, None
    bias = torch.cat([m.bias.data if m.bias is not None else m.weight.new_zeros(m.weight.shape[0])
                      for m in linears])
    return weight, bias


def _attention_mask(mask: torch.Tensor, steps: int) -> torch.Tensor | None:
    """[rows, 1, steps, width] booleans from the batch's [rows, width] mask, causal over the new steps.

    A padded query position may always see itself: with nothing to attend to its output would be
    NaN, which later layers' masked products would carry into real rows (0 x NaN is NaN).
    """
    width = int(mask.shape[1])
    keys = mask.bool()[:, None, None, :]
    if steps == 1:
        return None if bool(keys.all()) else keys
    cols = torch.arange(width, device=mask.device)
    query_cols = torch.arange(width - steps, width, device=mask.device)[:, None]
    causal = cols[None, :] <= query_cols
    diagonal = cols[None, :] == query_cols
    return (keys & causal) | diagonal


def lean_forward(model: Any) -> tuple[LeanForward | None, str]:
    """The lean pass for this model, or None and why not."""
    name = type(model).__name__
    if name not in _ARCHITECTURES:
        return None, f"{name} is not one of {', '.join(_ARCHITECTURES)}"
    config = model.config
    if getattr(config, "hidden_act", None) != "silu":
        return None, f"hidden_act {getattr(config, 'hidden_act', None)!r} (silu only)"
    if getattr(config, "sliding_window", None) and getattr(config, "use_sliding_window", True):
        return None, "sliding-window attention"
    if any(t != "full_attention" for t in getattr(config, "layer_types", None) or []):
        return None, "layers other than full attention"
    if getattr(config, "pretraining_tp", 1) not in (None, 1):
        return None, "pretraining_tp > 1"
    if getattr(config, "mlp_bias", False):
        return None, "MLP biases"
    inner = getattr(model, "model", None)
    if inner is None or not hasattr(inner, "rotary_emb"):
        return None, "no rotary embedding module"
    for layer in inner.layers:
        attn = layer.self_attn
        if hasattr(attn, "q_norm") or hasattr(attn, "k_norm"):
            return None, "q/k norms"
    return LeanForward(model), "ok"
