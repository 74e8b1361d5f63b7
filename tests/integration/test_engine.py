"""The engine itself, in process on CPU with the built-in model: continuous batching as a user would observe it."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Iterator

import pytest
import torch

from gpu_watchdog.inference import model as model_mod
from gpu_watchdog.inference.admission import AdmissionGate
from gpu_watchdog.inference.engine import Engine
from gpu_watchdog.inference.engine_api import GenRequest, GenResult, SamplingParams
from gpu_watchdog.inference.errors import InferenceOOM
from gpu_watchdog.inference.faults import FaultInjector
from gpu_watchdog.inference.guard import Guard
from gpu_watchdog.inference.handlers.causal_lm import CausalLM

PROMPTS = [("the first prompt", 24), ("a second, rather longer prompt about memory", 9), ("x", 31),
           ("four", 17), ("prompt number five is here", 5), ("six", 40), ("seven sevens", 12)]


@pytest.fixture(scope="module")
def lm() -> model_mod.LoadedModel:
    return model_mod.load(None, torch.device("cpu"))


@pytest.fixture
def engine(lm: model_mod.LoadedModel) -> Iterator[Engine]:
    e = Engine(CausalLM(lm))
    yield e
    e.stop()


def solo(engine: Engine, prompt: str, n: int) -> str:
    [r] = engine.generate([GenRequest(engine.lm.codec.encode(prompt), n)])
    return r.text


def test_greedy_answers_equal_solo_runs_when_requests_join_and_leave_mid_batch(engine: Engine) -> None:
    alone = [solo(engine, p, n) for p, n in PROMPTS]
    codec = engine.lm.codec
    started = threading.Event()
    first = [engine._sequence(GenRequest(codec.encode(p), n, on_text=lambda _: started.set()))
             for p, n in PROMPTS[:3]]
    for seq in first:
        engine._decode.enqueue(seq)
    # The others arrive while the first ones are decoding: they join the running batch.
    assert started.wait(30)
    rest = [engine._sequence(GenRequest(codec.encode(p), n)) for p, n in PROMPTS[3:]]
    for seq in rest:
        engine._decode.enqueue(seq)
    together = [seq.future.result(timeout=60).text for seq in first + rest]
    assert together == alone
    probe = engine.probe()
    assert probe.largest_batch >= 4
    # Fewer forward passes than tokens: the steps were shared.
    assert probe.threads == 1


def test_a_stream_and_plain_requests_decode_in_the_same_steps(engine: Engine) -> None:
    pieces: list[str] = []
    before = engine.probe().forward_batches
    requests = [GenRequest(engine.lm.codec.encode(p), n) for p, n in PROMPTS]
    requests[0] = GenRequest(requests[0].prompt_ids, requests[0].max_tokens, on_text=pieces.append)
    results = engine.generate(requests)
    steps = engine.probe().forward_batches - before
    assert "".join(pieces) == results[0].text
    assert steps < sum(n for _, n in PROMPTS) // 3
    assert max(n for _, n in PROMPTS) <= steps


def test_admission_by_weight_is_never_exceeded_under_a_burst_of_mixed_lengths(lm: model_mod.LoadedModel) -> None:
    capacity = 120.0
    gate = AdmissionGate(capacity)
    seen: list[tuple[float, int]] = []
    e = Engine(CausalLM(lm), guard=Guard(gate=gate), cost=float)  # weight = prompt + max_tokens, in tokens
    loop = e._loop
    loop.on_step = lambda rows: seen.append((gate.stats().in_use, rows))
    try:
        codec = lm.codec
        streamed: list[str] = []
        mix = [(f"burst {i} " + "y" * (i % 7) * 5, 4 + (i * 13) % 40) for i in range(24)]
        requests = [GenRequest(codec.encode(p), n, on_text=streamed.append if i % 3 == 0 else None)
                    for i, (p, n) in enumerate(mix)]
        heavy = GenRequest(codec.encode("heavier than the whole budget " * 4), 60)
        results = e.generate([*requests, heavy])
    finally:
        e.stop()
    assert [r.completion_tokens for r in results[:-1]] == [n for _, n in mix]
    assert results[-1].completion_tokens == 60
    assert max(in_use for in_use, _ in seen) <= capacity
    assert max(rows for _, rows in seen) > 1
    assert gate.stats().in_use == 0 and gate.stats().holders == 0


def test_an_oom_shrinks_the_batch_and_the_retried_sequences_resume_where_they_were(
        lm: model_mod.LoadedModel) -> None:
    faults = FaultInjector()
    e = Engine(CausalLM(lm), guard=Guard(faults=faults))
    try:
        alone = [solo(e, p, n) for p, n in PROMPTS]
        # A card that holds three sequences: more in one step runs out of memory.
        faults.inject("memory_cap", {"sequences": 3})
        results = e.generate([GenRequest(lm.codec.encode(p), n) for p, n in PROMPTS])
    finally:
        e.stop()
    assert [r.text for r in results] == alone
    assert e.guard.oom_count >= 1
    assert e.probe().preemptions >= 1


def test_a_second_oom_answers_with_a_clean_error_and_the_engine_serves_on(lm: model_mod.LoadedModel) -> None:
    faults = FaultInjector()
    e = Engine(CausalLM(lm), guard=Guard(faults=faults))
    try:
        faults.inject("oom", {"count": 3})
        seqs = [e._sequence(GenRequest(lm.codec.encode(p), 5)) for p in ("one", "two")]
        for seq in seqs:
            e._decode.enqueue(seq)
        outcomes = [seq.future.exception(timeout=30) for seq in seqs]
        assert all(isinstance(o, InferenceOOM) for o in outcomes)
        [after] = e.generate([GenRequest(lm.codec.encode("fine again"), 4)])
        assert after.completion_tokens == 4
    finally:
        e.stop()


def test_the_canary_is_answered_at_the_next_step_under_full_load(lm: model_mod.LoadedModel) -> None:
    e = Engine(CausalLM(lm), guard=Guard(gate=AdmissionGate(2.0)))
    try:
        async def scenario() -> tuple[bool, list[bool], int]:
            codec = lm.codec
            long = [asyncio.ensure_future(e.submit(GenRequest(codec.encode(f"long {i}"), 400), 60))
                    for i in range(6)]
            while e.inflight < 2:
                await asyncio.sleep(0.01)
            waiting = e.queued
            result = await e.canary(timeout=30)
            done = [t.done() for t in long]
            for t in long:
                t.cancel()
            await asyncio.gather(*long, return_exceptions=True)
            return result.ok, done, waiting

        ok, done, waiting = asyncio.run(scenario())
    finally:
        e.stop()
    assert ok
    assert waiting == 4
    # Neither the running generations nor the queue had to finish first.
    assert not any(done)


def test_a_seeded_sample_is_the_same_alone_and_in_a_batch(engine: Engine) -> None:
    codec = engine.lm.codec
    seeded = GenRequest(codec.encode("roll the dice"), 20, SamplingParams(temperature=1.0, seed=42))
    [alone] = engine.generate([seeded])
    sampled = SamplingParams(temperature=1.0)
    batch = engine.generate([GenRequest(codec.encode(p), n, sampled) for p, n in PROMPTS[:4]]
                            + [GenRequest(codec.encode("roll the dice"), 20, SamplingParams(temperature=1.0, seed=42))])
    assert batch[-1].text == alone.text
    [other] = engine.generate([GenRequest(codec.encode("roll the dice"), 20,
                                          SamplingParams(temperature=1.0, seed=43))])
    assert other.text != alone.text


def test_stop_strings_end_generation_early(engine: Engine) -> None:
    full = solo(engine, "stop test", 40)
    stop = full[10:13]
    [r] = engine.generate([GenRequest(engine.lm.codec.encode("stop test"), 40, stop=(stop,))])
    assert r.finish_reason == "stop"
    assert r.text == full[: full.index(stop)]
    assert r.completion_tokens < 40


def test_a_model_whose_cache_cannot_be_stitched_is_still_served_correctly() -> None:
    from transformers import MistralConfig, MistralForCausalLM

    config = MistralConfig(vocab_size=258, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                           num_attention_heads=4, num_key_value_heads=4, sliding_window=8,
                           max_position_embeddings=256, pad_token_id=256, bos_token_id=257, eos_token_id=None)
    torch.manual_seed(0)
    model = MistralForCausalLM(config).eval()
    printable = torch.zeros(258, dtype=torch.bool)
    printable[32:127] = True  # one character per token, so texts compare token for token
    lm = model_mod.LoadedModel("sliding", model, model_mod.ByteCodec(), torch.device("cpu"), torch.float32, 256,
                               printable, model_mod.last_logits_only(model), model_mod.cache_keyword(model))
    e = Engine(CausalLM(lm))
    try:
        prompts = [("a sliding window", 20), ("b", 12), ("c is longer than the window", 16)]
        results: list[GenResult] = e.generate([GenRequest(lm.codec.encode(p), n) for p, n in prompts])
        for (p, n), r in zip(prompts, results, strict=True):
            assert [ord(c) for c in r.text] == model_mod.greedy_without_cache(lm, p, n)
    finally:
        e.stop()


def test_a_sequence_that_leaves_the_queue_after_an_oom_does_not_keep_the_batch_capped(
        lm: model_mod.LoadedModel) -> None:
    faults = FaultInjector()
    e = Engine(CausalLM(lm), guard=Guard(faults=faults))
    loop = e._decode
    try:
        faults.inject("memory_cap", {"sequences": 3})
        faults.inject("slow", {"delay_s": 0.05})
        seqs = [e._sequence(GenRequest(lm.codec.encode(p), 12)) for p in ("a", "b", "c", "d", "e", "f")]
        for seq in seqs:
            loop.enqueue(seq)
        # Six in one step on a card of three: the newest three step out and wait, holding the cap.
        stepped_out = None
        for _ in range(200):
            stepped_out = next((s for s in list(loop._waiting) if s.retried), None)
            if stepped_out is not None:
                break
            threading.Event().wait(0.01)
        assert stepped_out is not None
        # Its queue timeout (or its client leaving) takes it out of the queue.
        assert loop.withdraw(stepped_out)
        faults.inject("clear", {})
        for seq in seqs:
            if seq is not stepped_out:
                seq.future.result(timeout=60)
        e.reset_peak()
        e.generate([GenRequest(lm.codec.encode(p), 8) for p in ("g", "h", "i", "j", "k", "l")])
        assert e.probe().peak_active_sequences > 3
    finally:
        e.stop()


def test_the_queue_timeout_never_cuts_off_a_sequence_stepped_out_by_an_oom(lm: model_mod.LoadedModel) -> None:
    """The queue timeout bounds the wait for admission: one admitted, then stepped out by an OOM and
    waiting to resume, is answered in full however long that takes, never a 503 half-way."""
    faults = FaultInjector()
    e = Engine(CausalLM(lm), guard=Guard(faults=faults))
    prompts = ("a", "b", "c", "d", "e", "f")
    try:
        alone = [solo(e, p, 12) for p in prompts]
        # A card of three: the newest three step out and wait behind twelve slow steps (> 0.6 s),
        # far past their 0.3 s queue timeout.
        faults.inject("memory_cap", {"sequences": 3})
        faults.inject("slow", {"delay_s": 0.05})

        async def together() -> list[GenResult | BaseException]:
            return await asyncio.gather(*(e.submit(GenRequest(lm.codec.encode(p), 12), timeout=0.3)
                                          for p in prompts), return_exceptions=True)

        results = asyncio.run(together())
        preempted = e.probe().preemptions
    finally:
        e.stop()
    assert preempted >= 1
    assert [r.text if isinstance(r, GenResult) else repr(r) for r in results] == alone


def test_stop_returns_once_the_loop_thread_has_ended(lm: model_mod.LoadedModel) -> None:
    """A loop thread left inside torch when the interpreter exits aborts the process
    ("terminate called without an active exception"): stop() waits for it."""
    e = Engine(CausalLM(lm))
    [r] = e.generate([GenRequest(lm.codec.encode("one more"), 6)])
    assert r.completion_tokens >= 1
    thread = e._decode._thread
    e.stop()
    assert not thread.is_alive()


def test_a_prompt_over_the_prefill_budget_is_prefilled_in_chunks_while_the_batch_decodes(
        lm: model_mod.LoadedModel) -> None:
    codec = lm.codec
    long_prompt = "a long prompt that takes several chunks to prefill, " * 4  # 208 tokens
    chunked = Engine(CausalLM(lm), prefill_tokens=32)
    whole = Engine(CausalLM(lm))
    try:
        [expected] = whole.generate([GenRequest(codec.encode(long_prompt), 12)])
        order: list[str] = []
        started = threading.Event()

        def running(_: str) -> None:
            order.append("running")
            started.set()

        seq = chunked._sequence(GenRequest(codec.encode("a running one"), 60, on_text=running))
        chunked._decode.enqueue(seq)
        assert started.wait(30)
        [result] = chunked.generate([GenRequest(codec.encode(long_prompt), 12,
                                                on_text=lambda _: order.append("long"))])
        seq.future.result(timeout=60)
    finally:
        chunked.stop()
        whole.stop()
    # The cache built a chunk at a time gives the answer one pass over the prompt gives.
    assert result.text == expected.text
    # 208 tokens in chunks of 32 take 7 steps; the running sequence decoded at each of them.
    chunks = -(-len(codec.encode(long_prompt)) // 32)
    before_first = order.index("long") - order.index("running")
    assert before_first >= chunks - 1


def test_an_oom_in_a_chunk_sends_that_prompt_back_to_start_over_and_nothing_is_lost(
        lm: model_mod.LoadedModel) -> None:
    faults = FaultInjector()
    e = Engine(CausalLM(lm), guard=Guard(faults=faults), prefill_tokens=16)
    try:
        codec = lm.codec
        prompt = codec.encode("chunked prefill meets an out-of-memory error " * 2)
        [expected] = e.generate([GenRequest(prompt, 8)])
        [running_alone] = e.generate([GenRequest(codec.encode("keeps decoding"), 40)])
        started = threading.Event()
        running = e._sequence(GenRequest(codec.encode("keeps decoding"), 40, on_text=lambda _: started.set()))
        e._decode.enqueue(running)
        assert started.wait(30)
        # Prefills fail, decode steps do not: the long prompt's first chunk runs out of memory.
        faults.inject("oom", {"count": 1})
        [result] = e.generate([GenRequest(prompt, 8)])
        other = running.future.result(timeout=60)
    finally:
        e.stop()
    assert result.text == expected.text
    assert other.text == running_alone.text
    assert e.guard.oom_count == 1 and e.probe().preemptions == 1


SYSTEM = "You are a careful assistant who answers briefly and exactly. "  # 61 bytes: 3 whole blocks


@pytest.mark.parametrize("forward", ["lean", "transformers"])
def test_prompts_that_begin_alike_reuse_the_cached_beginning_and_answer_the_same(
        lm: model_mod.LoadedModel, forward: str) -> None:
    import dataclasses

    loaded = lm if forward == "lean" else dataclasses.replace(lm, lean=None)
    codec = lm.codec
    first = SYSTEM + "What is a GPU?"
    rest = [SYSTEM + "Name a colour.", SYSTEM + SYSTEM + "Again?", "an unrelated prompt", SYSTEM[:40] + "half"]
    plain, cached = Engine(CausalLM(loaded)), Engine(CausalLM(loaded))
    cached.enable_prefix_cache(64 << 20)
    try:
        expected = [r.text for r in plain.generate([GenRequest(codec.encode(p), 12) for p in [first, *rest]])]
        [alone] = cached.generate([GenRequest(codec.encode(first), 12)])
        # Joined in one prefill: rows with three, six, none and two cached blocks side by side.
        together = cached.generate([GenRequest(codec.encode(p), 12) for p in rest])
        [again] = cached.generate([GenRequest(codec.encode(rest[1]), 12)])
    finally:
        plain.stop()
        cached.stop()
    assert [alone.text, *(r.text for r in together)] == expected
    assert alone.cached_tokens == 0
    assert [r.cached_tokens for r in together] == [48, 48, 0, 32]
    # The second time, all of it was there but for its last token (BOS + 128 bytes: 8 whole blocks).
    assert again.text == expected[2] and again.cached_tokens == 128
    prefix = cached.prefix_cache
    assert prefix is not None and prefix.hit_tokens == 48 + 48 + 32 + 128


def test_a_long_prompt_prefilled_in_chunks_starts_after_its_cached_beginning(lm: model_mod.LoadedModel) -> None:
    codec = lm.codec
    long_prompt = SYSTEM * 3 + "and then a question that comes at the very end"
    plain, cached = Engine(CausalLM(lm)), Engine(CausalLM(lm), prefill_tokens=16)
    cached.enable_prefix_cache(64 << 20)
    try:
        [expected] = plain.generate([GenRequest(codec.encode(long_prompt), 10)])
        cached.generate([GenRequest(codec.encode(SYSTEM * 3), 2)])
        before = cached.probe().forward_batches
        [result] = cached.generate([GenRequest(codec.encode(long_prompt), 10)])
        forwards = cached.probe().forward_batches - before
    finally:
        plain.stop()
        cached.stop()
    assert result.text == expected.text and result.cached_tokens == 176
    # 229 tokens, 176 cached: the other 53 in 4 chunks of 16, then 9 decode steps.
    assert forwards == 4 + 9


def test_a_prompt_to_score_is_computed_whole_and_scores_the_same_with_the_cache_on(
        lm: model_mod.LoadedModel) -> None:
    codec = lm.codec
    prompt = codec.encode(SYSTEM + "score me")
    plain, cached = Engine(CausalLM(lm)), Engine(CausalLM(lm))
    cached.enable_prefix_cache(64 << 20)
    try:
        [expected] = plain.generate([GenRequest(prompt, 1, prompt_logprobs=2)])
        cached.generate([GenRequest(prompt, 1)])
        [scored] = cached.generate([GenRequest(prompt, 1, prompt_logprobs=2)])
    finally:
        plain.stop()
        cached.stop()
    assert scored.cached_tokens == 0
    assert scored.prompt_logprobs is not None and expected.prompt_logprobs is not None
    assert [e.logprob if e else None for e in scored.prompt_logprobs] == pytest.approx(
        [e.logprob if e else None for e in expected.prompt_logprobs], abs=1e-5)


def test_joiners_found_cached_are_prefilled_apart_and_stream_first(lm: model_mod.LoadedModel) -> None:
    codec = lm.codec
    e = Engine(CausalLM(lm))
    e.enable_prefix_cache(64 << 20)
    try:
        e.generate([GenRequest(codec.encode(SYSTEM * 2), 2)])
        first: list[str] = []
        cached = [SYSTEM * 2 + f"question {i}" for i in range(3)]
        fresh = [f"an uncached prompt of about the same length as the others, number {i}" * 2 for i in range(2)]
        requests = [GenRequest(codec.encode(p), 4, on_text=lambda _, name=name: first.append(name))
                    for name, p in [*(("cached", p) for p in cached), *(("fresh", p) for p in fresh)]]
        before = e.probe().forward_batches
        results = e.generate(requests)
        forwards = e.probe().forward_batches - before
    finally:
        e.stop()
    # The cached ones (a few tokens each) in one pass, the long uncached ones in another: the
    # cached three stream their first token before the second pass is computed.
    assert first[:3] == ["cached"] * 3 and "fresh" in first[3:5]
    assert [r.cached_tokens for r in results] == [112, 112, 112, 0, 0]
    assert forwards == 2 + 3  # two prefill passes, then three decode steps
