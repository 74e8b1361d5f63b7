"""The lean forward pass computes what the model's own forward computes, and is taken only where it can."""

from __future__ import annotations

import copy
import dataclasses
from typing import Any

import pytest
import torch
import torch.nn.functional as F

from gpu_watchdog.inference import model as model_mod
from gpu_watchdog.inference.engine import Engine, GenRequest
from gpu_watchdog.inference.handlers.causal_lm import CausalLM
from gpu_watchdog.inference.kv import growing, prefill_inputs
from gpu_watchdog.inference.lean import lean_forward


def _llama(**overrides: Any) -> Any:
    from transformers import LlamaForCausalLM

    torch.manual_seed(0)
    return LlamaForCausalLM(model_mod.builtin_config(vocab_size=300, **overrides)).eval()


def _qwen2() -> Any:
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    config = Qwen2Config(vocab_size=300, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                         pad_token_id=0, use_sliding_window=False)
    model = Qwen2ForCausalLM(config).eval()
    with torch.no_grad():  # biases start at zero; make them count
        for layer in model.model.layers:
            for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
                proj.bias.normal_(0, 0.5)
    return model


MODELS = {
    "llama": lambda: _llama(),
    "llama-gqa": lambda: _llama(num_key_value_heads=2),
    "llama3-rope": lambda: _llama(rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0,
                                                   "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                                   "original_max_position_embeddings": 64}),
    "qwen2-biases": _qwen2,
}


# fp32 products summed in another order differ in the last bits, and 4 layers of weights drawn
# wide (the built-in model's 0.3) amplify that: both this pass and the model's own fp32 forward land
# about 1e-5 (relative) from the same model in fp64. A wrong rotation, mask or cache is off by 1e-1.
TOLERANCE = 5e-5


def _close(ours: torch.Tensor, exact: torch.Tensor) -> bool:
    return float((ours.double() - exact).abs().max()) <= TOLERANCE * max(1.0, float(exact.abs().max()))


@pytest.mark.parametrize("name", sorted(MODELS))
def test_prefill_and_decode_logits_match_the_model_computed_in_fp64(name: str) -> None:
    reference = MODELS[name]()
    exact = copy.deepcopy(reference).double()
    model = copy.deepcopy(reference)
    lean, why = lean_forward(model)
    assert lean is not None, why
    prompts = [list(range(5, 40)), [7, 8], list(range(100, 120))]
    ids, mask, positions = prefill_inputs(prompts, 0, torch.device("cpu"))
    real = mask.bool()
    keyword = model_mod.cache_keyword(exact)
    with torch.inference_mode():
        ours = lean(ids, mask, positions, None, all_logits=True)
        theirs = exact(input_ids=ids, attention_mask=mask, position_ids=positions, use_cache=True)
        assert _close(ours.logits[real], theirs.logits[real])
        assert not torch.isnan(ours.logits).any()  # padded positions too: NaN would leak through the cache
        mine = ours.past_key_values
        refs = getattr(theirs, "cache", None) or theirs.past_key_values
        growing(mine)
        step = theirs.logits[:, -1].argmax(-1, keepdim=True)
        for _ in range(8):
            positions = mask.sum(1, keepdim=True)
            mask = F.pad(mask, (0, 1), value=1)
            ours = lean(step, mask, positions, mine)
            theirs = exact(input_ids=step, attention_mask=mask, position_ids=positions, use_cache=True,
                           **{keyword: refs})
            assert ours.logits.shape == (3, 1, model.config.vocab_size)
            assert _close(ours.logits[:, -1], theirs.logits[:, -1])
            step = theirs.logits[:, -1].argmax(-1, keepdim=True)


def test_the_lean_pass_keeps_the_weights_in_place_without_a_second_copy() -> None:
    model = _llama()
    reference = copy.deepcopy(model)
    before = sum(p.numel() for p in model.parameters())
    lean, _ = lean_forward(model)
    assert lean is not None
    attn = model.model.layers[0].self_attn
    fused = lean.layers[0].qkv.weight_t
    # q, k and v are views of one [in, out] tensor: fusing them holds nothing twice...
    for proj in (attn.q_proj, attn.k_proj, attn.v_proj):
        assert proj.weight.untyped_storage().data_ptr() == fused.untyped_storage().data_ptr()
    assert sum(p.numel() for p in model.parameters()) == before
    # ...and they are the same weights, which the model's own forward still uses.
    for mine, theirs in zip(model.parameters(), reference.parameters(), strict=True):
        assert torch.equal(mine, theirs)
    ids = torch.tensor([[5, 6, 7, 8]])
    with torch.inference_mode():
        assert torch.allclose(model(input_ids=ids).logits, reference(input_ids=ids).logits, atol=1e-5)


def test_the_engine_answers_the_same_through_either_forward() -> None:
    lm = model_mod.load_builtin(torch.device("cpu"))
    assert lm.lean is not None and lm.forward_path == "lean"
    generic = dataclasses.replace(lm, lean=None)
    prompts = ["hello there", "a", "a much longer prompt than the others, to pad them", "mid"]
    answers = []
    for loaded in (lm, generic):
        engine = Engine(CausalLM(loaded))
        try:
            results = engine.generate([GenRequest(lm.codec.encode(p), max_tokens=14) for p in prompts])
        finally:
            engine.stop()
        answers.append([r.text for r in results])
    assert answers[0] == answers[1]
    assert len(set(answers[0])) == len(prompts)
    # and cached decoding through the lean pass equals recomputing every step with the model's own
    assert answers[0][0] == lm.codec.decoder().feed(model_mod.greedy_without_cache(lm, prompts[0], 14))


def test_architectures_it_does_not_reproduce_keep_their_own_forward() -> None:
    from transformers import MistralConfig, MistralForCausalLM

    sliding = MistralForCausalLM(MistralConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                               num_attention_heads=2, num_key_value_heads=2, sliding_window=8))
    assert lean_forward(sliding) == (None, "sliding-window attention")
    gelu = _llama(hidden_act="gelu")
    assert lean_forward(gelu)[0] is None and "gelu" in lean_forward(gelu)[1]

    wrapped = _llama()

    class Adapter(torch.nn.Linear):
        pass

    adapter = Adapter(256, 256, bias=False)
    adapter.weight.data = wrapped.model.layers[1].self_attn.o_proj.weight.data
    wrapped.model.layers[1].self_attn.o_proj = adapter
    before = wrapped.model.layers[0].self_attn.q_proj.weight.data_ptr()
    lean, why = lean_forward(wrapped)
    assert lean is None and "Adapter" in why
    # declined before anything was laid out anew
    assert wrapped.model.layers[0].self_attn.q_proj.weight.data_ptr() == before

    class Other(torch.nn.Module):
        pass

    lean, why = lean_forward(Other())
    assert lean is None and "Other" in why
