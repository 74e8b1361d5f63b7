"""The chaos soak, capped for CI (python -m gpu_watchdog.benchmarks.soak runs the long one)."""

from __future__ import annotations

import collections
from pathlib import Path

from gpu_watchdog.benchmarks.soak import RESTART_FAULTS, SoakSettings, run_soak

SERVE_AGAIN_BOUND_S = 30.0


async def test_chaos_soak_loses_nothing_and_restarts_only_for_faults(tmp_path: Path) -> None:
    # Six unbatched streams of ~190 tokens share two cores for up to ~11 s on a slow machine: a
    # client that gave up after 10 s would only restart the same work, over and over.
    report = await run_soak(SoakSettings(duration_s=70.0, clients=6, seed=20261129, soft_faults=4,
                                         try_timeout_s=30.0, workdir=tmp_path))
    print(report.summary())
    assert report.sent > 50
    assert report.lost == 0
    assert report.wrong == 0
    assert report.duplicated == 0
    assert report.silent_truncations == 0
    assert report.completed == report.sent
    injected = collections.Counter(RESTART_FAULTS[k] for _, k in report.faults if k in RESTART_FAULTS)
    assert report.restart_reasons() == injected  # one restart per restart-worthy fault, with its reason
    assert len(report.restarts) <= report.budget
    # Every restart came after a fault of its kind.
    for r in report.restarts:
        assert any(kind == r["reason"] for _, kind in report.faults)
    assert report.serve_again_s and max(report.serve_again_s) < SERVE_AGAIN_BOUND_S
    assert report.exit_code == 0
