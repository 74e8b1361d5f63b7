"""The pure rules of continuous batching: who joins the next step, what an OOM does, stop strings, sampling."""

from __future__ import annotations

import torch

from gpu_watchdog.inference.batch import Candidate, Room, take
from gpu_watchdog.inference.engine_api import SamplingParams
from gpu_watchdog.inference.recovery import Row, plan
from gpu_watchdog.inference.sampling import StopText, new_generator, sample


def room(rows: int = 0, max_rows: int = 8, in_use: float = 0.0, capacity: float = 4.0, join: bool = True) -> Room:
    return Room(rows=rows, max_rows=max_rows, in_use=in_use, capacity=capacity, can_join_running=join)


def test_waiting_requests_join_in_order_while_the_budget_lasts() -> None:
    waiting = [Candidate(1.0), Candidate(1.0), Candidate(1.0)]
    assert take(waiting, room(in_use=1.0, capacity=3.0)) == [0, 1]
    assert take(waiting, room(in_use=3.0, capacity=3.0)) == []


def test_a_heavy_request_at_the_head_is_not_overtaken_by_light_ones() -> None:
    waiting = [Candidate(3.0), Candidate(0.5), Candidate(0.5)]
    assert take(waiting, room(in_use=2.0, capacity=4.0)) == []


def test_a_request_heavier_than_the_whole_budget_runs_alone() -> None:
    assert take([Candidate(10.0), Candidate(1.0)], room(capacity=4.0)) == [0]
    assert take([Candidate(10.0)], room(rows=1, in_use=1.0, capacity=4.0)) == []


def test_rows_are_capped_by_the_batch_size() -> None:
    waiting = [Candidate(0.1) for _ in range(5)]
    assert take(waiting, room(rows=6, max_rows=8, capacity=100.0)) == [0, 1]


def test_the_canary_always_joins_even_with_no_room_left() -> None:
    waiting = [Candidate(1.0), Candidate(0.0, canary=True), Candidate(1.0)]
    assert take(waiting, room(rows=8, max_rows=8, in_use=4.0)) == [1]


def test_a_preempted_sequence_keeps_its_share_and_only_needs_a_row() -> None:
    waiting = [Candidate(3.0, holds_grant=True), Candidate(3.0)]
    assert take(waiting, room(rows=1, in_use=4.0, capacity=4.0)) == [0]


def test_nothing_joins_a_running_batch_whose_cache_cannot_be_stitched() -> None:
    assert take([Candidate(1.0)], room(rows=1, join=False)) == []
    assert take([Candidate(1.0), Candidate(1.0)], room(rows=0, join=False)) == [0, 1]


def test_an_oom_sends_the_newest_half_back_and_lowers_the_ceiling() -> None:
    decision = plan([Row(False), Row(False), Row(False), Row(False), Row(False)])
    assert decision.preempt == (3, 4)
    assert decision.fail == ()
    assert decision.ceiling == 3


def test_a_second_oom_or_a_lone_sequence_gets_a_503_not_another_retry() -> None:
    assert plan([Row(False)]) == plan([Row(True)])
    assert plan([Row(False)]).fail == (0,)
    decision = plan([Row(False), Row(False), Row(True), Row(False, canary=True)])
    assert decision.preempt == ()
    assert decision.fail == (2, 3)
    assert decision.ceiling == 2


def test_stop_strings_end_the_text_and_are_never_emitted_even_in_pieces() -> None:
    s = StopText(["END", "\n\n"])
    emitted = "".join(s.feed(p) for p in ["hel", "lo E", "N", "Dtail"])
    assert s.stopped
    assert emitted == "hello " and s.text == "hello "
    s = StopText(["END"])
    out = "".join(s.feed(p) for p in ["abc", "EN", "x"]) + s.flush()
    assert not s.stopped and out == "abcENx" == s.text


def test_seeded_sampling_repeats_and_greedy_rows_stay_argmax() -> None:
    logits = torch.randn(3, 50, generator=torch.Generator().manual_seed(0))
    logits[2] = logits[0]  # the same request twice in one batch: the same draw
    params = [SamplingParams(1.0, 1.0, 7), SamplingParams(0.0), SamplingParams(1.0, 1.0, 7)]
    first = sample(logits, params, [new_generator(p, torch.device("cpu")) for p in params])
    again = sample(logits, params, [new_generator(p, torch.device("cpu")) for p in params])
    assert first == again
    assert first[0] == first[2]
    assert first[1] == int(logits[1].argmax())


def test_top_p_keeps_only_the_most_likely_tokens() -> None:
    logits = torch.tensor([[5.0, 4.9, -5.0, -5.0, -5.0]])
    params = [SamplingParams(1.0, 0.5, None)]
    drawn = {sample(logits, params, [None])[0] for _ in range(50)}
    assert drawn <= {0, 1}
    drawn = {sample(logits, [SamplingParams(1.0, 0.4, None)], [None])[0] for _ in range(20)}
    assert drawn == {0}


def test_one_waiting_for_budget_never_stops_a_preempted_one_behind_it() -> None:
    # The budget was lowered below what the preempted sequences hold: only they can free it.
    waiting = [Candidate(1.0), Candidate(1.0, holds_grant=True), Candidate(1.0), Candidate(1.0, holds_grant=True)]
    assert take(waiting, room(rows=0, max_rows=4, in_use=12.0, capacity=7.0)) == [1, 3]
    assert take(waiting, room(rows=3, max_rows=4, in_use=12.0, capacity=7.0)) == [1]  # rows still bind


def test_one_step_prefills_at_most_its_budget_of_prompt_tokens() -> None:
    budgeted = Room(rows=0, max_rows=64, in_use=0.0, capacity=64.0, prefill_tokens=1024)
    waiting = [Candidate(1.0, tokens=256) for _ in range(6)]
    # 4 x 256 fit; the fifth would take the step to 1280.
    assert take(waiting, budgeted) == [0, 1, 2, 3]
    # What they compute counts (a cached beginning costs nothing), in order: past 1,024, the rest waits.
    mixed = [Candidate(1.0, tokens=100), Candidate(1.0, tokens=600), Candidate(1.0, tokens=400),
             Candidate(1.0, tokens=10)]
    assert take(mixed, budgeted) == [0, 1]


def test_a_prompt_over_the_budget_still_joins_alone_and_the_canary_joins_beside_it() -> None:
    budgeted = Room(rows=3, max_rows=64, in_use=3.0, capacity=64.0, prefill_tokens=512)
    waiting = [Candidate(1.0, tokens=5000), Candidate(0.0, canary=True, tokens=2), Candidate(1.0, tokens=8)]
    assert take(waiting, budgeted) == [0, 1]
    # Once the budget is spent, later arrivals wait for the next step; the canary never does.
    spent = [Candidate(1.0, tokens=400), Candidate(1.0, tokens=400), Candidate(0.0, canary=True, tokens=2)]
    assert take(spent, budgeted) == [0, 2]


def test_joiners_are_prefilled_in_passes_of_like_lengths_the_shortest_first() -> None:
    from gpu_watchdog.inference.batch import passes

    # Five prompts found cached but for 16 tokens beside two that compute all 258: two passes,
    # the cheap one first, instead of one pass 258 wide for everyone.
    assert passes([16, 258, 16, 16, 258, 2, 16]) == [[0, 2, 3, 5, 6], [1, 4]]
    # Alike lengths stay in one pass; every index comes out once.
    assert passes([250, 256, 240, 256]) == [[0, 1, 2, 3]]
    # A few short ones beside many long ones would pad little in all, but wait a long pass for nothing.
    assert passes([130] * 13 + [16] * 3) == [[13, 14, 15], list(range(13))]
    lengths = [1, 7, 300, 64, 65, 900, 3, 250]
    out = passes(lengths)
    assert sorted(i for p in out for i in p) == list(range(len(lengths)))
    for p in out:
        widest = max(lengths[i] for i in p)
        if widest > 64:
            assert len(p) * widest - sum(lengths[i] for i in p) <= 0.25 * len(p) * widest
            assert all(2 * lengths[i] >= widest for i in p)
    # Short rows share a pass whatever their padding: another forward would cost more.
    assert passes([1, 7, 64, 3]) == [[0, 1, 2, 3]]
    assert [max(lengths[i] for i in p) for p in out] == sorted(max(lengths[i] for i in p) for p in out)
