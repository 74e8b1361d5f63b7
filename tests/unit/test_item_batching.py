"""Request-level batching on traces: the window, the budgets, the order of forward passes, OOM retries;
and the `input` field's checks."""

from __future__ import annotations

import pytest

from gpu_watchdog.inference.handlers.inputs import InputLimits, token_items
from gpu_watchdog.inference.item_rules import BatchLimits, Item, after_oom, forwards, take
from gpu_watchdog.inference.validation import BadRequest


def limits(window_s: float = 0.0, max_items: int = 8, max_tokens: int = 1000, capacity: float = 64.0,
           in_use: float = 0.0) -> BatchLimits:
    return BatchLimits(max_items, max_tokens, window_s, capacity, in_use)


def queue(*tokens: int, arrived: float = 0.0) -> list[Item]:
    return [Item(t, 1.0, arrived) for t in tokens]


def test_window_zero_takes_what_is_queued_and_never_waits() -> None:
    assert take(queue(5, 5, 5), limits(), now=0.0).chosen == (0, 1, 2)
    assert take([], limits(), now=0.0).chosen == ()


def test_a_window_holds_the_batch_until_the_oldest_item_waited_it_out() -> None:
    q = queue(5, 5, arrived=10.0)
    waiting = take(q, limits(window_s=0.05), now=10.01)
    assert waiting.chosen == () and waiting.wait_s == pytest.approx(0.04)
    assert take(q, limits(window_s=0.05), now=10.05).chosen == (0, 1)


def test_a_full_batch_does_not_wait_for_the_window() -> None:
    assert take(queue(5, 5, 5), limits(window_s=1.0, max_items=2), now=0.0).chosen == (0, 1)
    assert take(queue(600, 600), limits(window_s=1.0, max_tokens=1000), now=0.0).chosen == (0,)


def test_the_canary_never_waits_and_joins_a_full_batch() -> None:
    q = [*queue(5, 5), Item(3, 0.0, 0.0, canary=True)]
    assert take(q, limits(window_s=1.0), now=0.0).chosen == (0, 1, 2)
    assert take(q, limits(max_items=1), now=0.0).chosen == (0, 2)


def test_first_come_first_served_a_long_item_is_not_starved_by_short_ones() -> None:
    # 400 + 700 passes the token budget: the 700 stops the batch, the 10 behind it waits its turn.
    assert take(queue(400, 700, 10), limits(max_tokens=1000), now=0.0).chosen == (0,)


def test_an_item_over_every_budget_still_runs_alone() -> None:
    assert take(queue(5000, 5), limits(max_tokens=1000), now=0.0).chosen == (0,)
    heavy = [Item(5, 100.0, 0.0), Item(5, 1.0, 0.0)]
    assert take(heavy, limits(capacity=4.0), now=0.0).chosen == (0,)


def test_the_admission_budget_bounds_the_batch() -> None:
    assert take(queue(1, 1, 1, 1), limits(capacity=2.0), now=0.0).chosen == (0, 1)
    # The control API lowered the budget under what others hold: nothing joins.
    assert take(queue(1), limits(capacity=2.0, in_use=2.0), now=0.0).chosen == ()


def test_forward_passes_are_sorted_by_length_and_cut_at_the_padded_budget() -> None:
    passes = forwards([100, 3, 50, 4, 100], max_tokens=200)
    assert passes == [[1, 3, 2], [0, 4]]
    assert all(len(p) * max([100, 3, 50, 4, 100][i] for i in p) <= 200 for p in passes)
    assert forwards([900], max_tokens=200) == [[0]]


def test_an_oom_splits_once_and_a_lone_item_or_a_retry_fails() -> None:
    assert after_oom(5, retried=False) == [(0, 3), (3, 5)]
    assert after_oom(1, retried=False) is None
    assert after_oom(4, retried=True) is None


def tokenize(texts: list[str]) -> list[list[int]]:
    return [[0, *(len(w) for w in t.split()), 1] for t in texts]


LIMITS = InputLimits(max_inputs=3, max_tokens=6, vocab_size=50)


@pytest.mark.parametrize(("value", "expected"), [
    ("a bb", [[0, 1, 2, 1]]),
    (["a", "bb"], [[0, 1, 1], [0, 2, 1]]),
    ([4, 5], [[4, 5]]),
    ([[4], [5, 6]], [[4], [5, 6]]),
])
def test_every_input_shape_the_sdks_send(value: object, expected: list[list[int]]) -> None:
    assert token_items(value, tokenize, LIMITS) == expected


@pytest.mark.parametrize(("value", "field", "words"), [
    (None, "input", "required"),
    ([], "input", "empty"),
    ("", "input", "empty"),
    (3.5, "input", "float"),
    (["a", 1], "input", "mix"),
    (["a", ""], "input[1]", "empty"),
    ([[1], []], "input[1]", "empty"),
    ([1, 99], "input", "49"),
    ([[1], [True]], "input[1]", "token id"),
    (["a"] * 4, "input", "at most 3"),
    ("a b c d e", "input", "at most 6"),
    ([[1], [1] * 7], "input[1]", "at most 6"),
])
def test_bad_input_names_the_field_and_the_limit(value: object, field: str, words: str) -> None:
    with pytest.raises(BadRequest) as err:
        token_items(value, tokenize, LIMITS)
    assert err.value.status == 400 and err.value.field == field and words in err.value.message
