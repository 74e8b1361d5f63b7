"""A lean forward pass for Llama-shaped decoders, used by the decode loop in place of the model's own.

Why: a decode step of a few rows does little arithmetic; on CPU it is bound by streaming the
weights from memory and by per-operation overhead. The generic Hugging Face forward builds its
masks through general machinery, runs q, k and v (and the MLP's gate and up) as separate products
over [out, in] weights and rotates q and k apart. This pass runs the same weights with the
operations the step needs: one product for q/k/v and one for gate/up, over weights laid out
[in, out], which a product of few rows reads about twice as fast (see `_Product`; the modules'
weights become views of them, so nothing is held twice), one rotation for q and k together, and
the attention mask built straight from the batch's [rows, width] mask. The cache is the same
per-layer cache the engine stitches, cuts and rolls back, updated through the same `update()`.

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
        inner = model.model
        self.embed = inner.embed_tokens
        self.norm = inner.norm
        self.rotary = inner.rotary_emb
        head = model.lm_head
        # A head tied to the embedding keeps its layout: the embedding reads rows of the same tensor.
        tied = head.weight.data_ptr() == self.embed.weight.data_ptr()
        plain = type(head) is torch.nn.Linear and head.bias is None
        self.lm_head: Any = _Product(head) if plain and not tied else head
        self.config = model.config
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
        self.qkv = _Product(attn.q_proj, attn.k_proj, attn.v_proj)
        self.o = _Product(attn.o_proj)
        self.gate_up = _Product(mlp.gate_proj, mlp.up_proj)
        self.down = _Product(mlp.down_proj)
        self.inter = int(mlp.gate_proj.weight.shape[0])

    def __call__(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, attn_mask: torch.Tensor | None,
                 cache: Any, index: int, rows: int, steps: int) -> torch.Tensor:
        h, d, kvh = self.heads, self.head_dim, self.kv_heads
        qkv = self.qkv(self.in_norm(x)).view(rows, steps, h + 2 * kvh, d)
        # q and k are adjacent in the fused product: one rotation for both.
        qk = qkv[:, :, : h + kvh]
        qk = qk * cos + _rotate_half(qk) * sin
        q = qk[:, :, :h].transpose(1, 2)
        k = qk[:, :, h:].transpose(1, 2)
        v = qkv[:, :, h + kvh:].transpose(1, 2)
        k, v = cache.layers[index].update(k, v) if index < len(cache.layers) else cache.update(k, v, index)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask, scale=self.scaling,
                                             enable_gqa=h != kvh)
        x = x + self.o(out.transpose(1, 2).reshape(rows, steps, h * d))
        gate, up = self.gate_up(self.post_norm(x)).split(self.inter, dim=-1)
        return x + self.down(F.silu(gate) * up)


class _Product:
    """One product for several linear layers that read the same input, over one [in, out] weight.

    The weight is held transposed ([in, out], contiguous): on CPU a product with few rows streams
    it from memory, and that layout reads it about twice as fast as the modules' [out, in] (one
    row: 76 against 148 us for a 256 x 768 weight out of cache, measured here). The modules keep
    views of it, so nothing is held twice and their own forward still works.
    """

    def __init__(self, *linears: Any) -> None:
        weight_t = torch.cat([m.weight.data for m in linears], dim=0).t().contiguous()
        offset = 0
        for m in linears:
            n = int(m.weight.shape[0])
            m.weight.data = weight_t[:, offset: offset + n].t()
            offset += n
        self.weight_t = weight_t
        self.bias: torch.Tensor | None = None
        if any(m.bias is not None for m in linears):
            self.bias = torch.cat([m.bias.data if m.bias is not None else m.weight.new_zeros(m.weight.shape[0])
                                   for m in linears])

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        y = torch.matmul(x, self.weight_t)
        return y if self.bias is None else y + self.bias


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def _attention_mask(mask: torch.Tensor, steps: int) -> torch.Tensor | None:
    """[rows, 1, steps, width] booleans from the batch's [rows, width] mask, causal over the new steps.

    A padded query position may always see itself: a row that sees nothing is left to the
    attention kernel, and one that answers NaN for it would have later layers' masked products
    carry the NaN into real rows (0 x NaN is NaN).
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
        attn, mlp = layer.self_attn, layer.mlp
        if hasattr(attn, "q_norm") or hasattr(attn, "k_norm"):
            return None, "q/k norms"
        for proj in (attn.q_proj, attn.k_proj, attn.v_proj, attn.o_proj, mlp.gate_proj, mlp.up_proj, mlp.down_proj):
            # Quantized or adapter-wrapped layers hold their weights otherwise: the model's own forward knows them.
            if type(proj) is not torch.nn.Linear or not proj.weight.dtype.is_floating_point:
                return None, f"{type(proj).__name__} projections (plain floating-point Linear layers only)"
    return LeanForward(model), "ok"
