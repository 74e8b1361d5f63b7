"""Assertion rewriting for the helper modules whose own asserts check what a test reads (they came out
of test modules, which pytest rewrites, so a failure there still shows the values compared), and
which tests `pytest -n` must run one at a time."""

from __future__ import annotations

from typing import Any

import pytest

# Registered before any test module imports them (a conftest loads first); a module already imported
# could no longer be rewritten.
pytest.register_assert_rewrite("tests.e2e.up_stack", "tests.integration.workers", "tests.unit.memory_record")


# The tests that start real processes and judge them by real time (a canary's timeout, a hang's
# seconds, a flood's share of 503s) run one at a time on one worker of `pytest -n`; the rest (pure
# functions, the simulation, the chart, the docs) share the other workers. Two of them side by side
# on a small machine would each be judged under the other's load.
REAL_TIME = ("e2e/", "fleet/", "integration/", "docs/test_runnable.py", "dashboards/test_dashboard_queries.py")
# ... but for these, whose processes are judged by what they answer, however late: a script's steps,
# the official clients' answers, an install, a locked-down start, a model read from a folder.
NOT_REAL_TIME = ("e2e/test_gpu_check_dry_run.py", "integration/test_openai_sdk.py",
                 "integration/test_open_model_surface.py", "integration/test_install_beside.py",
                 "integration/test_lockdown.py", "integration/test_local_model_dir.py",
                 "integration/test_log_lines.py")


def real_time(nodeid: str) -> bool:
    where = nodeid.split("::", 1)[0].removeprefix("tests/")
    return where.startswith(REAL_TIME) and not where.startswith(NOT_REAL_TIME)


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config: pytest.Config, log: Any) -> Any:
    """pytest-xdist's scheduling by scope, the real-time tests one scope (the largest: it starts first,
    on one worker), every other test a scope of its own."""
    from xdist.scheduler import LoadScopeScheduling

    class RealTimeApart(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return "real_time" if real_time(nodeid) else nodeid

    return RealTimeApart(config, log)
