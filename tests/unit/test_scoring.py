"""Scoring a prompt (`echo` + `logprobs`) in bounded chunks: the same log-probabilities as the whole
computation, logits of at most a chunk of positions alive at once, and an admission weight that
counts them."""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest
import torch

from gpu_watchdog.inference import scoring
from gpu_watchdog.inference.engine import Engine, GenRequest
from gpu_watchdog.inference.engine_api import TokenLogprob
from gpu_watchdog.inference.handlers.causal_lm import CausalLM
from gpu_watchdog.inference.lean import lean_forward
from gpu_watchdog.inference.model import LoadedModel, load_builtin
from gpu_watchdog.inference.planner import CostModel
from gpu_watchdog.inference.sampling import token_logprobs
from gpu_watchdog.inference.service import Admission

PROMPT = "a prompt to score, long enough to cross several chunks of both kinds: " * 2
K = 3


def _builtin(lean: bool, dtype: torch.dtype) -> LoadedModel:
    lm = load_builtin(torch.device("cpu"), lean=lean)
    if dtype == lm.dtype:
        return lm
    model = lm.model.to(dtype)
    return dataclasses.replace(lm, model=model, dtype=dtype, lean=lean_forward(model)[0] if lean else None)


class _Capped(torch.nn.Module):
    """A model whose forward soft-caps its head's logits (as Gemma 2 does): the head cannot be split off."""

    def __init__(self, inner: Any) -> None:
        super().__init__()
        self.inner = inner
        self.config = inner.config

    def get_output_embeddings(self) -> Any:
        return self.inner.get_output_embeddings()

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        out = self.inner(*args, **kwargs)
        out.logits = 4.0 * torch.tanh(out.logits / 4.0)
        return out


def _reference(lm: LoadedModel, prompt: list[int]) -> list[TokenLogprob]:
    """The whole computation: every position's logits from one plain forward, then the log-softmax."""
    with torch.inference_mode():
        logits = lm.model(input_ids=torch.tensor([prompt])).logits[0, :-1].float()
    assert lm.allowed_tokens is not None
    logits = logits.masked_fill(~lm.allowed_tokens[: logits.shape[-1]], float("-inf"))
    return token_logprobs(logits, prompt[1:], K)


def _scored(lm: LoadedModel, prompt: list[int], **engine: Any) -> list[TokenLogprob]:
    e = Engine(CausalLM(lm), **engine)
    try:
        [result] = e.generate([GenRequest(prompt, 2, prompt_logprobs=K)])
    finally:
        e.stop()
    assert result.prompt_logprobs is not None and result.prompt_logprobs[0] is None
    entries = [x for x in result.prompt_logprobs[1:] if x is not None]
    assert len(entries) == len(prompt) - 1
    return entries


def _same(ours: list[TokenLogprob], exact: list[TokenLogprob], tol: float) -> None:
    """Equal tokens and alternatives, log-probabilities within `tol` relative (and absolute, near 0)."""
    assert [e.token_id for e in ours] == [e.token_id for e in exact]
    assert [[t for t, _ in e.top] for e in ours] == [[t for t, _ in e.top] for e in exact]
    values = [v for e in ours for _, v in e.top]
    assert values == pytest.approx([v for e in exact for _, v in e.top], abs=tol, rel=tol)


@pytest.mark.parametrize("lean", [True, False], ids=["lean", "transformers"])
# `tol`: against the same engine computing it whole; `ref`: against a plain forward of the model, which in
# fp32 the lean pass matches within 5e-5 of each logit (README), 1e-3 of a log-probability (as vLLM's).
@pytest.mark.parametrize(("dtype", "tol", "ref"), [(torch.float32, 1e-5, 1e-3), (torch.float64, 1e-12, 1e-10)],
                         ids=["fp32", "fp64"])
def test_chunked_scoring_equals_the_whole_computation(lean: bool, dtype: torch.dtype, tol: float, ref: float) -> None:
    lm = _builtin(lean, dtype)
    assert scoring.split_head(lm)[0] is not None
    prompt = lm.codec.encode(PROMPT)
    assert len(prompt) > 100
    whole = _scored(lm, prompt, prefill_tokens=1024, score_chunk=1024)
    # Logits 7 positions at a time, prefilled 32 tokens a step: neither divides the prompt.
    chunked = _scored(lm, prompt, prefill_tokens=32, score_chunk=7)
    _same(chunked, whole, tol)
    _same(chunked, _reference(lm, prompt), ref)


def test_the_head_sees_at_most_a_chunk_of_positions() -> None:
    lm = _builtin(False, torch.float32)
    head = lm.model.get_output_embeddings()
    widths: list[int] = []
    handle = head.register_forward_hook(lambda _m, _args, out: widths.append(int(out.shape[1])))
    try:
        prompt = lm.codec.encode(PROMPT)
        _scored(lm, prompt, prefill_tokens=1024, score_chunk=9)
    finally:
        handle.remove()
    # The probe at start (a few tokens), then the pass's last position and the chunks, never the prompt.
    assert widths and max(widths[1:]) == 9 and len(prompt) > 9


def test_a_forward_that_changes_its_heads_logits_scores_them_whole_and_the_same() -> None:
    base = _builtin(False, torch.float64)
    lm = dataclasses.replace(base, model=_Capped(base.model))
    head, why = scoring.split_head(lm)
    assert head is None and "soft-capping" in why
    prompt = lm.codec.encode(PROMPT)
    _same(_scored(lm, prompt, prefill_tokens=32, score_chunk=7), _reference(lm, prompt), 1e-10)


def _weights(engine: Engine, tokens: int) -> tuple[float, float]:
    ids = [65] * tokens
    return engine.weight(GenRequest(ids, 16)), engine.weight(GenRequest(ids, 16, prompt_logprobs=1))


@pytest.mark.parametrize("mode", ["bytes", "slots"])
def test_a_scored_prompt_weighs_its_logits_more_with_a_longer_prompt(mode: str) -> None:
    lm = load_builtin(torch.device("cpu"))
    worst = lm.context_len
    cost = CostModel(fixed_bytes=1 << 20, per_token_bytes=16 << 10) if mode == "bytes" else None
    admission = Admission(mode, 4.0, 4, cost, worst, None, "test", float(scoring.kv_bytes(lm, worst)))
    chunk = 64
    engine = Engine(CausalLM(lm), cost=admission.cost, bytes_cost=admission.bytes_cost, score_chunk=chunk)
    try:
        engine.generate([GenRequest([65, 66], 1)])  # the loop has decided how its head is split
        extras = []
        for tokens in (10, 40, 200, 800):
            plain, scored = _weights(engine, tokens)
            assert scored > plain
            extras.append(scored - plain)
        # Up to a chunk the logits grow with the prompt; past it, a chunk's worth at most.
        assert extras[0] < extras[1] < extras[2] == extras[3]
        per_byte = 1.0 if mode == "bytes" else 1.0 / scoring.kv_bytes(lm, worst)
        assert extras[2] == pytest.approx(scoring.COPIES * 4 * lm.vocab_size * chunk * per_byte)
        if mode == "bytes":
            assert _weights(engine, 800)[0] > _weights(engine, 200)[0]  # a longer sequence costs more anyway
    finally:
        engine.stop()
    # A model whose head cannot be split off holds a whole pass of logits: the prefill budget's worth.
    capped = dataclasses.replace(lm, model=_Capped(lm.model), lean=None)
    engine = Engine(CausalLM(capped), cost=admission.cost, bytes_cost=admission.bytes_cost, score_chunk=chunk,
                    prefill_tokens=256)
    try:
        engine.generate([GenRequest([65, 66], 1)])
        whole = [s - p for p, s in (_weights(engine, t) for t in (200, 800))]
        assert whole[0] == pytest.approx(extras[2] * 200 / chunk)
        assert whole[1] == pytest.approx(extras[2] * 256 / chunk)
    finally:
        engine.stop()


def test_one_slot_stands_for_a_longest_sequences_keys_and_values() -> None:
    lm = load_builtin(torch.device("cpu"))
    config = lm.model.config
    per_token = 2 * config.num_hidden_layers * config.num_key_value_heads * (config.hidden_size
                                                                             // config.num_attention_heads) * 4
    assert scoring.kv_bytes(lm, 1000) == per_token * 1000
    unknown = Admission("slots", 4.0, 4, None, 1000, None, "test")
    assert unknown.bytes_cost(1.0) == 1.0 and unknown.bytes_cost(0.0) == 0.0
