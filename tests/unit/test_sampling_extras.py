"""The sampler's extra knobs on known logits: what each does to the scores, and the reported log-probabilities."""

from __future__ import annotations

import math

import torch

from gpu_watchdog.inference.engine_api import SamplingParams
from gpu_watchdog.inference.sampling import RowTokens, StopText, adjust, sample, token_logprobs

LOGITS = torch.tensor([2.0, -1.0, 0.5, 4.0, -3.0])


def test_repetition_penalty_divides_positive_and_multiplies_negative_scores_of_seen_tokens() -> None:
    out = adjust(LOGITS, SamplingParams(repetition_penalty=2.0), RowTokens(prompt=[0], generated=[1]))
    assert out.tolist() == [1.0, -2.0, 0.5, 4.0, -3.0]


def test_presence_and_frequency_penalties_count_generated_tokens_only() -> None:
    p = SamplingParams(presence_penalty=0.5, frequency_penalty=1.0)
    out = adjust(LOGITS, p, RowTokens(prompt=[2, 2], generated=[3, 3, 1]))
    assert out.tolist() == [2.0, -2.5, 0.5, 1.5, -3.0]


def test_bias_and_min_tokens_hold_back_the_end_tokens() -> None:
    p = SamplingParams(logit_bias=((4, 10.0),), min_tokens=2, stop_token_ids=(0,))
    early = adjust(LOGITS, p, RowTokens(prompt=[], generated=[1], eos_id=3))
    assert early[0] == -math.inf and early[3] == -math.inf and early[4] == 7.0
    late = adjust(LOGITS, p, RowTokens(prompt=[], generated=[1, 1], eos_id=3))
    assert late[3] == 4.0
    assert sample(LOGITS[None], [p], [None], [RowTokens([], [1], 3)]) == [4]


def test_top_k_and_min_p_sample_only_among_the_kept_tokens() -> None:
    gen = torch.Generator().manual_seed(0)
    for p in (SamplingParams(temperature=1.0, top_k=2), SamplingParams(temperature=1.0, min_p=0.1)):
        picks = {sample(LOGITS[None], [p], [gen])[0] for _ in range(200)}
        assert picks == {0, 3}, p


def test_logprobs_put_the_chosen_token_first_then_the_best_others() -> None:
    [entry] = token_logprobs(LOGITS[None], [2], 2)
    logp = torch.log_softmax(LOGITS, dim=-1)
    assert entry.token_id == 2 and abs(entry.logprob - float(logp[2])) < 1e-6
    assert [t for t, _ in entry.top] == [2, 3, 0]
    [greedy] = token_logprobs(LOGITS[None], [3], 2)
    assert [t for t, _ in greedy.top] == [3, 0]


def test_stop_string_kept_in_the_output_when_asked() -> None:
    kept, dropped = StopText(["END"], include_stop=True), StopText(["END"])
    for piece in ("abc", "EN", "Dxyz"):
        kept.feed(piece)
        dropped.feed(piece)
    assert kept.text == "abcEND" and dropped.text == "abc"
