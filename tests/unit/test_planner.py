from __future__ import annotations

import pytest

from gpu_watchdog.inference.planner import CostModel, PlanError, plan

GiB = 2**30


def test_seed_worked_example() -> None:
    # 24 GiB card, 15 GiB base after warm-up, 3 GiB reserve, 2 GiB peak per request -> 3.
    p = plan(24 * GiB, 15 * GiB, 2 * GiB, reserve_bytes=3 * GiB)
    assert p.max_concurrency == 3
    assert p.budget_bytes == 6 * GiB
    assert "maxConcurrency: 3" in p.helm_values()


def test_reserve_is_at_least_ten_percent() -> None:
    p = plan(24 * GiB, 15 * GiB, 2 * GiB, reserve_bytes=0)
    assert p.reserve_bytes == pytest.approx(2.4 * GiB, rel=1e-6)
    assert any("at least 10 %" in n for n in p.notes)


def test_workers_on_one_gpu_divide_the_budget() -> None:
    # The seed: two workers with 15 GiB each do not fit on a 24 GiB card at all.
    with pytest.raises(PlanError, match="no memory left"):
        plan(24 * GiB, 15 * GiB, 2 * GiB, reserve_bytes=3 * GiB, workers=2)
    p = plan(80 * GiB, 15 * GiB, 2 * GiB, reserve_ratio=0.125, workers=2)
    assert p.max_concurrency == (80 * GiB - 10 * GiB - 30 * GiB) // 2 // (2 * GiB)


def test_context_counts_once_per_worker() -> None:
    a = plan(24 * GiB, 14 * GiB, 1 * GiB, reserve_bytes=3 * GiB, context_bytes=1 * GiB)
    assert a.max_concurrency == 6
    assert a.base_bytes == 15 * GiB


@pytest.mark.parametrize("bad", [dict(total_bytes=0), dict(peak_bytes=0), dict(base_bytes=-1), dict(workers=0)])
def test_bad_inputs_are_named(bad: dict[str, int]) -> None:
    args = dict(total_bytes=24 * GiB, base_bytes=15 * GiB, peak_bytes=2 * GiB) | bad
    with pytest.raises(PlanError):
        plan(**args)


def test_cost_model_fit_is_linear_in_length() -> None:
    m = CostModel.fit(16, 100.0 + 16 * 10.0, 1016, 100.0 + 1016 * 10.0)
    assert m.per_token_bytes == pytest.approx(10.0)
    assert m.fixed_bytes == pytest.approx(100.0)
    assert m.peak_bytes(2000) == pytest.approx(20100.0)
