"""A lean forward pass for Llama-shaped decoders, used by the decode loop in place of the model's own.

Why: a decode step of a few rows does little arithmetic; on CPU it is bound by streaming the
weights from memory and by per-operation overhead, and a prefill by arithmetic and by the passes
its element-wise operations make over the activations. The generic Hugging Face forward builds
its masks through general machinery, runs q, k and v (and the MLP's gate and up) as separate
products over [out, in] weights, normalizes in five operations and rotates q and k apart. This
pass runs the same weights with the operations a step needs: one product for q/k/v and one for
gate/up (see `_Product`: on CPU over oneDNN's prepacked layout, the residual added inside the
product), one fused RMSNorm, one rotation for q and k together, causal attention without a mask
where no row is padded, and the attention mask built straight from the batch's [rows, width]
mask otherwise. The cache is the same per-layer cache the engine stitches, cuts and rolls back,
updated through the same `update()`.

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
    # Every position's final (normed) states, when asked for: a scored prompt's logits come from
    # them a chunk at a time (`inference.scoring`).
    hidden: torch.Tensor | None = None


class LeanForward:
    """Calls as the decode loop calls a model: (ids, mask, positions, cache, all_logits)."""

    def __init__(self, model: Any) -> None:
        inner = model.model
        self.embed = inner.embed_tokens
        self.norm = _Norm(inner.norm)
        self.rotary = inner.rotary_emb
        head = model.lm_head
        self.packing = _packing(head.weight)
        # A head tied to the embedding keeps its layout (the embedding reads rows of the same tensor);
        # a prepacked copy of it is still a copy, so on CPU it runs packed all the same.
        tied = head.weight.data_ptr() == self.embed.weight.data_ptr()
        plain = type(head) is torch.nn.Linear and head.bias is None
        self.lm_head: Any = head
        if plain and not tied:
            self.lm_head = _Product(head, pack=self.packing == "ok")
        elif plain and self.packing == "ok":
            self.lm_head = _PackedHead(head)
        self.config = model.config
        self.layers = [_Layer(layer, self.packing == "ok") for layer in inner.layers]

    @property
    def products(self) -> str:
        """How the products run, for the log: oneDNN's prepacked weights, or plain matmuls and why."""
        return "onednn" if self.packing == "ok" else f"matmul ({self.packing})"

    def __call__(self, ids: torch.Tensor, mask: torch.Tensor, positions: torch.Tensor, cache: Any,
                 all_logits: bool = False, states: bool = False) -> LeanOutput:
        from transformers.cache_utils import DynamicCache

        if cache is None:
            cache = DynamicCache(config=self.config)
        rows, steps = int(ids.shape[0]), int(ids.shape[1])
        x = self.embed(ids)
        cos, sin = self.rotary(x, positions)
        # [rows, 1, 1, heads' dim]: broadcast over heads.
        cos, sin = cos.unsqueeze(2), sin.unsqueeze(2)
        attn_mask = _attention_mask(mask, steps)
        # A prefill of rows that all start at column 0 with no padding is plain causal attention,
        # which the kernel computes without a mask and without the blocks above the diagonal.
        causal = attn_mask is not None and steps == int(mask.shape[1]) and bool(mask.all())
        if causal:
            attn_mask = None
        for i, layer in enumerate(self.layers):
            x = layer(x, cos, sin, attn_mask, causal, cache, i, rows, steps)
        if states:
            x = self.norm(x)
            return LeanOutput(logits=self.lm_head(x[:, -1:].contiguous()), past_key_values=cache, hidden=x)
        if not all_logits:
            x = x[:, -1:]
        return LeanOutput(logits=self.lm_head(self.norm(x)), past_key_values=cache)

    def head(self, states: torch.Tensor) -> torch.Tensor:
        """Logits of final states [rows, positions, hidden] (`states=True`'s `hidden`)."""
        logits: torch.Tensor = self.lm_head(states)
        return logits


class _Layer:
    def __init__(self, layer: Any, pack: bool) -> None:
        attn, mlp = layer.self_attn, layer.mlp
        self.in_norm, self.post_norm = _Norm(layer.input_layernorm), _Norm(layer.post_attention_layernorm)
        self.head_dim = int(attn.head_dim)
        self.heads = int(attn.q_proj.weight.shape[0]) // self.head_dim
        self.kv_heads = int(attn.k_proj.weight.shape[0]) // self.head_dim
        self.scaling = float(attn.scaling)
        self.qkv = _Product(attn.q_proj, attn.k_proj, attn.v_proj, pack=pack)
        self.o = _Product(attn.o_proj, pack=pack)
        # Gate and up as two products, not one: SiLU then runs inside the gate's product (or over a
        # contiguous output), where over half of a fused output it made a strided pass 4x as slow.
        self.gate = _Product(mlp.gate_proj, pack=pack, silu=True)
        self.up = _Product(mlp.up_proj, pack=pack)
        self.down = _Product(mlp.down_proj, pack=pack)

    def __call__(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, attn_mask: torch.Tensor | None,
                 causal: bool, cache: Any, index: int, rows: int, steps: int) -> torch.Tensor:
        h, d, kvh = self.heads, self.head_dim, self.kv_heads
        qkv = self.qkv(self.in_norm(x)).view(rows, steps, h + 2 * kvh, d)
        # q and k are adjacent in the fused product: one rotation for both.
        qk = _rotate(qkv[:, :, : h + kvh], cos, sin)
        q = qk[:, :, :h].transpose(1, 2)
        k = qk[:, :, h:].transpose(1, 2)
        v = qkv[:, :, h + kvh:].transpose(1, 2)
        k, v = cache.layers[index].update(k, v) if index < len(cache.layers) else cache.update(k, v, index)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask, is_causal=causal, scale=self.scaling,
                                             enable_gqa=h != kvh)
        x = self.o(out.transpose(1, 2).reshape(rows, steps, h * d), residual=x)
        normed = self.post_norm(x)
        return self.down(self.gate(normed).mul_(self.up(normed)), residual=x)


class _Norm:
    """The model's RMSNorm in three passes over the activations, two of them in place, instead of five.

    The same arithmetic in the same order as the model's own (x * rsqrt(mean(x^2) + eps), then
    the weight; in fp32, back to the input's dtype before the weight): the values are equal. Not
    torch's fused `rms_norm`, which on CPU builds it from temporaries and took 2.5x as long here.
    """

    def __init__(self, norm: Any) -> None:
        self.weight = norm.weight
        self.eps = float(getattr(norm, "variance_epsilon", getattr(norm, "eps", 1e-6)))
        self.size = int(norm.weight.shape[0])

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        h = x if x.dtype == torch.float32 else x.float()
        scale = torch.mul(h, h).sum(-1, keepdim=True).div_(self.size).add_(self.eps).rsqrt_()
        normed = torch.mul(h, scale)
        if x.dtype == torch.float32:
            return normed.mul_(self.weight)
        return self.weight * normed.to(x.dtype)


class _Product:
    """One product for several linear layers that read the same input, over one [in, out] weight.

    The weight is held transposed ([in, out], contiguous): on CPU a product with few rows streams
    it from memory, and that layout reads it about twice as fast as the modules' [out, in] (one
    row: 76 against 148 us for a 256 x 768 weight out of cache, measured here). The modules keep
    views of it, so their own forward still works.

    On CPU (`pack`) the product also holds the weight in oneDNN's prepacked layout, a second copy:
    a plain matmul of several rows repacks its weight at every call (a quarter of a served decode
    step went to that copy), which for a few rows costs more than the arithmetic. Measured on one
    core with the weights out of cache, 4 rows: 768 x 2048 400 against 946 us, 2048 x 768 300
    against 665 us. One row is the exception: a matrix-vector product over the plain [in, out]
    layout streams it faster (344 against 488 us), so one row keeps the plain matmul.
    """

    def __init__(self, *linears: Any, pack: bool = False, silu: bool = False) -> None:
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
        self.packed = _pack(weight_t) if pack else None
        self.silu = silu

    def __call__(self, x: torch.Tensor, residual: torch.Tensor | None = None) -> torch.Tensor:
        """silu?(x @ W (+ bias)) (+ residual)."""
        if self.packed is not None and x.numel() > x.shape[-1]:
            if self.silu and self.bias is None and residual is None:
                return torch.ops.mkldnn._linear_pointwise(x, self.packed, None, "swish", [], "")
            if residual is not None and self.bias is None and not self.silu:
                return torch.ops.mkldnn._linear_pointwise.binary(x, residual, self.packed, None, "add")
            y = torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")
        else:
            y = torch.matmul(x, self.weight_t)
            if self.bias is not None:
                y = y + self.bias
        if self.silu:
            y = F.silu(y, inplace=True)
        return y if residual is None else residual + y


class _PackedHead:
    """A head tied to the embedding: the module's own weight for one row, a prepacked copy for more."""

    def __init__(self, head: Any) -> None:
        self.head = head
        self.packed = _pack(head.weight.data.t())

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if x.numel() == x.shape[-1]:
            return self.head(x)
        return torch.ops.mkldnn._linear_pointwise(x, self.packed, None, "none", [], "")


def _packing(weight: torch.Tensor) -> str:
    """Whether products over weights like this one can run on oneDNN's prepacked layout, else why not."""
    if weight.device.type != "cpu":
        return "not on CPU"
    if weight.dtype != torch.float32:
        return f"{weight.dtype} weights"
    if not torch.backends.mkldnn.is_available():
        return "this torch has no oneDNN"
    try:
        probe = torch.ones(8, 4)
        got = torch.ops.mkldnn._linear_pointwise(torch.ones(2, 4), _pack(probe.t()), None, "none", [], "")
    except (RuntimeError, AttributeError) as exc:
        return f"oneDNN linear unavailable: {str(exc).splitlines()[0][:120]}"
    if not torch.equal(got, torch.full((2, 8), 4.0)):
        return "oneDNN linear answered wrong on a probe"
    return "ok"


def _pack(weight_t: torch.Tensor) -> torch.Tensor:
    # The batch-size hint only has to be above 1 (1 asks for a matrix-vector layout): measured
    # alike for 4 to 8,192 rows.
    return torch.ops.mkldnn._reorder_linear_weight(weight_t.t().contiguous(), 16)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x * cos + rotate_half(x) * sin, in four operations over halves instead of six over the whole.

    The rotary tables repeat their frequencies over both halves (cos = cat(f, f)), so each half
    of the output is a product and one multiply-add of the input's halves.
    """
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    c, s = cos[..., :half], sin[..., :half]
    out = torch.empty_like(x)
    o1, o2 = out[..., :half], out[..., half:]
    torch.mul(x1, c, out=o1).addcmul_(x2, s, value=-1.0)
    torch.mul(x2, c, out=o2).addcmul_(x1, s)
    return out


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
    if not _halves_repeat(inner.rotary_emb, model):
        return None, "rotary tables whose halves differ"
    return LeanForward(model), "ok"


def _halves_repeat(rotary: Any, model: Any) -> bool:
    """Whether the rotary tables repeat their frequencies over both halves, as `_rotate` assumes."""
    weight = model.model.embed_tokens.weight
    probe = torch.zeros((1, 1, 1), dtype=weight.dtype, device=weight.device)
    positions = torch.arange(0, 64, 7, device=weight.device)[None, :]
    with torch.inference_mode():
        cos, sin = rotary(probe, positions)
    half = cos.shape[-1] // 2
    return bool(torch.equal(cos[..., :half], cos[..., half:]) and torch.equal(sin[..., :half], sin[..., half:]))
