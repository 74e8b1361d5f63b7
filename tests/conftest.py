"""Assertion rewriting for the helper modules whose own asserts check what a test reads (they came out
of test modules, which pytest rewrites, so a failure there still shows the values compared), and
which tests `pytest -n` must run one at a time."""

from __future__ import annotations

from pathlib import Path

import pytest

# Registered before any test module imports them (a conftest loads first); a module already imported
# could no longer be rewritten.
pytest.register_assert_rewrite("tests.e2e.up_stack", "tests.integration.workers", "tests.unit.memory_record")


# The tests that start real processes and judge them by real time (a canary's timeout, a hang's
# seconds, a flood's share of 503s) run one at a time on one worker of `pytest -n`; the rest (pure
# functions, the simulation, the chart, the docs) share the other workers. Two of them side by side
# on a small machine would each be judged under the other's load.
REAL_TIME = ("e2e/", "fleet/", "integration/", "docs/test_runnable.py", "dashboards/test_dashboard_queries.py")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    tests = Path(__file__).parent
    for item in items:
        if item.path.relative_to(tests).as_posix().startswith(REAL_TIME):
            item.add_marker(pytest.mark.xdist_group("real_time"))
