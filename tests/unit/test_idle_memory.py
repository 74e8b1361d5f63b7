"""Active memory at idle against the process's own baseline, on recorded traces."""

from __future__ import annotations

from functools import reduce

from gpu_watchdog.watchdog.core.idle_memory import WARN_RATIO, IdleMemory, observe
from gpu_watchdog.watchdog.core.samples import TorchSample

GiB = 1 << 30
TOTAL = 80 * GiB


def cuda(at: float, active: float, inflight: int = 0, queued: int = 0, instance: str = "a",
         **extra: object) -> TorchSample:
    return TorchSample(at=at, reachable=True, device="cuda", total_bytes=TOTAL, active_bytes=int(active * GiB),
                       reserved_bytes=int(active * GiB) + GiB, inflight=inflight, queued=queued,
                       instance_id=instance, **extra)  # type: ignore[arg-type]


def fold(samples: list[TorchSample]) -> IdleMemory | None:
    return reduce(observe, samples, None)


def test_cache_that_returns_to_baseline_is_not_growth() -> None:
    # Bursts push active memory up while requests run; at idle it is back at the weights.
    trace = [cuda(0, 14.0), cuda(5, 30.0, inflight=6), cuda(10, 38.0, inflight=8, queued=3), cuda(15, 14.1),
             cuda(20, 35.0, inflight=4), cuda(25, 14.0)]
    m = fold(trace)
    assert m is not None
    assert m.baseline_bytes == 14 * GiB and m.growth_bytes == 0 and not m.growing
    assert m.idle_samples == 3


def test_active_memory_that_stays_up_at_idle_is_growth() -> None:
    trace = [cuda(0, 14.0)]
    for hour in range(1, 9):  # +0.6 GiB of live tensors per hour that nothing frees
        trace += [cuda(hour * 3600 - 5, 40.0, inflight=5), cuda(hour * 3600, 14.0 + 0.6 * hour)]
    m = fold(trace)
    assert m is not None
    assert abs(m.growth_bytes - 4.8 * GiB) < 1024
    assert abs(m.growth_ratio - 4.8 / 80) < 1e-6
    assert m.growing
    assert not fold(trace[:9]).growing  # type: ignore[union-attr]  # 2.4 GiB after 4 h: 3 %, below the mark


def test_the_baseline_is_the_first_idle_sample_not_the_first_sample() -> None:
    m = fold([cuda(0, 30.0, inflight=3), cuda(5, 14.0), cuda(10, 14.2)])
    assert m is not None and m.baseline_bytes == 14 * GiB and m.first_at == 5


def test_a_new_process_starts_a_new_baseline() -> None:
    before = [cuda(0, 14.0), cuda(3600, 20.0)]
    assert fold(before).growing  # type: ignore[union-attr]
    m = fold([*before, cuda(3700, 30.0, inflight=2, instance="b"), cuda(3710, 14.0, instance="b")])
    assert m is not None and m.instance_id == "b" and m.growth_bytes == 0
    # While the new process is busy, nothing is claimed about it.
    assert fold([*before, cuda(3700, 30.0, inflight=2, instance="b")]) is None


def test_cpu_unreachable_and_injected_figures_are_ignored() -> None:
    cpu = TorchSample(at=0, reachable=True, device="cpu", instance_id="a")
    assert fold([cpu, cpu]) is None
    down = TorchSample(at=10, reachable=False, error="connection refused")
    injected = cuda(20, 70.0, injected=True)
    base = fold([cuda(0, 14.0)])
    assert fold([cuda(0, 14.0), down, injected]) == base


def test_warn_ratio_is_a_share_of_the_card() -> None:
    at_mark = fold([cuda(0, 10.0), cuda(60, 10.0 + WARN_RATIO * 80)])
    below = fold([cuda(0, 10.0), cuda(60, 10.0 + WARN_RATIO * 80 - 0.01)])
    assert at_mark is not None and at_mark.growing
    assert below is not None and not below.growing
