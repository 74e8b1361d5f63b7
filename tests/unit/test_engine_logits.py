"""Generation asks the model for the last position's logits only, and answers exactly as before."""

from __future__ import annotations

import dataclasses

import torch

from gpu_watchdog.inference.engine import Engine, GenRequest
from gpu_watchdog.inference.handlers.causal_lm import CausalLM
from gpu_watchdog.inference.model import cache_keyword, greedy_without_cache, last_logits_only, load_builtin


def _texts(engine: Engine, prompts: list[str]) -> list[str]:
    codec = engine.lm.codec
    results = engine.generate([GenRequest(prompt_ids=codec.encode(p), max_tokens=12) for p in prompts])
    return [r.text for r in results]


def test_last_logits_only_gives_the_same_answers_as_full_logits() -> None:
    # The model's own forward takes the argument; the lean pass (inference.lean) never computes more.
    lm = dataclasses.replace(load_builtin(torch.device("cpu")), lean=None)
    assert lm.forward_extra == {"logits_to_keep": 1}
    ids = torch.tensor([lm.codec.encode("twelve bytes")])
    with torch.no_grad():
        assert lm.model(input_ids=ids, **lm.forward_extra).logits.shape[1] == 1
    # Different lengths: the batch is left-padded, so "last position" must be each row's own last token.
    prompts = ["a", "a much longer prompt than the first one", "mid-sized prompt"]
    trimmed = _texts(Engine(CausalLM(lm)), prompts)
    full = _texts(Engine(CausalLM(dataclasses.replace(lm, forward_extra={}))), prompts)
    assert trimmed == full
    assert len(set(trimmed)) == 3


def test_models_without_the_argument_get_no_extra_arguments() -> None:
    class Plain(torch.nn.Module):
        def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None) -> torch.Tensor:
            return input_ids

    class Trimming(torch.nn.Module):
        def forward(self, input_ids: torch.Tensor, logits_to_keep: int = 0) -> torch.Tensor:
            return input_ids

    assert last_logits_only(Plain()) == {}
    assert last_logits_only(Trimming()) == {"logits_to_keep": 1}


def test_cached_decoding_matches_recomputing_every_step() -> None:
    """The KV cache reaches the model under the keyword its transformers release uses: a wrong one
    is silently ignored, and every step would see only its new token."""
    lm = dataclasses.replace(load_builtin(torch.device("cpu")), lean=None)
    assert lm.cache_kwarg == cache_keyword(lm.model)
    codec = lm.codec
    for prompt in ("hello there", "a"):
        [result] = Engine(CausalLM(lm)).generate([GenRequest(prompt_ids=codec.encode(prompt), max_tokens=10)])
        reference = greedy_without_cache(lm, prompt, 10)
        assert result.text == codec.decoder().feed(reference)
    broken = dataclasses.replace(lm, cache_kwarg="kv_cache_under_a_name_nobody_reads")
    [garbled] = Engine(CausalLM(broken)).generate([GenRequest(prompt_ids=codec.encode("hello there"), max_tokens=10)])
    assert garbled.text != codec.decoder().feed(greedy_without_cache(lm, "hello there", 10))


def test_the_cache_keyword_follows_the_forward_signature() -> None:
    class New(torch.nn.Module):
        def forward(self, input_ids: torch.Tensor, cache: object = None) -> torch.Tensor:
            return input_ids

    class Old(torch.nn.Module):
        def forward(self, input_ids: torch.Tensor, past_key_values: object = None) -> torch.Tensor:
            return input_ids

    assert cache_keyword(New()) == "cache" and cache_keyword(Old()) == "past_key_values"
